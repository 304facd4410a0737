"""One completion's text as its tokens arrive: deltas that are safe to send.

Incremental detokenization: each new token's text is the decode of a short window of recent
tokens minus the decode of the window without it, so a token costs a decode of a few tokens,
not of the whole reply. While that text ends in U+FFFD the token ended inside a multi-byte
character, and the text waits for the next token. Byte-level BPE tokenizers (Llama 3, Qwen,
SmolLM2) decode by concatenation, so the deltas add up to the decode of all the tokens.

Holdback: text is sent only when no stop string or tool-call markup can still begin in it. The
end of the text that could be the start of a stop string is held until the next token decides;
when a stop string appears, the text ends right before it and the completion is over (its
tokens count up to and including the one that completed the stop string, as the OpenAI API
counts them). Tool-call markup (`ToolSyntax`) is held from where it begins to the end of the
reply, when the caller parses it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxrl.hf.tool_calls import ToolSyntax, prefix_overlap


class TextStream:
    """Token ids in (`push`), text deltas out; `finish` releases what was held back."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (),
                 tools: ToolSyntax | None = None, prefix: str = "", offset: int = 0):
        self._decode, self._stop, self._tools = decode, tuple(stop), tools
        self._offset = offset  # added to `offsets` (the reply's text before this one's)
        self._ids: list[int] = []
        self._window = self._read = 0  # ids[window:read] is the context of the next decode
        self.text = prefix  # everything decoded so far (a forced tool-call opening first)
        self.sent = 0  # text[:sent] has been handed out
        self.markup: int | None = None  # where held tool-call markup begins
        self.stopped = False  # a stop string ended the completion
        self.tokens = 0  # tokens that belong to the completion
        self.offsets: list[int] = []  # each counted token's start in `text` (plus offset)

    def _new_text(self) -> str:
        before = self._decode(self._ids[self._window:self._read])
        after = self._decode(self._ids[self._window:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._window, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def push(self, token: int) -> str:
        """The text that token makes safe to send ("" when it all waits, or after a stop)."""
        if self.stopped:
            return ""
        self.tokens += 1
        self.offsets.append(self._offset + len(self.text))
        self._ids.append(token)
        searched = max(0, len(self.text) - max(map(len, self._stop), default=0))
        self.text += self._new_text()
        ends = [i for s in self._stop if (i := self.text.find(s, searched)) >= 0]
        if ends:
            self.text, self.stopped = self.text[:min(ends)], True
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """What is left to send once the completion has ended (markup stays in `held`)."""
        if not self.stopped:
            tail = self._decode(self._ids[self._window:])
            self.text += tail[len(self._decode(self._ids[self._window:self._read])):]
        return self._release(final=True)

    @property
    def held(self) -> str:
        """The tool-call markup held back (from where it began to the end)."""
        return "" if self.markup is None else self.text[self.markup:]

    def _release(self, final: bool) -> str:
        if self.markup is not None:
            return ""
        end = len(self.text)
        if not final:
            end -= max((prefix_overlap(self.text, s) for s in self._stop), default=0)
        if self._tools is not None:
            start = self._tools.markup_start(self.text, self.sent)
            if start is not None:
                self.markup = end = start
            elif not final:
                end = min(end, len(self.text) - self._tools.undecided(self.text, self.sent))
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent:end], end
        return delta

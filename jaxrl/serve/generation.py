"""One request's completions on the server's event loop: engine events in, reply pieces out.

The engine thread calls each job's sink (`_Sink`), which turns each token into its text delta
through the choice's `TextStream` (so a stop string cancels the job before the engine's next
step) and posts it onto the event loop (`call_soon_threadsafe` into an asyncio queue);
`Generation.pieces` hands out the deltas, with log-probs when asked, and at the end of a
choice its finish reason and any tool calls. A choice ends at its first EOS id, its token
budget, or a stop string (then the engine's later tokens for it are ignored).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

from jaxrl.serve.protocol import Tools
from jaxrl.serve.responses import Piece, TokenLogprob
from jaxrl.serve.textstream import TextStream
from jaxrl.hf.tool_calls import ToolSyntax


class _Sink:
    """A job's results, posted from the engine thread onto the event loop. Each token goes
    through its choice's `TextStream` here, on the engine thread, so a stop string cancels the
    job (`Generation.on_stop`) before the engine's next step; tokens after it are dropped."""

    def __init__(self, generation: "Generation", index: int):
        self._generation, self._index = generation, index
        self._stream = generation.streams[index]

    def token(self, token: int, logprob: float, top) -> None:
        stream = self._stream
        if stream.stopped:
            return
        text = stream.push(token)
        self._generation._post((self._index, "token",
                                (token, logprob, top, text, stream.offsets[-1], stream.stopped)))
        if stream.stopped and self._generation.on_stop is not None:
            self._generation.on_stop(self._index)

    def done(self, finish_reason: str) -> None:
        self._generation._post((self._index, "done", finish_reason))

    def fail(self, error: Exception) -> None:
        self._generation._post((self._index, "fail", error))


class Generation:
    """The choices of one request (module docstring). `token_text(id)` is a token's own text
    (special tokens shown); logprobs: None, or how many alternatives to return per token."""

    def __init__(self, streams: Sequence[TextStream], token_text: Callable[[int], str],
                 logprobs: int | None, tools: Tools | None = None,
                 syntax: ToolSyntax | None = None):
        self.streams, self._token_text, self._logprobs = list(streams), token_text, logprobs
        self._tools, self._syntax = tools, syntax
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        # on_stop(index), called on the engine thread: choice `index` ended on a stop string
        # (its engine job is to be cancelled)
        self.on_stop: Callable[[int], None] | None = None

    def sink(self, index: int) -> _Sink:
        return _Sink(self, index)

    def _post(self, event: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody waits for this reply
            pass

    @property
    def completion_tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Pieces as they become ready, until every choice has ended; an engine failure is
        raised here."""
        open_ = set(range(len(self.streams)))
        while open_:
            index, kind, payload = await self._queue.get()
            if index not in open_:
                continue
            if kind == "fail":
                raise payload
            piece = self._token(index, *payload) if kind == "token" else self._end(index,
                                                                                  payload)
            if piece.finish_reason:
                open_.discard(index)
            if piece.text or piece.logprobs or piece.finish_reason:
                yield piece
        self.finished_at = time.monotonic()

    def _token(self, index: int, token: int, logprob: float, top, text: str, offset: int,
               stopped: bool) -> Piece:
        """The piece of one token that `_Sink.token` pushed through its stream: its text
        delta, its start in the choice's text (offset) and whether a stop string ended the
        choice with it."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        piece = Piece(index, text)
        if self._logprobs is not None:
            piece.logprobs.append(TokenLogprob(
                self._token_text(token), logprob,
                tuple((self._token_text(t), lp) for t, lp in top[:self._logprobs]), offset))
        return self._end(index, "stop", piece) if stopped else piece

    def _end(self, index: int, finish_reason: str, piece: Piece | None = None) -> Piece:
        stream = self.streams[index]
        piece = piece or Piece(index)
        piece.text += stream.finish()
        piece.finish_reason = finish_reason
        if stream.held:
            parsed = self._syntax.parse(stream.held)
            if parsed is None:  # not a tool call after all: the model's words as they are
                piece.text += stream.held
            else:
                content, calls = parsed
                piece.text += content or ""
                piece.tool_calls = calls if self._tools.parallel else calls[:1]
                piece.finish_reason = "tool_calls"
        return piece

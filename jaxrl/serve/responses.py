"""Reply bodies of the OpenAI API: whole responses, streamed chunks, usage and log-probs."""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence

from jaxrl.hf.tool_calls import ToolCall


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One completion token: its text, log-prob and the most likely alternatives (an echoed
    prompt's first token has neither: logprob None)."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...]
    offset: int  # where its text starts in the completion


@dataclasses.dataclass
class Piece:
    """What one choice adds to the reply: text, the log-probs of the tokens it consumed, and
    at the end the finish reason and any tool calls."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Choice:
    """A whole choice, the pieces of one index joined."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.logprobs += piece.logprobs
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.tool_calls += piece.tool_calls


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "replace"))


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": _bytes(e.token),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)}
                                          for t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    """The legacy shape; with no alternatives asked, top_logprobs holds the chosen token; an
    echoed prompt's first token has null for both."""
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else dict(e.top) if e.top
                             else {e.token: e.logprob} for e in entries],
            "text_offset": [e.offset for e in entries]}


def _message(choice: Choice) -> dict:
    message = {"role": "assistant", "content": choice.text, "refusal": None}
    if choice.tool_calls:
        message["content"] = choice.text or None
        message["tool_calls"] = [c.body() for c in choice.tool_calls]
    return message


class Reply:
    """The id, time and model that every body of one reply shares."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def response(self, choices: Sequence[Choice], prompt_tokens: int, completion_tokens: int,
                 logprobs: bool) -> dict:
        if self.kind == "chat":
            body = [{"index": c.index, "finish_reason": c.finish_reason, "message": _message(c),
                     "logprobs": chat_logprobs(c.logprobs) if logprobs else None}
                    for c in choices]
            obj = "chat.completion"
        else:
            body = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": completion_logprobs(c.logprobs) if logprobs else None}
                    for c in choices]
            obj = "text_completion"
        return {**self._head(obj), "choices": body,
                "usage": usage(prompt_tokens, completion_tokens)}

    def first_chunk(self, index: int) -> dict:
        """A chat stream opens each choice with the assistant role."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def chunk(self, piece: Piece, logprobs: bool) -> dict:
        if self.kind == "chat":
            delta = {"content": piece.text} if piece.text else {}
            if piece.tool_calls:
                delta["tool_calls"] = [{"index": i, **c.body()}
                                       for i, c in enumerate(piece.tool_calls)]
            return self._chunk({"index": piece.index, "delta": delta,
                                "logprobs": chat_logprobs(piece.logprobs)
                                if logprobs and piece.logprobs else None,
                                "finish_reason": piece.finish_reason})
        return self._chunk({"index": piece.index, "text": piece.text,
                            "logprobs": completion_logprobs(piece.logprobs)
                            if logprobs and piece.logprobs else None,
                            "finish_reason": piece.finish_reason})

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._chunk_head(), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}

    def _chunk_head(self) -> dict:
        return self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")

    def _chunk(self, choice: dict) -> dict:
        return {**self._chunk_head(), "choices": [choice], "usage": None}


def models_response(models: Sequence[str], created: int, root: str) -> dict:
    """The served models: the base first, then each adapter (its `parent` is the base)."""
    return {"object": "list", "data": [model_card(m, created, root) for m in models]}


def model_card(model: str, created: int, root: str) -> dict:
    card = {"id": model, "object": "model", "created": created, "owned_by": "jaxrl",
            "root": root}
    if model != root:
        card["parent"] = root
    return card

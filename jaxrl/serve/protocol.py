"""The OpenAI API's request and response shapes for /v1/chat/completions and /v1/completions.

Parsing is strict, as the OpenAI API is: an unknown field, a wrong type or a value out of range
is a 400 naming the field (`param`) and what is allowed. Fields the sampler cannot honour are
accepted only at the value that changes nothing (stream false, penalties 0, logit_bias empty,
top_logprobs 0, echo false, best_of = n): the sampler returns the chosen token's log-prob, not
the top alternatives, and has no penalties. Nothing here touches the model; `Engine` (engine.py)
turns prompts into token ids and `Job`s into completions.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_STOP = 4  # stop sequences per request, as in the OpenAI API
CHAT_ROLES = ("system", "developer", "user", "assistant")

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                     "user", "stream", "presence_penalty", "frequency_penalty", "logit_bias"})
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "response_format", "tools", "tool_choice", "parallel_tool_calls",
                         "store", "metadata", "stream_options"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}

# fields accepted only at values that leave sampling unchanged: (field, allowed, why)
_INERT = (("stream", (False,), "streaming is not supported; send stream=false"),
          ("presence_penalty", (0,), "penalties are not supported; send 0"),
          ("frequency_penalty", (0,), "penalties are not supported; send 0"),
          ("logit_bias", ({},), "logit_bias is not supported; send {} or leave it out"),
          ("top_logprobs", (0,), "only the sampled token's log-prob is returned (top_logprobs 0)"),
          ("echo", (False,), "echo is not supported; send echo=false"),
          ("suffix", ("",), "suffix (insertion) is not supported"),
          ("tools", ([],), "tool calls are not supported"),
          ("tool_choice", ("none",), "tool calls are not supported"),
          ("response_format", ({"type": "text"},), 'only {"type": "text"} is supported'))


class ApiError(Exception):
    """An error reply in the OpenAI shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param)


@dataclass(frozen=True)
class Settings:
    """The sampling settings of one request (every prompt of it shares them)."""
    n: int
    max_tokens: int | None  # None: the endpoint's default, within the context window
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    logprobs: bool


def _number(body: Mapping, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"expected a number, got {value!r}")
    if not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise bad(name, f"must be in {bracket}{low:g}, {high:g}]; got {value!r}")
    return float(value)


def _integer(body: Mapping, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and <= {high}"
        raise bad(name, f"must be >= {low}{upper}; got {value}")
    return value


def _stop(body: Mapping) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP):
        raise bad("stop", f"expected a non-empty string or a list of up to {MAX_STOP} non-empty "
                  f"strings, got {value!r}")
    return tuple(stops)


def check_fields(body: Any, allowed: frozenset[str], required: Sequence[str]) -> None:
    """The body is an object of known fields, with the required ones, the inert ones inert."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"unrecognized request argument; this endpoint accepts "
                  f"{', '.join(sorted(allowed))}")
    for name in required:
        if body.get(name) is None:
            raise bad(name, "is required")
    for name, values, why in _INERT:
        if name in allowed and not _inert(body.get(name), values):
            raise bad(name, f"{why}; got {body[name]!r}")


def _inert(value: Any, allowed: tuple) -> bool:
    """value is None or equals an allowed value of the same kind (true is not 1)."""
    return value is None or any(value == a and isinstance(value, bool) == isinstance(a, bool)
                                for a in allowed)


def settings(body: Mapping, max_rows: int, logprobs: bool) -> Settings:
    """The sampling settings of a checked body; `logprobs` as the endpoint reads it."""
    n = _integer(body, "n", 1, max_rows) or 1
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of != n:
        raise bad("best_of", f"must equal n ({n}): every sampled completion is returned")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    max_tokens = _integer(body, "max_tokens", 1) if max_tokens is None else max_tokens
    return Settings(n=n, max_tokens=max_tokens,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                    stop=_stop(body), seed=_integer(body, "seed", -(2 ** 63), 2 ** 63 - 1),
                    logprobs=logprobs)


def chat_logprobs(body: Mapping) -> bool:
    value = body.get("logprobs")
    if value is not None and not isinstance(value, bool):
        raise bad("logprobs", f"expected true or false, got {value!r}")
    return bool(value)


def completion_logprobs(body: Mapping) -> bool:
    """Completions take logprobs as a count of alternatives; only 0 (the sampled token's
    log-prob) is served."""
    value = body.get("logprobs")
    if value is not None and (isinstance(value, bool) or value != 0):
        raise bad("logprobs", "only the sampled token's log-prob is returned: send logprobs=0 "
                  f"or leave it out; got {value!r}")
    return value is not None


def _content(message: Mapping, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"messages[{index}].content", "expected a string or a list of "
              f"{{\"type\": \"text\", \"text\": ...}} parts, got {content!r:.100}")


def chat_messages(body: Mapping) -> list[dict[str, str]]:
    """The messages as {role, content} strings for the chat template; a developer message is
    rendered as a system message (what it is to a model without a separate developer role)."""
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got "
                      f"{role!r:.100}")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": _content(message, i)})
    return out


def completion_prompts(body: Mapping, vocab_size: int) -> list[str | list[int]]:
    """The prompts of a completions request: texts, or token-id lists (each id in the vocab)."""
    prompt = body["prompt"]
    is_ids = lambda p: isinstance(p, list) and p and all(
        isinstance(t, int) and not isinstance(t, bool) for t in p)
    if isinstance(prompt, str) or is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad("prompt", "expected a string, a list of strings, a list of token ids or a list "
                  f"of token-id lists (none empty), got {prompt!r:.100}")
    for p in prompts:
        if p == "":
            raise bad("prompt", "must not be empty")
        if isinstance(p, list) and not all(0 <= t < vocab_size for t in p):
            raise bad("prompt", f"token ids must be in [0, {vocab_size})")
    return prompts


@dataclass(frozen=True)
class Choice:
    """One completion: its text (stop sequence excluded), tokens, their text and log-probs."""
    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    text_offsets: tuple[int, ...]
    finish_reason: str


def usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _chat_logprobs(choice: Choice) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
                         "top_logprobs": []} for t, lp in zip(choice.tokens, choice.logprobs)],
            "refusal": None}


def _completion_logprobs(choice: Choice) -> dict:
    return {"tokens": list(choice.tokens), "token_logprobs": list(choice.logprobs),
            "top_logprobs": [{t: lp} for t, lp in zip(choice.tokens, choice.logprobs)],
            "text_offset": list(choice.text_offsets)}


def chat_response(model: str, choices: Sequence[Choice], prompt_tokens: int,
                  logprobs: bool) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "finish_reason": c.finish_reason,
                         "message": {"role": "assistant", "content": c.text, "refusal": None},
                         "logprobs": _chat_logprobs(c) if logprobs else None}
                        for i, c in enumerate(choices)],
            "usage": usage(prompt_tokens, choices)}


def completion_response(model: str, choices: Sequence[Choice], prompt_tokens: int,
                        logprobs: bool) -> dict:
    """Choices in the API's order: prompt by prompt, n each."""
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": _completion_logprobs(c) if logprobs else None}
                        for i, c in enumerate(choices)],
            "usage": usage(prompt_tokens, choices)}


def models_response(model: str, created: int) -> dict:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": created, "owned_by": "jaxrl"}]}

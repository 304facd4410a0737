"""Requests of the OpenAI API for /v1/chat/completions and /v1/completions, checked.

A known field of the wrong type or out of range is a 400 naming the field (`param`) and what
is allowed. A field this server does not know (vendor extensions, newer API fields) is ignored
with one warning per field name, as vLLM does (`UnknownFields`). Fields that only have a
neutral value here are accepted at that value alone: suffix "", best_of = n. Structured
output (response_format, guided_*) is read by structured.py. Completions take `echo` (the
prompt first in each choice's text, and with `logprobs` its tokens' log-probs first), and
with echo max_tokens 0 (the prompt alone: how evaluation harnesses score a text's
log-likelihood). Nothing here touches the model: the app (app.py) turns the parsed request
into prompts and engine jobs.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from typing import Any

from jaxrl.sampling.sampling_fns import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, Decoding
from jaxrl.hf.tool_calls import template_arguments

MAX_STOP = 4  # stop sequences per request, as in the OpenAI API
MAX_N = 128  # completions per prompt, as in the OpenAI API
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "user",
                     "stream", "stream_options", "presence_penalty", "frequency_penalty",
                     "logit_bias", "top_k", "min_p", "repetition_penalty",
                     # structured output (jaxrl/serve/structured.py)
                     "response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"})
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "response_format", "tools", "tool_choice", "parallel_tool_calls",
                         "store", "metadata"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_NEUTRAL = (("suffix", ("",), "suffix (insertion) is not supported"),)

log = logging.getLogger("jaxrl.serve")


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


class UnknownFields:
    """Warns once per unknown field name, across requests and threads."""

    def __init__(self):
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: Mapping, known: frozenset[str]) -> None:
        for name in sorted(set(body) - known):
            with self._lock:
                if name in self._seen:
                    continue
                self._seen.add(name)
            log.warning("ignoring the request field %r, which this server does not know "
                        "(warned once per field name)", name[:100])


@dataclasses.dataclass(frozen=True)
class Settings:
    """The sampling settings of one request (every prompt of it shares them)."""

    n: int
    max_tokens: int | None  # None: the endpoint's default, within the context window
    decoding: Decoding
    stop: tuple[str, ...]
    seed: int | None
    logprobs: int | None  # None: no log-probs; k: the chosen token's and k alternatives
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt (and its log-probs) before the completion


def _number(body: Mapping, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"expected a number, got {value!r:.100}")
    if not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise bad(name, f"must be in {bracket}{low:g}, {high:g}]; got {value!r}")
    return float(value)


def _integer(body: Mapping, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected an integer, got {value!r:.100}")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and <= {high}"
        raise bad(name, f"must be >= {low}{upper}; got {value}")
    return value


def _flag(body: Mapping, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"expected true or false, got {value!r:.100}")
    return bool(value)


def _stop(body: Mapping) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP):
        raise bad("stop", f"expected a non-empty string or a list of up to {MAX_STOP} non-empty "
                  f"strings, got {value!r:.100}")
    return tuple(stops)


def _logit_bias(body: Mapping, vocab_size: int) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"expected an object of up to {MAX_LOGIT_BIAS} token ids "
                  f"(as strings) to biases in [-100, 100], got {value!r:.100}")
    pairs = []
    for token, bias in value.items():
        if not (isinstance(token, str) and token.isdigit() and int(token) < vocab_size):
            raise bad("logit_bias", f"keys must be token ids in [0, {vocab_size}); got "
                      f"{token!r:.100}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or abs(bias) > 100:
            raise bad("logit_bias", f"biases must be numbers in [-100, 100]; got {bias!r:.100} "
                      f"for token {token}")
        pairs.append((int(token), float(bias)))
    return tuple(pairs)


def _min_p(body: Mapping) -> float:
    value = _number(body, "min_p", 0.0, 0.0, 1.0)
    if value == 1:
        raise bad("min_p", "must be in [0, 1); got 1")
    return value


def check_fields(body: Any, known: frozenset[str], required: tuple[str, ...],
                 unknown: UnknownFields) -> None:
    """The body is an object with the required fields and neutral values where only those
    are served; unknown fields are warned about once and ignored."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown.check(body, known)
    for name in required:
        if body.get(name) is None:
            raise bad(name, "is required")
    if not isinstance(body["model"], str):
        raise bad("model", f"expected a string, got {body['model']!r:.100}")
    for name, values, why in _NEUTRAL:
        value = body.get(name) if name in known else None
        if value is not None and not any(value == v and isinstance(value, bool) ==
                                         isinstance(v, bool) for v in values):
            raise bad(name, f"{why}; got {value!r:.100}")


def settings(body: Mapping, vocab_size: int, logprobs: int | None,
             echo: bool = False) -> Settings:
    """The sampling settings of a checked body; `logprobs` and `echo` as the endpoint reads
    them (max_tokens may be 0 only with echo: the prompt alone)."""
    n = _integer(body, "n", 1, MAX_N) or 1
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of != n:
        raise bad("best_of", f"must equal n ({n}): every sampled completion is returned")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 0)
        if max_tokens == 0 and not echo:
            raise bad("max_tokens", "must be >= 1 (0, the prompt alone, only with echo=true on "
                      "/v1/completions); got 0")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad("stream_options", "is an object allowed only with stream=true; got "
                  f"{options!r:.100}")
    top_k = _integer(body, "top_k", -1)  # -1 and 0 both mean off, as in vLLM
    decoding = Decoding(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(top_k or 0, 0), min_p=_min_p(body),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        top_logprobs=logprobs or 0, logit_bias=_logit_bias(body, vocab_size))
    return Settings(n=n, max_tokens=max_tokens, decoding=decoding, stop=_stop(body),
                    seed=_integer(body, "seed", -(2 ** 63), 2 ** 63 - 1), logprobs=logprobs,
                    stream=stream, include_usage=_flag(options or {}, "include_usage"),
                    echo=echo)


def chat_logprobs(body: Mapping) -> int | None:
    """None, or how many alternatives (top_logprobs) to return beside the chosen token's."""
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not _flag(body, "logprobs"):
        if top:
            raise bad("top_logprobs", "needs logprobs=true")
        return None
    return top or 0


def completion_echo(body: Mapping) -> bool:
    return _flag(body, "echo")


def completion_logprobs(body: Mapping) -> int | None:
    """Completions take logprobs as the number of alternatives (0: the chosen token's only)."""
    return _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def _content(message: Mapping, param: str, allow_null: bool = False) -> str:
    content = message.get("content")
    if content is None and allow_null:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(param, "expected a string or a list of {\"type\": \"text\", \"text\": ...} parts, "
              f"got {content!r:.100}")


def _tool_calls(calls: Any, param: str) -> list[dict]:
    """An assistant message's tool_calls for the chat template."""
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), (str, dict)) for c in calls)
    if not ok:
        raise bad(param, "expected a list of {\"id\", \"type\": \"function\", \"function\": "
                  f"{{\"name\", \"arguments\"}}}} objects, got {calls!r:.100}")
    return [{"id": c.get("id"), "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": template_arguments(c["function"]["arguments"])}}
            for c in calls]


def _message(message: Any, i: int) -> dict:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in CHAT_ROLES:
        raise bad(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got "
                  f"{(role if isinstance(message, dict) else message)!r:.100}")
    param = f"messages[{i}].content"
    if role == "assistant":
        out = {"role": role, "content": _content(message, param, allow_null=True)}
        if message.get("tool_calls"):
            out["tool_calls"] = _tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
        return out
    out = {"role": "system" if role == "developer" else role,
           "content": _content(message, param)}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad(f"messages[{i}].tool_call_id", f"a tool message needs the id of the "
                      f"call it answers, got {call_id!r:.100}")
        out["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def chat_messages(body: Mapping) -> list[dict]:
    """The messages as the chat template takes them; a developer message is rendered as a
    system message (what it is to a model without a separate developer role), a null
    assistant content as "" (templates concatenate it), tool-call arguments as objects."""
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of {\"role\", \"content\"} objects")
    return [_message(m, i) for i, m in enumerate(messages)]


@dataclasses.dataclass(frozen=True)
class Tools:
    """A request's tools (OpenAI function definitions) and how the model may use them."""

    tools: list[dict]
    choice: str | dict  # "auto", "required" or {"type": "function", "function": {"name"}}
    parallel: bool


def _tool(tool: Any, i: int) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if (not isinstance(fn, dict) or tool.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str) or not fn["name"]
            or not isinstance(fn.get("parameters", {}), dict)
            or not isinstance(fn.get("description", ""), str)):
        raise bad(f"tools[{i}]", "expected {\"type\": \"function\", \"function\": {\"name\", "
                  f"\"description\", \"parameters\"}}}}, got {tool!r:.100}")
    return {"type": "function", "function": fn}


def chat_tools(body: Mapping) -> Tools | None:
    """The tools the model is offered, or None (no tools, or tool_choice "none")."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("tools", f"expected a list of function tools, got {tools!r:.100}")
    tools = [_tool(t, i) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    choice = ("auto" if tools else "none") if choice is None else choice
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(fn, dict) \
                or fn.get("name") not in names:
            raise bad("tool_choice", f"a named tool_choice must name one of the tools "
                      f"({', '.join(names) or 'none given'}); got {choice!r:.100}")
    elif choice not in ("none", "auto", "required"):
        raise bad("tool_choice", f"expected \"none\", \"auto\", \"required\" or "
                  f"{{\"type\": \"function\", \"function\": {{\"name\"}}}}; got {choice!r:.100}")
    if choice != "none" and not tools:
        raise bad("tool_choice", f"{choice!r:.100} needs tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"expected true or false, got {parallel!r:.100}")
    return None if choice == "none" else Tools(tools, choice, parallel is not False)


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

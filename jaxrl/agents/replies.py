"""Asking a model for JSON: extraction, validation, a bounded retry, and a token meter.

`Asker.ask(role, messages, validate)` returns the validated value, or None when every attempt
was invalid (the reply had no JSON object, or the object failed `validate`) or the case's token
budget is spent. Each invalid attempt is counted and recorded with its error; a retry shows the
model its reply and what was wrong with it. What None means is up to the caller, which documents
its fallback; a bad reply never raises.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl.agents.chat import ChatClient


class ReplyError(ValueError):
    """A reply whose JSON does not have the shape asked for; the message says what is wrong."""


def json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object in text, in order (code fences and prose around them are skipped)."""
    decoder, found, start = json.JSONDecoder(), [], text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            found.append(value)
        start = text.find("{", end)
    return found


def parse_reply(text: str, validate: Callable[[dict[str, Any]], Any]) -> Any:
    """The first JSON object in text that validates, as `validate` returns it."""
    objects = json_objects(text)
    if not objects:
        raise ReplyError("the reply holds no JSON object")
    errors = []
    for obj in objects:
        try:
            return validate(obj)
        except ReplyError as e:
            errors.append(str(e))
    raise ReplyError(errors[0])


@dataclasses.dataclass
class Usage:
    calls: int = 0
    invalid: int = 0  # attempts whose reply did not validate
    failed: int = 0  # asks that ended with no valid reply after the retries
    skipped: int = 0  # asks not sent because the token budget was spent
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Asker:
    """Sends chats for one case, counting tokens against `token_budget` (completion tokens)."""

    def __init__(self, client: ChatClient, max_tokens: int, token_budget: int, retries: int = 1,
                 record: Callable[[dict[str, Any]], None] = lambda event: None):
        self.client, self.max_tokens, self.token_budget = client, max_tokens, token_budget
        self.retries, self.record, self.usage = retries, record, Usage()

    @property
    def spent(self) -> bool:
        return self.usage.completion_tokens >= self.token_budget

    def _send(self, messages: Sequence[Mapping[str, str]]) -> str:
        left = self.token_budget - self.usage.completion_tokens
        reply = self.client.chat(messages, min(self.max_tokens, left))
        self.usage.calls += 1
        self.usage.prompt_tokens += reply.prompt_tokens
        self.usage.completion_tokens += reply.completion_tokens
        return reply.text

    def ask(self, role: str, messages: Sequence[Mapping[str, str]],
            validate: Callable[[dict[str, Any]], Any]) -> Any:
        messages = list(messages)
        for attempt in range(self.retries + 1):
            if self.spent:
                self.usage.skipped += 1
                self.record({"event": "skipped", "role": role, "why": "token budget spent"})
                return None
            text = self._send(messages)
            try:
                return parse_reply(text, validate)
            except ReplyError as e:
                self.usage.invalid += 1
                self.record({"event": "invalid_reply", "role": role, "attempt": attempt,
                             "error": str(e), "reply": text})
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": f"That reply was invalid: {e}. "
                              "Answer again with one JSON object only, in the format asked."}]
        self.usage.failed += 1
        return None

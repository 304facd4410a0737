"""Tool calls in the markup of the model families jaxrl loads: what `jaxrl serve` returns as
OpenAI `tool_calls` and what the environments of multi-turn training (jaxrl/envs/) execute.

The chat template renders the request's `tools` (transformers' `apply_chat_template(tools=...)`)
and the model answers in its family's markup, which `ToolSyntax.parse` turns back into OpenAI
`tool_calls`:
  qwen    Qwen2.5 / Qwen3 (Hermes style): content, then one or more
          `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks.
  llama3  Llama 3.1 JSON tool calling: the whole reply is `{"name": ..., "parameters": {...}}`
          (several separated by `;`), optionally after `<|python_tag|>`.
The syntax is read off the template's source (`syntax_of`); a template that mentions neither
cannot render tools. `tool_choice` "required" and a named function are honoured by starting
the reply with the markup's opening (`forced_prefix`), which the model then completes; the
reply is parsed with that opening in front. A reply whose markup does not parse is returned
as plain content, never as an error.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

_QWEN_OPEN, _QWEN_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# one block; the last may lack its closing tag (the reply ended there)
_QWEN_BLOCK = re.compile(r"\s*<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as the OpenAI API sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest end of text that begins marker (and is shorter than it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _call(obj: Any, key: str) -> ToolCall | None:
    """A ToolCall of {"name": str, key: object or JSON-object string}, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args)) if isinstance(args, dict) else None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class ToolSyntax:
    """One family's tool-call markup (module docstring)."""

    name: str  # "qwen" or "llama3"

    def markup_start(self, text: str, sent: int) -> int | None:
        """Where tool-call markup begins in a reply's text so far (of which text[:sent] went
        out as content), if it has begun."""
        if self.name == "qwen":
            i = text.find(_QWEN_OPEN, max(0, sent - len(_QWEN_OPEN)))
            return None if i < 0 else i
        head = text.lstrip()
        return len(text) - len(head) if sent == 0 and head.startswith(("{", _PYTHON_TAG)) \
            else None

    def undecided(self, text: str, sent: int) -> int:
        """How many characters at the end of text may still turn out to begin markup."""
        if self.name == "qwen":
            return prefix_overlap(text, _QWEN_OPEN)
        head = text.lstrip()
        return len(text) if sent == 0 and (not head or _PYTHON_TAG.startswith(head)) else 0

    def forced_prefix(self, choice: str | dict) -> str:
        """The reply's forced opening for tool_choice "required" or {"function": {"name"}}."""
        if choice in ("auto", "none"):
            return ""
        if self.name == "qwen":
            if choice == "required":
                return _QWEN_OPEN + "\n"
            return f'{_QWEN_OPEN}\n{{"name": {json.dumps(choice["function"]["name"])}, ' \
                   '"arguments": '
        if choice == "required":
            return '{"name": "'
        return f'{{"name": {json.dumps(choice["function"]["name"])}, "parameters": '

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]] | None:
        """(content before the calls or None, calls) of a reply, or None when its markup does
        not parse (or it has none)."""
        return self._parse_qwen(text) if self.name == "qwen" else self._parse_llama(text)

    @staticmethod
    def _parse_qwen(text: str):
        start = text.find(_QWEN_OPEN)
        if start < 0:
            return None
        calls, pos = [], start
        while text[pos:].strip():
            block = _QWEN_BLOCK.match(text, pos)
            call = None if block is None else _call(_json(block.group(1).strip()), "arguments")
            if call is None:
                return None
            calls.append(call)
            pos = block.end()
        return (text[:start].strip() or None), calls

    @staticmethod
    def _parse_llama(text: str):
        body = text.strip()
        body = body[len(_PYTHON_TAG):].strip() if body.startswith(_PYTHON_TAG) else body
        calls = [_call(_json(part.strip()), "parameters") for part in body.split(";")]
        if not body or any(c is None for c in calls):
            return None
        return None, calls


def syntax_of(template: str | dict | None) -> ToolSyntax | None:
    """The tool-call syntax a chat template's source uses (of any of them, for a tokenizer with
    named templates), or None when it renders no tools."""
    if isinstance(template, dict):
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if not template:
        return None
    if _QWEN_OPEN in template:
        return ToolSyntax("qwen")
    if _PYTHON_TAG in template or "ipython" in template:
        return ToolSyntax("llama3")
    return None


def template_arguments(arguments: Any) -> Any:
    """An assistant tool call's `arguments` as chat templates expect them: a JSON-object string
    becomes the object (templates render it with `tojson`); anything else stays as sent."""
    if isinstance(arguments, str):
        parsed = _json(arguments)
        if isinstance(parsed, dict):
            return parsed
    return arguments

"""Structured output: replies that follow a JSON schema, a regular expression, a grammar or a
list of choices, by masking the tokens the grammar does not allow at every decode step
(llguidance computes the masks; the engine applies them, jaxrl/sampling/engine.py).

A request asks for one grammar at most, through one of:
  response_format  {"type": "json_object"} (any JSON object) or {"type": "json_schema",
                   "json_schema": {"name", "schema", "strict"}} (OpenAI; {"type": "text"}: none)
  guided_json      a JSON schema, as an object or as a JSON string (vLLM's extra_body fields)
  guided_regex     a regular expression the whole reply matches (Rust regex syntax)
  guided_choice    a non-empty list of strings: the reply is exactly one of them
  guided_grammar   a Lark or GBNF grammar (llguidance's syntax)
Two of them at once, a schema, regex or grammar llguidance cannot compile, or an empty choice
list are a 400 naming the field. JSON replies are laid out as Python's json.dumps lays them out
(", " and ": ", no other whitespace), so a model cannot spend its budget on blank space; the
schema is enforced whether `strict` is set or not.

Each completion gets its own `Constraint` (an llguidance matcher, copied from one compiled
per request on a prompt worker): `allowed` is the bitmask of the next tokens as [vocab] bool,
only an EOS id once the grammar is complete and allows nothing more, an EOS id among the
others where it could end or go on; `advance` feeds it each emitted token. A matcher error (or
any exception in it) ends the completion at the next token with an EOS id, with a warning in
the log: the engine thread never sees an exception from here. A reply cut by max_tokens
(finish_reason "length") may not parse, as with OpenAI's structured outputs.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.serve import protocol as p

log = logging.getLogger("jaxrl.serve")

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# JSON as json.dumps writes it: no free whitespace (a model could loop on it), ", " and ": "
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_ERROR = 500  # characters of an llguidance error shown in a 400


def request_grammar(body: Mapping) -> tuple[str, str] | None:
    """(the field that asked for it, an llguidance grammar) for a request's structured-output
    fields, or None when it asks for none; a malformed field is a 400 naming it."""
    import llguidance

    asked = [name for name in FIELDS if body.get(name) is not None
             and not (name == "response_format" and body[name] == {"type": "text"})]
    if len(asked) > 1:
        raise p.bad(asked[1], f"give one of {', '.join(FIELDS)} at most; got "
                    f"{' and '.join(asked)}")
    if not asked:
        return None
    name = asked[0]
    value = body[name]
    if name == "response_format":
        return name, _json_grammar(name, _response_format(value))
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise p.bad(name, f"a schema given as a string must be JSON: {error}") from None
        if not isinstance(value, dict):
            raise p.bad(name, f"expected a JSON schema (an object), got {value!r:.100}")
        return name, _json_grammar(name, value)
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise p.bad(name, f"expected a non-empty regular expression, got {value!r:.100}")
        return name, llguidance.LLMatcher.grammar_from_regex(value)
    if name == "guided_choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) for c in value)):
            raise p.bad(name, f"expected a non-empty list of strings, got {value!r:.100}")
        return name, llguidance.grammar_from("choice", value)
    if not isinstance(value, str) or not value.strip():
        raise p.bad(name, f"expected a Lark or GBNF grammar (a string), got {value!r:.100}")
    try:
        return name, llguidance.grammar_from("grammar", value)
    except ValueError as error:
        raise p.bad(name, f"not a grammar llguidance reads: {str(error)[:_MAX_ERROR]}") from None


def _response_format(value: Any) -> Any:
    """The JSON schema a non-text response_format asks for."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise p.bad("response_format", "json_schema needs {\"name\", \"schema\": {...}, "
                        f"\"strict\"}}; got {spec!r:.100}")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise p.bad("response_format", f"json_schema.strict must be true or false; got "
                        f"{spec['strict']!r:.100}")
        return spec["schema"]
    raise p.bad("response_format", "expected {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                f"or {{\"type\": \"json_schema\", \"json_schema\": {{...}}}}; got {value!r:.100}")


def _json_grammar(name: str, schema: Any) -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as error:
        raise p.bad(name, f"not a JSON schema: {str(error)[:_MAX_ERROR]}") from None


class Structured:
    """Grammars and constraints for one served tokenizer; the llguidance tokenizer (about a
    second to build) is built on first use and kept."""

    def __init__(self, tokenizer, eos_ids: Sequence[int]):
        self._tokenizer, self.eos_ids = tokenizer, tuple(int(e) for e in eos_ids)
        self._lltokenizer = None
        self._lock = threading.Lock()

    def lltokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                self._lltokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer, eos_token=list(self.eos_ids) or None)
            return self._lltokenizer

    def constraints(self, body: Mapping, rows: int) -> list[Constraint] | None:
        """One constraint per completion (`rows`) for the grammar `body` asks for, or None;
        a grammar llguidance cannot compile is a 400 naming its field."""
        asked = request_grammar(body)
        if asked is None:
            return None
        import llguidance

        name, grammar = asked
        try:
            tokenizer = self.lltokenizer()
        except Exception as error:  # noqa: BLE001 -- e.g. a slow (Python) tokenizer
            raise p.bad(name, f"structured output needs a tokenizer llguidance reads (a fast "
                        f"one); this model's: {type(error).__name__}: {error}"[:_MAX_ERROR]
                        ) from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise p.bad(name, f"llguidance cannot compile it: "
                        f"{matcher.get_error()[:_MAX_ERROR]}")
        matchers = [matcher] + [matcher.deep_copy() for _ in range(rows - 1)]
        return [Constraint(m, self.eos_ids, tokenizer.vocab_size) for m in matchers]


class Constraint:
    """The tokens one completion may take next, from an llguidance matcher (module docstring):
    the `constraint` of a `jaxrl.sampling.requests.Request`. Never raises."""

    def __init__(self, matcher, eos_ids: Sequence[int], size: int):
        self._matcher, self._eos, self._size = matcher, tuple(eos_ids), size
        self._bitmask = np.full((1, (size + 31) // 32), -1, np.int32)
        self.error: str | None = None  # why it ended the completion early, if it did

    def allowed(self, vocab: int) -> np.ndarray:
        mask = None
        if self.error is None:
            try:
                mask = self._mask(vocab)
            except Exception as error:  # noqa: BLE001 -- never into the engine thread
                self._fail(f"{type(error).__name__}: {error}")
        if mask is not None:
            return mask
        mask = np.zeros(vocab, bool)
        mask[[e for e in self._eos if e < vocab]] = True
        if not mask.any():  # no EOS id in the vocab: nothing can end it; let it run out
            mask[:] = True
        return mask

    def _mask(self, vocab: int) -> np.ndarray | None:
        import llguidance.numpy

        if self._matcher.is_error():
            self._fail(self._matcher.get_error())
            return None
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8)[0], bitorder="little")
        mask = np.zeros(vocab, bool)
        n = min(vocab, self._size)
        mask[:n] = bits[:n]
        if not mask.any():
            self._fail("the grammar allows no token of the model's vocabulary")
            return None
        return mask

    def advance(self, token: int) -> None:
        if self.error is not None or token in self._eos:
            return
        try:
            if not self._matcher.consume_token(int(token)):
                self._fail(self._matcher.get_error() or f"token {token} was refused")
        except Exception as error:  # noqa: BLE001 -- never into the engine thread
            self._fail(f"{type(error).__name__}: {error}")

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why[:_MAX_ERROR]
            log.warning("structured output: the grammar failed (%s); the completion ends here",
                        self.error)

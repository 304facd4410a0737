"""Structured output through the openai client on a tiny random model with the default
model's tokenizer (jaxrl/serve/structured.py): response_format json_schema (objects, enums,
arrays, nesting; strict) and json_object, vLLM's guided_json / guided_regex / guided_choice /
guided_grammar on chat and completions, streamed and not, n > 1, 400s for bad grammars and
conflicting fields, a request without a grammar decoding beside a constrained one exactly as
alone, and a constraint that fails ending its completion instead of the engine."""
import json
import re
import threading

import numpy as np
import openai
import pytest

from jaxrl.serve import start_server
from jaxrl.serve.structured import Structured
from tests.serve.helpers import HELLO, SERVE, client, post

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "role", "active"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "active": {"type": "boolean"}}}
TEAM = {"type": "object", "additionalProperties": False, "required": ["team", "members"],
        "properties": {"team": {"enum": ["red", "blue"]},
                       "members": {"type": "array", "minItems": 1, "maxItems": 3,
                                   "items": {"type": "object", "additionalProperties": False,
                                             "required": ["id", "tags"],
                                             "properties": {
                                                 "id": {"type": "integer", "minimum": 1,
                                                        "maximum": 9},
                                                 "tags": {"type": "array", "maxItems": 2,
                                                          "items": {"enum": ["a", "b"]}}}}}}}
LEVEL = {"type": "object", "additionalProperties": False, "required": ["level", "ok"],
         "properties": {"level": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with start_server(tiny_chat_model, port=0, **SERVE) as handle:
        yield handle


def _valid(value, schema) -> bool:
    """`value` follows `schema` (jsonschema where installed; else the subset used here)."""
    try:
        import jsonschema
    except ImportError:
        return _check(value, schema)
    return jsonschema.Draft202012Validator(schema).is_valid(value) and _check(value, schema)


def _check(value, schema) -> bool:
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", ())) <= set(value)
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(_check(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value)
                <= schema.get("maxItems", len(value))
                and all(_check(v, schema["items"]) for v in value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    return True


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema,
                                                   "strict": True}}


def _chat(handle, stream=False, **kw):
    """(texts, finish reasons) of a chat request, streamed or not."""
    kw = {"model": handle.model_id, "messages": HELLO, "max_tokens": 160, **kw}
    c = client(handle)
    if not stream:
        reply = c.chat.completions.create(**kw)
        return ([ch.message.content for ch in reply.choices],
                [ch.finish_reason for ch in reply.choices])
    n = kw.get("n", 1)
    texts, reasons = [""] * n, [None] * n
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    return texts, reasons


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("schema", [PERSON, TEAM, LEVEL], ids=["person", "team", "level"])
def test_json_schema_replies_parse_and_validate(server, schema, stream):
    for settings in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 3}):
        texts, reasons = _chat(server, stream, response_format=_schema_format(schema),
                               **settings)
        for text, reason in zip(texts, reasons):
            assert reason == "stop", text
            assert _valid(json.loads(text), schema), text


def test_streamed_equals_whole(server):
    kw = {"response_format": _schema_format(TEAM), "temperature": 0.9, "seed": 11, "n": 2}
    assert _chat(server, True, **kw) == _chat(server, False, **kw)


def test_json_object_is_an_object(server, tiny_chat_model):
    # a random model wanders in an open-ended object (long keys, many members): biased toward
    # the tokens that close strings and objects, it ends one within its budget
    close = {str(t): 100 for text in ('"', "}", '"}') for t in
             tiny_chat_model.tokenizer.encode(text, add_special_tokens=False)}
    for stream in (False, True):
        texts, reasons = _chat(server, stream, response_format={"type": "json_object"},
                               temperature=0.7, seed=1, n=2, logit_bias=close, max_tokens=60)
        for text, reason in zip(texts, reasons):
            assert reason == "stop" and isinstance(json.loads(text), dict), texts
    # unbiased, it runs out of tokens: finish_reason "length", a reply that begins an object
    texts, reasons = _chat(server, response_format={"type": "json_object"}, temperature=0,
                           max_tokens=24)
    assert reasons == ["length"] and texts[0].startswith("{"), texts


def test_guided_json_as_object_or_string_on_chat_and_completions(server):
    for schema in (LEVEL, json.dumps(LEVEL)):
        texts, _ = _chat(server, extra_body={"guided_json": schema}, temperature=0)
        assert _valid(json.loads(texts[0]), LEVEL)
        reply = client(server).completions.create(
            model=server.model_id, prompt="JSON:", max_tokens=60, temperature=0.7, seed=1,
            n=2, extra_body={"guided_json": schema})
        for choice in reply.choices:
            assert choice.finish_reason == "stop"
            assert _valid(json.loads(choice.text), LEVEL), choice.text


@pytest.mark.parametrize("stream", [False, True])
def test_guided_regex_matches(server, stream):
    regex = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]{1,4})?"
    texts, reasons = _chat(server, stream, extra_body={"guided_regex": regex},
                           temperature=1.0, seed=5, n=3)
    for text, reason in zip(texts, reasons):
        assert reason == "stop" and re.fullmatch(regex, text), text
    c = client(server)
    if stream:
        text = "".join(ch.choices[0].text for ch in c.completions.create(
            model=server.model_id, prompt="Code:", max_tokens=40, temperature=0, stream=True,
            extra_body={"guided_regex": regex}))
    else:
        text = c.completions.create(model=server.model_id, prompt="Code:", max_tokens=40,
                                    temperature=0, extra_body={"guided_regex": regex}
                                    ).choices[0].text
    assert re.fullmatch(regex, text), text


def test_guided_choice_returns_a_choice(server):
    choices = ["yes", "no", "maybe so", 'a "quoted" one']
    texts, reasons = _chat(server, extra_body={"guided_choice": choices}, temperature=1.0,
                           seed=2, n=6)
    assert all(t in choices for t in texts) and set(reasons) == {"stop"}, texts
    reply = client(server).completions.create(
        model=server.model_id, prompt=["Answer:", "Say:"], max_tokens=20, temperature=0,
        extra_body={"guided_choice": choices})
    assert all(ch.text in choices for ch in reply.choices)


def test_guided_grammar(server):
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'
    texts, reasons = _chat(server, extra_body={"guided_grammar": grammar}, temperature=0.8,
                           seed=4, n=2)
    for text, reason in zip(texts, reasons):
        assert reason == "stop" and re.fullmatch(r"\([1-9](\+[1-9])*\)", text), text


def test_a_reply_cut_by_max_tokens_ends_with_length(server):
    texts, reasons = _chat(server, extra_body={"guided_regex": "[a-z]{100}"}, max_tokens=4,
                           temperature=0)
    assert reasons == ["length"] and re.fullmatch("[a-z]+", texts[0])


def test_text_response_format_is_no_constraint(server):
    free = _chat(server, temperature=0, max_tokens=12)
    assert _chat(server, temperature=0, max_tokens=12, response_format={"type": "text"}) == free


@pytest.mark.parametrize("path, extra, param", [
    ("/chat/completions", {"response_format": _schema_format({"type": "nope"})},
     "response_format"),
    ("/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/chat/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/chat/completions", {"guided_json": {"$ref": "#/missing"}}, "guided_json"),
    ("/completions", {"guided_regex": "(("}, "guided_regex"),
    ("/completions", {"guided_regex": ""}, "guided_regex"),
    ("/completions", {"guided_choice": []}, "guided_choice"),
    ("/completions", {"guided_choice": ["a", 1]}, "guided_choice"),
    ("/completions", {"guided_grammar": "start: ("}, "guided_grammar"),
    ("/chat/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "guided_regex"),
    ("/chat/completions", {"response_format": {"type": "json_object"}, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
])
def test_bad_grammars_are_400s(server, path, extra, param):
    body = {"model": server.model_id, "max_tokens": 4,
            **({"messages": HELLO} if path.startswith("/chat") else {"prompt": "Hi"}), **extra}
    status, reply = post(server, path, body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert reply["error"]["message"]


def test_the_openai_client_gets_a_400_and_the_server_goes_on(server):
    with pytest.raises(openai.BadRequestError, match="nope"):
        _chat(server, response_format=_schema_format({"type": "nope"}))
    assert _chat(server, response_format=_schema_format(LEVEL), temperature=0)[1] == ["stop"]


def test_a_free_request_beside_a_constrained_one_decodes_as_alone(server):
    alone, _ = _chat(server, temperature=0, max_tokens=40)
    started, result = threading.Event(), {}

    def constrained():
        kw = {"extra_body": {"guided_regex": "[a-z ]{1000}"}, "temperature": 1.0, "seed": 0,
              "max_tokens": 180}
        texts = ""
        for chunk in client(server).chat.completions.create(
                model=server.model_id, messages=HELLO, stream=True, **kw):
            started.set()
            texts += "".join(ch.delta.content or "" for ch in chunk.choices)
        result["constrained"] = texts

    thread = threading.Thread(target=constrained)
    thread.start()
    assert started.wait(120)
    beside, _ = _chat(server, temperature=0, max_tokens=40)
    overlapped = thread.is_alive()  # the constrained one (180 tokens) still decodes
    thread.join()
    assert overlapped
    assert server.counts.running == 0
    assert beside == alone
    assert re.fullmatch("[a-z ]+", result["constrained"])


def test_a_failing_constraint_ends_its_completion_with_an_eos_id(tiny_chat_model):
    """A token the grammar refuses (as a bug would feed it) puts the matcher in its error
    state: from then on only the EOS ids are allowed, and nothing raises."""
    model = tiny_chat_model
    structured = Structured(model.tokenizer, model.eos_ids)
    (c,) = structured.constraints({"guided_choice": ["yes", "no"]}, 1)
    vocab = model.spec.vocab_size + 64  # the model's vocab may pad the tokenizer's
    first = c.allowed(vocab)
    assert first.shape == (vocab,) and first.any() and not first[model.spec.vocab_size:].any()
    assert not first[list(model.eos_ids)].any()  # nothing chosen yet: no EOS
    refused = int(np.flatnonzero(~first[:model.spec.vocab_size])[100])
    c.advance(refused)
    assert c.error
    assert set(np.flatnonzero(c.allowed(vocab))) == set(model.eos_ids)
    c.advance(7)  # ignored from now on
    assert set(np.flatnonzero(c.allowed(vocab))) == set(model.eos_ids)


def test_a_complete_grammar_allows_only_eos(tiny_chat_model):
    model = tiny_chat_model
    structured = Structured(model.tokenizer, model.eos_ids)
    c1, c2 = structured.constraints({"guided_choice": ["yes"]}, 2)
    for token in model.tokenizer.encode("yes", add_special_tokens=False):
        assert c1.allowed(model.spec.vocab_size)[token]
        c1.advance(token)
    assert set(np.flatnonzero(c1.allowed(model.spec.vocab_size))) == set(model.eos_ids)
    assert not c1.error
    assert not c2.allowed(model.spec.vocab_size)[list(model.eos_ids)].any()  # its own matcher

"""Tool calls end to end on a model whose greedy replies are scripted tool-call markup
(tests/serve/scripted.py), with a Qwen-style and a Llama-3.1-style chat template: tools are
rendered by the template, the markup comes back as `tool_calls` (streamed too), tool_choice
none / required / named is honoured, transcripts with tool results are accepted, and markup
that does not parse comes back as plain content."""
import copy
import dataclasses
import json

import pytest

from jaxrl.hf.pretrained import load_pretrained
from jaxrl.serve import start_server
from tests.serve.helpers import SERVE, client
from tests.serve.scripted import LLAMA_TEMPLATE, make_scripted

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": name, "description": "look it up",
    "parameters": {"type": "object", "properties": {key: {"type": "string"}}}}}
    for name, key in (("get_weather", "city"), ("get_time", "tz"))]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, default_model_dir):
    return load_pretrained(make_scripted(tmp_path_factory.mktemp("scripted"), default_model_dir))


@pytest.fixture(scope="module")
def qwen(scripted):
    with start_server(scripted, port=0, model_id="qwen", **SERVE) as handle:
        yield handle


@pytest.fixture(scope="module")
def llama(scripted):
    tokenizer = copy.deepcopy(scripted.tokenizer)
    tokenizer.chat_template = LLAMA_TEMPLATE
    with start_server(dataclasses.replace(scripted, tokenizer=tokenizer), port=0,
                      model_id="llama", **SERVE) as handle:
        yield handle


def _ask(handle, messages=ASK, **kw):
    return client(handle).chat.completions.create(model=handle.model_id, messages=messages,
                                                  tools=TOOLS, temperature=0, max_tokens=16, **kw)


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("choice", ["auto", "required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_qwen_markup_becomes_tool_calls(qwen, choice):
    reply = _ask(qwen, tool_choice=choice).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    assert _calls(reply.message) == [("get_weather", {"city": "Paris"})]
    assert reply.message.tool_calls[0].id.startswith("call_")


def test_tool_choice_none_renders_no_tools_and_parses_nothing(qwen):
    reply = _ask(qwen, tool_choice="none").choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason == "stop"
    assert reply.message.content == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                     '{"city": "Paris"}}\n</tool_call>')
    with_tools, without = (_ask(qwen, tool_choice=c).usage.prompt_tokens for c in ("auto", "none"))
    assert with_tools > without  # the template wrote the tools into the prompt


def test_streamed_tool_calls(qwen):
    chunks = list(_ask(qwen, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant" and not any(d.content for d in deltas)
    calls = [c for d in deltas if d.tool_calls for c in d.tool_calls]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_transcript_with_tool_results_is_accepted(qwen):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = _ask(qwen, messages=messages)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.usage.prompt_tokens > _ask(qwen).usage.prompt_tokens


@pytest.mark.parametrize("choice", ["auto", {"type": "function", "function": {"name": "get_time"}}])
def test_llama_json_becomes_tool_calls(llama, choice):
    reply = _ask(llama, tool_choice=choice).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert _calls(reply.message) == [("get_time", {"tz": "UTC"})]


def test_markup_that_does_not_parse_is_plain_content(llama):
    # "required" opens the JSON; this model then ends the reply at once: '{"name": "'
    reply = _ask(llama, tool_choice="required").choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason == "stop"
    assert reply.message.content == '{"name": "'
    streamed = "".join(ch.choices[0].delta.content or ""
                       for ch in _ask(llama, tool_choice="required", stream=True))
    assert streamed == '{"name": "'

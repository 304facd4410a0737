"""Tool-call markup of Qwen2.5 / Qwen3 and Llama 3.1 parsed into OpenAI tool calls; markup that
does not parse is no tool call."""
import json

import pytest

from jaxrl.hf.tool_calls import ToolSyntax, syntax_of, template_arguments

QWEN, LLAMA = ToolSyntax("qwen"), ToolSyntax("llama3")


def _calls(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_qwen_content_then_several_calls_the_last_unclosed():
    text = ('I will look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}')
    assert _calls(QWEN.parse(text)) == ("I will look.", [("a", {"x": 1}), ("b", {"y": [2]})])


@pytest.mark.parametrize("text", [
    "no markup at all",
    '<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>',  # JSON cut short
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> and then some words',
])
def test_qwen_markup_that_does_not_parse_is_none(text):
    assert QWEN.parse(text) is None


def test_llama_json_calls_with_parameters():
    text = '<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "parameters": {}}'
    assert _calls(LLAMA.parse(text)) == (None, [("a", {"q": "x"}), ("b", {})])
    assert LLAMA.parse('{"name": "a", "parameters": {"q": "x"') is None
    assert LLAMA.parse("The answer is 4.") is None


def test_forced_prefixes_open_the_markup():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert QWEN.forced_prefix("auto") == "" and LLAMA.forced_prefix("none") == ""
    assert QWEN.forced_prefix("required") == "<tool_call>\n"
    assert QWEN.forced_prefix(named) == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert LLAMA.forced_prefix(named) == '{"name": "get_weather", "parameters": '
    # a forced opening completed by the model parses as a call
    done = QWEN.forced_prefix(named) + '{"city": "Paris"}}\n</tool_call>'
    assert _calls(QWEN.parse(done)) == (None, [("get_weather", {"city": "Paris"})])


def test_syntax_is_read_off_the_template_and_arguments_become_objects():
    assert syntax_of("... <tool_call> ...") == QWEN
    assert syntax_of("... ipython ...") == LLAMA
    assert syntax_of("{{ message['content'] }}") is None and syntax_of(None) is None
    assert syntax_of({"default": "{{ m }}", "tool_use": "<tool_call>"}) == QWEN
    assert template_arguments('{"a": 1}') == {"a": 1}
    assert template_arguments("not json") == "not json"

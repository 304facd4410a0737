"""Text deltas of a streamed completion with the default model's byte-level tokenizer: they
add up to the decoded text, never split a character, and hold back what could become a stop
string or tool-call markup."""
import pytest

from jaxrl.hf.tokenizer import load_tokenizer
from jaxrl.serve.textstream import TextStream
from jaxrl.hf.tool_calls import ToolSyntax


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return load_tokenizer(default_model_dir)


def _run(tok, text, **kw):
    """(deltas, stream) of text's tokens pushed one by one, then finished."""
    stream = TextStream(lambda ids: tok.decode(list(ids), skip_special_tokens=True), **kw)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    deltas = [stream.push(i) for i in ids]
    return deltas + [stream.finish()], stream


def test_multibyte_characters_are_never_split(tok):
    text = "Grüße 🙂 und 你好, ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens hold part of a character
    deltas, stream = _run(tok, text)
    assert "".join(deltas) == text and stream.tokens == len(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_text_ends_before_the_stop_string_and_never_shows_part_of_it(tok):
    text = "The quick brown fox jumps over the lazy dog today"
    deltas, stream = _run(tok, text, stop=("lazy dog", "cat"))
    assert "".join(deltas) == "The quick brown fox jumps over the "
    assert stream.stopped and not any("lazy" in d or " laz" in d for d in deltas)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # tokens count up to the one that completed the stop string
    whole = [tok.decode(ids[:k]) for k in range(1, len(ids) + 1)]
    assert stream.tokens == next(k for k, t in enumerate(whole, 1) if "lazy dog" in t)


def test_a_held_prefix_that_does_not_become_a_stop_string_is_sent(tok):
    deltas, stream = _run(tok, "we say lazy days", stop=("lazy dog",))
    assert "".join(deltas) == "we say lazy days" and not stream.stopped


def test_qwen_markup_is_held_from_its_start(tok):
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    deltas, stream = _run(tok, text, tools=ToolSyntax("qwen"))
    assert "".join(deltas) == "Let me check.\n"
    assert not any("<" in d for d in deltas)
    assert stream.held == text[text.index("<tool_call>"):]


def test_llama_json_is_held_only_at_the_start_of_the_reply(tok):
    deltas, stream = _run(tok, ' {"name": "f", "parameters": {}}', tools=ToolSyntax("llama3"))
    assert "".join(deltas) == " " and stream.held == '{"name": "f", "parameters": {}}'
    deltas, stream = _run(tok, 'Use {"a": 1} here', tools=ToolSyntax("llama3"))
    assert "".join(deltas) == 'Use {"a": 1} here' and stream.held == ""


def test_a_forced_prefix_is_markup_from_the_first_character(tok):
    stream = TextStream(lambda ids: tok.decode(list(ids)), tools=ToolSyntax("qwen"),
                        prefix="<tool_call>\n")
    assert stream.push(tok("{}", add_special_tokens=False)["input_ids"][0]) == ""
    assert stream.finish() == "" and stream.held.startswith("<tool_call>\n{")

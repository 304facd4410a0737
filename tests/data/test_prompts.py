"""Prompts: the output format, the exact answer format per verifier, chat-template lengths."""
import pytest

from jaxrl.data.generators import GENERATORS, generate
from jaxrl.data.prompts import (
    FORM,
    SYSTEM_PROMPT,
    TEMPLATES,
    answer_instruction,
    build_messages,
    prompt_fits,
    system_prompt,
)
from jaxrl.data.sources import SOURCES

# prompts in Problem.fields["messages"]
READY_MADE = {"knk", "knk-brief", "zebra", "ar_lsat", "zebralogic", "calculator", "diagnosis"}


def test_every_task_has_a_template_or_ready_made_messages():
    tasks = set(SOURCES) | set(GENERATORS)
    assert {"arithmetic", "crypto", "list_fn", "abduction_rules"} | READY_MADE <= tasks
    assert tasks - READY_MADE <= set(TEMPLATES)
    for task in ("knk", "zebra"):
        system, user = generate(task, 1)[0]["messages"]
        assert system == {"role": "system", "content": system_prompt(task)}
        assert user["role"] == "user" and "<answer>" in user["content"]


def test_messages_are_system_format_then_user_task():
    messages = build_messages("arithmetic", {"kind": "numeric"}, expression="7 + 5")
    assert messages == [
        {"role": "system", "content": SYSTEM_PROMPT + "\nExample:\nUser: What is 3 + 4?\n"
                                      "Assistant: <think>3 plus 4 equals 7.</think>"
                                      "<answer>7</answer>"},
        {"role": "user", "content": "What is 7 + 5?\n\nInside <answer></answer> write only the "
                                    "final number, e.g. <answer>12</answer>."}]
    crypto = build_messages("crypto", {"kind": "python", "entry_point": "transform"},
                            examples="a -> b")
    assert crypto[0]["content"] == SYSTEM_PROMPT + "\n" + FORM  # no worked example: the form
    assert "<think>your reasoning</think><answer>your final answer</answer>" in FORM


@pytest.mark.parametrize("task, verifier, expected", [
    ("art", {"kind": "mcq", "choices": ["A", "B"]},
     "write only the letter of the correct option (A, B), e.g. <answer>A</answer>."),
    ("climate_fever", {"kind": "label", "labels": ["SUPPORTS", "REFUTES"]},
     "write exactly one of: SUPPORTS, REFUTES."),
    ("uniadilr", {"kind": "set"}, "write only the numbers of the supporting sentences, "
                                  "separated by commas, e.g. <answer>1, 3</answer>."),
    ("crypto", {"kind": "python", "entry_point": "transform", "tests": []},
     "write the source of one Python function `def transform(...)`."),
    ("abduction_rules", {"kind": "exact"},
     "write the one missing fact, as a single short sentence, e.g. <answer>Bob is kind."),
])
def test_answer_format_per_verifier(task, verifier, expected):
    assert expected in answer_instruction(task, verifier)


def test_unknown_template_or_format_is_an_error():
    with pytest.raises(ValueError, match="no prompt template for task 'nope'"):
        build_messages("nope", {"kind": "exact"})
    with pytest.raises(ValueError, match="no answer format for task 'art' with verifier kind "
                                         "'exact'"):
        answer_instruction("art", {"kind": "exact"})
    with pytest.raises(ValueError, match="no answer format for task 'crypto' with verifier kind "
                                         "'set'"):
        answer_instruction("crypto", {"kind": "set"})


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    backend = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                   chat_template=template)


def test_prompt_fits_counts_chat_template_tokens():
    record = generate("arithmetic", 1, seed=0)[0]
    tokenizer = _tokenizer()
    text = tokenizer.apply_chat_template(record["messages"], tokenize=False,
                                         add_generation_prompt=True)
    length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert prompt_fits(tokenizer, length)(record)
    assert not prompt_fits(tokenizer, length - 1)(record)

"""Span extraction, samples from records, the format reward, and no jax under jaxrl.rewards."""
import subprocess
import sys

import pytest

from jaxrl.rewards.base import (
    RewardResult,
    Sample,
    answer_span,
    completion_text,
    failed,
    failures_of,
    sample_from_record,
    think_span,
)
from jaxrl.rewards.format import FormatReward, well_formed


def test_spans():
    text = "<think>a</think><answer>x</answer> then <answer>y</answer>"
    assert answer_span(text) == "y" and think_span(text) == "a"
    assert answer_span("<answer>a<answer>b</answer>") == "b"
    assert answer_span("<answer>open") is None and answer_span("close</answer>") is None
    assert think_span("no trace") is None


@pytest.mark.parametrize("text", [
    "<think>why</think><answer>42</answer>",
    "  <think>\nwhy\n</think>\n\n<answer> 42 </answer>\n",
    "<think></think><answer></answer>",
])
def test_well_formed(text):
    assert well_formed(text)


@pytest.mark.parametrize("text", [
    "<answer>42</answer>",
    "<think>why</think>",
    "<answer>42</answer><think>why</think>",
    "so: <think>why</think><answer>42</answer>",
    "<think>why</think><answer>42</answer> done",
    "<think>why</think>text<answer>42</answer>",
    "<think>why</think><answer>4</answer><answer>2</answer>",
    "<think>a<think>b</think><answer>42</answer>",
    "<think>why</think><answer>4<answer>2</answer>",
])
def test_not_well_formed(text):
    assert not well_formed(text)


def test_format_reward_restores_a_think_tag_opened_by_the_template():
    reward = FormatReward()
    opened = Sample("<|im_start|>assistant\n<think>\n", "why</think><answer>4</answer>", {})
    assert completion_text(opened) == "<think>why</think><answer>4</answer>"
    assert reward.score([opened]) == [RewardResult(1.0, {"format": 1.0}, {})]
    plain = Sample("user: 2+2?", "why</think><answer>4</answer>", {})
    assert reward.score_one(plain) == RewardResult(0.0, {"format": 0.0}, {"error": "bad_format"})


def test_sample_from_record():
    record = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "old"}], "completion": "4"}
    sample = sample_from_record(record)
    assert sample.prompt == "Be brief.\n\n2+2?" and sample.completion == "4"
    assert sample_from_record({**record, "prompt": "P"}, "5") == Sample(
        "P", "5", {**record, "prompt": "P"})


def test_failures_of():
    assert failures_of(RewardResult(1.0)) == []
    assert failures_of(failed("timeout", detail="x")) == ["timeout"]
    assert failed("timeout", 0.5).value == 0.5
    assert failures_of(RewardResult(0.0, {}, {"failures": ["a", "b"]})) == ["a", "b"]


def test_rewards_never_import_jax():
    code = ("import sys, jaxrl.rewards.pool, jaxrl.rewards.cedar, jaxrl.rewards.format, "
            "jaxrl.commands.score; assert 'jax' not in sys.modules, 'jax was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

"""CEDAR judges: prompts, reply validation and the composite reward."""
import pytest

from jaxrl.config import Config, RewardEntry, apply_overrides
from jaxrl.rewards.base import Sample
from jaxrl.rewards.cedar import (
    COVERAGE_SYSTEM,
    DIRECTIONALITY_SYSTEM,
    Cedar,
    coverage_of,
    dataset_note,
    directionality_of,
    judge_messages,
    parse_json_object,
)
from jaxrl.rewards.pool import RewardPool
from tests.rewards.openai_stub import StubServer

RECORD = {"id": "ab-1", "task": "abduction", "answer": "the sprinkler",
          "verifier": {"kind": "exact"}}


def _sample(answer="the sprinkler", scenario="good"):
    return Sample("Observations: the lawn is wet; the street is dry.",
                  f"<think>Wet lawn, dry street. SCENARIO={scenario}</think>"
                  f"<answer>{answer}</answer>", RECORD)


def _cfg(server, tmp_path, *extra):
    return apply_overrides(Config(), [
        f"judge.base_url={server.base_url}", "judge.model=stub", "judge.timeout_s=0.5",
        "judge.max_retries=0", f"run.output_dir={tmp_path}", *extra])


def test_messages_hold_the_prompt_the_think_span_and_the_task_note():
    system, user = judge_messages(COVERAGE_SYSTEM, _sample())
    assert "Dataset-specific note: Observations: the facts, the rules" in system["content"]
    assert "{dataset_note}" not in system["content"] and '"addressed"' in system["content"]
    assert "the lawn is wet; the street is dry" in user["content"]
    assert "Wet lawn, dry street." in user["content"]
    assert "<answer>" not in user["content"] and "sprinkler" not in user["content"]
    no_span = Sample("P", "no tags, just text <answer>x</answer>", RECORD)
    assert "no tags, just text <answer>x</answer>" in judge_messages(
        DIRECTIONALITY_SYSTEM, no_span)[1]["content"]


def test_dataset_notes():
    for task in ("list_fn", "list-function", "crypto", "knk", "zebra", "UniADILR",
                 "climate_fever", "causelogics", "balanced_copa"):
        assert dataset_note(task) != dataset_note("other"), task
    assert dataset_note("list_fn") == dataset_note("list_function")
    assert "everything the problem states" in dataset_note("gsm8k")


def test_parse_json_object():
    assert parse_json_object('{"score": 1}') == {"score": 1}
    assert parse_json_object('```json\n{"score": 0.5}\n```') == {"score": 0.5}
    assert parse_json_object('Here: {"score": 0} done') == {"score": 0}
    assert parse_json_object("[1, 2]") is None and parse_json_object("nothing") is None


def test_coverage_validation():
    reply = {"details": [{"detail": "a", "addressed": True}, {"detail": "b", "addressed": False},
                         {"detail": "a", "addressed": True}, {"detail": "c", "addressed": False}]}
    assert coverage_of(reply) == (0.5, {"details": 4, "addressed": 2})  # no deduplication
    for bad in (None, {}, {"details": []}, {"details": "x"},
                {"details": [{"detail": "a", "addressed": "yes"}]},
                {"details": [{"detail": " ", "addressed": True}]},
                {"details": [{"addressed": True}]}):
        assert coverage_of(bad) is None, bad


def test_directionality_validation():
    for score, value in ((1, 1.0), (0.5, 0.5), (0.0, 0.0), ("1.0", 1.0)):
        assert directionality_of({"score": score}) == (value, {})
    for bad in (None, {}, {"score": 0.7}, {"score": True}, {"score": "high"}, {"score": None}):
        assert directionality_of(bad) is None, bad


def test_composite_weights_parts_and_failures(tmp_path):
    with StubServer() as server:
        cedar = Cedar(_cfg(server, tmp_path, "rewards.cedar_weights=[1, 0.3, 0.6]"))
        right, wrong, broken = cedar.score([_sample(), _sample("rain"),
                                            _sample(scenario="http500")])
    assert right.components == {"correctness": 1.0, "coverage": pytest.approx(2 / 3),
                                "directionality": 1.0}
    assert right.value == pytest.approx(1 + 0.3 * 2 / 3 + 0.6) and "failures" not in right.info
    assert wrong.value == pytest.approx(0.3 * 2 / 3 + 0.6)
    assert wrong.info["correctness"] == {"error": "wrong_answer"}
    assert broken.value == 1.0 and broken.info["failures"] == ["judge_http_error"] * 2


def test_default_weights_keep_correctness_dominant():
    weights = Config().rewards.cedar_weights
    assert weights[0] > weights[1] + weights[2]


def test_composite_through_the_pool_logs_each_part(tmp_path):
    with StubServer() as server:
        cfg = _cfg(server, tmp_path, "rewards.workers=1")
        with RewardPool(cfg, [RewardEntry("cedar"), RewardEntry("format", 0.5)]) as pool:
            batch = pool.score([_sample(), _sample("rain", "http500")])
    assert batch.rewards[0] == pytest.approx(1 + 0.25 * 2 / 3 + 0.25 + 0.5)
    assert batch.rewards[1] == pytest.approx(0.5)
    metrics = batch.metrics
    assert metrics["rewards/cedar/correctness/mean"] == 0.5
    assert metrics["rewards/cedar/coverage/mean"] == pytest.approx(1 / 3)
    assert metrics["rewards/format/mean"] == 1.0
    assert metrics["rewards/failures/judge_http_error"] == 2

"""Generators: gold answers pass their verifier on 200 records, perturbed answers fail, the same
seed gives the same records, and every difficulty produces valid, distinct problems."""
import importlib.util

import pytest

from jaxrl.data.generators import GENERATORS, PLANNED, GeneratorError, generate
from jaxrl.data.generators.arithmetic import evaluate
from jaxrl.data.generators.crypto import encrypt
from jaxrl.data.records import validate_record
from tests.data.reference import perturb, score, score_python

N = 200
TASKS = ("arithmetic", "crypto", "list_fn", "abduction_rules")


def _scores(records, answers):
    if records[0]["verifier"]["kind"] == "python":
        return score_python(list(zip(records, answers)))
    return [score(r, a) for r, a in zip(records, answers)]


@pytest.mark.parametrize("task", TASKS)
def test_gold_scores_one_and_perturbed_zero(task):
    records = generate(task, N, seed=7)
    assert len(records) == N and all(r["task"] == task for r in records)
    assert _scores(records, [r["answer"] for r in records]) == [1.0] * N
    assert _scores(records, [perturb(r) for r in records]) == [0.0] * N


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_records_and_prefix_stable(task):
    first = generate(task, 50, seed=3)
    assert first == generate(task, 50, seed=3)
    assert first[:20] == generate(task, 20, seed=3)
    other = generate(task, 50, seed=4)
    assert [r["answer"] for r in first] != [r["answer"] for r in other]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("difficulty", (1, 2, 3))
def test_every_difficulty_gives_distinct_valid_prompts(task, difficulty):
    records = generate(task, 40, seed=1, difficulty=difficulty)
    prompts = [r["messages"][-1]["content"] for r in records]
    assert len(set(prompts)) == len(prompts)
    for r in records:
        validate_record(r)
        assert r["metadata"]["difficulty"] == difficulty and r["metadata"]["seed"] == 1
        assert r["messages"][0]["role"] == "system" and "<answer>" in r["messages"][0]["content"]
    if records[0]["verifier"]["kind"] == "python":
        assert score_python([(r, r["answer"]) for r in records]) == [1.0] * len(records)
    else:
        assert all(score(r, r["answer"]) == 1.0 for r in records)


def test_arithmetic_matches_python_and_difficulty_bounds():
    assert evaluate([7, 5], ["+"]) == 12
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([10, 2, 3, 4], ["-", "*", "-"]) == 0
    easy = generate("arithmetic", 200, seed=0, difficulty=1)
    assert all(r["metadata"]["operations"] == 1 for r in easy)
    numbers = [int(t) for r in easy for t in r["metadata"]["expression"].split() if t.isdigit()]
    assert max(numbers) < 10
    assert easy[0]["messages"][-1]["content"].startswith("What is ")
    assert easy[0]["verifier"] == {"kind": "numeric", "tolerance": 1e-6}


def test_crypto_rules():
    assert encrypt("Hello, World!", 3) == "Khoor, Zruog!"
    assert encrypt("abc xyz", None) == "zyx cba"
    assert encrypt(encrypt("Round trip.", 11), 15) == "Round trip."
    rules = {r["metadata"]["rule"].split("+")[0] for r in generate("crypto", 60, seed=0)}
    assert rules == {"caesar", "atbash"}


def test_list_fn_shows_a_change_and_holds_out_other_inputs():
    for r in generate("list_fn", 100, seed=2, difficulty=2):
        tests = r["verifier"]["tests"]
        shown = r["messages"][-1]["content"].split("\n\n")[0]
        assert len(tests) == 5 and all(f"{t['input']} ->" not in shown for t in tests)


def test_abduction_answer_is_absent_from_context():
    for r in generate("abduction_rules", 100, seed=5, difficulty=3):
        context = r["messages"][-1]["content"].split("Observation:")[0]
        assert r["answer"] not in context


def test_unknown_and_planned_tasks_are_clear_errors(monkeypatch):
    assert [r["task"] for r in generate("knk", 2) + generate("zebra", 1)] == ["knk", "knk",
                                                                            "zebra"]
    with pytest.raises(GeneratorError, match="unknown generated task 'arith'; available: "
                                              "abduction_rules, arithmetic, calculator, crypto, "
                                              "diagnosis, knk, knk-brief, list_fn, zebra"):
        generate("arith", 3)
    monkeypatch.setitem(PLANNED, "sudoku", "Sudoku grids, coming later")
    with pytest.raises(GeneratorError, match="'sudoku' is not available yet: Sudoku grids, "
                                              "coming later; available generated tasks: "
                                              "abduction_rules, arithmetic, calculator, "
                                              "crypto, diagnosis, knk"):
        generate("sudoku", 3)
    with pytest.raises(GeneratorError, match="difficulty must be one of"):
        generate("arithmetic", 3, difficulty=4)


def test_registry_is_open_to_new_tasks():
    assert set(TASKS) <= set(GENERATORS)
    assert all(GENERATORS[t].verifier_kind in ("numeric", "python", "exact") for t in TASKS)


@pytest.mark.skipif(importlib.util.find_spec("jaxrl.rewards.correctness") is None,
                    reason="jaxrl.rewards.correctness is not there yet")
@pytest.mark.parametrize("task", TASKS)
def test_the_real_correctness_reward_agrees(task):
    from jaxrl.rewards.base import sample_from_record
    from jaxrl.rewards.correctness import Correctness

    records = generate(task, N if task in ("arithmetic", "abduction_rules") else 12, seed=7)
    reward = Correctness()
    for answers, expected in (([r["answer"] for r in records], 1.0),
                              ([perturb(r) for r in records], 0.0)):
        samples = [sample_from_record(r, f"<think>x</think><answer>{a}</answer>")
                   for r, a in zip(records, answers)]
        assert [result.value for result in reward.score(samples)] == [expected] * len(records)

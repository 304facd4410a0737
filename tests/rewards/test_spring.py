"""The spring reward: the formula against hand-computed numbers, the worked example end to end,
the s_sat gate, adversarial completions, and `jaxrl score` writing every component."""
import json

import pytest
from hypothesis import example, HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl.cli import main
from jaxrl.rewards.base import RewardConfigError, Sample
from jaxrl.rewards.spring import COMPONENTS, Spring, spring_reward
from tests.logic.worked_example import PREMISES, SOLUTION, STEPS, record

GOLD = json.dumps(SOLUTION)
RECORD = record(GOLD)


def _score(think: str, answer: str = GOLD) -> tuple[float, dict, dict]:
    result = Spring().score_one(Sample("", f"<think>{think}</think><answer>{answer}</answer>",
                                       RECORD))
    return result.value, dict(result.components), dict(result.info)


@pytest.mark.parametrize("components,expected", [
    # s_sat = 0: 0.15 * 0.5 + 0.10 * 1 + 0.60 * 0 (the process terms are ignored)
    ({"parsed": 0.5, "format": 1, "accuracy": 0, "s_sat": 0, "novel": 1, "consistency": 1,
      "contra": 0}, 0.175),
    # 0.85 + (0.5 + 0.5) * (0.40 * 0.5 + 0.30 * 1 - 0.15 * 0.25) = 0.85 + 0.4625
    ({"parsed": 1, "format": 1, "accuracy": 1, "s_sat": 1, "novel": 0.5, "consistency": 1,
      "contra": 0.25}, 1.3125),
    # 0.15 + (0.5 + 0) * (0.40 * 1) = 0.35
    ({"parsed": 1, "format": 0, "accuracy": 0, "s_sat": 1, "novel": 1, "consistency": 0,
      "contra": 0}, 0.35),
    # the lowest value: 0.5 * (-0.15)
    ({"parsed": 0, "format": 0, "accuracy": 0, "s_sat": 1, "novel": 0, "consistency": 0,
      "contra": 1}, -0.075),
    # the highest value: 0.85 + 0.70
    ({"parsed": 1, "format": 1, "accuracy": 1, "s_sat": 1, "novel": 1, "consistency": 1,
      "contra": 0}, 1.55),
])
def test_formula_matches_hand_computed_values(components, expected):
    assert spring_reward(components) == pytest.approx(expected)


def test_worked_example_end_to_end():
    value, components, info = _score(PREMISES + STEPS)
    assert info["verdicts"] == ["novel", "novel", "tautological", "contradictory"]
    # 9/9 forms parsed; novel 2/4, contra 1/4; the contradiction breaks consistency
    assert components == {"parsed": 1.0, "format": 1.0, "accuracy": 1.0, "s_sat": 1.0,
                          "novel": 0.5, "consistency": 0.0, "contra": 0.25}
    assert value == pytest.approx(0.85 + 1.0 * (0.40 * 0.5 - 0.15 * 0.25))  # 1.0125


def test_clean_trace_and_a_wrong_answer():
    steps = "(step 1 (= Bob 2))\n(step 2 (= cat 2))\n(step 3 (Dave))\n"
    value, components, info = _score(PREMISES + steps)
    assert components["parsed"] == 7 / 8 and components["novel"] == 1.0
    assert components["consistency"] == 1.0 and value == pytest.approx(
        0.15 * 7 / 8 + 0.70 + 0.70)
    wrong = json.loads(GOLD)
    wrong["House 1"]["Pet"], wrong["House 3"]["Pet"] = "fish", "dog"
    value, components, info = _score(PREMISES + steps, json.dumps(wrong))
    assert components["accuracy"] == 0.0 and info["answer"]["cell_accuracy"] == 7 / 9
    assert components["consistency"] == 1.0  # the steps do not mention the pets
    assert value == pytest.approx(0.15 * 7 / 8 + 0.10 + 0.5 * (0.40 + 0.30))


@pytest.mark.parametrize("premises,base", [
    ("(assert (= Bob 1))\n(assert (= Bob 2))\n", "unsat"),
    ("(assert (= Bob tea))\n(assert (= tea 2))\n", "multiple"),
])
def test_without_a_unique_solution_only_the_base_counts(premises, base):
    value, components, info = _score(premises + "(step 1 (= Bob 2))")
    assert info["base"] == base and components["s_sat"] == 0.0
    assert components["novel"] == components["contra"] == components["consistency"] == 0.0
    assert value == pytest.approx(0.15 + 0.10 + 0.60)


def test_missing_parts_score_what_is_there():
    result = Spring().score_one(Sample("", "<think>no formal text</think>", RECORD))
    assert result.value == 0.0 and result.info["error"] == "no_answer_span"
    value, components, info = _score("prose only", "not json")
    assert value == 0.0 and components["format"] == 0.0 and info["error"] == "no_formal_forms"


def test_records_without_a_theory_are_config_errors():
    mcq = {**RECORD, "answer": "A", "verifier": {"kind": "mcq", "choices": ["A", "B"]}}
    with pytest.raises(RewardConfigError, match="needs a puzzle record with a formal theory"):
        Spring().check(Sample("", "", mcq))
    broken = {**RECORD, "verifier": {**RECORD["verifier"], "theory": {"consts": {"x": "Real"}}}}
    with pytest.raises(RewardConfigError, match="'theory' is unusable.*Int or Bool"):
        Spring().check(Sample("", "", broken))


ADVERSARIAL = {
    "100k open parens": "(step 1 " + "(" * 100_000,
    "100k step heads": "(step 1 " * 12_500,
    "100k-char symbol": "(step 1 (= " + "x" * 100_000 + " 1))",
    "nesting depth 10000": "(step 1 " + "(not " * 10_000 + "true" + ")" * 10_001,
    "undeclared symbol": "(step 1 (= Mallory 1))",
    "huge integer": "(step 1 (= Bob " + "9" * 5000 + "))",
    "quantifier over Int": "(step 1 (forall ((x Int)) (= x x)))",
    "quantifier blow-up": "(step 1 (forall ((a Name) (b Name) (c Name) (d Name) (e Name) "
                          "(f Name) (g Name) (h Name) (i Name) (j Name)) (distinct a b)))",
    "code injection": "(step 1 (eval \"__import__('os').system('true')\"))",
    "smt-lib injection": "(step 1 (declare-fun f (Int) Int))",
    "100k garbage bytes": "(step 1 " + bytes(range(256)).decode("latin-1") * 400 + ")",
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_steps_are_unparsed(name):
    value, components, info = _score(PREMISES + ADVERSARIAL[name] + "\n(step 2 (= Bob 2))")
    assert info["base"] == "unique" and info["verdicts"][0] == "unparsed"
    if name not in ("100k open parens", "100k step heads"):  # those swallow the last step
        assert info["verdicts"][-1] == "novel"
    assert components["parsed"] < 1.0 and -0.075 <= value <= 1.55


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example("(assert -0=")  # a token that starts like a number but is not one (found by fuzzing)
@given(st.lists(st.sampled_from(list("()=+-<>; \n0123456789abBobteacat") +
                               ["(assert ", "(step 1 ", "(forall ((x Pet)) ", "\x00"]),
                max_size=200).map("".join))
def test_fuzzed_reasoning_never_raises(text):
    value, components, _ = _score(PREMISES + text)
    assert -0.075 <= value <= 1.55 and set(components) == set(COMPONENTS)


def test_jaxrl_score_writes_every_component(tmp_path, capsys):
    lines = [{**RECORD, "completion": f"<think>{PREMISES}{STEPS}</think><answer>{GOLD}</answer>"},
             {**RECORD, "completion": "<answer>{}</answer>"}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    assert main(["score", "--reward", "spring", "--input", str(src), "--out", str(out),
                 "rewards.workers=1"]) == 0
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [set(s["components"]) for s in scored] == [set(COMPONENTS)] * 2
    assert scored[0]["reward"] == pytest.approx(1.0125)
    assert scored[0]["info"]["verdicts"] == ["novel", "novel", "tautological", "contradictory"]
    assert "scored 2 completions with spring" in capsys.readouterr().err

"""The step checker: the paper's worked example, each verdict by hand, the s_sat gate,
consistency, and the time budget."""
import pytest

from jaxrl.logic.sexpr import extract
from jaxrl.logic.step_checker import StepChecker
from jaxrl.logic.z3_theory import Theory
from tests.logic.worked_example import PREMISES, STEPS, THEORY

GOLD = [("=", s, h) for s, h in (("Alice", 1), ("dog", 1), ("coffee", 1), ("Bob", 2),
                                 ("cat", 2), ("tea", 2), ("Carol", 3), ("fish", 3),
                                 ("juice", 3))]


def _check(text, answer=None, **kwargs):
    return StepChecker(Theory(THEORY), **kwargs).check(extract(text), answer)


def _verdicts(result):
    return [s.verdict for s in result.steps]


def test_worked_example_as_in_the_paper():
    result = _check(PREMISES + STEPS, GOLD)
    assert result.base == "unique" and result.s_sat and result.premises_parsed == 5
    assert _verdicts(result) == ["novel", "novel", "tautological", "contradictory"]
    assert not result.consistent  # the contradictory step is one of the trace's steps


def test_worked_example_clean_trace_is_consistent_with_the_answer():
    steps = ("(step 1 (= Bob 2))\n(step 2 (not (= Alice 3)))\n(step 3 (= Alice 1))\n"
             "(step 4 (= cat 2))\n")
    result = _check(PREMISES + steps, GOLD)
    # Alice = 1 follows from steps 1 and 2 and the domain rules alone: not novel
    assert _verdicts(result) == ["novel", "novel", "redundant", "novel"] and result.consistent
    assert not _check(PREMISES + steps, [("=", "Bob", 3)]).consistent
    assert not _check(PREMISES, GOLD).consistent  # no step: nothing to be consistent


@pytest.mark.parametrize("steps,verdicts", [
    (["(= Bob 2)", "(not (= Bob 1))"], ["novel", "redundant"]),  # entailed by step 1
    (["(= tea 2)", "(= 2 tea)", "(not (distinct Bob tea))"], ["redundant"] * 3),  # premises
    (["(distinct Alice Bob)", "(<= 1 cat 3)", "(forall ((x Pet)) (> x 0))"],
     ["tautological"] * 3),
    (["(= Alice 3)", "(= Alice 1)"], ["contradictory", "novel"]),  # rejected, not accepted
    (["(= Alice 1)", "(= cat 2)"], ["novel", "novel"]),  # cat = 2 needs clue 1 too
    (["(and (= Bob 2) (= cat 2))", "(= cat 2)"], ["novel", "redundant"]),
    (["(= Dave 1)", "(+ 1 2)", "(= Bob 2)"], ["unparsed", "unparsed", "novel"]),
])
def test_each_verdict_by_hand(steps, verdicts):
    text = PREMISES + "".join(f"(step {i} {s})\n" for i, s in enumerate(steps, 1))
    result = _check(text)
    assert _verdicts(result) == verdicts
    assert result.steps_parsed == sum(v != "unparsed" for v in verdicts)


@pytest.mark.parametrize("premises,base", [
    ("(assert (= Bob 1))\n(assert (= Bob 2))\n", "unsat"),
    ("(assert (= Bob tea))\n(assert (= tea 2))\n", "multiple"),
    ("no premises at all\n", "no_premises"),
    ("(assert (= Dave 1))\n", "no_premises"),
])
def test_gate_fails_without_a_unique_solution(premises, base):
    result = _check(premises + "(step 1 (= Bob 2))\n(step 2 (= Eve 1))", GOLD)
    assert result.base == base and not result.s_sat and not result.consistent
    assert _verdicts(result) == ["unchecked", "unparsed"]


def test_unparsed_premises_are_counted_and_explained():
    result = _check(PREMISES + "(assert (= Dave 1))\n(assert (a\"))")
    assert (result.premises_total, result.premises_parsed) == (7, 5) and result.s_sat
    assert any("undeclared symbol 'Dave'" in e for e in result.errors)


def test_out_of_budget_checks_are_unknown_and_unparsed():
    assert _check(PREMISES, budget_s=0.0).base == "unknown"
    steps = "".join(f"(step {i} (= Bob 2))\n" for i in range(1, 129))
    result = _check(PREMISES + steps, budget_s=0.002)  # 128 steps need far more than 2 ms
    assert len(result.steps) == 128
    if result.base == "unique":
        assert result.steps[-1].verdict == "unparsed" and result.steps[-1].detail == "budget"
    else:  # a slow machine spent the budget on the gate already
        assert result.base == "unknown"

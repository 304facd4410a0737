"""Correctness: every verifier kind scores its gold answer 1 and a wrong answer 0."""
import pytest

from jaxrl.rewards import VERIFIERS, register_verifier
from jaxrl.rewards.base import RewardConfigError, RewardResult, Sample
from jaxrl.rewards.correctness import (
    Correctness,
    Verifier,
    choice_of,
    items,
    json_equal,
    normalize,
    parse_number,
    strip_fences,
)

DOUBLE = "def transform(xs):\n    return [x * 2 for x in xs]\n"
RECORDS = {
    "exact": ({"answer": "Paris", "verifier": {"kind": "exact"}}, "Lyon"),
    "label": ({"answer": "SUPPORTS", "verifier": {"kind": "label", "labels": [
        "SUPPORTS", "REFUTES", "DISPUTED", "NOT ENOUGH INFO"]}}, "REFUTES"),
    "set": ({"answer": "1, 3, 4", "verifier": {"kind": "set"}}, "1, 3"),
    "numeric": ({"answer": "1,234.5", "verifier": {"kind": "numeric"}}, "1234.6"),
    "mcq": ({"answer": "B", "verifier": {"kind": "mcq", "choices": ["A", "B", "C", "D"]}}, "C"),
    "python": ({"answer": DOUBLE, "verifier": {"kind": "python", "entry_point": "transform",
                                               "tests": [{"input": [1, 2], "output": [2, 4]},
                                                         {"input": [], "output": []}]}},
               "def transform(xs):\n    return xs\n"),
    "knk": ({"answer": "Alice is a knight, Bob is a knave",
             "verifier": {"kind": "knk", "people": ["Alice", "Bob"]}}, "Alice: knave, Bob: knave"),
    "zebra": ({"answer": '{"House 1": {"Name": "Bob"}, "House 2": {"Name": "Alice"}}',
               "verifier": {"kind": "zebra", "attributes": {"Name": ["Alice", "Bob"]},
                            "symbols": {"Name": ["Alice", "Bob"]}}},
              '```json\n{"solution": {"House 1": {"name": "alice"}, "House 2": {"Name": "Bob"}}}'),
}


def _sample(record, answer, kind="k"):
    record = {"id": f"{kind}-1", "task": "t", **record}
    return Sample("prompt", f"<think>reasoning</think>\n<answer>{answer}</answer>", record)


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_gold_scores_one_and_a_wrong_answer_zero(kind):
    record, wrong = RECORDS[kind]
    reward = Correctness()
    gold = reward.score_one(_sample(record, record["answer"], kind))
    bad = reward.score_one(_sample(record, wrong, kind))
    assert gold.value == 1.0 and gold.components["correctness"] == 1.0, gold
    assert bad.value == 0.0 and bad.components["correctness"] == 0.0 and bad.info["error"], bad


def test_every_registered_kind_is_covered():
    assert set(RECORDS) == set(VERIFIERS)


def test_no_answer_span_scores_zero():
    record, _ = RECORDS["exact"]
    for completion in ("Paris", "<answer>Paris", "<think>x</think> Paris</answer>"):
        result = Correctness().score_one(Sample("p", completion, record))
        assert result == RewardResult(0.0, {"correctness": 0.0}, {"error": "no_answer_span"})


def test_the_last_complete_answer_span_counts():
    record, _ = RECORDS["exact"]
    reward = Correctness()
    assert reward.score_one(Sample("p", "<answer>Lyon</answer> no: <answer>Paris</answer>",
                                   record)).value == 1.0
    assert reward.score_one(Sample("p", "<answer>Paris</answer><answer>Lyon</answer><answer>",
                                   record)).value == 0.0


def test_normalization():
    assert normalize('  "The   Big\tCat."  ') == "the big cat"
    assert normalize("'Paris'.") == normalize("\u201cParis\u201d") == "paris"
    assert normalize("a.b.") == "a.b"


def test_sets_split_on_commas_whitespace_and_and():
    assert items("1, 3 and 4.") == items("4 3 1") == items("[1,3,4]") == {"1", "3", "4"}
    assert items("1, 3") != items("1, 3, 4")


@pytest.mark.parametrize("text,value", [
    ("42", 42.0), ("-7", -7.0), ("+3.5", 3.5), ("1,234,567", 1234567.0), ("0.25.", 0.25),
    ("3/4", 0.75), ("-1 / 8", -0.125), ("1e-3", 0.001), (".5", 0.5), ("2.", 2.0)])
def test_numbers_parse(text, value):
    assert parse_number(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "abc", "1,23", "1/0", "12 apples", "--3"])
def test_non_numbers_do_not_parse(text):
    assert parse_number(text) is None


def test_numeric_tolerance_is_relative():
    record = {"answer": "1000", "verifier": {"kind": "numeric", "tolerance": 1e-3}}
    reward = Correctness()
    assert reward.score_one(_sample(record, "1000.9")).value == 1.0
    assert reward.score_one(_sample(record, "1001.1")).value == 0.0
    assert reward.score_one(_sample(record, "a thousand")).info["error"] == "not_a_number"
    exact = {"answer": "3/4", "verifier": {"kind": "numeric"}}
    assert reward.score_one(_sample(exact, "0.75")).value == 1.0


def test_mcq_answer_forms():
    choices = ["A", "B", "C", "D"]
    for text in ("B", "(B)", "B)", "B.", "B. the second option", "b", "( B )", "B: second"):
        assert choice_of(text, choices) == "B", text
    for text in ("Bee", "E", "(E)", "AB", "the answer is B"):
        assert choice_of(text, choices) is None, text
    record, _ = RECORDS["mcq"]
    assert Correctness().score_one(_sample(record, "E")).info["error"] == "not_a_choice"


def test_label_outside_the_set_scores_zero_with_info():
    record, _ = RECORDS["label"]
    result = Correctness().score_one(_sample(record, "MAYBE"))
    assert result.value == 0.0 and result.info["error"] == "not_a_label"
    assert Correctness().score_one(_sample(record, "supports.")).value == 1.0


def test_python_fences_partial_passes_and_errors():
    record, _ = RECORDS["python"]
    reward = Correctness()
    fenced = reward.score_one(_sample(record, f"```python\n{DOUBLE}```"))
    assert fenced.value == 1.0 and fenced.components["pass_fraction"] == 1.0
    half = reward.score_one(_sample(record, "def transform(xs):\n    return [] if not xs else 0"))
    assert half.value == 0.0 and half.components["pass_fraction"] == 0.5
    assert half.info["error"] == "tests_failed" and half.info["first_failed"] == 0
    missing = reward.score_one(_sample(record, "def other(xs):\n    return xs"))
    assert missing.info["error"] == "code_error" and "transform" in missing.info["detail"]


def test_strip_fences_and_json_equality():
    assert strip_fences("```py\nx = 1\n```\ntext") == "x = 1"
    assert strip_fences("```\nx = 1") == "x = 1"
    assert strip_fences("x = 1") == "x = 1"
    assert json_equal([1, {"a": 2.0}], [1.0, {"a": 2}])
    assert not json_equal(True, 1) and not json_equal("1", 1) and not json_equal([1], [1, 1])


@pytest.mark.parametrize("record,message", [
    ({"answer": "x", "verifier": {"kind": "knk-typo"}},
     "unknown verifier kind 'knk-typo'; known kinds: exact, knk, label, mcq, numeric, python, set, "
     "zebra"),
    ({"answer": "x"}, "unknown verifier kind None"),
    ({"verifier": {"kind": "exact"}}, "has no gold 'answer'"),
    ({"answer": "seven", "verifier": {"kind": "numeric"}}, "gold answer 'seven' is not a number"),
    ({"answer": "E", "verifier": {"kind": "mcq", "choices": ["A"]}}, "not one of the choices"),
    ({"answer": "X", "verifier": {"kind": "label", "labels": ["Y"]}}, "not one of the labels"),
    ({"answer": "x", "verifier": {"kind": "python", "tests": []}}, "needs a non-empty list"),
])
def test_bad_records_are_data_errors_naming_the_record(record, message):
    sample = Sample("p", "<answer>x</answer>", {"id": "rec-9", "task": "t", **record})
    with pytest.raises(RewardConfigError, match="task record 'rec-9'") as err:
        Correctness().check(sample)
    assert message in str(err.value) and err.value.exit_code == 2


def _verify_even(answer, record, settings):
    return RewardResult(float(int(answer) % 2 == 0), {}, {})


EVEN = Verifier(_verify_even)


def test_new_kinds_register_without_editing_correctness(monkeypatch):
    monkeypatch.setitem(VERIFIERS, "even", VERIFIERS["exact"])
    register_verifier("even", f"{__name__}:EVEN")
    record = {"answer": "", "verifier": {"kind": "even"}}
    assert Correctness().score_one(_sample(record, "4")).value == 1.0
    assert Correctness().score_one(_sample(record, "3")).value == 0.0

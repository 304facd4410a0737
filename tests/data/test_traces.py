"""Gold formal traces (jaxrl.data.traces) and `jaxrl data --gold-traces --split`."""
import json

import pytest

from jaxrl.cli import main
from jaxrl.data.generators import generate
from jaxrl.data.generators.knk import KnkPuzzle, problem
from jaxrl.data.pipeline import split_records
from jaxrl.data.records import make_record
from jaxrl.data.traces import TraceError, gold_trace, novel_steps
from jaxrl.logic.sexpr import parse, write
from jaxrl.rewards.base import Sample
from jaxrl.rewards.spring import Spring


def _knk(statements: dict, knights: dict) -> dict:
    made = problem(KnkPuzzle(list(knights), knights, statements))
    return make_record("knk", 0, made.fields["messages"], made.answer, made.verifier,
                       made.metadata)


def test_write_reads_back():
    for text in ("(= (knight Ann) (and (knave Bo) (not (knight Cy))))", "(< a -3)"):
        assert write(parse(text)) == text


def test_hand_worked_knk_trace():
    # Ann says "Bo is a knave"; Bo says "Ann and Bo are knights". If Bo were a knight, Ann
    # would be a knight too, and her statement would be false: so Bo is a knave, and Ann,
    # whose statement is then true, is a knight. Neither role restates a clue: two novel steps.
    record = _knk({"Ann": ("knave", "Bo"),
                   "Bo": ("and", ("knight", "Ann"), ("knight", "Bo"))},
                  {"Ann": True, "Bo": False})
    assert gold_trace(record) == (
        "<think>\n(assert (= (knight Ann) (knave Bo)))\n"
        "(assert (= (knight Bo) (and (knight Ann) (knight Bo))))\n"
        "(step 1 (knight Ann))\n(step 2 (knave Bo))\n"
        "</think><answer>Ann is a knight, Bo is a knave</answer>")
    result = Spring().score_one(Sample("", gold_trace(record), record))
    assert result.value == pytest.approx(1.55)
    assert result.info["verdicts"] == ["novel", "novel"]


def test_a_step_that_restates_a_clue_is_left_out():
    # Ann says "Bo is a knight or Bo is a knave" (always true): the clue is (knight Ann)
    # itself, so only Bo's role is a novel step.
    record = _knk({"Ann": ("or", ("knight", "Bo"), ("knave", "Bo")),
                   "Bo": ("knight", "Ann")}, {"Ann": True, "Bo": True})
    assert novel_steps(record) == [("knight", "Bo")]


@pytest.mark.parametrize("task", ["knk", "zebra"])
def test_generated_gold_traces_score_the_maximum(task):
    spring = Spring()
    for record in generate(task, 12, seed=5, difficulty=1):
        result = spring.score_one(Sample("", gold_trace(record), record))
        steps = result.info["steps"]
        assert result.components["accuracy"] == 1.0 and result.components["s_sat"] == 1.0
        assert steps["novel"] == len(result.info["verdicts"])
        assert result.value == pytest.approx(1.55 if steps["novel"] else 0.85)


def test_records_without_formal_clues_are_refused():
    with pytest.raises(TraceError, match="verifier kind 'exact'|clues_formal"):
        gold_trace(generate("arithmetic", 1, seed=0)[0])


def test_cli_writes_the_training_split_as_chat_records(tmp_path):
    out = tmp_path / "sft.jsonl"
    assert main(["data", "--task", "knk", "--n", "12", "--seed", "7", "--split", "train",
                 "--validation-fraction", "0.25", "--gold-traces", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    train, _ = split_records(generate("knk", 12, seed=7), 0.25, 7, "knk")
    assert [r["id"] for r in rows] == [r["id"] for r in train]
    assert rows[0]["messages"][:2] == train[0]["messages"]
    assert rows[0]["messages"][2] == {"role": "assistant", "content": gold_trace(train[0])}
    with pytest.raises(SystemExit):
        main(["data", "--task", "arithmetic", "--n", "2", "--gold-traces", "--out", str(out)])

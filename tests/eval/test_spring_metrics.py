"""Spring's evaluation metrics against hand-counted values, overall and by outcome."""
import json
import math

import pytest

from jaxrl.eval.spring_metrics import main, spring_metrics


def _row(accuracy, s_sat, verdicts, parsed=1.0, **answer):
    return {"components": {"accuracy": accuracy, "s_sat": s_sat, "parsed": parsed}, "info": {
        "verdicts": verdicts, "answer": answer}}


ROWS = [
    _row(1.0, 1.0, ["novel", "novel", "redundant", "tautological"], cell_accuracy=1.0),
    _row(0.0, 1.0, ["novel", "contradictory", "unparsed"], 0.8, cell_accuracy=0.5),
    _row(0.0, 0.0, ["unchecked", "unchecked", "unparsed"], 0.5, cell_accuracy=0.25),
    _row(1.0, 1.0, ["novel"], person_accuracy=1.0),
]


def test_metrics_by_hand():
    m = spring_metrics(ROWS)
    assert m["n"] == 4 and m["puzzle_accuracy"] == 0.5 and m["sat_rate"] == 0.75
    assert m["cell_accuracy"] == pytest.approx(1.75 / 3) and m["person_accuracy"] == 1.0
    assert m["steps"] == pytest.approx((4 + 2 + 2 + 1) / 4)
    assert m["novel_steps"] == pytest.approx((2 + 1 + 0 + 1) / 4)
    assert m["parse_rate"] == pytest.approx((1.0 + 0.8 + 0.5 + 1.0) / 4)
    # classified steps: the s_sat = 1 rows' parsed steps: 4 + 2 + 1 = 7, one contradictory
    assert m["valid_per_parsed"] == pytest.approx(6 / 7)
    assert m["contradictions_per_100_steps"] == pytest.approx(100 / 7)
    assert m["solved/steps"] == 2.5 and m["solved/contradictions_per_100_steps"] == 0.0
    assert m["failed/steps"] == 2.0 and m["failed/contradictions_per_100_steps"] == 50.0
    assert m["failed/sat_rate"] == 0.5


def test_no_classified_steps_is_nan_not_an_error():
    m = spring_metrics([_row(0.0, 0.0, [], 0.0)])
    assert math.isnan(m["valid_per_parsed"]) and m["steps"] == 0.0 and "solved/n" not in m


def test_command_line(tmp_path, capsys):
    path = tmp_path / "scored.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    assert main([str(path)]) == 0
    assert "puzzle_accuracy" in capsys.readouterr().out
    assert main([]) == 2

"""`jaxrl eval --outputs` on generated records with saved completions: accuracy with its Wilson
interval, Spring's metrics and CEDAR's process metrics against hand-computed values, judge
failures counted apart, two variants compared."""
import json
import math
import re

import pytest

from jaxrl.cli import main
from jaxrl.data.generators import generate
from jaxrl.eval.cedar_metrics import METRICS, PROMPTS
from jaxrl.eval.metrics import wilson
from tests.logic.worked_example import PREMISES, SOLUTION, STEPS
from tests.logic.worked_example import record as zebra_record
from tests.rewards.openai_stub import StubServer, _completion

# instances the scripted judge lists per counting metric
COUNTS = {"uncertainty_markers": 2, "branchiness": 3, "backtracking": 1,
          "differential_elimination": 0, "prior_invocation": 4}


class ProcessJudge(StubServer):
    """The scripted judge, answering the counting metrics too (the first line of each
    evaluation prompt names its metric); coverage and directionality as the stub does."""

    def _reply(self, scenario, body, headers):
        metric = re.match(r"Metric: (\w+)", body["messages"][0]["content"]).group(1)
        if scenario != "good" or metric not in COUNTS:
            return super()._reply(scenario, body, headers)
        instances = [{"quote": f"q{i}", "explanation": "counts"} for i in range(COUNTS[metric])]
        return 200, {}, _completion(body["model"], json.dumps({"instances": instances}))


def _arithmetic(variant, right, scenario="good"):
    """Five arithmetic records; the first `right` answered right, the others wrong or with no
    answer span; each trace carries the judge's scenario."""
    out = []
    for i, r in enumerate(generate("arithmetic", 5, seed=3)):
        answer = r["answer"] if i < right else "-999"
        tail = f"<answer>{answer}</answer>" if i != 4 or right == 5 else "no answer"
        think = f"<think>thinking SCENARIO={scenario if i == 0 else 'good'}</think>"
        out.append({**r, "variant": variant, "completion": think + tail})
    return out


def _zebra(variant):
    gold = json.dumps(SOLUTION)
    wrong = json.loads(gold)
    wrong["House 1"]["Pet"], wrong["House 3"]["Pet"] = "fish", "dog"
    clean = "(step 1 (= Bob 2))\n(step 2 (= cat 2))\n(step 3 (Dave))\n"
    return [{**zebra_record(gold), "id": f"z{i}", "variant": variant,
             "completion": f"<think>{think}</think><answer>{answer}</answer>"}
            for i, (think, answer) in enumerate([(PREMISES + STEPS, gold),
                                                  (PREMISES + clean, json.dumps(wrong))])]


def test_wilson_by_hand():
    # p = 3/5, z^2 = 3.8415: center 0.98415 / 1.76829 = 0.55655, half 1.96 sqrt(0.086415) / 1.76829
    # = 0.32583
    low, high = wilson(3, 5)
    assert (low, high) == pytest.approx((0.23072, 0.88238), abs=1e-5)
    assert wilson(0, 4)[0] == 0.0 and wilson(4, 4)[1] == 1.0
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_prompts_name_their_metric_and_reply_shape():
    assert len(METRICS) == 7
    for name, (system, _) in PROMPTS.items():
        assert system.startswith(f"Metric: {name}\n") and "{dataset_note}" in system
        assert "Reply with one JSON object" in system


def test_saved_outputs_metrics_equal_hand_computed_values(tmp_path, capsys):
    lines = (_arithmetic("base", 3, scenario="http500") + _zebra("base")
             + _arithmetic("adapter", 4, scenario="malformed") + _zebra("adapter"))
    path = tmp_path / "outputs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    with ProcessJudge() as judge:
        assert main(["eval", "--outputs", str(path), "--out", str(tmp_path / "eval.json"),
                     f"judge.base_url={judge.base_url}", "judge.model=stub",
                     "judge.max_retries=0", f"run.output_dir={tmp_path}"]) == 0
    doc = json.loads((tmp_path / "eval.json").read_text())
    base, adapter = doc["variants"]["base"], doc["variants"]["adapter"]
    arith = base["tasks"]["arithmetic"]
    assert (arith["n"], arith["correct"], arith["accuracy"]) == (5, 3, 0.6)
    assert (arith["accuracy_ci95_low"], arith["accuracy_ci95_high"]) == pytest.approx(
        (0.23072, 0.88238), abs=1e-5)
    assert base["all"]["n"] == 7 and base["all"]["accuracy"] == pytest.approx(4 / 7)
    assert adapter["tasks"]["arithmetic"]["accuracy"] == 0.8
    assert doc["difference"]["of"] == "adapter - base"
    assert doc["difference"]["tasks"]["arithmetic"]["accuracy"] == pytest.approx(0.2)
    assert doc["difference"]["all"]["accuracy"] == pytest.approx(1 / 7)

    # Spring: verdicts [novel, novel, tautological, contradictory] and [novel, novel,
    # unparsed]; the second answer has 7 of 9 cells right
    zebra = base["tasks"]["zebra"]
    assert zebra["spring/puzzle_accuracy"] == 0.5 and zebra["spring/sat_rate"] == 1.0
    assert zebra["spring/cell_accuracy"] == pytest.approx((1 + 7 / 9) / 2)
    assert zebra["spring/steps"] == 3.0
    assert zebra["spring/valid_per_parsed"] == pytest.approx(5 / 6)
    assert zebra["spring/contradictions_per_100_steps"] == pytest.approx(100 / 6)
    assert "spring/puzzle_accuracy" not in arith

    # CEDAR: the judge failed (HTTP 500) on one base trace and replied badly on one adapter
    # trace; those are counted apart and the means are over the 6 traces judged
    for variant, kind in ((base, "judge_http_error"), (adapter, "judge_invalid_reply")):
        everything = variant["all"]
        for name, count in COUNTS.items():
            assert everything[f"cedar/{name}"] == count
            assert (everything[f"cedar/{name}/judged"], everything[f"cedar/{name}/failed"]) == (
                6, 1)
        assert everything["cedar/evidence_coverage"] == pytest.approx(200 / 3)
        assert everything["cedar/directionality"] == 1.0
        assert variant["judge_failures"] == {name: {kind: 1} for name in METRICS}
    assert base["tasks"]["zebra"]["cedar/branchiness/failed"] == 0

    table = capsys.readouterr().out
    assert "difference" in table and "-- task arithmetic" in table
    assert "0.600 [0.231, 0.882]" in table and "(1 failed)" in table
    saved = [json.loads(x) for x in (tmp_path / "eval_outputs.jsonl").read_text().splitlines()]
    assert [r["correctness"] for r in saved[:5]] == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_without_a_judge_cedar_is_reported_as_not_run(tmp_path, capsys):
    path = tmp_path / "outputs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _arithmetic("only", 2)))
    assert main(["eval", "--outputs", str(path), f"run.output_dir={tmp_path}"]) == 0
    doc = json.loads((tmp_path / "eval.json").read_text())
    assert doc["cedar"].startswith("not run") and "difference" not in doc
    assert not any(k.startswith("cedar/") for k in doc["variants"]["only"]["all"])
    assert "not run" in capsys.readouterr().err


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main(["eval", "--compare"]) == 2
    assert "--adapter" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "x"}\n')
    assert main(["eval", "--outputs", str(bad), f"run.output_dir={tmp_path}"]) == 2
    assert "completion" in capsys.readouterr().err

"""`eval.every` in `jaxrl train`: eval rows at the steps it names and after the last, equal to
`jaxrl eval` of the adapter exported at that step, `adapter-best/` keeping the best, and the
evaluation's time kept out of the step's."""
import json

import pytest

from jaxrl.config import from_dict
from jaxrl.eval.during import flat_metrics, higher_is_better
from jaxrl.eval.run import run_model
from jaxrl.rl.loop import train


def test_flat_metrics_name_the_whole_and_each_task():
    result = {"all": {"accuracy": 0.5, "n": 4.0, "note": "x"},
              "tasks": {"a": {"accuracy": 1.0}, "b": {"accuracy": 0.0}}}
    assert flat_metrics(result) == {"eval/accuracy": 0.5, "eval/n": 4.0,
                                    "eval/a/accuracy": 1.0, "eval/b/accuracy": 0.0}
    assert higher_is_better("eval/accuracy") and not higher_is_better("eval/loss")


@pytest.mark.slow
def test_eval_rows_equal_jaxrl_eval_of_the_exported_adapter(tiny_chat, tmp_path):
    cfg = from_dict({
        "run": {"steps": 3, "output_dir": str(tmp_path / "run")},
        "model": {"path": str(tiny_chat[0]), "dtype": "float32"}, "quant": {"mode": "none"},
        "lora": {"rank": 4, "alpha": 8},
        "data": {"tasks": ["arithmetic:40"], "prompts_per_step": 2,
                 "validation_fraction": 0.2},
        "sampling": {"max_new_tokens": 8},
        "grpo": {"num_generations": 2},
        "optim": {"lr": 0.05},
        "rewards": {"functions": ["format"], "workers": 1},
        "eval": {"every": 2, "records": 5, "batch_size": 4},
        "checkpoint": {"every": 2, "keep_best": "eval/accuracy"}})
    run = train(cfg, log=lambda m: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in rows if "eval/accuracy" in r]
    assert evaluated == [2, 3]  # every 2 steps and after the last
    for r in rows:
        if "time/eval" in r:
            assert r["time/eval"] > 0 and r["eval/n"] == 5
    best = json.loads((run / "adapter-best" / "best.json").read_text())
    assert best["step"] in (2, 3) and (run / "adapter-best" / "adapter_config.json").is_file()
    # the step-3 evaluation is that of the adapter exported after step 3
    doc, variants = run_model(cfg, str(run / "adapter"), False, 4, lambda *a: (lambda: None))
    ours = [json.loads(line) for line in
            (run / "eval" / "step_3_outputs.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in variants["adapter"][:5]] == [r["completion"] for r in ours]
    assert doc["records"] >= 5


def test_sft_evaluates_held_out_records_too(tiny_chat, tmp_path):
    from jaxrl.cli import main

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {a} + 1?"},
        {"role": "assistant", "content": f"{a + 1}"}]}) + "\n" for a in range(6)))
    out = tmp_path / "sft"
    assert main(["sft", f"model.path={tiny_chat[0]}", f"data.train_file={data}",
                 "data.tasks=arithmetic:20", "data.validation_fraction=0.2", "run.steps=2",
                 f"run.output_dir={out}", "quant.mode=none", "sft.batch_size=2",
                 "lora.rank=4", "lora.alpha=8", "sampling.max_new_tokens=4", "eval.every=2",
                 "eval.records=3", "checkpoint.keep_best=eval/accuracy"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval/accuracy" in rows[1] and "eval/accuracy" not in rows[0]
    assert rows[1]["eval/n"] == 3 and (out / "adapter-best" / "best.json").is_file()
    assert (out / "eval" / "step_2.json").is_file() and (out / "report.png").is_file()

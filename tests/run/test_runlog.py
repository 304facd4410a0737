"""Run directory files: config without secrets, metrics rows, samples, report.png; rows past a
resumed checkpoint dropped."""
import json

from jaxrl.config import load_config
from jaxrl.report import read_metrics
from jaxrl.runlog import RunLog, trim_logs


def test_run_directory_files(tmp_path):
    cfg = load_config(None, ["judge.api_key=sk-secret-123", "logging.tensorboard=true"])
    log = RunLog(cfg, tmp_path / "run")
    for step in range(1, 4):
        log.log_step(step, {"reward/mean": step / 4, "reward/std": 0.1, "loss/kl": 0.01 * step,
                            "completion/length_mean": 10.0 + step, "time/step": 1.5,
                            "grad_norm": float("nan")})
    log.log_samples(2, [{"prompt": "p", "completion": "c", "reward": 1.0}])
    with open(log.metrics_path, "a") as f:
        f.write('{"step": 4, "reward/me')  # a run killed mid-write
    report = log.finish()
    run = tmp_path / "run"
    assert "sk-secret-123" not in (run / "config.yaml").read_text()
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["reward/mean"] == 0.75
    assert rows[0]["grad_norm"] == "nan"
    assert json.loads((run / "samples.jsonl").read_text())["step"] == 2
    assert report == run / "report.png" and report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_trim_logs_drops_rows_past_the_checkpoint(tmp_path):
    rows = [{"step": s, "x": s} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "samples.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    trim_logs(tmp_path, 2, log=lambda m: None)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows[:2]
    assert (tmp_path / "samples.jsonl").read_text() == json.dumps({"step": 2}) + "\n"
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())

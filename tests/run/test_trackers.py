"""Trackers through RunLog: W&B offline (no network) gets the config without secrets, every
step's metrics, the sample table and report.png, and a resumed run keeps its run id; a tracker
that cannot start is a clear error (or a warning), and one that fails mid-run is turned off."""
import json
import struct
import sys
import time
from typing import ClassVar

import pytest

from jaxrl.config import load_config
from jaxrl.runlog import RunLog
from jaxrl.trackers import RUN_ID_FILE, TRACKERS, TrackerError

SECRET = "sk-sentinel-5b7e1c"


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline with all of its files under tmp_path; nothing reaches the network."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR",
                 "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's capture of stdout alone
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return wandb


def _end(log, wandb):
    """log.finish(), then what the process's exit does: W&B's service stops, which completes
    its files (finish alone may return before the transaction log is on disk)."""
    report = log.finish()
    wandb.teardown()
    return report


def _records(path):
    """The protobuf Records of a `.wandb` transaction log: a 7-byte header (":W&B", magic,
    version), then LevelDB-log style blocks of 32 KiB whose records have a 7-byte header
    (CRC-32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's zero-padded tail
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def _offline_run(run_dir, run_id):
    """The newest offline run directory of `run_id` W&B wrote under run_dir/wandb."""
    dirs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert dirs, list((run_dir / "wandb").iterdir())
    return dirs


def _read(run_dir, run_id, index=-1):
    """(run record, {step: metrics}, files record paths, the offline run's directory)."""
    offline = _offline_run(run_dir, run_id)[index]
    records = _records(offline / f"run-{run_id}.wandb")
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = history.setdefault(r.history.step.num, {})
            for item in r.history.item:  # nested_key: a media value's fields, under its key
                *parents, key = list(item.nested_key) or [item.key]
                node = row
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[key] = json.loads(item.value_json)
    files = [f.path for r in records if r.WhichOneof("record_type") == "files"
             for f in r.files.files]
    return run, history, files, offline


def test_wandb_offline_gets_config_metrics_samples_and_report(tmp_path, wandb_offline,
                                                               monkeypatch):
    # as `jaxrl train judge.api_key=...` (W&B records the command line)
    monkeypatch.setattr(sys, "argv", ["jaxrl", "train", f"judge.api_key={SECRET}"])
    cfg = load_config(None, [f"judge.api_key={SECRET}", "logging.wandb=true",
                             "logging.wandb_tags=[grpo,tiny]", "logging.wandb_project=proj"])
    run_dir = tmp_path / "run"
    log = RunLog(cfg, run_dir)
    for step in (1, 2, 3):
        log.log_step(step, {"reward/mean": step / 4, "loss/kl": 0.01 * step,
                            "grad_norm": float("nan")})
        if step == 2:  # as the loop does: a step's samples right after its metrics
            log.log_samples(2, [{"prompt": "2+2?", "completion": "4", "reward": 1.0,
                                 "finish_reason": "stop", "components": {}}])
    report = _end(log, wandb_offline)

    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    run, history, files, offline = _read(run_dir, run_id)
    assert run.run_id == run_id and run.project == "proj"
    assert run.display_name == "run" and list(run.tags) == ["grpo", "tiny"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["judge"]["model"] == "" and "api_key" not in config["judge"]
    assert config["logging"]["wandb"] is True
    assert sorted(history) == [1, 2, 3]
    assert [history[s]["reward/mean"] for s in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert history[3]["loss/kl"] == pytest.approx(0.03)
    assert history[2]["samples"]["_type"] == "table-file"
    assert history[3]["report"]["_type"] == "image-file"

    (table_path,) = [f for f in files if f.startswith("media/table/samples_")]
    table = json.loads((offline / "files" / table_path).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward", "finish_reason"]
    assert table["data"] == [[2, "2+2?", "4", 1.0, "stop"]]
    (image_path,) = [f for f in files if f.startswith("media/images/report_")]
    assert (offline / "files" / image_path).read_bytes() == report.read_bytes()

    env = next(r.environment for r in _records(offline / f"run-{run_id}.wandb")
               if r.WhichOneof("record_type") == "environment" and r.environment.args)
    assert list(env.args) == ["train", "judge.api_key=<redacted>"]
    assert sys.argv[2] == f"judge.api_key={SECRET}"  # restored after wandb.init
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) > 5
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]


def test_wandb_resumed_runlog_keeps_the_run_id(tmp_path, wandb_offline):
    cfg = load_config(None, ["logging.wandb=true"])
    run_dir = tmp_path / "run"
    first = RunLog(cfg, run_dir)
    first.log_step(1, {"reward/mean": 0.5})
    _end(first, wandb_offline)
    time.sleep(1)  # W&B names an offline run's directory by the second it started
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()

    second = RunLog(cfg, run_dir)  # as a resumed `jaxrl train` does
    second.log_step(2, {"reward/mean": 0.75})
    _end(second, wandb_offline)
    assert (run_dir / RUN_ID_FILE).read_text().strip() == run_id
    assert len(_offline_run(run_dir, run_id)) == 2  # `wandb sync` appends both to one run
    run, history, _, _ = _read(run_dir, run_id)
    assert run.run_id == run_id and history[2]["reward/mean"] == 0.75


def test_missing_library_is_a_clear_error_or_one_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = load_config(None, ["logging.wandb=true"])
    with pytest.raises(TrackerError, match=r"pip install -e '\.\[wandb\]'"):
        RunLog(cfg, tmp_path / "required")

    cfg = load_config(None, ["logging.wandb=true", "logging.tracker_required=false"])
    log = RunLog(cfg, tmp_path / "optional")
    log.log_step(1, {"reward/mean": 0.5})
    log.finish()
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "pip install -e '.[wandb]'" in err
    assert (tmp_path / "optional" / "metrics.jsonl").is_file()


def test_unreachable_tracker_is_an_error_at_start(tmp_path, wandb_offline, monkeypatch):
    def refuse(**kwargs):
        raise ConnectionError("wandb.example: connection refused")

    monkeypatch.setattr(wandb_offline, "init", refuse)
    cfg = load_config(None, ["logging.wandb=true"])
    with pytest.raises(TrackerError, match="connection refused.*tracker_required=false"):
        RunLog(cfg, tmp_path / "run")


class _Flaky:
    """A tracker whose log fails from its second call on."""

    name = "flaky"
    calls: ClassVar[list] = []

    def __init__(self, cfg, run_dir):
        self.calls.clear()

    def log(self, step, metrics):
        self.calls.append(("log", step))
        if step >= 2:
            raise OSError("disk full")

    def samples(self, step, rows):
        self.calls.append(("samples", step))

    def image(self, name, path, step):
        self.calls.append(("image", step))

    def finish(self, failed=False):
        self.calls.append(("finish", failed))


def test_a_tracker_failing_mid_run_warns_once_and_is_turned_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(TRACKERS, "tensorboard", _Flaky)  # logging.tensorboard turns it on
    cfg = load_config(None, ["logging.tensorboard=true"])
    log = RunLog(cfg, tmp_path / "run")
    for step in (1, 2, 3):
        log.log_step(step, {"reward/mean": 0.5})
    log.log_samples(3, [{"prompt": "p", "completion": "c", "reward": 0.0}])
    assert log.finish() is not None
    assert _Flaky.calls == [("log", 1), ("log", 2)]
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "disk full" in err
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_run_that_raises_finishes_its_trackers_as_failed(tmp_path, monkeypatch):
    monkeypatch.setitem(TRACKERS, "tensorboard", _Flaky)
    log = RunLog(load_config(None, ["logging.tensorboard=true"]), tmp_path / "run")
    log.log_step(1, {"reward/mean": 0.5})
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("step failed")
        finally:
            log.finish()
    assert _Flaky.calls == [("log", 1), ("image", 1), ("finish", True)]

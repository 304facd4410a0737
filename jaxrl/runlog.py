"""The run directory: resolved config, metrics.jsonl, samples.jsonl, TensorBoard, report.png;
the trackers that `logging` turns on (W&B: jaxrl/trackers.py) get the same rows.

In a multi-process run process 0 alone writes them; the others' calls do nothing (their rows
reach process 0 through jaxrl/distributed.py first)."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import jax

from jaxrl.config import Config, dump_yaml
from jaxrl.distributed import initialize_from_env
from jaxrl.report import write_report
from jaxrl.tensorboard import ScalarWriter
from jaxrl.trackers import Trackers


def _jsonable(value: Any) -> Any:
    """Floats stay floats (NaN and inf as strings, which JSON lacks); arrays become lists."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class RunLog:
    """Appends one JSON object per step to metrics.jsonl (and TensorBoard when enabled) and
    sample rows to samples.jsonl; `finish` draws report.png."""

    def __init__(self, cfg: Config, output_dir: str | Path | None = None):
        self.dir = Path(output_dir or cfg.run.output_dir)
        initialize_from_env()  # which process this is, before anything else starts JAX
        self.writes = jax.process_index() == 0
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "samples.jsonl"
        self._tb = None
        self._trackers: Trackers | None = None
        self._last_step: int | None = None
        if self.writes:
            self.dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, self.dir / "config.yaml")
            self._trackers = Trackers(cfg, self.dir)  # a tracker that cannot start raises here
            if cfg.logging.tensorboard:
                self._tb = ScalarWriter(self.dir / "tensorboard")

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.writes:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            self._tb.write(step, {k: float(v) for k, v in metrics.items()
                                  if isinstance(v, (int, float))})
        if self._trackers is not None:
            self._trackers.log(step, metrics)
            self._last_step = step

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not self.writes:
            return
        with open(self.samples_path, "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, default=_jsonable) + "\n")
        if self._trackers is not None:
            self._trackers.samples(step, rows)

    def finish(self) -> Path | None:
        """Writes report.png from the metrics so far (None when no step was logged) and ends
        the trackers' runs (failed when called while an exception propagates)."""
        failed = sys.exc_info()[0] is not None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        trackers, self._trackers = self._trackers, None
        try:
            if not self.writes or not self.metrics_path.exists():
                return None
            report = write_report(self.metrics_path, self.dir / "report.png")
            if trackers is not None:
                trackers.image("report", report, self._last_step)
            return report
        finally:
            if trackers is not None:
                trackers.finish(failed=failed)


def trim_logs(run_dir: Path, step: int, log: Callable[[str], None] = print) -> None:
    """Drop rows past `step` from metrics.jsonl and samples.jsonl: the run continues from the
    checkpoint of `step`, so later rows belong to a run that was lost. Process 0 alone."""
    if jax.process_index():
        return
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = run_dir / name
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        if len(kept) == len(lines):
            continue
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
        log(f"{path}: dropped {len(lines) - len(kept)} rows past step {step}")

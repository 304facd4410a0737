"""Experiment trackers beside the run directory's own files: Weights & Biases, through its own
library, an optional extra (`pip install -e '.[wandb]'`). A tracker is a class with log,
samples, image and finish, registered in TRACKERS under its `logging.NAME` switch.

RunLog (jaxrl/runlog.py) starts them on process 0 and hands each one what it writes itself:
every step's metrics, the sample rows, report.png, and the end of the run. A tracker that cannot
start is an error at start (TrackerError), or with `logging.tracker_required: false` one
warning and the run goes on without it; a tracker call that fails mid-run warns once and turns
that tracker off, so a tracker never stops a run that has started.

A resumed run logs to the same W&B run (its id is kept in the run directory). W&B keeps the
history it has: steps past the checkpoint a run resumes from, which trim_logs drops from
metrics.jsonl, stay there, and W&B ignores (with its own warning) the steps logged again."""
from __future__ import annotations

import contextlib
import importlib
import secrets
import string
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from jaxrl.config import Config, ConfigError, to_dict

SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward", "finish_reason")
RUN_ID_FILE = "wandb_run_id"  # in the run directory: a resumed run attaches to the same W&B run


class TrackerError(ConfigError):
    """A tracker the config asks for cannot start (its library is missing, it is unreachable).
    A ConfigError, so that `jaxrl train` and `jaxrl sft` print it and exit 2."""


def _warn(message: str) -> None:
    print(f"jaxrl: warning: {message}", file=sys.stderr, flush=True)


def _import(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerError(f"config key 'logging.{extra}' is true but the {module} library "
                           f"cannot be imported ({e}); install it with "
                           f"pip install -e '.[{extra}]' (or set logging.{extra}=false, or "
                           "logging.tracker_required=false to run without it)") from None


@contextlib.contextmanager
def _argv_without_secrets():
    """sys.argv with the values of secret overrides (`judge.api_key=...`) replaced: W&B records
    the command line in its run metadata."""
    secret = {f"{group.name}.{f.name}" for group in fields(Config)
              for f in fields(group.type) if f.metadata.get("secret")}
    saved = sys.argv
    sys.argv = [f"{arg.partition('=')[0]}=<redacted>"
                if arg.partition("=")[0].strip() in secret else arg for arg in saved]
    try:
        yield
    finally:
        sys.argv = saved


def _number(value: Any) -> Any:
    """Arrays and numpy scalars as plain Python values (NaN stays a float for the trackers)."""
    return value.tolist() if hasattr(value, "tolist") else value


def _sample_table_rows(step: int, rows: list[dict[str, Any]]) -> list[list[Any]]:
    return [[step, str(row.get("prompt", "")), str(row.get("completion", "")),
             _number(row.get("reward")), row.get("finish_reason", "")] for row in rows]


class WandbTracker:
    """One W&B run per run directory: its id is kept in RUN_ID_FILE, and init resumes it."""

    name = "wandb"

    def __init__(self, cfg: Config, run_dir: Path):
        self._wandb = wandb = _import("wandb", "wandb")
        log = cfg.logging
        id_path = run_dir / RUN_ID_FILE
        run_id = id_path.read_text().strip() if id_path.is_file() else ""
        if not run_id:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits)
                             for _ in range(8))  # as wandb's own ids
            id_path.write_text(run_id + "\n")
        try:
            with _argv_without_secrets():
                self._run = wandb.init(
                    project=log.wandb_project, entity=log.wandb_entity or None,
                    name=log.wandb_name or run_dir.resolve().name, tags=list(log.wandb_tags),
                    config=to_dict(cfg), dir=str(run_dir), id=run_id, resume="allow",
                    mode=log.wandb_mode or None, reinit="create_new")
        except Exception as e:  # noqa: BLE001 - no API key, no network, a refusal
            reason = f"{type(e).__name__}: {str(e).strip().rstrip('.')}"
            raise TrackerError(f"W&B (logging.wandb) did not start: {reason}. Log in "
                               "(wandb login or WANDB_API_KEY), run offline "
                               "(logging.wandb_mode=offline, then wandb sync), or set "
                               "logging.tracker_required=false to run without it") from None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._run.log({k: _number(v) for k, v in metrics.items()}, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS),
                                  data=_sample_table_rows(step, rows))
        self._run.log({"samples": table}, step=step)

    def image(self, name: str, path: Path, step: int | None) -> None:
        self._run.log({name: self._wandb.Image(str(path))}, step=step)

    def finish(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)


TRACKERS: dict[str, type] = {"wandb": WandbTracker}  # logging.NAME turns one on


class Trackers:
    """The trackers `cfg.logging` turns on, each call guarded: a failure warns once and turns
    that tracker off (never an exception into the training loop)."""

    def __init__(self, cfg: Config, run_dir: str | Path,
                 warn: Callable[[str], None] = _warn):
        self._warn = warn
        self._active: list[Any] = []
        run_dir = Path(run_dir)
        for name, cls in TRACKERS.items():
            if not getattr(cfg.logging, name, False):
                continue
            try:
                self._active.append(cls(cfg, run_dir))
            except TrackerError as e:
                if cfg.logging.tracker_required:
                    self.finish(failed=True)
                    raise
                warn(f"{e}; the run goes on without {name}")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._active]

    def _call(self, method: str, *args) -> None:
        for tracker in list(self._active):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                self._active.remove(tracker)
                self._warn(f"{tracker.name} failed in {method} ({type(e).__name__}: {e}); "
                           f"{tracker.name} is off for the rest of the run")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._call("log", step, metrics)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._call("samples", step, rows)

    def image(self, name: str, path: Path, step: int | None = None) -> None:
        self._call("image", name, path, step)

    def finish(self, failed: bool = False) -> None:
        self._call("finish", failed)
        self._active.clear()

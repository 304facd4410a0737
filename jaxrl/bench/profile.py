"""`jaxrl bench --profile DIR`: a `jax.profiler` trace of one timed run, and the device's time
read back from it by program and operation.

The trace (TensorBoard's profile plugin or XProf read DIR; Perfetto reads the
perfetto_trace.json.gz in it) holds an event per operation the device ran: a GPU kernel or
copy, a TPU op, an XLA:CPU thunk, each named by its program (`hlo_module`) and instruction
(`hlo_op`). `op_times` sums those events per program and operation. Control-flow thunks of the
CPU (a while loop's or a conditional's) span the operations inside them and are left out, so
no time counts twice.
"""
from __future__ import annotations

import collections
import contextlib
import gzip
import json
from pathlib import Path

import jax

_CONTROL_FLOW = ("while", "conditional", "cond", "call")


@contextlib.contextmanager
def traced(directory: str | Path):
    """Trace what runs inside into `directory` (created if missing)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        yield


def _events(directory: Path) -> list[dict]:
    traces = sorted(directory.glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}/plugins/profile")
    with gzip.open(traces[-1], "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def op_times(directory: str | Path, top: int = 12) -> list[dict]:
    """The `top` operations of each program by the device's time in the newest trace under
    `directory`: program, op, calls, total ms, mean us, share of the program's time."""
    ops: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in _events(Path(directory)):
        args = event.get("args") or {}
        if event.get("ph") != "X" or "hlo_module" not in args or "hlo_op" not in args:
            continue
        if args["hlo_op"].split(".")[0] in _CONTROL_FLOW:
            continue
        entry = ops[(args["hlo_module"].removeprefix("jit_"), event["name"])]
        entry[0] += 1
        entry[1] += float(event.get("dur", 0.0))  # microseconds
    totals: dict[str, float] = collections.Counter()
    for (program, _), (_, us) in ops.items():
        totals[program] += us
    rows = []
    for program in sorted(totals, key=totals.get, reverse=True):
        mine = sorted(((op, n, us) for (p, op), (n, us) in ops.items() if p == program),
                      key=lambda r: -r[2])
        rows += [{"program": program, "op": op, "calls": int(n), "ms": us / 1e3,
                  "mean_us": us / n, "share": us / totals[program] if totals[program] else 0.0}
                 for op, n, us in mine[:top]]
    return rows


def op_table(rows: list[dict]) -> str:
    lines = ["| program | op | calls | ms | mean us | share of program |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['program']} | {r['op']} | {r['calls']} | {r['ms']:.2f} | "
              f"{r['mean_us']:.1f} | {r['share']:.1%} |" for r in rows]
    return "\n".join(lines)

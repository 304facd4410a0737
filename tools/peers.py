"""Measuring jaxrl beside another system (transformers, TRL) as users run each: every
measurement is a process of its own, started with the system's own defaults (torch keeps its
thread settings; nothing is set in the environment for it), and the systems alternate round by
round, so that a change in the machine's load falls on both. Used by tools/bench_*.py.

A worker is a command given the path of a file to which it appends its figures as JSON lines:
`jaxrl bench ... --out FILE`, or a peer's worker mode of the script.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
Command = Callable[[str], Sequence[str]]  # the result file's path -> argv


def run_worker(name: str, command: Command) -> dict:
    """Runs one worker process to its end: {"rows": its JSON lines, "wall_s", "load": the
    1-minute load average before and after}. A failing worker stops the comparison."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.jsonl"
        load = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(list(command(str(result))), cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - start
        if done.returncode != 0 or not result.is_file():
            sys.exit(f"{name} failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
        rows = [json.loads(line) for line in result.read_text().splitlines() if line.strip()]
    return {"rows": rows, "wall_s": wall, "load": [load, os.getloadavg()[0]]}


def alternate(workers: dict[str, Command], rounds: int) -> list[dict[str, dict]]:
    """Each round runs every worker once, the order reversed every other round; returns one
    {worker name: result} per round."""
    names = list(workers)
    results = []
    for i in range(rounds):
        results.append({})
        for name in (names if i % 2 == 0 else names[::-1]):
            result = results[-1][name] = run_worker(name, workers[name])
            print(f"round {i + 1}: {name} took {result['wall_s']:.0f} s (load "
                  f"{result['load'][0]:.1f} -> {result['load'][1]:.1f})", flush=True)
    return results


def jaxrl_bench(mode: str, args: Sequence[str], overrides: Sequence[str]) -> Command:
    """A `jaxrl bench MODE` worker of this checkout (the result file is its --out)."""
    return lambda out: [sys.executable, "-m", "jaxrl.cli", "bench", mode, *args, "--out", out,
                        *overrides]


def load_range(rounds: list[dict[str, dict]]) -> str:
    loads = [x for r in rounds for result in r.values() for x in result["load"]]
    return f"{min(loads):.1f}-{max(loads):.1f}"

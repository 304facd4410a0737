"""Reward overlap benchmark: simulated rollouts (sleep) + the real reward pool + a local
OpenAI-compatible judge server answering with fixed latency.

    python tools/bench_rewards.py [--steps 5] [--batch 32] [--rollout-s 2.0] [--ref-s 0.5]
                                  [--latency-s 0.2] [--workers 2]

Each step "rolls out" a batch (sleep --rollout-s), submits it to the pool with rewards
correctness + format + cedar (two judge calls per sample), runs the "reference log-prob pass"
(sleep --ref-s) and collects, scheduled by `jaxrl.rewards.pool.pipelined` with max_staleness 0
and 1. A third of the samples are Python answers run in the sandbox. Prints one row per
staleness: wall time, mean overlap fraction (share of reward time hidden behind device work),
device wait per step, and rewards scored per second.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxrl.config import Config, RewardEntry, apply_overrides
from jaxrl.rewards.base import Sample
from jaxrl.rewards.pool import RewardPool, pipelined
from tests.rewards.openai_stub import StubServer

FUNCTIONS = [RewardEntry("correctness"), RewardEntry("format", 0.5), RewardEntry("cedar")]
PYTHON = {"kind": "python", "entry_point": "transform",
          "tests": [{"input": [1, 2, 3], "output": [2, 4, 6]}, {"input": [], "output": []}]}


def _sample(step: int, i: int) -> Sample:
    """A varied sample: numeric, mcq or python, right or wrong; unique per step (no cache hits)."""
    kind, right = i % 3, i % 2 == 0
    if kind == 0:
        record, answer = {"answer": "42", "verifier": {"kind": "numeric"}}, "42" if right else "41"
    elif kind == 1:
        record = {"answer": "B", "verifier": {"kind": "mcq", "choices": ["A", "B", "C"]}}
        answer = "(B)" if right else "C"
    else:
        body = "[x * 2 for x in xs]" if right else "xs"
        record = {"answer": "", "verifier": PYTHON}
        answer = f"def transform(xs):\n    return {body}"
    record = {"id": f"s{step}-{i}", "task": "abduction", **record}
    completion = (f"<think>step {step} sample {i}: from the evidence...</think>"
                  f"<answer>{answer}</answer>")
    return Sample(f"Problem {i}: explain the observations.", completion, record)


def _run(cfg: Config, args, staleness: int) -> dict:
    def rollouts():
        for step in range(args.steps):
            time.sleep(args.rollout_s)
            yield [_sample(step + 1000 * staleness, i) for i in range(args.batch)]

    with RewardPool(cfg, FUNCTIONS) as pool:
        pool.score([_sample(-1, i) for i in range(3)])  # workers up, sandbox probed
        start = time.monotonic()
        metrics = [scored.metrics for _, scored, _ in pipelined(
            pool, rollouts(), lambda b: b, staleness, lambda b: time.sleep(args.ref_s))]
        wall = time.monotonic() - start
    return {"wall_s": wall, "overlap": statistics.mean(m["rewards/overlap"] for m in metrics),
            "wait_s": statistics.mean(m["rewards/wait_s"] for m in metrics),
            "reward_s": statistics.mean(m["rewards/time_s"] for m in metrics),
            "per_s": statistics.mean(m["rewards/per_s"] for m in metrics),
            "failures": sum(m["rewards/failures"] for m in metrics)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rollout-s", type=float, default=2.0)
    parser.add_argument("--ref-s", type=float, default=0.5)
    parser.add_argument("--latency-s", type=float, default=0.2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.steps} steps of {args.batch} samples; rollout {args.rollout_s} s, reference "
          f"pass {args.ref_s} s, judge latency {args.latency_s} s, {args.workers} workers")
    print("| max_staleness | wall s | reward s/step | device wait s/step | overlap | rewards/s "
          "| failures |\n| --- | --- | --- | --- | --- | --- | --- |")
    with StubServer(latency_s=args.latency_s) as server, tempfile.TemporaryDirectory() as run:
        cfg = apply_overrides(Config(), [
            f"judge.base_url={server.base_url}", "judge.model=bench", f"run.output_dir={run}",
            f"rewards.workers={args.workers}"])
        for staleness in (0, 1):
            r = _run(cfg, args, staleness)
            print(f"| {staleness} | {r['wall_s']:.2f} | {r['reward_s']:.2f} | {r['wait_s']:.2f} "
                  f"| {r['overlap']:.2f} | {r['per_s']:.1f} | {r['failures']:.0f} |")


if __name__ == "__main__":
    main()

"""Spring reward throughput: completions scored per second, in one process and through the
reward pool, for 20-step traces on 4x4 Zebra puzzles.

Each completion formalizes all of its puzzle's clues as premises, then writes 20 steps drawn
from the gold solution (facts and exclusions, some already implied by earlier steps), with two
tautologies, two contradictions and two restated clues among them, and answers with the gold
grid (a quarter of them with two cells swapped). Prompts come in GRPO groups of G completions
sharing one puzzle, as in training.

    python tools/bench_spring.py                       # 64 completions = 8 puzzles x G 8
    python tools/bench_spring.py --puzzles 16 --workers 1,2

The pool figure is the wall time of one batch from submit to collect, the pool already started
and warmed up, which is what a GRPO step waits for. Compare it with the sampler's time for the
same batch: SmolLM2-135M at batch 32 decodes ~200-400 tokens/s on this 2-core CPU
(tools/bench_sampler.py), so 64 completions of ~300 tokens take ~50-100 s.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from jaxrl.config import Config, RewardEntry, RewardsConfig
from jaxrl.data.generators import zebra
from jaxrl.data.records import make_record
from jaxrl.rewards.base import Sample
from jaxrl.rewards.pool import RewardPool
from jaxrl.rewards.spring import Spring


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--puzzles", type=int, default=8, help="distinct 4x4 puzzles (8)")
    parser.add_argument("--group", type=int, default=8, help="completions per puzzle, G (8)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", default="1,2", help="pool sizes to time (1,2)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def _steps(rng: random.Random, puzzle: zebra.ZebraPuzzle, clues: list[str], n: int) -> list[str]:
    symbols = zebra.symbol_table(puzzle.attributes)
    where = {symbols[a][puzzle.attributes[a].index(v)]: h for (a, v), h in puzzle.where.items()}
    names = sorted(where)
    facts = [f"(= {s} {where[s]})" for s in names]
    facts += [f"(distinct {s} {h})" for s in names for h in range(1, 5) if h != where[s]]
    wrong = [f"(= {s} {where[s] % 4 + 1})" for s in names[1:3]]  # contradictions
    special = [f"(distinct {names[0]} 0)", "(not (= 1 2))", *wrong, clues[0], clues[-1]]
    steps = rng.sample(facts, n - len(special)) + special
    rng.shuffle(steps)
    return steps


def _completion(rng: random.Random, puzzle: zebra.ZebraPuzzle, record: dict, n: int) -> str:
    clues = record["metadata"]["clues_formal"]
    lines = [f"(assert {c})" for c in clues]
    lines += [f"So:\n(step {k} {s})" for k, s in enumerate(_steps(rng, puzzle, clues, n), 1)]
    answer = json.loads(record["answer"])
    if rng.random() < 0.25:
        answer["House 1"]["Name"], answer["House 2"]["Name"] = (answer["House 2"]["Name"],
                                                                answer["House 1"]["Name"])
    return f"<think>{chr(10).join(lines)}</think><answer>{json.dumps(answer)}</answer>"


def _batch(args) -> list[Sample]:
    rng = random.Random(args.seed)
    samples = []
    for index in range(args.puzzles):
        puzzle = zebra.make_puzzle(rng, 4, 4)
        p = zebra.problem(puzzle)
        record = make_record("zebra", index, p.fields["messages"], p.answer, p.verifier,
                             p.metadata)
        samples += [Sample("", _completion(rng, puzzle, record, args.steps), record)
                    for _ in range(args.group)]
    return samples


def _in_process(samples: list[Sample]) -> tuple[float, dict]:
    spring = Spring()
    spring.score_one(samples[0])  # imports and the first theory
    start = time.perf_counter()
    results = spring.score(samples)
    seconds = time.perf_counter() - start
    counts: dict[str, int] = {}
    for r in results:
        for verdict, k in r.info["steps"].items():
            counts[verdict] = counts.get(verdict, 0) + k
    return len(samples) / seconds, counts


def _pool(samples: list[Sample], workers: int) -> float:
    cfg = Config(rewards=RewardsConfig(functions=(RewardEntry("spring"),), workers=workers))
    with RewardPool(cfg) as pool:
        pool.score(samples[:workers * 2])  # start-up and warm-up
        start = time.perf_counter()
        pool.score(samples)
        return time.perf_counter() - start


def main() -> None:
    args = _args()
    samples = _batch(args)
    rate, counts = _in_process(samples)
    print(f"{len(samples)} completions ({args.puzzles} 4x4 puzzles x G {args.group}), "
          f"{args.steps} steps each; verdicts {counts}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'where':<28}{'completions/s':>14}{'batch wall s':>14}")
    print(f"{'one process, in-line':<28}{rate:>14.1f}{len(samples) / rate:>14.2f}")
    for workers in map(int, args.workers.split(",")):
        seconds = _pool(samples, workers)
        print(f"{f'pool, {workers} worker(s)':<28}{len(samples) / seconds:>14.1f}"
              f"{seconds:>14.2f}")


if __name__ == "__main__":
    main()

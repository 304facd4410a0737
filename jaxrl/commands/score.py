"""`jaxrl score --reward NAME [--config FILE] --input FILE.jsonl [--out FILE.jsonl] [k=v ...]`."""
from __future__ import annotations

import collections
import contextlib
import json
import sys
import time

from jaxrl.commands import read_input_objects
from jaxrl.rewards import REWARDS

_BATCH = 256


def register(sub) -> None:
    score = sub.add_parser(
        "score", help="score saved completions with a reward function",
        description="Score saved completions with any registered reward, through the same "
        "worker pool training uses. Each input line is a task record plus a `completion` "
        "field (and optionally `prompt`; else the record's system and user messages); each "
        "output line is that object plus `reward` (the value), `components` and `info`. "
        "A summary goes to stderr. Judge rewards need judge.base_url and judge.model; their "
        "replies are cached in run.output_dir.")
    score.add_argument("--reward", required=True, choices=sorted(REWARDS), metavar="NAME",
                       help=f"one of: {', '.join(sorted(REWARDS))}")
    score.add_argument("--config", default=None, help="YAML run config (default: built-ins)")
    score.add_argument("--input", required=True, help="JSONL of records with a `completion`")
    score.add_argument("--out", default=None, help="JSONL to write (default: stdout)")
    score.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. judge.base_url=http://127.0.0.1:8000/v1")
    score.set_defaults(func=_score)


def _score(args) -> int:
    from jaxrl.config import RewardEntry, load_config
    from jaxrl.rewards.base import sample_from_record
    from jaxrl.rewards.pool import RewardPool, pipelined

    cfg = load_config(args.config, args.overrides)
    records = read_input_objects(args.input, "completion")
    batches = [records[i:i + _BATCH] for i in range(len(records))[::_BATCH]]
    total, failures, start = 0.0, collections.Counter(), time.monotonic()
    out_file = open(args.out, "w", encoding="utf-8") if args.out else contextlib.nullcontext(
        sys.stdout)
    with out_file as out, RewardPool(cfg, [RewardEntry(args.reward)]) as pool:
        scored = pipelined(pool, batches, lambda b: [sample_from_record(r) for r in b], 1)
        for batch, result, _ in scored:
            for record, r in zip(batch, result.results[args.reward]):
                line = {**record, "reward": r.value, "components": dict(r.components),
                        "info": dict(r.info)}
                out.write(json.dumps(line, default=str) + "\n")
                total += r.value
            failures.update({k[len("rewards/failures/"):]: int(v)
                             for k, v in result.metrics.items()
                             if k.startswith("rewards/failures/")})
    seconds = time.monotonic() - start
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(failures.items())) or "none"
    print(f"scored {len(records)} completions with {args.reward}: mean reward "
          f"{total / max(1, len(records)):.4f}, {len(records) / seconds:.1f} per second; "
          f"failures: {kinds}", file=sys.stderr)
    return 0

"""`jaxrl pilot [--config FILE] [--prompts N] [--out FILE.json] [--no-step-timing]
[key=value ...]`: will this run learn, and when will it finish?"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxrl.config import UsageError


def register(sub) -> None:
    pilot = sub.add_parser(
        "pilot", help="before a run: will it learn (reward spread per task) and its ETA",
        description="Sample grpo.num_generations completions for --prompts prompts of the "
        "run's training data with its model (and the adapter checkpoint.resume would continue "
        "from), sampling settings and rewards, then report per task and overall: reward mean "
        "and spread within groups, the share of groups with zero spread (no gradient), useful "
        "groups per step, completion lengths and truncation; seconds per step (the measured "
        "rollout scaled to a step, plus the reference pass and update timed as `jaxrl bench "
        "step` times them) and the ETA of run.steps; recommendations (tasks to drop or "
        "re-weight, grpo.dynamic_sampling, grpo.num_generations, sampling.max_new_tokens, "
        "data.prompts_per_step) and a verdict. Writes nothing to the run directory. Without "
        "--config: configs/quickstart.yaml.")
    pilot.add_argument("--config", metavar="FILE", help="YAML run config")
    pilot.add_argument("--prompts", type=int, default=32, metavar="N",
                       help="training prompts to sample (32)")
    pilot.add_argument("--out", metavar="FILE.json", help="also write the results as JSON")
    pilot.add_argument("--no-step-timing", action="store_true",
                       help="skip timing the reference pass and the update (no ETA)")
    pilot.add_argument("--target-groups", type=int, default=4, metavar="K",
                       help="useful groups per step to aim at for data.prompts_per_step (4)")
    pilot.add_argument("overrides", nargs="*", metavar="key=value",
                       help="dotted overrides, e.g. data.tasks=[arithmetic:100]")
    pilot.set_defaults(func=_pilot)


def _pilot(args) -> int:
    from jaxrl.commands.train import run_config
    from jaxrl.eval.pilot import format_report, run_pilot

    if args.prompts < 1:
        raise UsageError(f"--prompts must be at least 1; got {args.prompts}")
    if args.target_groups < 1:
        raise UsageError(f"--target-groups must be at least 1; got {args.target_groups}")
    cfg = run_config(args)
    doc = run_pilot(cfg, args.prompts, step_timing=not args.no_step_timing,
                    target_groups=args.target_groups,
                    log=lambda m: print(m, file=sys.stderr))
    print(format_report(doc))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0

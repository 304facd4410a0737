"""`jaxrl train [--config FILE] [key=value ...]`."""
from __future__ import annotations

import sys
from pathlib import Path

from jaxrl.config import UsageError, load_config

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def register(sub) -> None:
    train = sub.add_parser(
        "train", help="GRPO post-training (no --config: the quickstart)",
        description="Run GRPO: rollouts with the jitted sampler, rewards on host workers, "
        "LoRA updates over the frozen (NF4) base. With data.env=calculator|diagnosis each row is "
        "a multi-turn episode: the model calls the environment's tools, their results are "
        "appended to its KV cache and kept out of the loss, and the episode reward scores the "
        "whole trajectory (env.* sets turns, token budget and process terms). Without --config "
        "it runs configs/quickstart.yaml on the embedded default model. Prints the run "
        "directory, which holds config.yaml, metrics.jsonl, samples.jsonl and report.png.")
    train.add_argument("--config", metavar="FILE", help="YAML run config")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="dotted overrides, e.g. grpo.beta=0.01 run.steps=50")
    train.set_defaults(func=_train)


def run_config(args):
    """The config of --config (configs/quickstart.yaml without one) plus the overrides."""
    path = args.config
    if path is None:
        if not QUICKSTART.is_file():
            raise UsageError(f"no --config given and the quickstart config {QUICKSTART} is "
                             "missing (install jaxrl from its repository with pip install -e .)")
        path = QUICKSTART
    return load_config(path, args.overrides)


def _train(args) -> int:
    cfg = run_config(args)
    from jaxrl.rl.loop import train

    run_dir = train(cfg, log=lambda m: print(m, file=sys.stderr))
    print(run_dir.resolve())
    return 0

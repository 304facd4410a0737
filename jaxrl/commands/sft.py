"""`jaxrl sft [--config FILE] [key=value ...]`."""
from __future__ import annotations

import sys


def register(sub) -> None:
    sft = sub.add_parser(
        "sft", help="LoRA supervised fine-tuning on chat records",
        description="Fine-tune a LoRA adapter over the frozen (NF4) base on the chat records of "
        "data.train_file (JSONL lines with `messages`), the loss on assistant tokens only. "
        "Keys: sft.batch_size, sft.max_length, sft.length_window, sft.eval_every (with "
        "data.eval_file), optim.*, lora.*, checkpoint.*. Prints the run directory, which "
        "holds config.yaml, metrics.jsonl, report.png, checkpoints/ and adapter/ (PEFT).")
    sft.add_argument("--config", metavar="FILE", help="YAML run config (default: built-ins)")
    sft.add_argument("overrides", nargs="*", metavar="key=value",
                     help="dotted overrides, e.g. data.train_file=chats.jsonl run.steps=200")
    sft.set_defaults(func=_sft)


def _sft(args) -> int:
    from jaxrl.config import load_config
    from jaxrl.sft.loop import sft

    cfg = load_config(args.config, args.overrides)
    run_dir = sft(cfg, log=lambda m: print(m, file=sys.stderr))
    print(run_dir.resolve())
    return 0

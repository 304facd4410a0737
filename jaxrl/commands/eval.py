"""`jaxrl eval [--config FILE] [--adapter DIR] [--compare] [--outputs FILE.jsonl] [--out FILE]
[key=value ...]`: accuracy and process metrics of a model, an adapter, or saved outputs."""
from __future__ import annotations

import sys
from pathlib import Path

from jaxrl.config import UsageError


def register(sub) -> None:
    ev = sub.add_parser(
        "eval", help="accuracy (Wilson 95%% interval) and process metrics on evaluation records",
        description="Decode the evaluation records (the validation split of data.tasks, or "
        "data.eval_file) greedily with model.path (model.dtype, quant.*) and optionally a PEFT "
        "adapter; score each task's accuracy with its verifier, Spring's metrics for formal "
        "tasks (knk, zebra) and, when judge.base_url and judge.model are set, CEDAR's seven "
        "process metrics through the judge (failures counted apart, never scored 0). "
        "With data.env each record is played as one greedy episode of that environment: "
        "accuracy, the valid share of tool calls, replies and calls per episode. "
        "--compare evaluates the base and the adapter and prints the difference. Writes the "
        "results JSON (--out) and the completions beside it (NAME_outputs.jsonl), prints a "
        "table. Without --config: configs/quickstart.yaml.")
    ev.add_argument("--config", metavar="FILE", help="YAML run config")
    ev.add_argument("--adapter", default=None, metavar="DIR",
                    help="PEFT LoRA adapter (e.g. a run's adapter/ directory)")
    ev.add_argument("--compare", action="store_true",
                    help="evaluate the base model and the adapter, with their difference")
    ev.add_argument("--outputs", default=None, metavar="FILE.jsonl",
                    help="score saved completions instead of running a model: task records "
                    "plus `completion` (and `variant`; two variants are compared)")
    ev.add_argument("--out", default=None, metavar="FILE.json",
                    help="results JSON (default: run.output_dir/eval.json)")
    ev.add_argument("--batch-size", type=int, default=16, help="rows per sampler call")
    ev.add_argument("overrides", nargs="*", metavar="key=value",
                    help="dotted overrides, e.g. data.tasks=[arithmetic:40] model.path=default")
    ev.set_defaults(func=_eval)


def _check(args) -> None:
    if args.compare and not args.adapter:
        raise UsageError("--compare evaluates the base model against an adapter; give "
                         "--adapter DIR")
    if args.outputs and (args.adapter or args.compare):
        raise UsageError("--outputs scores saved completions; it takes no --adapter or "
                         "--compare (put a `variant` field on each line to compare two sets)")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1; got {args.batch_size}")


def _eval(args) -> int:
    from jaxrl.commands.train import run_config
    from jaxrl.eval.run import progress_bar, read_outputs, run_model, score_variants, write
    from jaxrl.eval.table import format_table

    _check(args)
    cfg = run_config(args)
    with progress_bar() as phase:
        if args.outputs:
            try:
                variants = read_outputs(args.outputs)
            except (OSError, ValueError) as error:
                raise UsageError(str(error)) from None
            doc = score_variants(cfg, variants, phase)
            doc.update(outputs=args.outputs, records=sum(map(len, variants.values())))
        else:
            doc, variants = run_model(cfg, args.adapter, args.compare, args.batch_size, phase)
    out = Path(args.out) if args.out else Path(cfg.run.output_dir) / "eval.json"
    outputs = write(doc, variants, out)
    print(format_table(doc))
    print(f"jaxrl eval: results {out}, completions {outputs}; CEDAR metrics: {doc['cedar']}",
          file=sys.stderr)
    return 0

"""`jaxrl export --run DIR [--step N] --out DIR [--merged] [--dtype D]`."""
from __future__ import annotations

import sys
from pathlib import Path

from jaxrl.config import UsageError


def register(sub) -> None:
    export = sub.add_parser(
        "export", help="write a run's adapter as a PEFT directory (or a merged model)",
        description="Read checkpoint N (default: the newest complete one) of a run directory and "
        "write a Hugging Face PEFT LoRA adapter directory (adapter_config.json + "
        "adapter_model.safetensors) that PeftModel.from_pretrained loads. With --merged, write "
        "a transformers model directory instead: the base as trained (NF4 dequantized) with the "
        "adapter merged in, its config.json, tokenizer files and chat template.")
    export.add_argument("--run", required=True, metavar="DIR",
                        help="run directory (run.output_dir of jaxrl train)")
    export.add_argument("--step", type=int, default=None, metavar="N",
                        help="checkpoint step (default: the newest complete one)")
    export.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    export.add_argument("--merged", action="store_true",
                        help="write the base with the adapter merged in, not an adapter")
    export.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="weight dtype of --merged (default bfloat16)")
    export.set_defaults(func=_export)


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def _base_dir(cfg, base: dict[str, str]) -> Path:
    """The checkpoint's base model: model.path of its config, else the directory it recorded;
    either must still hash as recorded."""
    from jaxrl.checkpoint import base_identity
    from jaxrl.hf.default_model import ModelPathError, resolve_model_path

    candidates = [Path(base["dir"])]
    try:
        candidates.insert(0, resolve_model_path(cfg.model.path))
    except ModelPathError:
        pass  # moved or deleted; the recorded directory may still hold it
    for model_dir in candidates:
        if (model_dir / "config.json").is_file() and \
                base_identity(model_dir, base["path"])["sha256"] == base["sha256"]:
            return model_dir
    raise UsageError(f"the checkpoint's base model {base['path']!r} (sha256 {base['sha256'][:12]} "
                     f"of its config and weights) is not at {' or '.join(map(str, candidates))} "
                     "any more; put that base model back to export")


def _export(args) -> int:
    from jaxrl.checkpoint import CHECKPOINTS, adapter_base_name, checkpoint_steps, load_run_lora
    from jaxrl.hf.export import write_merged_model, write_peft_adapter
    from jaxrl.model.families import load_spec

    run, out = Path(args.run), Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; pass a directory to write the export into")
    steps = checkpoint_steps(run / CHECKPOINTS)
    if not steps:
        raise UsageError(f"--run {run} holds no complete checkpoint under {run / CHECKPOINTS}; "
                         "pass the run.output_dir of a jaxrl train run with checkpoint.every > 0")
    if args.step is not None and args.step not in steps:
        raise UsageError(f"--step {args.step} is not a complete checkpoint of {run}; complete "
                         f"steps: {', '.join(map(str, steps))}")
    lora, cfg, base, step = load_run_lora(run, args.step, log=_log)
    model_dir = _base_dir(cfg, base)
    spec = load_spec(model_dir)
    if args.merged:
        write_merged_model(out, model_dir, spec, cfg.quant, lora, args.dtype)
    else:
        write_peft_adapter(out, lora, spec, adapter_base_name(cfg, base), cfg.lora.dropout)
    kind = f"merged {args.dtype} model" if args.merged else "PEFT adapter"
    _log(f"jaxrl export: step {step} of {run} as a {kind} (LoRA r{lora.rank}, "
         f"{', '.join(lora.targets)})")
    print(out.resolve())
    return 0

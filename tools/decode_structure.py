"""Structural counts of the decode program (jaxrl/bench/lowered.py) for each target and form.

Lowers `generate` for an architecture from abstract shapes (no weights) and counts, per layer
of a decode step, its dot_generals, custom calls by target and ops, and for the whole chunk
its conditionals, counted and data-dependent while loops and host transfers; where the target
compiles (cpu, a local gpu, a TPU slice), the compiled layer's launches, fusions and dots too.
Targets: cpu, cuda (jax.export for CUDA from any host), gpu (a local GPU), tpu:NAME (a TPU slice
without TPUs; needs libtpu, and is left out of the default targets without it). Forms: each
target's platform numerics ("platform"), or the forms `jaxrl bench decode` compares (block,
split, kernels, dense; kernels not for a TPU) over it. A compiler that refuses a program for
lack of the device's memory is reported, not failed. Prints one line per target and form;
--out writes the JSON.

    python tools/decode_structure.py                                  # Qwen3-4B's shapes
    python tools/decode_structure.py --model path/to/config-dir --slots 4 --capacity 64
    python tools/decode_structure.py --targets cuda --forms split,kernels,dense --out s.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-4b",
                        help="architecture: a preset name or a directory with a config.json")
    parser.add_argument("--targets", help="comma-separated targets (default: cpu, cuda, and "
                        "tpu:v5p:1x1x1 where libtpu is found)")
    parser.add_argument("--forms", default="platform",
                        help="platform, or forms of block, split, kernels, dense")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--quant", default="nf4", choices=("nf4", "dense"),
                        help="weights of the platform form (the others name their own)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per chunk")
    parser.add_argument("--out", help="write the results as JSON here")
    return parser.parse_args()


def default_targets() -> list[str]:
    tpu = importlib.util.find_spec("libtpu") or os.environ.get("TPU_LIBRARY_PATH")
    return ["cpu", "cuda"] + (["tpu:v5p:1x1x1"] if tpu else [])


def main() -> int:
    args = _args()
    import jax

    from jaxrl.backends.numerics import numerics_for
    from jaxrl.bench import decode_forms, lowered
    from jaxrl.hf.loader import architecture

    spec = architecture(args.model)
    targets = args.targets.split(",") if args.targets else default_targets()
    forms = args.forms.split(",")
    results, failed = {}, 0
    print(f"{args.model}: {spec.num_layers} layers; {args.slots} slots x {args.capacity} "
          f"columns, LoRA r{args.lora_rank}, {args.steps} steps per chunk; jax {jax.__version__}")
    for target in targets:
        results[target] = {}
        platform = lowered.target_platform(target)
        base = numerics_for(platform)
        if forms == ["platform"]:
            chosen = [decode_forms.Form("platform", base, args.quant)]
        else:
            chosen = decode_forms.decode_forms(base, forms, interpret=platform == "cpu")
        for form in chosen:
            if form.name == "kernels" and platform == "tpu":
                print(f"{form.name:8} {target}: left out (the kernels are GPU kernels)")
                continue
            case = lowered.DecodeCase(spec, form.numerics, args.slots, args.capacity, form.quant,
                                      args.lora_rank, args.steps)
            start = time.perf_counter()
            try:
                result = {"form": form.name, **lowered.structure(case, target)}
            except Exception as e:  # noqa: BLE001  (one target's failure is a result)
                result = {"target": target, "form": form.name, "case": case.describe(),
                          "error": f"{type(e).__name__}: {e}"}
                # a compiler that refuses the program for lack of device memory has lowered it
                failed += "RESOURCE_EXHAUSTED" not in str(e)
            results[target][form.name] = result
            print(f"{form.name:8} {lowered.summary_line(result)} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "jax": jax.__version__, "results": results}, f,
                      indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

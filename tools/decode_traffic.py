"""Bytes one decode step moves, against the floor, from the compiled decode program.

Compiles the decode engine's `generate` for ONE step (jaxrl/sampling/programs.py) from abstract
shapes, as `jaxrl plan` does (no weights), with NF4 kernels dequantized per layer (the path
accelerators take), and walks its optimized HLO (jaxrl/hlo.py): every top-level
instruction reads its operands and writes its result, loops count their trip counts. Per device:

  floor   = the weights as stored (NF4 codes and block scales, bf16 embedding / LM head, norms)
            + the KV cache's filled slots (every slot but the one being written, at a full
            cache) + the new token's keys and values
  moved   = the walk's total; ratio = moved / floor

The cache is full (`--fill` defaults to the capacity minus one) because the decode attention
reads every slot of its cache; at a lower fill the floor falls and the ratio rises.
`--topology v5p:1x1x1` compiles for a TPU slice without TPUs (libtpu; `pip install -e
'.[tpu]'` or TPU_LIBRARY_PATH); without it the local backend compiles (CPU: XLA:CPU's fusion,
which differs from an accelerator's). Prints a table row and the instructions that move most.

    python tools/decode_traffic.py --topology v5p:1x1x1
    python tools/decode_traffic.py                      # the local backend
    python tools/decode_traffic.py --topology v5p:1x1x1 --config configs/qwen3_4b_v5e_2x2.yaml
"""
from __future__ import annotations

import argparse
import collections
import time

from jaxrl.hlo import Program

DEFAULT_CONFIG = "configs/cedar_qwen3_4b_1gpu.yaml"
DEFAULT_OVERRIDES = ("model.path=Qwen/Qwen3-4B",)


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--topology", help="TPU slice, e.g. v5p:1x1x1 (default: local devices)")
    parser.add_argument("--top", type=int, default=12, help="instructions to list")
    parser.add_argument("--chunk", type=int, default=16,
                        help="steps per generate call to spread its fixed traffic over")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    return parser.parse_args()


def per_device(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
    import math

    import jax

    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree_util.tree_leaves(tree))


def compile_step(cfg, spec, rules, compiler_options: dict | None = None):
    """(compiled one-step `generate`, abstract run, abstract slots); compiler_options: XLA
    options for this compile."""
    from jaxrl.planner import abstract_run
    from jaxrl.sampling.buckets import bucket
    from jaxrl.sampling.programs import abstract_slots, generate

    run = abstract_run(cfg, spec, rules)
    capacity = bucket(cfg.data.max_prompt_tokens) + bucket(cfg.sampling.max_new_tokens)
    slots = abstract_slots(run.params, spec, bucket(run.rows, minimum=1), capacity, rules,
                           numerics=run.numerics)
    lowered = generate.lower(slots, run.params, run.lora, spec=spec,
                             eos_ids=spec.eos_token_ids or (0,), steps=1, shardings=rules,
                             numerics=run.numerics)
    return lowered.compile(compiler_options), run, slots


def floor_bytes(run, slots) -> tuple[int, int]:
    """(weights as stored, KV slots read and written at a full cache), per device."""
    cache = slots.cache
    kv = per_device(cache.k) + per_device(cache.v)
    return per_device(run.params) + per_device(run.lora), kv


def main() -> None:
    args = _args()
    import jax

    from jaxrl.config import load_config
    from jaxrl.hf.loader import architecture
    from jaxrl.planner import topology_devices
    from jaxrl.sharding import MeshRules, make_mesh

    cfg = load_config(args.config, [*DEFAULT_OVERRIDES, "quant.dequantize=per_layer",
                                    *args.overrides])
    spec = architecture(cfg.model.path)
    devices = topology_devices(args.topology) if args.topology else jax.devices()
    rules = MeshRules(make_mesh(cfg.mesh, devices))
    start = time.perf_counter()
    compiled, run, slots = compile_step(cfg, spec, rules)
    seconds = time.perf_counter() - start
    program = Program(compiled.as_text())
    moves = program.moves()
    step = sum(m.bytes for m in moves if m.depth)  # inside the chunk's step loop
    call = sum(m.bytes for m in moves if not m.depth)  # once per `generate` call
    weights, kv = floor_bytes(run, slots)
    floor = weights + kv
    c = slots.cache
    print(f"{cfg.model.path} on {args.topology or jax.default_backend()} "
          f"({devices[0].device_kind}), mesh {dict(rules.mesh.shape)}: {c.k.shape[1]} slots x "
          f"{c.k.shape[3]} cache columns, {c.k.dtype.name} cache; compiled in {seconds:.0f} s")
    print("| weights | KV cache | floor | moved per step | per call | per step in a "
          f"{args.chunk}-step chunk | / floor |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    amortized = step + call / args.chunk
    print(f"| {weights / 1e9:.3f} | {kv / 1e9:.3f} | {floor / 1e9:.3f} | {step / 1e9:.3f} | "
          f"{call / 1e9:.3f} | {amortized / 1e9:.3f} | {amortized / floor:.2f} |")
    print("GB per device")
    if program.uncounted_loops:
        print(f"loops without a known trip count, counted once: {program.uncounted_loops}")
    by_op = collections.Counter()
    for m in moves:
        by_op[m.op_name.split("/")[-1] or m.opcode] += m.bytes
    print("largest by operation: " + ", ".join(f"{k} {v / 1e9:.3f} GB"
                                               for k, v in by_op.most_common(args.top)))
    for m in sorted(moves, key=lambda m: -m.bytes)[:args.top]:
        print(f"  {m.bytes / 1e9:8.3f} GB  x{m.times:<3} {m.opcode:<20} {m.result_type[:60]:<60} "
              f"{m.op_name[-70:]}")

if __name__ == "__main__":
    main()

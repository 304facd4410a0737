"""The collectives of the compiled GRPO train step and decode step, with bytes per step.

Compiles, from abstract shapes as `jaxrl plan` does, the train step (`jaxrl plan`'s
`compile_grpo_step`, with the remat policy a run takes) and one decode step (the engine's
`generate`, as tools/decode_traffic.py) on a mesh of the local devices, with NF4 kernels
dequantized per layer (the accelerators' path),
and lists every collective of the optimized HLO (jaxrl/hlo.py) with the bytes of its result
per call per device, loops counted by their trip counts, each array in the type it carries:
XLA:CPU widens bfloat16 collectives to float32 around the transfer, and on CPU the programs are
compiled without its all-reduce promotion so that a bfloat16 all-reduce shows it
(`jaxrl.hlo.CPU_OPTIONS`). Then it checks, in every branch, what must never cross the
interconnect (`jaxrl.hlo.forbidden`): a dequantized weight (a floating-point array holding a
whole layer kernel, or the stack of them) and full-vocabulary float32 logits (a float32 array
with a vocab-sized dim). Exits 1 if it finds one.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/collectives.py \
        mesh.data=1 mesh.fsdp=8 mesh.tensor=1 optim.micro_batch_size=8
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

from decode_traffic import DEFAULT_CONFIG, DEFAULT_OVERRIDES, compile_step

from jaxrl.hlo import CPU_OPTIONS, Program, forbidden


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides (mesh.*)")
    return parser.parse_args()


def brief(result_type: str) -> str:
    """'(bf16[8,2560]{1,0}, bf16[8,2560]{1,0}, f32[8,16]{1,0})' -> 'bf16[8,2560] x2 + f32[8,16]'."""
    arrays = collections.Counter(re.findall(r"\b\w+\[[\d,]*\]", result_type))
    return " + ".join(a if n == 1 else f"{a} x{n}" for a, n in arrays.items())


def report(name: str, compiled, vocab: int, kernels) -> int:
    """Print the table of one program's collectives; the number of forbidden ones."""
    program = Program(compiled.as_text())
    moves = program.collectives()
    groups = collections.defaultdict(lambda: [0, 0.0])
    for m in moves:
        where = "/".join(p for p in m.op_name.split("/")[-3:] if p) or "-"
        key = (m.opcode.removesuffix("-start"), brief(m.result_type), where[-60:])
        groups[key][0] += m.times
        groups[key][1] += m.bytes
    print(f"\n{name}: {len(moves)} collective instructions, "
          f"{sum(m.bytes for m in moves) / 1e6:.1f} MB per call per device")
    print("| collective | result | from | per call | MB per call |")
    print("| --- | --- | --- | ---: | ---: |")
    for (kind, result, where), (times, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kind} | {result} | {where} | {times} | {nbytes / 1e6:.2f} |")
    bad = [(m, why) for m in program.collectives(every_branch=True)
           if (why := forbidden(m.result_type, vocab, kernels))]
    for m, why in bad:
        print(f"FORBIDDEN: {m.opcode} moves {why} ({m.op_name})")
    return len(bad)


def main() -> None:
    args = _args()
    import jax

    from jaxrl.config import load_config
    from jaxrl.devices import device_memory
    from jaxrl.hf.loader import architecture
    from jaxrl.model.params import declare
    from jaxrl.planner import abstract_run, compile_grpo_step, lower_step
    from jaxrl.sharding import MeshRules, make_mesh

    cfg = load_config(args.config, [*DEFAULT_OVERRIDES, "quant.dequantize=per_layer",
                                    *args.overrides])
    spec = architecture(cfg.model.path)
    rules = MeshRules(make_mesh(cfg.mesh, jax.devices()))
    options = CPU_OPTIONS if jax.default_backend() == "cpu" else None
    kernels = {d.shape[1:] for p, d in declare(spec).items()
               if p.startswith("layers/") and p.endswith("/kernel")}
    print(f"{cfg.model.path}, NF4 per layer, on {len(jax.devices())} x "
          f"{jax.devices()[0].device_kind}, mesh {dict(rules.mesh.shape)}; "
          f"{cfg.data.prompts_per_step} x {cfg.grpo.num_generations} rows")
    decode, _, _ = compile_step(cfg, spec, rules, options)
    run = abstract_run(cfg, spec, rules)
    policy = cfg.optim.remat
    if policy == "auto":
        policy = compile_grpo_step(cfg, spec, rules, run, device_memory(jax.devices())[0])[0]
    print(f"train step: optim.remat {policy}")
    step = lower_step(cfg, spec, rules, run, policy).compile(options)
    bad = (report("decode step", decode, spec.vocab_size, kernels)
           + report("train step", step, spec.vocab_size, kernels))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

"""`jaxrl plan [--config FILE] [--topology NAME] [--device-memory GIB] [key=value ...]`: compile
the sampler, the reference pass and the GRPO step for a configuration from abstract shapes (no
weights are read or allocated) and report their per-device memory.

What is compiled and how each figure is counted: jaxrl/planner.py. The run fits when the
largest need is within the memory the device's allocator hands out: on a GPU, XLA's allocator takes a fraction of the card
(XLA_CLIENT_MEM_FRACTION, formerly XLA_PYTHON_CLIENT_MEM_FRACTION; 0.75 when unset; the
launch scripts set 0.90), so `--device-memory GIB` names the card's memory and the plan fits
against --mem-fraction (default: that variable) of it; a TPU chip's figure is what its
compiler reports as usable. With several hosts the plan also checks that each host can feed
the rows its chips hold (hosts whose chips share a batch shard sample and score it alike).
The step is compiled with optim.remat's policy; under auto, with the one a run would take
(jaxrl/rl/remat.py), which the step's row names. With judge.local the engines are planned as
the run holds them (the judge's slots and columns, a second model's weights) and a line gives
the judge's share; a run that does not fit names the judge's settings to shrink.

`--topology v5e:4x4` compiles for a TPU slice without TPUs, through libtpu
(`pip install -e '.[tpu]'`); without it the local devices are used.
"""
from __future__ import annotations

import sys

from jaxrl.config import load_config
from jaxrl.devices import device_memory


def register(sub) -> None:
    plan = sub.add_parser(
        "plan", help="compile the sampler and GRPO step for a config; report device memory",
        description=__doc__.split("\n\n", 1)[1].replace("`", ""))
    plan.add_argument("--config", metavar="FILE", help="YAML run config (default: the quickstart)")
    plan.add_argument("--topology", metavar="NAME",
                      help="TPU slice to compile for without TPUs, e.g. v5e:2x2, v5e:4x4, "
                      "v5p:4x4x4 (needs libtpu); default: the local devices")
    plan.add_argument("--device-memory", metavar="GIB", type=float,
                      help="memory of each device, e.g. a GPU's card; the run gets "
                      "--mem-fraction of it (default: the allocator's limit the device reports, "
                      "the usable HBM of a topology's chip, or on a CPU the memory available now)")
    plan.add_argument("--mem-fraction", metavar="F", type=float,
                      help="share of --device-memory XLA's GPU allocator takes (default: "
                      "$XLA_CLIENT_MEM_FRACTION or $XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75, "
                      "XLA's default)")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    plan.set_defaults(func=_plan)


def _plan(args) -> int:
    import jax

    from jaxrl.commands.train import QUICKSTART
    from jaxrl.hf.loader import architecture
    from jaxrl.planner import (SHRINK_JUDGE, host_layout, judge_share, plan_memory, report,
                               topology_devices)
    from jaxrl.sharding import MeshRules, make_mesh

    cfg = load_config(args.config or QUICKSTART, args.overrides)
    spec = architecture(cfg.model.path)
    devices = topology_devices(args.topology) if args.topology else jax.devices()
    rules = MeshRules(make_mesh(cfg.mesh, devices))
    where = args.topology or jax.default_backend()
    print(f"{cfg.model.path}: {spec.family}, {spec.num_layers} layers, {spec.hidden_size} "
          f"hidden; {len(devices)} x {devices[0].device_kind} ({where}); mesh "
          f"{dict(rules.mesh.shape)}; {cfg.data.prompts_per_step} x "
          f"{cfg.grpo.num_generations} rows, {cfg.data.max_prompt_tokens} prompt + "
          f"{cfg.sampling.max_new_tokens} new tokens; {cfg.quant.mode} + LoRA r{cfg.lora.rank}")
    print(f"hosts: {host_layout(cfg, rules)}")
    capacity, source = device_memory(devices, args.device_memory, args.mem_fraction)
    entries = plan_memory(cfg, spec, rules, capacity)
    text, fits = report(entries, capacity, source, judge_share(cfg, spec, rules))
    print(text)
    if not fits:
        print("jaxrl plan: the run does not fit the device memory; shard further (mesh.fsdp), "
              "shorten sampling.max_new_tokens or set optim.micro_batch_size"
              + (f"; {SHRINK_JUDGE}" if cfg.judge.local else ""), file=sys.stderr)
    return 0 if fits else 1


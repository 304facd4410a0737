"""`jaxrl plan [--config FILE] [--topology NAME] [--device-memory GIB] [key=value ...]`: compile
the sampler, the reference pass and the GRPO step for a configuration from abstract shapes (no
weights are read or allocated) and report their per-device memory.

The programs are the ones `jaxrl train` runs, lowered with the run's mesh, shardings, batch
(data.prompts_per_step x grpo.num_generations rows), prompt and completion buckets, NF4 layout
and LoRA targets. Figures come from XLA's `memory_analysis()` of each compiled program, per
device: arguments, outputs, temporaries, and peak = arguments + outputs - aliased (donated)
buffers + temporaries. What stays on the device between programs counts too: while the sampler
runs, the optimizer state (not one of its arguments) is still resident, so the sampler needs
its peak plus that (and the reference pass, which takes no adapter, its peak plus the whole
train state). The run fits when the largest need is within the memory the device's
allocator hands out: on a GPU, XLA's allocator takes a fraction of the card
(XLA_CLIENT_MEM_FRACTION, formerly XLA_PYTHON_CLIENT_MEM_FRACTION; 0.75 when unset; the
launch scripts set 0.90), so `--device-memory GIB` names the card's memory and the plan fits
against --mem-fraction (default: that variable) of it; a TPU chip's figure is what its
compiler reports as usable. With several hosts the plan also checks that each host can feed
the rows its chips hold (hosts whose chips share a batch shard sample and score it alike).
The step is compiled with optim.remat's policy; under auto, with the one a run would take
(jaxrl/rl/remat.py), which the step's row names.

`--topology v5e:4x4` compiles for a TPU slice without TPUs, through libtpu
(`pip install -e '.[tpu]'`); without it the local devices are used.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Any

from jaxrl.devices import GIB, device_memory


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


def architecture(path: str):
    """The ModelSpec of model.path: its config.json when it is a local directory holding one,
    else an embedded preset (jaxrl/model/presets) its last path part names."""
    from jaxrl.commands import UsageError
    from jaxrl.model.families import load_spec, spec_from_hf_config
    from jaxrl.model.presets import PRESETS, preset_config

    if path == "default":  # the embedded model, prepared on first use
        from jaxrl.hf.default_model import resolve_model_path

        path = str(resolve_model_path(path))
    if path and (Path(path) / "config.json").is_file():
        return load_spec(path)
    config = preset_config(path) if path else None
    if config is None:
        raise UsageError(f"config key 'model.path' = {path!r} is neither a directory with a "
                         f"config.json nor a known architecture; presets: {', '.join(PRESETS)}")
    return spec_from_hf_config(config)


def topology_devices(name: str) -> list:
    """Compile-only devices of a TPU slice such as v5e:4x4."""
    from jax.experimental import topologies

    from jaxrl.commands import UsageError

    # compiling touches no chip, so the lock libtpu takes against a second process is not needed
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        dims = [int(d) for d in name.split(":", 1)[1].split("x")]
    except (IndexError, ValueError):
        raise UsageError(f"--topology {name!r} is not GENERATION:AxB[xC], e.g. v5e:4x4, "
                         "v5p:4x4x4") from None
    # a slice smaller than one host's chips (a single chip, say) has to say so
    small = {"chips_per_host_bounds": (dims + [1, 1])[:3]} if math.prod(dims) < 4 else {}
    try:
        return list(topologies.get_topology_desc(topology_name=name, platform="tpu",
                                                 **small).devices)
    except RuntimeError as e:
        if "not installed" in str(e):
            raise RuntimeError("--topology needs libtpu: pip install -e '.[tpu]' (or point "
                               "TPU_LIBRARY_PATH at a libtpu.so)") from e
        raise UsageError(f"--topology {name!r} is not a TPU slice libtpu knows ({e}); "
                         "examples: v5e:2x2, v5e:4x4, v5p:2x2x1, v5p:4x4x4") from e


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program, plus what else is resident while it runs."""

    name: str
    argument: int
    output: int
    alias: int
    temp: int
    resident_other: int

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @property
    def need(self) -> int:
        return self.peak + self.resident_other


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of an abstract tree laid out by `shardings` (the largest shard)."""
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    specs = jax.tree_util.tree_leaves(shardings)
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(leaves, specs))


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """The run's device state as ShapeDtypeStructs, with its shardings."""

    params: Any
    lora: Any
    state: Any
    state_shardings: Any
    optimizer: Any
    rows: int


def abstract_run(cfg, spec, rules) -> AbstractRun:
    """Params as the run holds them on `rules`' platform (NF4 kernels packed, or dequantized
    once on CPU), the adapter, and the train state: shapes, dtypes and shardings only."""
    import jax
    import jax.numpy as jnp

    from jaxrl.lora.lora import init_lora
    from jaxrl.model.params import abstract_params
    from jaxrl.model.transformer import layer_bits
    from jaxrl.quant.qparams import abstract_quantized_params, dequantize_strategy
    from jaxrl.rl.train_step import init_train_state, make_optimizer
    from jaxrl.sharding import abstract, lora_shardings, param_shardings, state_shardings

    dtype = jnp.dtype(cfg.model.dtype)
    platform = rules.mesh.devices.flat[0].platform
    once = dequantize_strategy(cfg.quant, platform) == "once"
    params = (abstract_params(spec, dtype) if once
              else abstract_quantized_params(spec, cfg.quant, dtype))
    placed = param_shardings(rules, params, spec)
    params = jax.eval_shape(lambda p: layer_bits(p, platform), params)  # as a run holds them
    lora = jax.eval_shape(lambda key: init_lora(
        spec, key, rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=cfg.lora.targets,
        dropout=cfg.lora.dropout), jax.random.PRNGKey(0))
    optimizer, _ = make_optimizer(cfg.optim, cfg.run.steps)
    state = jax.eval_shape(lambda adapter: init_train_state(adapter, optimizer), lora)
    shardings = state_shardings(rules, state, optimizer, spec)
    return AbstractRun(params=abstract(params, placed),
                       lora=abstract(lora, lora_shardings(rules, lora, spec)),
                       state=abstract(state, shardings), state_shardings=shardings,
                       optimizer=optimizer,
                       rows=cfg.data.prompts_per_step * cfg.grpo.num_generations)


def _slots(cfg, spec, rules, run: AbstractRun):
    """The rollout engine's slots as `sample` lays them out for the run's rows (a group's G
    slots sharing its prompt; one slot each in multi-turn rollouts), ShapeDtypeStructs."""
    from jaxrl.sampling.buckets import bucket
    from jaxrl.sampling.programs import abstract_slots
    from jaxrl.sampling.sampler import slot_layout

    group = 1 if cfg.data.env else cfg.grpo.num_generations
    slots, share = slot_layout(run.rows, group, 0, rules.batch_ways)
    return abstract_slots(run.params, spec, slots, _capacity(cfg), rules, share=share,
                          prompt_capacity=bucket(cfg.data.max_prompt_tokens))


def lower_sampler(cfg, spec, rules, run: AbstractRun):
    """The decode engine's `generate` (one chunk of the run's new-token bucket) lowered for a
    slot per row of the run (jaxrl/sampling/programs.py)."""
    from jaxrl.sampling.buckets import bucket
    from jaxrl.sampling.programs import generate

    state = _slots(cfg, spec, rules, run)
    return generate.lower(state, run.params, run.lora, spec=spec,
                          eos_ids=spec.eos_token_ids or (0,),
                          steps=bucket(cfg.sampling.max_new_tokens), shardings=rules)


def lower_prefill(cfg, spec, rules, run: AbstractRun):
    """The decode engine's `admit` lowered for one step's prompts (data.prompts_per_step of
    data.max_prompt_tokens) filling a slot per row."""
    import jax
    import jax.numpy as jnp

    from jaxrl.sampling.buckets import bucket
    from jaxrl.sampling.programs import admit
    from jaxrl.sampling.sampling_fns import Decoding, RowSettings

    state = _slots(cfg, spec, rules, run)
    slots = state.last.shape[0]
    u, p = bucket(cfg.data.prompts_per_step, minimum=1), bucket(cfg.data.max_prompt_tokens)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rules.rows(shape))
    m = (slots,)
    settings = jax.tree_util.tree_map(lambda a: sds(a.shape, a.dtype),
                                      RowSettings.of([Decoding()] * slots))
    return admit.lower(state, run.params, run.lora, sds((u, p), jnp.int32), sds((u,), jnp.int32),
                       sds(m, jnp.int32), sds(m, jnp.int32), sds((slots, 2), jnp.uint32),
                       settings, sds(m, jnp.int32), spec=spec,
                       eos_ids=spec.eos_token_ids or (0,), shardings=rules)


def _capacity(cfg) -> int:
    """Cache columns per slot: the prompt bucket plus the new-token bucket, or with data.env
    the episode's token budget (multi-turn rollouts, jaxrl/rl/episodes.py)."""
    from jaxrl.sampling.buckets import bucket

    return bucket(cfg.data.max_prompt_tokens) + (
        cfg.env.max_tokens if cfg.data.env else bucket(cfg.sampling.max_new_tokens))


def lower_step(cfg, spec, rules, run: AbstractRun, remat: str):
    """The GRPO train step lowered for a batch of the run's rows: the prompt bucket plus
    sampling.max_new_tokens columns (env.max_tokens with data.env), micro-batched as
    optim.micro_batch_size says, recomputing as the remat policy `remat` (none, dots or full)
    says."""
    import jax
    import jax.numpy as jnp

    from jaxrl.rl.session import completion_width, prompt_share_limit, step_options
    from jaxrl.rl.train_step import Batch, compile_train_step
    from jaxrl.sampling.buckets import bucket
    from jaxrl.sharding import step_shardings

    b, n = run.rows, completion_width(cfg)
    s = bucket(cfg.data.max_prompt_tokens) + n
    sds = jax.ShapeDtypeStruct
    batch = Batch(tokens=sds((b, s), jnp.int32), positions=sds((b, s), jnp.int32),
                  attn_mask=sds((b, s), jnp.bool_), completion_mask=sds((b, n), jnp.bool_),
                  logp_old=sds((b, n), jnp.float32), advantages=sds((b,), jnp.float32),
                  ref_logp=sds((b, n), jnp.float32) if cfg.grpo.beta > 0 else None,
                  share=prompt_share_limit(cfg, rules, b))  # a group's rows: one prompt
    shardings = step_shardings(rules, run.state, run.params, spec, run.optimizer, b)
    opts = dataclasses.replace(step_options(cfg, rules), remat=remat)
    step = compile_train_step(spec, run.optimizer, opts, shardings)
    return step.lower(run.state, run.params, batch)


def lower_reference(cfg, spec, rules, run: AbstractRun):
    """The GRPO reference pass (the frozen base's log-probs of a step's rows) lowered for the
    step's batch, micro-batched as the update is."""
    import jax
    import jax.numpy as jnp

    from jaxrl.rl.session import completion_width, prompt_share_limit, step_options
    from jaxrl.rl.train_step import compile_reference
    from jaxrl.sampling.buckets import bucket
    from jaxrl.sharding import reference_shardings

    b = run.rows
    s = bucket(cfg.data.max_prompt_tokens) + completion_width(cfg)
    shardings = reference_shardings(rules, run.params, spec, b)
    rows = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=shardings[1])
    mask = jax.ShapeDtypeStruct((b, s), jnp.bool_, sharding=shardings[1])
    share = prompt_share_limit(cfg, rules, b)  # a group's rows: one prompt
    return compile_reference(spec, step_options(cfg, rules), shardings,
                             share=share).lower(run.params, rows, rows, mask)


class OutOfMemory(RuntimeError):
    """The compiler itself found that a program cannot fit the device (TPU compiles refuse)."""


@contextlib.contextmanager
def _refusal(name: str):
    """Turns the compiler's refusal of a program for lack of device memory into OutOfMemory."""
    import jax

    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise OutOfMemory(f"{name}: {str(e).split(':', 1)[-1].strip()}") from None


def _analysis(name: str, compiled, resident_other: int = 0) -> ProgramMemory:
    m = compiled.memory_analysis()
    return ProgramMemory(name, m.argument_size_in_bytes, m.output_size_in_bytes,
                         m.alias_size_in_bytes, m.temp_size_in_bytes, resident_other)


def compile_grpo_step(cfg, spec, rules, run: AbstractRun,
                      capacity: int | None) -> tuple[str, Any]:
    """(remat policy, the GRPO step compiled with it): optim.remat, or for auto the one
    `jaxrl.rl.remat.choose` takes for `capacity` bytes per device, as a run takes it."""
    from jaxrl.rl.remat import choose

    lower = lambda policy: lower_step(cfg, spec, rules, run, policy)  # noqa: E731
    if cfg.optim.remat == "auto":
        return choose(lower, capacity)
    return cfg.optim.remat, lower(cfg.optim.remat).compile()


def _step_memory(cfg, spec, rules, run: AbstractRun, capacity: int | None) -> ProgramMemory:
    """The GRPO step's figures, named with its remat policy (`compile_grpo_step`)."""
    with _refusal("grpo step"):
        policy, compiled = compile_grpo_step(cfg, spec, rules, run, capacity)
    return _analysis(f"grpo step (remat {policy})", compiled)


def plan_memory(cfg, spec, rules,
                capacity: int | None = None) -> list[ProgramMemory | OutOfMemory]:
    """Compiles the sampler, the reference pass and the GRPO step of `cfg` on `rules`' mesh
    from abstract shapes; a program the compiler refuses for lack of device memory is an
    `OutOfMemory` entry. capacity: bytes per device, for optim.remat auto."""
    run = abstract_run(cfg, spec, rules)
    opt_bytes = per_device_bytes(run.state.opt_state, run.state_shardings.opt_state)
    state_bytes = per_device_bytes(run.state, run.state_shardings)
    rows = []
    for name, lower, resident in (("sampler", lower_sampler, opt_bytes),
                                  ("prefill", lower_prefill, opt_bytes),
                                  ("reference", lower_reference, state_bytes)):
        try:
            with _refusal(name):
                rows.append(_analysis(name, lower(cfg, spec, rules, run).compile(), resident))
        except OutOfMemory as e:  # the other program's figures still tell where memory goes
            rows.append(e)
    try:
        rows.append(_step_memory(cfg, spec, rules, run, capacity))
    except OutOfMemory as e:
        rows.append(e)
    return rows


def host_layout(cfg, rules) -> str:
    """How the step's rows fall to the hosts of `rules`' devices; ConfigError when a host
    cannot feed its rows (jaxrl/distributed.py)."""
    from jaxrl import distributed
    from jaxrl.config import ConfigError

    held = distributed.batch_shards(rules)
    if len(held) == 1:
        return "one host"
    distributed.check_layout(rules)
    g, rows = cfg.grpo.num_generations, cfg.data.prompts_per_step * cfg.grpo.num_generations
    sharers = sum(s == held[0] for s in held.values())
    blocks = len(held) // sharers
    if rows % rules.batch_ways or (rows // blocks) % g:
        raise ConfigError(
            f"config key 'data.prompts_per_step' = {cfg.data.prompts_per_step} must be a "
            f"multiple of the {blocks} row blocks of this mesh, and its rows (x "
            f"grpo.num_generations = {rows}) of the {rules.batch_ways} batch shards")
    return (f"{len(held)} hosts x {rules.mesh.devices.size // len(held)} chips: {blocks} row "
            f"blocks of {rows // blocks} rows, each held by {sharers} "
            f"host{'s, which sample and score it alike' if sharers > 1 else ''}")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def report(entries: list[ProgramMemory | OutOfMemory], capacity: int | None,
           source: str = "") -> tuple[str, bool]:
    """The table `jaxrl plan` prints, and whether the run fits; `source` says where the
    capacity comes from."""
    lines = ["| program | argument | output | aliased | temporary | peak | + resident | need |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = [e for e in entries if isinstance(e, ProgramMemory)]
    failed = [f"DOES NOT FIT: the compiler ran out of device memory for the {e}"
              for e in entries if isinstance(e, OutOfMemory)]
    for r in rows:
        lines.append(f"| {r.name} | {_gib(r.argument)} | {_gib(r.output)} | {_gib(r.alias)} | "
                     f"{_gib(r.temp)} | {_gib(r.peak)} | {_gib(r.resident_other)} | "
                     f"{_gib(r.need)} |")
    need = max((r.need for r in rows), default=0)
    fits = not failed and (capacity is None or need <= capacity)
    cap = "unknown" if capacity is None else f"{_gib(capacity)} GiB"
    cap += f" ({source})" if source else ""
    spare = "" if capacity is None or not fits else f", {_gib(capacity - need)} GiB to spare"
    lines.append(f"GiB per device; needs {_gib(need)} GiB of {cap}: "
                 f"{'fits' if fits else 'DOES NOT FIT'}{spare}")
    return "\n".join(lines + failed), fits


def _plan(args) -> int:
    import jax

    from jaxrl.config import load_config
    from jaxrl.sharding import MeshRules, make_mesh

    from jaxrl.commands.train import QUICKSTART

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
    text, fits = report(plan_memory(cfg, spec, rules, capacity), capacity, source)
    print(text)
    if not fits:
        print("jaxrl plan: the run does not fit the device memory; shard further (mesh.fsdp), "
              "shorten sampling.max_new_tokens or set optim.micro_batch_size", file=sys.stderr)
    return 0 if fits else 1


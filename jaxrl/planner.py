"""Memory and compile planning: the programs `jaxrl train` runs, lowered and compiled for a
configuration from abstract shapes (no weights are read or allocated), with their per-device
memory. `jaxrl plan` (jaxrl/commands/plan.py) prints it; `jaxrl bench` and tools/ build on the
abstract run.

The programs are the ones a run compiles, with the run's mesh, shardings, batch
(data.prompts_per_step x grpo.num_generations rows), prompt and completion buckets, NF4 layout
and LoRA targets. Figures come from XLA's `memory_analysis()` of each compiled program, per
device: arguments, outputs, temporaries, and peak = arguments + outputs - aliased (donated)
buffers + temporaries. What stays on the device between programs counts too: while the sampler
runs, the optimizer state (not one of its arguments) is still resident, so the sampler needs
its peak plus that (and the reference pass, which takes no adapter, its peak plus the whole
train state). The step is compiled with optim.remat's policy; under auto, with the one a run
would take (jaxrl/rl/remat.py).

quant.dequantize auto on a GPU or TPU is decided by memory (`Numerics.dequantize_strategy`):
a run dequantizes its NF4 kernels once (dense kernels, plain matmuls) when its plan with dense
kernels fits the device's memory, and keeps them packed when it does not or the memory is
unknown (`dense_fit`, which a run's loader asks, jaxrl/hf/loader.py). The plan of such a config
is the one the run takes, and its sampler row names the choice.

With `judge.local` (jaxrl/rewards/local_judge.py) the plan is of the engine(s) the run holds
for the whole run (`JudgeService`), as `local_judge.layout` lays them out: with base or
adapter:DIR the policy's engine has the rollout's slots plus judge.slots, every slot of the
larger of the rollout's and the judge's columns, one slot per row (no prompt sharing), and its
adapter is an `AdapterSet`; with model:PATH it keeps the rollout's slots and columns and a
second engine of judge.slots x the judge's columns decodes the second model. Those engines'
slots stay allocated between rollouts, so the reference pass and the GRPO step count them as
resident too; a second model's weights and its engine's slots are resident beside every
program (its own decode programs are not compiled here). `judge_share` gives the judge's part
for the report's judge line, and a plan that does not fit names what to shrink.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from jaxrl import distributed
from jaxrl.backends.numerics import Numerics, numerics_of
from jaxrl.config import ConfigError, MeshConfig, UsageError
from jaxrl.devices import GIB, device_memory
from jaxrl.hf.loader import architecture, load_model
from jaxrl.lora.adapters import AdapterSet
from jaxrl.lora.lora import init_lora
from jaxrl.rl.remat import choose
from jaxrl.rl.session import completion_width, prompt_share_limit, step_options
from jaxrl.rl.train_step import (Batch, compile_reference, compile_train_step, init_train_state,
                                 make_optimizer)
from jaxrl.sampling.buckets import bucket
from jaxrl.sampling.programs import abstract_slots, admit, generate
from jaxrl.sampling.sampler import slot_layout
from jaxrl.sampling.sampling_fns import Decoding, RowSettings
from jaxrl.sharding import (MeshRules, abstract, lora_shardings, make_mesh, reference_shardings,
                            state_shardings, step_shardings)


def topology_devices(name: str) -> list:
    """Compile-only devices of a TPU slice such as v5e:4x4."""
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
    leaves = jax.tree_util.tree_leaves(tree)
    specs = jax.tree_util.tree_leaves(shardings)
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(leaves, specs))


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """The run's device state as ShapeDtypeStructs, with its shardings, and the numerics its
    programs take."""

    params: Any
    lora: Any
    state: Any
    state_shardings: Any
    optimizer: Any
    rows: int
    numerics: Numerics


def abstract_run(cfg, spec, rules) -> AbstractRun:
    """Params as the run holds them on `rules`' platform (`jaxrl.hf.loader.load_model`'s
    abstract weights: NF4 kernels packed, or dequantized once on the CPU), the adapter, and the
    train state: shapes, dtypes and shardings only."""
    numerics = numerics_of(rules)
    params = load_model(spec, dtype=cfg.model.dtype, quant=cfg.quant, numerics=numerics,
                        rules=rules, weights="abstract").params
    lora = jax.eval_shape(lambda key: init_lora(
        spec, key, rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=cfg.lora.targets,
        dropout=cfg.lora.dropout), jax.random.PRNGKey(0))
    optimizer, _ = make_optimizer(cfg.optim, cfg.run.steps)
    state = jax.eval_shape(lambda adapter: init_train_state(adapter, optimizer), lora)
    shardings = state_shardings(rules, state, optimizer, spec)
    return AbstractRun(params=params,
                       lora=abstract(lora, lora_shardings(rules, lora, spec)),
                       state=abstract(state, shardings), state_shardings=shardings,
                       optimizer=optimizer,
                       rows=cfg.data.prompts_per_step * cfg.grpo.num_generations,
                       numerics=numerics)


def _layout(cfg, rules, run: AbstractRun):
    """The local judge's `Layout` of the run's engines (None without judge.local)."""
    if not cfg.judge.local:
        return None
    from jaxrl.rewards.local_judge import layout

    return layout(cfg, run.rows, rules.batch_ways)


def _slots(cfg, spec, rules, run: AbstractRun):
    """The rollout engine's slots as `sample` lays them out for the run's rows (a group's G
    slots sharing its prompt; one slot each in multi-turn rollouts), ShapeDtypeStructs; with
    judge.local the policy's engine of the local judge's layout (module docstring); with
    sampling.partial the engine kept across steps (a slot each, sampling.slots of them)."""
    lay = _layout(cfg, rules, run)
    if lay is not None:
        return abstract_slots(run.params, spec, lay.policy_slots, lay.policy_capacity, rules,
                              numerics=run.numerics)
    if cfg.sampling.partial:  # jaxrl/rl/partial.py: single slots, sampling.slots or a step's
        slots = bucket(max(cfg.sampling.slots or run.rows, rules.batch_ways), minimum=1)
        return abstract_slots(run.params, spec, slots, _capacity(cfg), rules,
                              numerics=run.numerics)
    group = 1 if cfg.data.env else cfg.grpo.num_generations
    slots, share = slot_layout(run.rows, group, 0, rules.batch_ways)
    return abstract_slots(run.params, spec, slots, _capacity(cfg), rules, share=share,
                          prompt_capacity=bucket(cfg.data.max_prompt_tokens),
                          numerics=run.numerics)


def _engine_lora(cfg, run: AbstractRun):
    """The adapter the policy's engine decodes with: the policy's `Lora`, or with judge.local
    base or adapter:DIR an `AdapterSet` of it and, for adapter:DIR, the judge's adapter. An
    abstract plan reads nothing from disk, so the judge's adapter is a stand-in of the policy's
    structure (lora.rank and lora.targets); a PEFT adapter of another rank or targets changes
    the set's rank columns, and with them the sampler's figures, by its own size."""
    from jaxrl.rewards.local_judge import judge_kind

    kind = judge_kind(cfg)[0]
    if kind not in ("base", "adapter"):
        return run.lora
    return AdapterSet.of([run.lora, run.lora] if kind == "adapter" else [run.lora])


def lower_sampler(cfg, spec, rules, run: AbstractRun):
    """The decode engine's `generate` (one chunk of the run's new-token bucket) lowered for a
    slot per row of the run (jaxrl/sampling/programs.py); with judge.local, for the policy's
    engine as the run holds it (module docstring)."""
    state = _slots(cfg, spec, rules, run)
    return generate.lower(state, run.params, _engine_lora(cfg, run), spec=spec,
                          eos_ids=spec.eos_token_ids or (0,),
                          steps=bucket(cfg.sampling.max_new_tokens), shardings=rules,
                          numerics=run.numerics)


def lower_prefill(cfg, spec, rules, run: AbstractRun):
    """The decode engine's `admit` lowered for one step's prompts (data.prompts_per_step of
    data.max_prompt_tokens) filling a slot per row. With a judge in the policy's engine
    (judge.local base or adapter:DIR), for the widest admission it takes: the step's prompts
    and judge.slots judge prompts at once, as wide as the wider of the prompt bucket and the
    judge's prompt columns (bucketed, within the slots' columns)."""
    state = _slots(cfg, spec, rules, run)
    slots = state.last.shape[0]
    u, p = bucket(cfg.data.prompts_per_step, minimum=1), bucket(cfg.data.max_prompt_tokens)
    lay = _layout(cfg, rules, run)
    if lay is not None and lay.shared:
        from jaxrl.rewards.local_judge import judge_prompt_tokens

        u = bucket(cfg.data.prompts_per_step + lay.judge_slots, minimum=1)
        p = min(max(p, bucket(judge_prompt_tokens(cfg))), lay.policy_capacity)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rules.rows(shape))
    m = (slots,)
    settings = jax.tree_util.tree_map(lambda a: sds(a.shape, a.dtype),
                                      RowSettings.of([Decoding()] * slots))
    return admit.lower(state, run.params, _engine_lora(cfg, run), sds((u, p), jnp.int32),
                       sds((u,), jnp.int32), sds((u,), jnp.int32), sds(m, jnp.int32),
                       sds(m, jnp.int32), sds((slots, 2), jnp.uint32),
                       settings, sds(m, jnp.int32), spec=spec,
                       eos_ids=spec.eos_token_ids or (0,), shardings=rules,
                       numerics=run.numerics)


def _capacity(cfg) -> int:
    """Cache columns per slot: the prompt bucket plus the new-token bucket, or with data.env
    the episode's token budget (multi-turn rollouts, jaxrl/rl/episodes.py)."""
    return bucket(cfg.data.max_prompt_tokens) + (
        cfg.env.max_tokens if cfg.data.env else bucket(cfg.sampling.max_new_tokens))


def lower_step(cfg, spec, rules, run: AbstractRun, remat: str):
    """The GRPO train step lowered for a batch of the run's rows: the prompt bucket plus
    sampling.max_new_tokens columns (env.max_tokens with data.env), micro-batched as
    optim.micro_batch_size says, recomputing as the remat policy `remat` (none, dots or full)
    says."""
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
    lower = lambda policy: lower_step(cfg, spec, rules, run, policy)  # noqa: E731
    if cfg.optim.remat == "auto":
        return choose(lower, capacity)
    return cfg.optim.remat, lower(cfg.optim.remat).compile()


def _step_memory(cfg, spec, rules, run: AbstractRun, capacity: int | None,
                 resident: int = 0) -> ProgramMemory:
    """The GRPO step's figures, named with its remat policy (`compile_grpo_step`); resident:
    what else stays on the device while it runs (a local judge's engines; optim.remat auto
    chooses against the whole capacity, as a run's `choose` does)."""
    with _refusal("grpo step"):
        policy, compiled = compile_grpo_step(cfg, spec, rules, run, capacity)
    return _analysis(f"grpo step (remat {policy})", compiled, resident)


def plan_memory(cfg, spec, rules,
                capacity: int | None = None) -> list[ProgramMemory | OutOfMemory]:
    """Compiles the sampler, the reference pass and the GRPO step of `cfg` on `rules`' mesh
    from abstract shapes; a program the compiler refuses for lack of device memory is an
    `OutOfMemory` entry. capacity: bytes per device, for optim.remat auto and for
    quant.dequantize auto where memory decides it (module docstring; None: NF4 kept)."""
    quantized = cfg.quant.mode != "none"
    asked: list[DenseFit] = []

    def dense_fits() -> bool | None:
        asked.append(dense_fit(cfg, spec, rules, (capacity, "")))
        return asked[-1].fits

    strategy = (numerics_of(rules).dequantize_strategy(cfg.quant, dense_fits)
                if quantized else None)
    if not asked:
        return _plan(cfg, spec, rules, capacity)
    if strategy == "once" and asked[-1].entries:
        entries = list(asked[-1].entries)
    else:
        entries = _plan(with_dequantize(cfg, strategy), spec, rules, capacity,
                        **_judge_quant(cfg))
    first = entries[0]
    if isinstance(first, ProgramMemory):
        entries[0] = dataclasses.replace(first, name=f"{first.name} (quant.dequantize auto: "
                                                     f"{strategy})")
    return entries


def _judge_quant(cfg) -> dict:
    """`_plan`'s keyword for a second judge model: the quant settings of `cfg` as written (a run
    loads it with them, its quant.dequantize auto not decided by the policy's memory)."""
    return {"judge_quant": cfg.quant} if cfg.judge.local else {}


def _plan(cfg, spec, rules, capacity: int | None,
          judge_quant=None) -> list[ProgramMemory | OutOfMemory]:
    """`plan_memory` of `cfg` with its quant settings as they are; judge_quant: the quant
    settings a second judge model (judge.local model:PATH) loads with (default cfg.quant)."""
    run = abstract_run(cfg, spec, rules)
    opt_bytes = per_device_bytes(run.state.opt_state, run.state_shardings.opt_state)
    state_bytes = per_device_bytes(run.state, run.state_shardings)
    share = judge_share(cfg, spec, rules, run, judge_quant)
    beside_step = 0
    if share is not None:  # what the local judge holds for the whole run (module docstring)
        opt_bytes += share.beside_sampler
        state_bytes += share.beside_step
        beside_step = share.beside_step
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
        rows.append(_step_memory(cfg, spec, rules, run, capacity, beside_step))
    except OutOfMemory as e:
        rows.append(e)
    return rows


def _tree_bytes(tree) -> int:
    """Bytes one device holds of ShapeDtypeStructs that carry their shardings."""
    leaves = [a for a in jax.tree_util.tree_leaves(tree) if hasattr(a, "shape")]
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               if getattr(a, "sharding", None) is not None
               else math.prod(a.shape) * a.dtype.itemsize for a in leaves)


@dataclasses.dataclass(frozen=True)
class JudgeShare:
    """What a `judge.local` judge holds on each device for the whole run (bytes per device):
    the policy's engine (its slots' cache and the rest of their state) and, for model:PATH, the
    second model's weights and its own engine."""

    local: str  # judge.local
    shared: bool  # the judge decodes in the policy's engine
    slots: int  # judge.slots (rounded up to the batch shards)
    columns: int  # cache columns of a judge slot
    cache: int  # the judge's slots' KV cache (keys and values)
    engine_slots: int  # slots of the policy's engine (rollout rows, plus the judge's if shared)
    engine_columns: int
    engine_cache: int  # the policy's engine's KV cache
    engine_state: int  # the policy's engine's slots, cache included
    judge_state: int = 0  # model:PATH: the judge's engine's slots, cache included
    weights: int = 0  # model:PATH: the second model's params
    adapter: int = 0  # adapter:DIR: the judge's adapter (a stand-in of the policy's structure)
    model: str = ""  # model:PATH: the second model's architecture, in words

    @property
    def beside_sampler(self) -> int:
        """Resident beside the policy's decode programs (whose arguments hold its engine)."""
        return self.weights + self.judge_state

    @property
    def beside_step(self) -> int:
        """Resident beside the reference pass and the GRPO step: every engine and judge."""
        return self.engine_state + self.judge_state + self.weights + self.adapter

    def describe(self) -> str:
        """The report's judge line."""
        head = (f"judge (judge.local {self.local}): {self.slots} slots x {self.columns} "
                f"columns, {_gib(self.cache)} GiB of KV cache")
        if self.shared:
            return (f"{head}, in the policy's engine of {self.engine_slots} slots x "
                    f"{self.engine_columns} columns ({_gib(self.engine_cache)} GiB of KV cache, "
                    f"{_gib(self.engine_state)} GiB of slots, held through the reference pass "
                    "and the GRPO step too)"
                    + (f"; judge adapter {_gib(self.adapter)} GiB (a stand-in of the policy's "
                       "rank and targets)" if self.adapter else ""))
        return (f"{head}, in an engine of its own ({_gib(self.judge_state)} GiB of slots); the "
                f"second model ({self.model}) {_gib(self.weights)} GiB of weights; the policy's "
                f"engine {self.engine_slots} slots x {self.engine_columns} columns "
                f"({_gib(self.engine_state)} GiB of slots); all resident beside every program")


SHRINK_JUDGE = ("shrink judge.slots, judge.max_tokens or judge.max_prompt_tokens (the judge's "
                "slots and columns) or sampling.slots (the rollout's slots)")


def judge_share(cfg, spec, rules, run: AbstractRun | None = None,
                judge_quant=None) -> JudgeShare | None:
    """The local judge's share of device memory (`JudgeShare`), None without judge.local, from
    abstract shapes: the engines `local_judge.layout` lays out for the run's rows on `rules`'
    mesh, and for model:PATH the second model (its architecture from PATH's config.json or a
    preset, `architecture`) as `load_model` holds it abstractly, quantized per judge_quant
    (default cfg.quant), as `JudgeService` loads it."""
    if not cfg.judge.local:
        return None
    from jaxrl.rewards.local_judge import judge_kind

    run = run if run is not None else abstract_run(cfg, spec, rules)
    lay = _layout(cfg, rules, run)
    kind, path = judge_kind(cfg)
    engine = _slots(cfg, spec, rules, run)
    engine_cache = _tree_bytes((engine.cache.k, engine.cache.v))
    fields = dict(local=cfg.judge.local, shared=lay.shared, slots=lay.judge_slots,
                  engine_slots=lay.policy_slots, engine_columns=lay.policy_capacity,
                  engine_cache=engine_cache, engine_state=_tree_bytes(engine))
    if lay.shared:
        return JudgeShare(columns=lay.policy_capacity,
                          cache=engine_cache * lay.judge_slots // lay.policy_slots,
                          adapter=_tree_bytes(run.lora) if kind == "adapter" else 0, **fields)
    judge_spec = architecture(path)
    params = load_model(judge_spec, dtype=cfg.model.dtype,
                        quant=judge_quant if judge_quant is not None else cfg.quant,
                        numerics=run.numerics, rules=rules, weights="abstract").params
    state = abstract_slots(params, judge_spec, lay.judge_slots, lay.judge_capacity, rules,
                           numerics=run.numerics)
    return JudgeShare(columns=lay.judge_capacity, cache=_tree_bytes((state.cache.k, state.cache.v)),
                      judge_state=_tree_bytes(state), weights=_tree_bytes(params),
                      model=f"{judge_spec.family}, {judge_spec.num_layers} layers, "
                            f"{judge_spec.hidden_size} hidden", **fields)


def with_dequantize(cfg, strategy: str):
    """cfg with quant.dequantize set to `strategy`."""
    return dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, dequantize=strategy))


@dataclasses.dataclass(frozen=True)
class DenseFit:
    """Whether a run fits its devices' memory with its quantized kernels dequantized once: its
    memory plan (`plan_memory`) with quant.dequantize once, per device."""

    fits: bool | None  # None: the device's memory is unknown
    weights: int  # bytes of the params with dense kernels
    need: int | None  # the plan's need (None: not planned: the weights alone do not fit)
    capacity: int | None  # the device's memory
    source: str  # where `capacity` comes from
    entries: tuple = dataclasses.field(default=(), repr=False)  # the plan's rows
    note: str = ""

    def describe(self) -> str:
        """One line: the figures and the verdict."""
        where = f"{_gib(self.capacity)} GiB" if self.capacity is not None else "unknown"
        where += f" ({self.source})" if self.source else ""
        if self.fits is None and self.capacity is not None:
            text = f"dense weights {_gib(self.weights)} GiB of {where}: not planned, NF4 kept"
        elif self.capacity is None:
            text = f"dense weights {_gib(self.weights)} GiB; device memory {where}: NF4 kept"
        elif self.need is None:
            text = (f"dense weights alone {_gib(self.weights)} GiB per device, of {where}: "
                    "do not fit, NF4 kept")
        else:
            text = (f"with dense kernels the run needs {_gib(self.need)} GiB per device (dense "
                    f"weights {_gib(self.weights)} GiB) of {where}: "
                    f"{'fits' if self.fits else 'does not fit, NF4 kept'}")
        return text + (f"; {self.note}" if self.note else "")


def dense_fit(cfg, spec, rules: MeshRules | None = None,
              memory: tuple[int | None, str] | None = None) -> DenseFit:
    """Whether `cfg` fits its devices' memory with quant.dequantize once, by its memory plan on
    `rules`' mesh (None: one device, the first). memory: (bytes per device, where that figure
    comes from); default `jaxrl.devices.device_memory` of the mesh's devices (the allocator's
    limit a device reports, else the chip's known memory, else unknown). When the dense weights
    alone exceed it nothing is compiled; a plan that fails to build leaves the answer unknown
    (the note says why). With several processes every process calls this, and the run fits
    only where every process's devices fit."""
    if rules is None:
        rules = MeshRules(make_mesh(MeshConfig(), jax.devices()[:1]))
    capacity, source = memory if memory is not None else device_memory(
        list(rules.mesh.devices.flat))
    dense = with_dequantize(cfg, "once")
    run = abstract_run(dense, spec, rules)
    weights = per_device_bytes(run.params,
                               jax.tree_util.tree_map(lambda a: a.sharding, run.params))
    need, entries, note = None, (), ""
    if capacity is None:
        fits = None
    elif weights > capacity:
        fits = False
    else:
        try:
            entries = tuple(_plan(dense, spec, rules, capacity, **_judge_quant(cfg)))
        except Exception as e:  # noqa: BLE001  (no plan: the memory question stays open)
            fits, note = None, f"the plan with dense kernels failed: {type(e).__name__}: {e}"
        else:
            rows = [e for e in entries if isinstance(e, ProgramMemory)]
            need = max((r.need for r in rows), default=0)
            fits = len(rows) == len(entries) and need <= capacity
    # every process asks the others (host_max gathers), so that all take one layout
    if jax.process_count() > 1 and distributed.host_max(0 if fits else 1) and fits:
        fits, note = False, "another process's devices do not fit"
    return DenseFit(fits, weights, need, capacity, source, entries, note)


def host_layout(cfg, rules) -> str:
    """How the step's rows fall to the hosts of `rules`' devices; ConfigError when a host
    cannot feed its rows (jaxrl/distributed.py)."""
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
           source: str = "", judge: JudgeShare | None = None) -> tuple[str, bool]:
    """The table `jaxrl plan` prints, and whether the run fits; `source` says where the
    capacity comes from; `judge`: a local judge's share, a line of its own (and where the run
    does not fit, what of the judge's to shrink)."""
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
    if judge is not None:
        lines.append(judge.describe())
        if not fits:
            failed.append(f"DOES NOT FIT with the local judge: {SHRINK_JUDGE}")
    return "\n".join(lines + failed), fits

"""The decode program as lowered and compiled: what one layer of a decode step and one chunk are
built of, the bytes a decode step must move, and the decode chunk timed at a set cache fill.

Cases. A `DecodeCase` names what `generate` (jaxrl/sampling/programs.py) is lowered for: a model
spec, a numerics value (`jaxrl.backends.numerics`), S slots of C cache columns, NF4 or dense
weights, a LoRA rank and N steps per chunk. `abstract_inputs` gives its arguments as
ShapeDtypeStructs in the layout `jaxrl.hf.loader.load_model` gives a run; no weights are made.

Targets (`lower`):
  cpu       the host's CPU: jax.jit's lowering, compiled
  gpu       the local GPU, on a machine that has one: lowered and compiled there
  cuda      CUDA from any host, no GPU needed: `jax.export` for platform cuda, StableHLO only.
            Pallas GPU kernels lower to custom calls (Triton's, Mosaic GPU's) that export's
            safety check is told to allow (`GPU_KERNEL_TARGETS`).
  tpu:NAME  the compile-only devices of the TPU slice NAME, e.g. tpu:v5e:1x1 (libtpu, as for
            `jaxrl plan --topology`), on a mesh over them, compiled

Counts (`count`) read the StableHLO, following each `func.call` into the function it calls,
every time it is called:
  layer   one pass of the layer loop's body, that is one layer of one decode step; the layer loop
          is the innermost while loop holding a dot_general whose predicate compares a counter
          with the model's layer count. Its dot_generals, custom calls by target, while loops,
          conditionals, and every op by name.
  chunk   the whole program: conditionals (stablehlo.case, stablehlo.if); while loops, each
          counted (its predicate compares a counter with a constant: the trip count) or
          data-dependent (any other predicate, which the device must evaluate before each
          trip; XLA:GPU copies it to the host); host transfers (send, recv, infeed, outfeed,
          custom calls to host callbacks, placements in host memory); custom calls by target
          and dot_generals. Chunk counts are of the program's text: each loop's body once.
Where the target compiles, the compiled HLO is read as well (`compiled`): the layer loop's body
(the innermost while loop of the layer count's trip count that holds a dot) as the
instructions it launches, its fusions by kind, custom calls by target and dots (a fusion
holding a dot, a library matmul call or a GPU kernel counts as one); the program's
conditionals, loops with and without a known trip count, and host transfers. XLA may unroll a
short loop, and then finds no layer loop.

Bytes (`step_bytes`): what a decode step must move whatever program runs it: the weights as
stored (NF4 codes and scales, or dense kernels; the embedding only when it is the tied LM
head, else the fed rows, left out), the adapter in the compute dtype, the filled cache columns
read (slots x filled columns x layers x 2 x KV heads x head dim x the cache dtype's bytes) and
the step's own column written. `jaxrl.bench.limits.decode_cost` counts what today's XLA
attention reads instead: every column of the capacity.

Forms (`decode_forms`): the ways to run the decode program that `jaxrl bench decode` compares:
block and split (the XLA NF4 forms over XLA attention, the chunk stopping early), kernels (the
Pallas NF4 and attention kernels and the fixed chunk, where this tree's numerics has them) and
dense (the platform's numerics over dense kernels).

Timing (`time_forms`): each (slots, capacity) case's slots are set to hold `filled` columns
(zeros: no prefill) and every slot live; each form's `generate` is compiled, then the forms take
turns, each call starting from the same fill. `check_report` gathers tools/accelerator_check.sh's
figures into one JSON value and Markdown tables.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.backends.numerics import Numerics, numerics_for
from jaxrl.devices import GIB, published_peaks
from jaxrl.model.families import ModelSpec

# custom-call targets of Pallas GPU kernels, allowed past jax.export's safety check
GPU_KERNEL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu",
                      "mosaic_gpu_v2")
HOST_OPS = ("stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed")
_DOTS = ("stablehlo.dot_general", "stablehlo.dot")
_CONDITIONALS = ("stablehlo.case", "stablehlo.if")
# compiled custom calls that are matrix products (cuBLAS, cuBLASLt, oneDNN)
_LIBRARY_MATMULS = ("gemm", "matmul", "cublas")
QUANTS = ("nf4", "dense")


# -- cases ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """What `generate` is lowered for (module docstring)."""

    spec: ModelSpec
    numerics: Numerics
    slots: int
    capacity: int
    quant: str = "nf4"  # QUANTS: NF4 kernels kept packed (per_layer), or dense kernels
    lora_rank: int = 16
    steps: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.quant not in QUANTS:
            raise ValueError(f"quant {self.quant!r} is not one of {QUANTS}")

    def describe(self) -> dict:
        return {"slots": self.slots, "capacity": self.capacity, "quant": self.quant,
                "lora_rank": self.lora_rank, "steps": self.steps, "dtype": self.dtype,
                "layers": self.spec.num_layers, "numerics": numerics_fields(self.numerics)}


def numerics_fields(numerics: Numerics) -> dict:
    """The numerics value's fields as plain values (tuples as lists)."""
    return {f.name: (list(v) if isinstance(v := getattr(numerics, f.name), tuple) else v)
            for f in dataclasses.fields(numerics)}


def quant_config(quant: str):
    """The `quant` config group a case's weights are loaded with: NF4 kept packed, or None."""
    from jaxrl.config import QuantConfig

    return QuantConfig(dequantize="per_layer") if quant == "nf4" else None


def _features(slots: int):
    """The static sampling features of `slots` rows under default decoding, where `generate`
    takes them; None where it does not."""
    from jaxrl.sampling import programs

    if "features" not in inspect.signature(programs.generate.fun).parameters:
        return None
    from jaxrl.sampling.sampling_fns import Decoding, Features

    return Features.of([Decoding()] * slots)


def _static(case: DecodeCase, rules=None) -> dict:
    static = {"spec": case.spec, "eos_ids": case.spec.eos_token_ids or (0,),
              "steps": case.steps, "shardings": rules, "numerics": case.numerics}
    features = _features(case.slots)
    return static if features is None else {**static, "features": features}


def abstract_inputs(case: DecodeCase, rules=None):
    """(slots, params, lora) of `case` as ShapeDtypeStructs, laid out on `rules`' mesh when
    given (then each carries its sharding)."""
    from jaxrl.hf.loader import load_model
    from jaxrl.lora.lora import init_lora
    from jaxrl.sampling.programs import abstract_slots, init_slots
    from jaxrl.sharding import abstract, lora_shardings

    params = load_model(case.spec, dtype=case.dtype, quant=quant_config(case.quant),
                        numerics=case.numerics, rules=rules, weights="abstract").params
    lora = jax.eval_shape(lambda key: init_lora(case.spec, key, rank=case.lora_rank,
                                                alpha=2.0 * case.lora_rank),
                          jax.random.PRNGKey(0))
    if rules is None:
        slots = jax.eval_shape(functools.partial(
            init_slots, spec=case.spec, slots=case.slots, capacity=case.capacity,
            numerics=case.numerics), params)
        return slots, params, lora
    lora = abstract(lora, lora_shardings(rules, lora, case.spec))
    slots = abstract_slots(params, case.spec, case.slots, case.capacity, rules,
                           numerics=case.numerics)
    return slots, params, lora


# -- lowering ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Lowering:
    """One case lowered for one target: its StableHLO text and, where the target compiles, the
    compiled HLO text."""

    target: str
    stablehlo: str
    hlo: str | None
    seconds: float


def target_platform(target: str) -> str:
    """The numerics platform of a target (cpu, gpu or tpu)."""
    if target == "cuda":
        return "gpu"
    if target.startswith("tpu:"):
        return "tpu"
    if target in ("cpu", "gpu"):
        return target
    raise ValueError(f"target {target!r} is not cpu, gpu, cuda or tpu:NAME (e.g. tpu:v5e:1x1)")


def lower(case: DecodeCase, target: str = "cpu", compile: bool = True) -> Lowering:
    """`generate` of `case` lowered for `target` (module docstring), compiled where the target
    compiles and `compile` asks."""
    from jaxrl.sampling.programs import generate

    platform = target_platform(target)
    start = time.perf_counter()
    if target == "cuda":
        slots, params, lora = abstract_inputs(case)
        checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in GPU_KERNEL_TARGETS]
        exported = jax.export.export(generate.jitted(case.numerics), platforms=["cuda"],
                                     disabled_checks=checks)(slots, params, lora,
                                                             **_static(case))
        return Lowering(target, exported.mlir_module(), None, time.perf_counter() - start)
    rules = None
    if platform == "tpu":
        from jaxrl.config import MeshConfig
        from jaxrl.planner import topology_devices
        from jaxrl.sharding import MeshRules, make_mesh

        rules = MeshRules(make_mesh(MeshConfig(), topology_devices(target.split(":", 1)[1])))
    elif jax.default_backend() != platform:
        raise RuntimeError(f"target {target} needs jax's default backend to be {platform}; it "
                           f"is {jax.default_backend()} (for CUDA from this host: cuda)")
    slots, params, lora = abstract_inputs(case, rules)
    lowered = generate.lower(slots, params, lora, **_static(case, rules))
    hlo = lowered.compile().as_text() if compile else None
    return Lowering(target, lowered.as_text(), hlo, time.perf_counter() - start)


# -- counts from StableHLO ----------------------------------------------------------------------
def _ir():
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    return mlir, ir


def _attr(op, name: str) -> str | None:
    attrs = op.operation.attributes
    return str(attrs[name]) if name in attrs else None


def _symbol(op, name: str) -> str | None:
    text = _attr(op, name)
    return None if text is None else text.strip('@"')


def _ops(op):
    """The ops directly inside op's regions."""
    for region in op.operation.regions:
        for block in region.blocks:
            yield from block.operations


def _constant(value) -> int | None:
    """The integer a value holds when a stablehlo.constant defines it, else None."""
    owner = value.owner
    name = getattr(owner, "name", None)
    if name != "stablehlo.constant":
        return None
    m = re.match(r"dense<(-?\d+)>", _attr(owner, "value") or "")
    return int(m.group(1)) if m else None


def _is_argument(value) -> bool:
    return isinstance(value, _ir()[1].BlockArgument)


def loop_trip(while_op) -> int | None:
    """A stablehlo.while's trip count when its predicate is a counter (a loop-carried value)
    compared below a constant, else None (a data-dependent predicate)."""
    block = while_op.operation.regions[0].blocks[0]
    ret = list(block.operations)[-1]
    pred = ret.operands[0].owner
    if getattr(pred, "name", None) != "stablehlo.compare":
        return None
    a, b = pred.operands[0], pred.operands[1]
    direction = _attr(pred, "comparison_direction") or ""
    if "LT" in direction and _is_argument(a):
        return _constant(b)
    if "GT" in direction and _is_argument(b):
        return _constant(a)
    return None


class _Walk:
    """Op counts of a StableHLO module, `func.call`s followed (module docstring)."""

    def __init__(self, text: str):
        mlir, ir = _ir()
        self._context = mlir.make_ir_context()
        with self._context:
            self.module = ir.Module.parse(text)
        self.funcs = {_symbol(f, "sym_name"): f for f in self.module.body.operations
                      if f.operation.name == "func.func"}
        self.main = self.funcs.get("main") or next(iter(self.funcs.values()))

    def visit(self, op, fn, depth: int = 0, stack=()):
        """fn(op, depth) for every op inside `op` (calls followed, loops counted as loops:
        depth is the number of while loops around)."""
        for inner in _ops(op):
            name = inner.operation.name
            fn(inner, depth)
            if name == "func.call":
                callee = _symbol(inner, "callee")
                if callee in self.funcs and callee not in stack:
                    self.visit(self.funcs[callee], fn, depth, (*stack, callee))
                continue
            self.visit(inner, fn, depth + (name == "stablehlo.while"), stack)

    def tally(self, op) -> dict:
        """Counts of every op inside `op`: by name, dots, custom calls by target, loops,
        conditionals, host transfers."""
        names, targets = collections.Counter(), collections.Counter()
        loops = []

        def fn(inner, depth):
            name = inner.operation.name
            if name in ("func.call", "func.return", "stablehlo.return"):
                return
            names[name] += 1
            if name == "stablehlo.custom_call":
                targets[_symbol(inner, "call_target_name") or "?"] += 1
            if name == "stablehlo.while":
                loops.append(loop_trip(inner))

        self.visit(op, fn)
        host = {n.split(".")[-1]: names[n] for n in HOST_OPS if names[n]}
        for target, n in targets.items():
            if "callback" in target:
                host[target] = host.get(target, 0) + n
        placed = self._host_placements(op)
        if placed:
            host["host memory placements"] = placed
        return {"ops": sum(names.values()), "dots": sum(names[d] for d in _DOTS),
                "custom_calls": dict(targets),
                "conditionals": sum(names[c] for c in _CONDITIONALS),
                "while_loops": {"counted": sum(t is not None for t in loops),
                                "data_dependent": sum(t is None for t in loops),
                                "trip_counts": [t for t in loops]},
                "host_transfers": host, "by_op": dict(names.most_common())}

    def _host_placements(self, op) -> int:
        found = []

        def fn(inner, depth):
            if (inner.operation.name == "stablehlo.custom_call"
                    and _symbol(inner, "call_target_name") == "annotate_device_placement"
                    and "host" in str(inner.operation.attributes)):
                found.append(inner)

        self.visit(op, fn)
        return len(found)

    def layer_loop(self, layers: int):
        """The layer loop (module docstring), or None."""
        candidates = []

        def fn(inner, depth):
            if inner.operation.name == "stablehlo.while" and loop_trip(inner) == layers:
                candidates.append(inner)

        self.visit(self.main, fn)
        holding = [w for w in candidates if self.tally(w)["dots"]]
        innermost = [w for w in holding if not any(
            o.operation != w.operation and self._contains(w, o) for o in holding)]
        return innermost[0] if innermost else None

    def _contains(self, outer, inner) -> bool:
        found = []
        self.visit(outer, lambda op, depth: found.append(op.operation == inner.operation)
                   if op.operation.name == "stablehlo.while" else None)
        return any(found)


def count(stablehlo: str, layers: int, hlo: str | None = None) -> dict:
    """The counts of a lowered decode program (module docstring): "layer" (None when no layer
    loop is found), "chunk", and "compiled" from the compiled HLO text `hlo` (None without)."""
    walk = _Walk(stablehlo)
    with walk._context:
        loop = walk.layer_loop(layers)
        layer = None
        if loop is not None:
            body = _Region(loop.operation.regions[1])
            layer = {"trip_count": layers, **walk.tally(body)}
        chunk = walk.tally(walk.main)
    return {"layer": layer, "chunk": chunk,
            "compiled": None if hlo is None else count_compiled(hlo, layers)}


class _Region:
    """A region seen as an op with that one region (for `_Walk.visit`)."""

    def __init__(self, region):
        self.operation = self
        self.regions = [region]


# -- counts from compiled HLO -------------------------------------------------------------------
def _matmul_call(attrs: str) -> bool:
    """Whether a compiled custom call is a matrix product: a library matmul or a GPU kernel."""
    m = re.search(r'custom_call_target="([^"]*)"', attrs)
    target = m.group(1).lower() if m else ""
    return any(k in target for k in _LIBRARY_MATMULS) or target in GPU_KERNEL_TARGETS


def count_compiled(hlo: str, layers: int) -> dict:
    """Counts of a compiled program's HLO text (module docstring)."""
    from jaxrl.hlo import _FREE, parse, trip_count

    comps, entry = parse(hlo)

    def holds_dot(comp_name: str, seen=()) -> bool:
        for i in comps[comp_name].instrs:
            if i.opcode in ("dot", "convolution") or (
                    i.opcode == "custom-call" and _matmul_call(i.attrs)):
                return True
            for key in ("calls", "to_apply", "body"):
                callee = i.attr(key)
                if callee in comps and callee not in seen and holds_dot(callee, (*seen, callee)):
                    return True
        return False

    def walk(comp_name: str, fn, depth: int = 0, seen=()):
        """fn(instr, depth) over the instructions a computation launches, loops and calls
        followed (not into fusions)."""
        for i in comps[comp_name].instrs:
            fn(i, depth)
            subs = []
            if i.opcode == "while":
                subs = [(i.attr("body"), depth + 1), (i.attr("condition"), depth + 1)]
            elif i.opcode in ("call", "async-start"):
                subs = [(i.attr("to_apply") or i.attr("calls"), depth)]
            elif i.opcode == "conditional":
                names = re.findall(r"%?([\w.\-]+)", i.attrs.split("branch_computations=")[-1]
                                   .split("}")[0]) if "branch_computations" in i.attrs else [
                    i.attr("true_computation"), i.attr("false_computation")]
                subs = [(n, depth) for n in names if n in comps]
            for sub, d in subs:
                if sub in comps and sub not in seen:
                    walk(sub, fn, d, (*seen, sub))

    def tally(comp_name: str) -> dict:
        opcodes, kinds, targets = collections.Counter(), collections.Counter(), \
            collections.Counter()
        loops = []
        dots = 0

        def fn(i, depth):
            nonlocal dots
            if i.opcode in _FREE:
                return
            opcodes[i.opcode] += 1
            if i.opcode == "fusion":
                kinds[i.attr("kind") or "?"] += 1
                if holds_dot(i.attr("calls")):
                    dots += 1
            elif i.opcode in ("dot", "convolution"):
                dots += 1
            if i.opcode == "custom-call":
                m = re.search(r'custom_call_target="([^"]*)"', i.attrs)
                targets[m.group(1) if m else "?"] += 1
                dots += _matmul_call(i.attrs)
            if i.opcode == "while":
                loops.append(trip_count(i, comps))

        walk(comp_name, fn)
        host = {k: opcodes[k] for k in ("send", "recv", "infeed", "outfeed") if opcodes[k]}
        for target, n in targets.items():
            if "callback" in target:
                host[target] = n
        control = {"while", "conditional", "call"}
        return {"launches": sum(n for k, n in opcodes.items() if k not in control),
                "fusions": opcodes["fusion"], "fusion_kinds": dict(kinds), "dots": dots,
                "custom_calls": dict(targets), "conditionals": opcodes["conditional"],
                "while_loops": {"counted": sum(t is not None for t in loops),
                                "uncounted": sum(t is None for t in loops),
                                "trip_counts": loops},
                "host_transfers": host, "by_opcode": dict(opcodes.most_common())}

    loops = []
    walk(entry, lambda i, depth: loops.append(i) if i.opcode == "while" else None)
    bodies = [i.attr("body") for i in loops
              if trip_count(i, comps) == layers and holds_dot(i.attr("body"))]

    def inside(outer: str, inner: str) -> bool:
        found = []
        walk(outer, lambda i, depth: found.append(i.attr("body") == inner)
             if i.opcode == "while" else None)
        return any(found)

    innermost = [b for b in bodies if not any(o != b and inside(b, o) for o in bodies)]
    layer = {"trip_count": layers, **tally(innermost[0])} if innermost else None
    return {"layer": layer, "chunk": tally(entry)}


# -- structure of cases over targets ------------------------------------------------------------
def structure(case: DecodeCase, target: str = "cpu") -> dict:
    """`count` of `case` lowered for `target`, with the case, the target and the seconds the
    lowering (and compile) took."""
    lowering = lower(case, target)
    return {"target": target, "case": case.describe(), "seconds": round(lowering.seconds, 2),
            **count(lowering.stablehlo, case.spec.num_layers, lowering.hlo)}


def structures(spec: ModelSpec, targets, *, slots: int, capacity: int, quant: str = "nf4",
               lora_rank: int = 16, steps: int = 16, numerics: Numerics | None = None,
               log=lambda message: None) -> dict:
    """{target: `structure`} of each target, each with `numerics` (default: the numerics
    its platform takes, `numerics_for`); a target that fails has {"error": why}."""
    out = {}
    for target in targets:
        try:
            num = numerics or numerics_for(target_platform(target))
            case = DecodeCase(spec, num, slots, capacity, quant, lora_rank, steps)
            out[target] = structure(case, target)
        except Exception as e:  # noqa: BLE001  (one target's failure is a result)
            out[target] = {"target": target, "error": f"{type(e).__name__}: {e}"}
        log(summary_line(out[target]))
    return out


def summary_line(result: dict) -> str:
    """One line of a `structure` result."""
    if "error" in result:
        return f"{result['target']}: FAILED {result['error'][:300]}"
    layer, chunk = result["layer"] or {}, result["chunk"]
    compiled = (result.get("compiled") or {}).get("layer") or {}
    text = (f"{result['target']}: per layer {layer.get('dots', '?')} dots, custom calls "
            f"{layer.get('custom_calls', {})}, {layer.get('ops', '?')} ops; per chunk "
            f"{chunk['conditionals']} conditionals, while loops {chunk['while_loops']['counted']}"
            f" counted / {chunk['while_loops']['data_dependent']} data-dependent, host "
            f"transfers {chunk['host_transfers'] or 0}")
    if compiled:
        text += (f"; compiled layer: {compiled['launches']} launches, {compiled['fusions']} "
                 f"fusions, {compiled['dots']} dots")
    return text


# -- bytes a decode step must move ---------------------------------------------------------------
def _leaf_bytes(tree) -> int:
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step must move (module docstring)."""

    weights: int
    adapter: int
    cache_read: int
    cache_write: int

    @property
    def total(self) -> int:
        return self.weights + self.adapter + self.cache_read + self.cache_write

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}


def step_bytes(spec: ModelSpec, params, lora, *, slots: int, filled: int,
               cache_dtype) -> StepBytes:
    """What one decode step of `slots` slots, each holding `filled` cache columns, must move
    (module docstring). params: as held (arrays or ShapeDtypeStructs, NF4 QTensors, held bits);
    lora: a `Lora` (concrete or abstract) or None."""
    weights = _leaf_bytes(params)
    if not spec.tie_word_embeddings:
        weights -= _leaf_bytes(params["embed_tokens"])
    compute = jnp.dtype(jax.tree_util.tree_leaves(params["embed_tokens"])[0].dtype)
    if compute == jnp.uint16:  # a bfloat16 table held as its bits
        compute = jnp.dtype(jnp.bfloat16)
    adapter = 0 if lora is None else sum(
        math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(lora.weights)
    ) * compute.itemsize
    column = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * jnp.dtype(
        cache_dtype).itemsize
    return StepBytes(weights=weights, adapter=adapter, cache_read=slots * filled * column,
                     cache_write=slots * column)


def bandwidth_share(nbytes: float, seconds: float, device_kind: str) -> float | None:
    """Achieved bandwidth (nbytes / seconds) as a share of the device's published peak
    (`jaxrl.devices.published_peaks`, by device_kind), None for a device without one."""
    peaks = published_peaks(device_kind)
    return None if peaks is None else nbytes / seconds / peaks.bandwidth


# -- the forms compared --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Form:
    """A way to run the decode program: its numerics and whether its weights are NF4 or
    dense."""

    name: str
    numerics: Numerics
    quant: str


# A form's numerics fields (those the Numerics of this tree has): the XLA forms of the NF4
# product over XLA attention with the early-stopping chunk, and the Pallas kernels; values a
# Numerics rejects leave the form out.
FORM_FIELDS = {
    "block": ({"nf4_decode": "block", "attention": "xla", "fixed_chunk": False},),
    "split": ({"nf4_decode": "split", "attention": "xla", "fixed_chunk": False},),
    "kernels": ({"nf4_decode": "kernel"},
                {"attention": "pallas_gpu"}, {"fixed_chunk": True}),
}
FORMS = ("block", "split", "kernels", "dense")


def _replace(numerics: Numerics, fields: dict) -> Numerics | None:
    known = {f.name for f in dataclasses.fields(numerics)}
    fields = {k: v for k, v in fields.items() if k in known}
    if not fields:
        return None
    try:
        return dataclasses.replace(numerics, **fields)
    except (ValueError, TypeError):
        return None


def decode_forms(base: Numerics, names=FORMS, overrides: dict | None = None,
                 interpret: bool | None = None) -> list[Form]:
    """The forms `names` over the platform's numerics `base`, each with `overrides` applied
    last: "dense" is `base` with dense weights; an NF4 form sets its FORM_FIELDS (every group
    of them this tree's Numerics accepts; a form none of whose groups it accepts is left out).
    interpret: the Pallas kernels in interpret mode (default: where jax's backend is the
    CPU)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    out = []
    for name in names:
        if name not in FORMS:
            raise ValueError(f"form {name!r} is not one of {FORMS}")
        numerics, quant = base, "dense" if name == "dense" else "nf4"
        if name != "dense":
            applied = 0
            for group in FORM_FIELDS[name]:
                changed = _replace(numerics, group)
                if changed is not None:
                    numerics, applied = changed, applied + 1
            if not applied:
                continue
            if name == "kernels" and interpret:
                numerics = _replace(numerics, {"interpret": True}) or numerics
        if overrides:
            numerics = dataclasses.replace(numerics, **overrides)
        out.append(Form(name, numerics, quant))
    return out


# -- timing ----------------------------------------------------------------------------------------
def _filled_state(spec, params, numerics, slots: int, capacity: int, filled: int, seed: int):
    """Slots each holding `filled` columns of zeros, live, with a budget past any chunk, random
    last tokens and keys, default decoding."""
    from jaxrl.sampling.programs import init_slots

    state = init_slots(params, spec=spec, slots=slots, capacity=capacity, numerics=numerics)
    rng = np.random.default_rng(seed)
    return _refill(state, filled).replace(
        last=jnp.asarray(rng.integers(0, spec.vocab_size, slots), jnp.int32),
        keys=jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(
            jnp.arange(slots)),
        budget=jnp.full((slots,), 1 << 30, jnp.int32))


def _refill(state, filled: int):
    """state with every slot back at `filled` columns, live, nothing generated."""
    s = state.last.shape[0]
    return state.replace(cache=state.cache.replace(index=jnp.full((s,), filled, jnp.int32)),
                         live=jnp.ones((s,), bool), count=jnp.zeros((s,), jnp.int32))


def memory_needed(spec: ModelSpec, params_bytes: int, slots: int, capacity: int,
                  cache_dtype) -> int:
    """Bytes a timing case holds: the params of its forms and one full cache."""
    column = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * jnp.dtype(
        cache_dtype).itemsize
    return params_bytes + slots * capacity * column


def time_forms(spec: ModelSpec, forms: list[Form], params: dict[str, Any], lora, *,
               batches, capacities, fill: float = 0.5, steps: int = 16, repeats: int = 3,
               seed: int = 0, device_memory: int | None = None, peaks=None,
               structure_counts: bool = False, trace=None, command=None,
               log=lambda message: None) -> list[dict]:
    """Rows of ms per decode step for each (batch, capacity, form): slots holding
    fill x capacity columns (module docstring), `steps` steps per call, the median of `repeats`
    calls after a warm-up one, the forms taking turns. params: by quant ("nf4", "dense"), as
    held for the forms' numerics. Each row has the bytes a step must move and their share of
    `peaks` (`jaxrl.devices.Peaks`); a case whose cache and params need more than
    `device_memory` bytes is a skipped row, a form that fails a failed one. structure_counts:
    each row also holds `count` of its program; trace(batch, capacity, form): a context
    (a profile) one more call of each form runs inside, or None; command(batch, capacity,
    form): the command that gives the row alone."""
    rows = []
    held = sum(_leaf_bytes(params[q]) for q in {f.quant for f in forms})
    dtype = jnp.dtype(jax.tree_util.tree_leaves(params[forms[0].quant]["embed_tokens"])[0].dtype)
    if dtype == jnp.uint16:
        dtype = jnp.dtype(jnp.bfloat16)
    for capacity in capacities:
        filled = max(1, min(capacity - steps - 1, round(fill * capacity)))
        for batch in batches:
            base = {"batch": batch, "capacity": capacity, "filled": filled, "steps": steps}
            row_of = {f.name: {**base, "form": f.name, "quant": f.quant,
                               "numerics": numerics_fields(f.numerics),
                               "command": None if command is None else command(
                                   batch, capacity, f.name)} for f in forms}
            cache_dtypes = {f.numerics.cache_dtype(dtype) for f in forms}
            need = max(memory_needed(spec, held, batch, capacity, c) for c in cache_dtypes)
            if device_memory is not None and need > 0.9 * device_memory:
                why = (f"skipped: needs {need / GIB:.1f} GiB (params and a full cache) of "
                       f"{device_memory / GIB:.1f} GiB")
                rows += [{**r, "status": why} for r in row_of.values()]
                log(f"batch {batch}, capacity {capacity}: {why}")
                continue
            rows += _time_case(spec, forms, params, lora, batch, capacity, filled, steps,
                               repeats, seed, peaks, structure_counts, trace, row_of, log)
    return rows


def _failure(e: Exception) -> str:
    """A row's status for an exception: out of memory is a skip, anything else a failure."""
    if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
        return f"skipped: out of memory ({str(e)[:300]})"
    return f"failed: {type(e).__name__}: {str(e)[:500]}"


def _time_case(spec, forms, params, lora, batch, capacity, filled, steps, repeats, seed, peaks,
               structure_counts, trace, row_of, log) -> list[dict]:
    """Lowers each form's program in turn, compiles them at once (threads: XLA compiles
    without the interpreter lock), then times them taking turns (`time_forms`)."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxrl.sampling.programs import generate

    states, makers, lowered, compiled = {}, {}, {}, {}
    for form in forms:
        p = params[form.quant]
        try:
            key = jnp.dtype(form.numerics.cache_dtype(
                jax.tree_util.tree_leaves(p["embed_tokens"])[0].dtype)).name
            if key not in states:
                makers[key] = functools.partial(_filled_state, spec, p, form.numerics, batch,
                                                capacity, filled, seed)
                states[key] = makers[key]()
            case = DecodeCase(spec, form.numerics, batch, capacity, form.quant, steps=steps)
            start = time.perf_counter()
            lowered[form.name] = (generate.lower(states[key], p, lora, **_static(case)), key,
                                  time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001  (a form that fails is a result)
            row_of[form.name]["status"] = _failure(e)
            log(f"batch {batch}, capacity {capacity}, {form.name}: {row_of[form.name]['status']}")

    def build(name):
        start = time.perf_counter()
        return lowered[name][0].compile(), time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=max(1, len(lowered))) as pool:
        futures = {name: pool.submit(build, name) for name in lowered}
    for name, future in futures.items():
        row = row_of[name]
        try:
            program, seconds = future.result()
            compiled[name] = (program, lowered[name][1])
            row["compile_s"] = lowered[name][2] + seconds
            if structure_counts:
                row["structure"] = count(lowered[name][0].as_text(), spec.num_layers,
                                         program.as_text())
        except Exception as e:  # noqa: BLE001
            row["status"] = _failure(e)
            log(f"batch {batch}, capacity {capacity}, {name}: {row['status']}")
    runs = {name: [] for name in compiled}

    def call(name):
        program, key = compiled[name]
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(states[key])):
            states[key] = makers[key]()  # a failed call consumed the donated state
        states[key] = jax.block_until_ready(_refill(states[key], filled))
        start = time.perf_counter()
        states[key], chunk = program(states[key], params[row_of[name]["quant"]], lora)
        jax.block_until_ready(chunk)
        return time.perf_counter() - start

    for i in range(repeats + 1):
        for name in list(runs):
            try:
                seconds = call(name)
            except Exception as e:  # noqa: BLE001
                row_of[name]["status"] = _failure(e)
                del runs[name]
                continue
            if i:
                runs[name].append(seconds)
    if trace is not None:
        for name in runs:
            with trace(batch, capacity, name) as directory:
                call(name)
            row_of[name]["profile"] = trace_summary(directory, steps, spec.num_layers)
    out = []
    for form in forms:
        row = row_of[form.name]
        if runs.get(form.name):
            seconds = statistics.median(runs[form.name]) / steps
            key = compiled[form.name][1]
            moved = step_bytes(spec, params[form.quant], lora, slots=batch, filled=filled,
                               cache_dtype=key)
            bandwidth = moved.total / seconds
            row.update(status="ok", step_ms=1e3 * seconds,
                       runs_ms=[1e3 * s / steps for s in runs[form.name]],
                       tok_s=batch / seconds, bytes=moved.as_dict(), bandwidth=bandwidth,
                       bandwidth_share=None if peaks is None else bandwidth / peaks.bandwidth)
            log(f"batch {batch}, capacity {capacity}, {form.name}: {1e3 * seconds:.3f} ms/step")
        out.append(row)
    return out


# -- profiles ------------------------------------------------------------------------------------
_CONTROL = ("while", "conditional", "cond", "call")


def trace_summary(directory, steps: int, layers: int) -> dict:
    """Of the newest trace under `directory` (`jaxrl.bench.profile.traced`), the decode
    program's device events: how many ran per step and per layer-step, and the share of their
    span (first start to last end) in which none ran (idle)."""
    from jaxrl.bench.profile import _events

    events = []
    for event in _events(directory):
        args = event.get("args") or {}
        if event.get("ph") != "X" or "hlo_module" not in args or "hlo_op" not in args:
            continue
        if "generate" not in args["hlo_module"] or args["hlo_op"].split(".")[0] in _CONTROL:
            continue
        start = float(event.get("ts", 0.0))
        events.append((start, start + float(event.get("dur", 0.0))))
    if not events:
        return {"events": 0}
    events.sort()
    busy, (lo, hi) = 0.0, events[0]
    first, last = events[0][0], max(e for _, e in events)
    for s, e in events[1:]:
        if s > hi:
            busy, (lo, hi) = busy + hi - lo, (s, e)
        else:
            hi = max(hi, e)
    busy += hi - lo
    span = last - first
    return {"events": len(events), "per_step": len(events) / steps,
            "per_layer_step": len(events) / (steps * layers), "span_us": span,
            "busy_us": busy, "idle_share": 1 - busy / span if span > 0 else 0.0}


@contextlib.contextmanager
def traced_into(directory):
    """A profile of what runs inside into `directory`, which it yields."""
    from jaxrl.bench.profile import traced

    with traced(directory):
        yield directory


# -- the Markdown table ----------------------------------------------------------------------------
def markdown_rows(rows: list[dict], device: str, jax_version: str) -> str:
    """A Markdown table of decode rows (`time_forms`): device, jax version, the command, the
    form, batch, capacity and fill, ms per step, and the share of peak HBM bandwidth by the
    bytes a step must move."""
    lines = ["| device | jax | command | form | batch | capacity | filled | ms/step | "
             "MB moved/step | share of peak HBM BW |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ok = r.get("status") == "ok"
        share = r.get("bandwidth_share")
        ms = f"{r['step_ms']:.3f}" if ok else r.get("status", "")
        moved = f"{r['bytes']['total'] / 1e6:.1f}" if ok else "-"
        of_peak = "-" if not ok or share is None else f"{100 * share:.1f}%"
        lines.append(f"| {device} | {jax_version} | `{r.get('command') or ''}` | {r['form']} | "
                     f"{r['batch']} | {r['capacity']} | {r['filled']} | {ms} | {moved} | "
                     f"{of_peak} |")
    return "\n".join(lines)


# -- the accelerator check's report -------------------------------------------------------------
def _json_lines(path) -> list[dict]:
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_report(directory) -> tuple[dict, str]:
    """The JSON and Markdown of tools/accelerator_check.sh from what its steps wrote into
    `directory`: decode.jsonl and profile.jsonl (`jaxrl bench decode`), step.jsonl (`jaxrl
    bench step`), structure.json (tools/decode_structure.py) and commands.tsv (step name, tab,
    command). Missing files leave their parts empty."""
    import json
    from pathlib import Path

    directory = Path(directory)
    decode, profile = _json_lines(directory / "decode.jsonl"), _json_lines(
        directory / "profile.jsonl")
    step = _json_lines(directory / "step.jsonl")
    structure_path = directory / "structure.json"
    structure = json.loads(structure_path.read_text()) if structure_path.is_file() else {}
    commands = {}
    if (directory / "commands.tsv").is_file():
        for line in (directory / "commands.tsv").read_text().splitlines():
            name, _, command = line.partition("\t")
            commands[name] = command
    first = (decode or step or profile or [{}])[0]
    device = f"{first.get('devices', '?')} x {first.get('device_kind', '?')}"
    version = first.get("jax") or structure.get("jax", "?")
    report = {"device": device, "jax": version, "jaxrl": first.get("jaxrl"),
              "decode": decode, "step": step, "profile": profile, "structure": structure,
              "commands": commands}
    lines = [f"Accelerator check on {device}, jax {version} (tools/accelerator_check.sh).", "",
             "Decode steps at a set fill (random weights, LoRA; bytes a step must move: weights "
             "as stored, adapter, filled cache columns):", "",
             markdown_rows(decode, device, version)]
    if step:
        lines += ["", "| device | jax | command | rollout (s) | reference (s) | update (s) | "
                  "step (s) | first step (s) |", "| --- | --- | --- | ---: | ---: | ---: | "
                  "---: | ---: |"]
        for r in step:
            m, f = r["median_s"], r["first_step_s"]
            lines.append(f"| {device} | {version} | `{commands.get('bench_step', '')}` | "
                         f"{m['rollout']:.2f} | {m['reference']:.2f} | {m['update']:.2f} | "
                         f"{m['step']:.2f} | {f['step']:.2f} |")
    traced = [r for r in profile if r.get("profile")]
    if traced:
        lines += ["", "| device | jax | command | form | ms/step | device events per layer "
                  "and step | idle share of the call |", "| --- | --- | --- | --- | ---: | ---: "
                  "| ---: |"]
        for r in traced:
            p = r["profile"]
            ms = f"{r['step_ms']:.3f}" if r.get("status") == "ok" else r.get("status", "")
            lines.append(f"| {device} | {version} | `{r.get('command') or ''} --profile DIR` | "
                         f"{r['form']} | {ms} | {p.get('per_layer_step', 0):.1f} | "
                         f"{100 * p.get('idle_share', 0):.1f}% |")
    results = structure.get("results", {})
    if results:
        lines += ["", f"Structure of the decode program (`{commands.get('structure', '')}`), "
                  "per layer of a decode step and per chunk:", "",
                  "| target | form | dots / layer | custom calls / layer | compiled launches / "
                  "layer | data-dependent loops | conditionals | host transfers |",
                  "| --- | --- | ---: | --- | ---: | ---: | ---: | --- |"]
        for target, forms in results.items():
            for form, r in forms.items():
                if "error" in r:
                    lines.append(f"| {target} | {form} | {r['error'][:120]} | | | | | |")
                    continue
                layer, chunk = r["layer"] or {}, r["chunk"]
                launches = ((r.get("compiled") or {}).get("layer") or {}).get("launches", "-")
                calls = ", ".join(f"{k} {v}" for k, v in layer.get("custom_calls", {}).items())
                lines.append(f"| {target} | {form} | {layer.get('dots', '-')} | {calls or '-'} | "
                             f"{launches} | {chunk['while_loops']['data_dependent']} | "
                             f"{chunk['conditionals']} | {chunk['host_transfers'] or '-'} |")
    return report, "\n".join(lines) + "\n"


def write_check_report(directory) -> None:
    """`check_report` of `directory` into accelerator_check.json and accelerator_check.md
    there; prints the Markdown."""
    import json
    from pathlib import Path

    report, markdown = check_report(directory)
    Path(directory, "accelerator_check.json").write_text(json.dumps(report, indent=1,
                                                                    default=str))
    Path(directory, "accelerator_check.md").write_text(markdown)
    print(markdown)

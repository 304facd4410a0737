"""The decode program as lowered and compiled: what one layer of a decode step and one chunk are
built of.

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

The bytes a decode step must move, the forms compared and their timing:
jaxrl/bench/decode_forms.py.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import re
import time

import jax

from jaxrl.backends.numerics import Numerics
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


def static_arguments(case: DecodeCase, rules=None) -> dict:
    """`generate`'s static arguments for `case` (on the mesh `rules`, or one device)."""
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
                                                             **static_arguments(case))
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
    lowered = generate.lower(slots, params, lora, **static_arguments(case, rules))
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

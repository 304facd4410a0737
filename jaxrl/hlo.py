"""Memory traffic and collectives of a compiled XLA program, read from its optimized HLO text.

XLA's `cost_analysis()` counts the body of a while loop once, whatever its trip count, so for a
program built of loops (the decode chunk, the layer scan) its "bytes accessed" is far from what
one call moves. This module walks the optimized HLO instead: every top-level instruction of a
computation reads its operands and writes its result once (a fusion is one instruction: what it
computes inside stays on chip), and a while loop's body counts `known_trip_count` times, or the
bound of its `counter < N` condition (loops it cannot count are reported). What a fusion reads
of an operand only through a dynamic-slice / slice / gather is the slice (or the operand, if
smaller); a fusion whose root is a dynamic-update-slice of one of its operands (or a scatter
into it) updates that buffer in place and moves only the update (both as XLA's own cost model
does). Only device memory (HBM) counts: arrays the TPU compiler places on chip (layout memory
space S(1)) are free, so a copy-start that prefetches into it costs its read. Layout padding
(TPU tiles) is not counted.

Collectives (`Program.collectives`) count the bytes of their result per call. XLA:CPU has no
bfloat16 collectives: it widens them to float32 around the transfer (the operand converted up
just before, the result converted back after), so a collective array whose operand is such a
conversion chain through a narrower float type is counted, and named, in that narrower type,
the type an accelerator moves. `forbidden` says why a collective must not cross the mesh.

Used by tools/decode_traffic.py, tools/collectives.py and tests/sharding/test_collectives.py.
"""
from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True))
                    + r")\[([\d,]*)\](\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> (.*) \{$")
_INSTR = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
# no bytes move: views, tuples, control
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
         "opt-barrier", "partition-id", "replica-id", "iota", "add-dependency", "domain",
         "copy-done", "all-reduce-done", "all-gather-done", "collective-permute-done",
         "async-done", "send-done", "recv-done"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_PASS_THROUGH = {"bitcast", "copy", "convert", "bitcast-convert"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> operand number of the update
# XLA:CPU compile options for reading collectives: without its all-reduce-promotion pass, a
# bfloat16 all-reduce keeps the conversions that show what it carries (with it, the float32
# partial sums are reduced unrounded and look like a float32 all-reduce)
CPU_OPTIONS = {"xla_disable_hlo_passes": "all-reduce-promotion"}
_FLOATS = {"f8e4m3fn", "f8e5m2", "f16", "bf16", "f32", "f64"}
_CONVERSIONS = {"convert", "bitcast", "copy"}  # what XLA:CPU puts around a widened collective
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute", "ragged-all-to-all", "collective-broadcast")


def shape_bytes(text: str) -> float:
    """Bytes in device memory of every array in an HLO type ('f32[8,128]{1,0}', or a tuple
    of them). An array whose layout names a memory space S(n), n >= 1, lives on chip (the
    TPU compiler's memory-space assignment puts it there), so it moves no HBM bytes."""
    return sum(DTYPE_BYTES[d] * math.prod(int(n) for n in dims.split(",") if n)
               for d, dims, layout in _ARRAY.findall(text) if not _ON_CHIP.search(layout))


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # the result's HLO type
    opcode: str
    operands: list[str]
    args: str  # the text inside the parentheses (a constant's value, a parameter's number)
    attrs: str

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    params: dict[int, str]  # parameter number -> instruction name

    def by_name(self) -> dict[str, Instr]:
        return {i.name: i for i in self.instrs}

    @property
    def root(self) -> Instr:
        return self.instrs[-1]


def _split_operands(text: str) -> tuple[list[str], str, str]:
    """'%a, %b), attrs...' -> (operand names, the text inside the parentheses, the rest)."""
    depth, i = 1, 0
    while depth and i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    inner, rest = text[:i - 1], text[i:]
    return re.findall(r"%([\w.\-]+)", inner), inner.strip(), rest


def parse(hlo: str) -> tuple[dict[str, Computation], str]:
    """Computations of an HLO module by name, and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        line = line.strip()
        header = _HEADER.match(line)
        if header:
            current = Computation(header.group(2), [], {})
            comps[current.name] = current
            entry = current.name if header.group(1) else entry
            continue
        if current is None:
            continue
        if line == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            operands, args, rest = _split_operands(m.group(4))
            instr = Instr(m.group(1), m.group(2), m.group(3), operands, args, rest)
            if instr.opcode == "parameter":
                current.params[int(args)] = instr.name
            current.instrs.append(instr)
    return comps, entry


def trip_count(instr: Instr, comps: dict[str, Computation]) -> int | None:
    """XLA's known_trip_count, else the bound c of a condition `counter < c` (a counter from 0,
    as lax.scan and fori_loop count; the TPU compiler drops known_trip_count), else None."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
    if m:
        return int(m.group(1))
    cond = comps[instr.attr("condition")]
    root, inner = cond.root, cond.by_name()
    if root.opcode != "compare" or "direction=LT" not in root.attrs:
        return None
    bound = inner.get(root.operands[1])
    if bound is None or bound.opcode != "constant":
        return None
    return int(bound.args) if re.fullmatch(r"-?\d+", bound.args) else None


@dataclasses.dataclass
class Move:
    """Bytes one instruction moves per call of the program (trip counts applied)."""

    bytes: float
    opcode: str
    name: str
    op_name: str
    result_type: str
    times: int
    depth: int  # how many loops it sits in
    comp: str = ""  # the computation it sits in


class Program:
    """An optimized HLO module, walked for traffic and collectives."""

    def __init__(self, hlo: str):
        self.comps, self.entry = parse(hlo)
        self.uncounted_loops: list[str] = []

    def _fusion_bytes(self, instr: Instr, shapes: dict[str, str]) -> float:
        body = self.comps[instr.attr("calls")]
        inner = body.by_name()
        users: dict[str, list[Instr]] = {}
        for i in body.instrs:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        root = body.root
        while root.opcode == "bitcast":
            root = inner[root.operands[0]]
        in_place = root.operands[0] if root.opcode in _IN_PLACE else None
        total = 0.0
        for n, pname in body.params.items():
            uses = users.get(pname, [])
            if pname == in_place and len(uses) == 1:
                continue  # the buffer updated in place: only the update moves
            whole = shape_bytes(shapes.get(instr.operands[n], ""))
            sliced = self._sliced_bytes(body, pname)
            total += whole if sliced is None else min(whole, sliced)
        if in_place is not None:
            return total + shape_bytes(inner[root.operands[_IN_PLACE[root.opcode]]].type)
        return total + shape_bytes(instr.type)

    def _sliced_bytes(self, comp: Computation, name: str) -> float | None:
        """Bytes of the slices through which a fused value is read, following element-for-
        element ops (a relayout, a conversion: computed only where sliced) and nested
        fusions, or None if some use reads all of it."""
        uses = [u for u in comp.instrs if name in u.operands]
        if not uses:
            return None
        total = 0.0
        for u in uses:
            if u.opcode in _SLICING and u.operands[0] == name:
                total += shape_bytes(u.type)
                continue
            nested = self.comps[u.attr("calls")] if u.opcode == "fusion" else None
            if nested and all(i.opcode in _PASS_THROUGH | {"parameter"} for i in nested.instrs):
                inner = self._sliced_bytes(comp, u.name)  # a fused relayout: follow its result
            elif nested and u.operands.count(name) == 1:
                inner = self._sliced_bytes(nested, nested.params[u.operands.index(name)])
            elif u.opcode in _PASS_THROUGH and len(u.operands) == 1:
                inner = self._sliced_bytes(comp, u.name)
            else:
                inner = None
            if inner is None:
                return None
            total += inner
        return total

    def moves(self, comp: str | None = None, times: int = 1, depth: int = 0,
              every_branch: bool = False) -> list[Move]:
        """Every instruction's traffic, loops expanded by their trip counts; of a conditional,
        the branch that moves most (every_branch: all its branches)."""
        c = self.comps[comp or self.entry]
        shapes = {i.name: i.type for i in c.instrs}
        out = []
        for i in c.instrs:
            if i.opcode in _FREE:
                continue
            if i.opcode == "while":
                n = trip_count(i, self.comps)
                if n is None:
                    self.uncounted_loops.append(i.name)
                    n = 1
                out += self.moves(i.attr("body"), times * n, depth + 1, every_branch)
                out += self.moves(i.attr("condition"), times * n, depth + 1, every_branch)
                continue
            if i.opcode in ("call", "async-start"):
                out += self.moves(i.attr("to_apply") or i.attr("calls"), times, depth,
                                  every_branch)
                continue
            if i.opcode == "conditional":
                branches = re.findall(r"%([\w.\-]+)", i.attrs.split("branch_computations=")[-1]
                                      .split("}")[0]) or [i.attr("true_computation"),
                                                          i.attr("false_computation")]
                costs = [self.moves(b, times, depth, every_branch) for b in branches if b]
                if every_branch:
                    out += [m for ms in costs for m in ms]
                else:
                    out += max(costs, key=lambda ms: sum(m.bytes for m in ms), default=[])
                continue
            if i.opcode == "fusion":
                b = self._fusion_bytes(i, shapes)
            elif i.opcode in _IN_PLACE:
                b = 2 * shape_bytes(shapes[i.operands[_IN_PLACE[i.opcode]]])
            elif i.opcode == "copy-start":  # (destination, source, context): one copy
                b = shape_bytes(shapes.get(i.operands[0], "")) + shape_bytes(
                    " ".join(f"{d}[{n}]{lay}" for d, n, lay in _ARRAY.findall(i.type)[:1]))
            elif i.opcode in _SLICING:
                b = 2 * shape_bytes(i.type)
            else:
                b = sum(shape_bytes(shapes.get(o, "")) for o in i.operands) + shape_bytes(i.type)
            out.append(Move(b * times, i.opcode, i.name, i.op_name, i.type, times, depth, c.name))
        return out

    def collectives(self, every_branch: bool = False) -> list[Move]:
        """Collective instructions, each with the type its result carries (module docstring)
        as result_type and that result's bytes per call (trip counts applied); an async pair
        counts once, at its start. every_branch: the collectives of every branch of a
        conditional, where `moves` takes the branch that moves most."""
        kinds = tuple(COLLECTIVES) + tuple(f"{k}-start" for k in COLLECTIVES)
        out = []
        for m in self.moves(every_branch=every_branch):
            if m.opcode in kinds:
                carried = self._carried(self.comps[m.comp].by_name()[m.name], m.comp)
                out.append(dataclasses.replace(m, result_type=carried,
                                               bytes=shape_bytes(carried) * m.times))
        return out

    def _carried(self, instr: Instr, comp: str) -> str:
        """A collective's result type (of an async start's (operands, results) tuple, the
        results), each array in the narrowest float type its operand's conversion chain
        passed through, where that is narrower than the array's."""
        arrays = _ARRAY.findall(instr.type)
        if instr.opcode.endswith("-start") and instr.type.startswith("(") and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2:]
        out = []
        for n, (dtype, dims, layout) in enumerate(arrays):
            chain = self._conversions(comp, instr.operands[n]) if n < len(instr.operands) else []
            floats = [t for t in chain if t in _FLOATS]
            narrow = min(floats, key=DTYPE_BYTES.get, default=dtype)
            if dtype in _FLOATS and DTYPE_BYTES[narrow] < DTYPE_BYTES[dtype]:
                dtype = narrow
            out.append(f"{dtype}[{dims}]{layout}")
        return out[0] if len(out) == 1 else "(" + ", ".join(out) + ")"

    def _conversions(self, comp: str, name: str) -> list[str]:
        """Element types along the conversions (convert, bitcast, copy, and fusions whose
        root is one) that produce value `name` of computation `comp`, down to the first
        value that is not a conversion, that value's type included."""
        inner = self.comps[comp].by_name()
        instr, types = inner.get(name), []
        while instr is not None:
            types += [d for d, _, _ in _ARRAY.findall(instr.type)[:1]]
            if instr.opcode in _CONVERSIONS:
                instr = inner.get(instr.operands[0])
            elif instr.opcode == "fusion":
                body = self.comps[instr.attr("calls")]
                inner, instr = body.by_name(), body.root
                if instr.opcode not in _CONVERSIONS:
                    break
            else:
                break
        return types


def forbidden(result_type: str, vocab: int, kernels: set[tuple[int, ...]]) -> str | None:
    """Why a collective's result (the type it carries) must not cross the mesh, or None: a
    dequantized weight (a floating-point array shaped like a layer kernel [I, O] in `kernels`,
    or a stack of them) or full-vocabulary float32 logits (a float32 array of two dims or more
    with a dim of `vocab`)."""
    for dtype, dims in re.findall(r"\b(bf16|f16|f32)\[([\d,]*)\]", result_type):
        shape = tuple(int(d) for d in dims.split(",") if d)
        if shape in kernels or shape[1:] in kernels:
            return f"a dequantized weight {dtype}{list(shape)}"
        if dtype == "f32" and vocab in shape and len(shape) >= 2:
            return f"full-vocabulary float32 logits {dtype}{list(shape)}"
    return None

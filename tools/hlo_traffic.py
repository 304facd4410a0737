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

Used by tools/decode_traffic.py and tools/collectives.py.
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

    def moves(self, comp: str | None = None, times: int = 1, depth: int = 0) -> list[Move]:
        """Every instruction's traffic, loops expanded by their trip counts."""
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
                out += self.moves(i.attr("body"), times * n, depth + 1)
                out += self.moves(i.attr("condition"), times * n, depth + 1)
                continue
            if i.opcode in ("call", "async-start"):
                out += self.moves(i.attr("to_apply") or i.attr("calls"), times, depth)
                continue
            if i.opcode == "conditional":
                branches = re.findall(r"%([\w.\-]+)", i.attrs.split("branch_computations=")[-1]
                                      .split("}")[0]) or [i.attr("true_computation"),
                                                          i.attr("false_computation")]
                costs = [self.moves(b, times, depth) for b in branches if b]
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
            out.append(Move(b * times, i.opcode, i.name, i.op_name, i.type, times, depth))
        return out

    def collectives(self) -> list[Move]:
        """Collective instructions with the bytes of their result per call (trip counts
        applied); an async pair counts once, at its start."""
        kinds = tuple(COLLECTIVES) + tuple(f"{k}-start" for k in COLLECTIVES)
        out = []
        for m in self.moves():
            if m.opcode in kinds:
                out.append(dataclasses.replace(m, bytes=shape_bytes(_result_of_start(m)) * m.times))
        return out


def _result_of_start(m: Move) -> str:
    """The result type of a collective; an async start's tuple holds (operands, results):
    the second half."""
    if not m.opcode.endswith("-start") or not m.result_type.startswith("("):
        return m.result_type
    arrays = _ARRAY.findall(m.result_type)
    half = arrays[len(arrays) // 2:] if len(arrays) > 1 else arrays
    return " ".join(f"{d}[{s}]{layout}" for d, s, layout in half)

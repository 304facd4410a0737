"""The causal graph of the belief state.

Nodes are Signals (what was observed up front), Evidence (what a tool request revealed, quoted)
and Hypotheses (a candidate cause at a level of granularity: 0 is the coarsest). Edges:

    support, refute   Evidence -> Hypothesis
    refines           Hypothesis (level l+1) -> Hypothesis (level l)
    causal            Hypothesis -> Signal (the hypothesis would explain the signal)

Hypotheses are never deleted: backtracking marks the abandoned ones `pruned`, so the rendered
graph and the trace still show what was tried.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

NODE_KINDS = ("signal", "evidence", "hypothesis")
EDGE_KINDS = {"support": ("evidence", "hypothesis"), "refute": ("evidence", "hypothesis"),
              "refines": ("hypothesis", "hypothesis"), "causal": ("hypothesis", "signal")}
_PREFIX = {"signal": "S", "evidence": "E", "hypothesis": "H"}


class GraphError(ValueError):
    """An edit that does not fit the graph (unknown node, wrong edge kind, bad confidence)."""


@dataclasses.dataclass
class Node:
    id: str
    kind: str
    label: str
    confidence: float = 1.0
    level: int = 0
    rationale: str = ""
    status: str = "active"  # active | pruned (hypotheses abandoned by a backtrack)
    source: str = ""  # evidence: the request that revealed it, e.g. "dmesg node-12"


@dataclasses.dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    kind: str


@dataclasses.dataclass
class CausalGraph:
    nodes: dict[str, Node] = dataclasses.field(default_factory=dict)
    edges: list[Edge] = dataclasses.field(default_factory=list)

    def _add(self, kind: str, **fields: Any) -> str:
        count = sum(1 for n in self.nodes.values() if n.kind == kind)
        node_id = f"{_PREFIX[kind]}{count + 1}"
        self.nodes[node_id] = Node(id=node_id, kind=kind, **fields)
        return node_id

    def add_signal(self, label: str) -> str:
        return self._add("signal", label=label)

    def add_evidence(self, label: str, source: str, rationale: str = "") -> str:
        """An Evidence node for a quote, reusing the node of an identical quote."""
        for node in self.nodes.values():
            if node.kind == "evidence" and node.label == label:
                return node.id
        return self._add("evidence", label=label, source=source, rationale=rationale)

    def add_hypothesis(self, label: str, confidence: float, level: int, rationale: str = "",
                       parent: str | None = None) -> str:
        _check_confidence(label, confidence)
        if parent is not None:
            if self.node(parent, "hypothesis").level != level - 1:
                raise GraphError(f"a level-{level} hypothesis refines a level-{level - 1} one; "
                                 f"{parent} is level {self.nodes[parent].level}")
        elif level != 0:
            raise GraphError(f"a level-{level} hypothesis needs a parent; only level 0 has none")
        node_id = self._add("hypothesis", label=label, confidence=float(confidence),
                            level=level, rationale=rationale)
        if parent is not None:
            self.add_edge(node_id, parent, "refines")
        return node_id

    def node(self, node_id: str, kind: str | None = None) -> Node:
        if node_id not in self.nodes:
            raise GraphError(f"no node {node_id!r}; nodes: {', '.join(self.nodes) or 'none'}")
        node = self.nodes[node_id]
        if kind is not None and node.kind != kind:
            raise GraphError(f"{node_id} is a {node.kind}, not a {kind}")
        return node

    def add_edge(self, src: str, dst: str, kind: str) -> None:
        if kind not in EDGE_KINDS:
            raise GraphError(f"unknown edge kind {kind!r}; kinds: {', '.join(EDGE_KINDS)}")
        src_kind, dst_kind = EDGE_KINDS[kind]
        if (self.node(src).kind, self.node(dst).kind) != (src_kind, dst_kind):
            raise GraphError(f"a {kind} edge goes from a {src_kind} to a {dst_kind}; got "
                             f"{src} ({self.nodes[src].kind}) -> {dst} ({self.nodes[dst].kind})")
        edge = Edge(src, dst, kind)
        if edge not in self.edges:
            self.edges.append(edge)

    def set_confidence(self, node_id: str, confidence: float) -> None:
        node = self.node(node_id, "hypothesis")
        _check_confidence(node_id, confidence)
        node.confidence = float(confidence)

    def parent(self, node_id: str) -> str | None:
        return next((e.dst for e in self.edges if e.kind == "refines" and e.src == node_id), None)

    def children(self, node_id: str | None) -> list[str]:
        """Active hypotheses refining node_id; with None, the active level-0 hypotheses."""
        return [n.id for n in self.nodes.values()
                if n.kind == "hypothesis" and n.status == "active"
                and (n.level == 0 if node_id is None else self.parent(n.id) == node_id)]

    def descendants(self, node_id: str) -> list[str]:
        found, frontier = [], [node_id]
        while frontier:
            kids = [e.src for e in self.edges if e.kind == "refines" and e.dst in frontier]
            found += kids
            frontier = kids
        return found

    def support(self, node_id: str) -> int:
        """How many Evidence nodes support the hypothesis."""
        return sum(1 for e in self.edges if e.kind == "support" and e.dst == node_id)

    def prune(self, node_ids: Iterable[str]) -> None:
        for node_id in node_ids:
            self.node(node_id, "hypothesis").status = "pruned"

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [dataclasses.asdict(n) for n in self.nodes.values()],
                "edges": [dataclasses.asdict(e) for e in self.edges]}

    def describe(self) -> str:
        """The graph as prompt text: one line per active node, edges listed under it."""
        lines = []
        for node in self.nodes.values():
            if node.status != "active":
                continue
            if node.kind == "hypothesis":
                lines.append(f"{node.id} [hypothesis, level {node.level}, confidence "
                             f"{node.confidence:.2f}, support {self.support(node.id)}] "
                             f"{node.label}")
            else:
                lines.append(f"{node.id} [{node.kind}] {node.label}")
            lines += [f"  {e.kind} -> {e.dst}" for e in self.edges if e.src == node.id]
        return "\n".join(lines)


def _check_confidence(what: str, confidence: float) -> None:
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) \
            or not 0.0 <= confidence <= 1.0:
        raise GraphError(f"confidence of {what} must be a number in [0, 1]; got {confidence!r}")

"""One Graph of States investigation: the loop of agent turns and state-machine transitions.

    ingest signals -> coarse hypotheses
    repeat: plan expert calls on the focus -> experts retrieve and analyze -> grounded evidence
            into the graph -> central agent revises confidences and decides -> transition
            (stay, drill down and refine, backtrack and prune, or report)

The report is read off the graph, not written by the model: its root cause is the finest
hypothesis on the belief path (the top hypothesis at each level, coarsest first), and its
evidence is what supports the hypotheses on that path.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.agents import agents
from jaxrl.agents.agents import Limits, Session
from jaxrl.agents.chat import ChatClient
from jaxrl.agents.replies import Asker
from jaxrl.agents.roles import Roles
from jaxrl.agents.state import Budget, State, belief_path, transition
from jaxrl.envs.base import Case


@dataclasses.dataclass
class Outcome:
    report: dict[str, Any]
    graph: dict[str, Any]
    trace: list[dict[str, Any]]
    claims: int
    fabricated: int
    usage: dict[str, int]


class _Trace(list):
    """Trace events, each stamped with the investigation step it happened in."""
    step = 0

    def add(self, event: dict[str, Any]) -> None:
        self.append({"step": self.step, **event})


def _step(s: Session, state: State, trace: _Trace, claims: list[dict[str, Any]]) -> str:
    """One investigation step; returns the central agent's decision."""
    calls, planned = agents.plan(s, state)
    trace.add({"event": "plan", "calls": calls, "from_model": planned})
    found = []
    for call in calls:
        expert = s.roles.expert(call["expert"])
        seen = agents.retrieve(s, expert, call, state.steps + 1)
        trace.add({"event": "retrieve", "expert": expert.name, "outputs": seen})
        if seen:
            found += agents.analyze(s, expert, seen, state)
    claims += found
    evidence = agents.record_evidence(s, found)
    trace.add({"event": "analyze", "findings": found})
    edits = agents.update(s, state, evidence)
    trace.add({"event": "update", **edits})
    return edits["decision"]


def _report(s: Session, state: State, reason: str) -> dict[str, Any]:
    path = belief_path(s.graph)
    nodes = [s.graph.nodes[h] for h in path]
    evidence = [{"id": e.src, "relation": e.kind, "hypothesis": e.dst,
                 "quote": s.graph.nodes[e.src].label, "source": s.graph.nodes[e.src].source}
                for e in s.graph.edges if e.dst in path and e.kind in ("support", "refute")]
    return {"case": s.case.id, "method": "gos", "reason": reason,
            "root_cause": nodes[-1].label if nodes else "",
            "category": nodes[0].label if nodes else "",
            "path": [{"id": n.id, "level": n.level, "label": n.label,
                      "confidence": n.confidence, "support": s.graph.support(n.id),
                      "rationale": n.rationale} for n in nodes],
            "evidence": evidence, "steps": state.steps, "backtracks": state.backtracks,
            "depth_reached": len(nodes)}


def investigate(case: Case, client: ChatClient, roles: Roles, budget: Budget = Budget(),
                limits: Limits = Limits()) -> Outcome:
    trace = _Trace()
    asker = Asker(client, limits.max_tokens, limits.token_budget, limits.retries, trace.add)
    s = Session(case, roles, asker, budget, limits)
    hypotheses = agents.ingest(s)
    trace.add({"event": "ingest", "hypotheses": hypotheses})
    state, claims, reason = State(), [], "no_hypotheses"
    while hypotheses:
        if asker.spent:
            reason = "token_budget"
            break
        trace.step = state.steps + 1
        decision = _step(s, state, trace, claims)
        move = transition(s.graph, state.after_step(), budget, decision == "report")
        s.graph.prune(move.pruned)
        trace.add({"event": "transition", "kind": move.kind, "reason": move.reason,
                   "path": list(move.state.path), "pruned": list(move.pruned)})
        state = move.state
        if move.kind == "report":
            reason = move.reason
            break
        if move.kind == "drill_down" and not s.graph.children(state.path[-1]):
            trace.add({"event": "refine", "parent": state.path[-1],
                       "hypotheses": agents.refine(s, state.path[-1])})
    report = _report(s, state, reason)
    trace.add({"event": "report", "reason": reason, "root_cause": report["root_cause"]})
    return Outcome(report=report, graph=s.graph.to_json(), trace=list(trace),
                   claims=len(claims), fabricated=sum(not c["grounded"] for c in claims),
                   usage=dataclasses.asdict(asker.usage))

"""The central agent and the expert agents. Each turn asks the model for JSON (see schemas.py);
when a turn ends with no valid reply, its documented fallback applies:

- ingest  no coarse hypotheses: the case ends with an undetermined report
- plan    the focus hypothesis goes to the first `experts_per_step` experts, in role order (the
          symbolic state still says what to test)
- retrieve  the expert stops retrieving
- analyze   no findings from this expert call
- update    confidences stay as they are and the decision is "refine"
- refine    no finer hypotheses: the level has no candidates, so the budget rule ends the case
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.agents import schemas
from jaxrl.agents.graph import CausalGraph
from jaxrl.agents.grounding import grounded
from jaxrl.agents.replies import Asker
from jaxrl.agents.roles import Role, Roles
from jaxrl.agents.state import Budget, State, candidates, focus
from jaxrl.envs.base import Case


@dataclasses.dataclass(frozen=True)
class Limits:
    """Model-side limits of one case."""
    max_tokens: int = 256  # per reply
    token_budget: int = 4096  # completion tokens per case
    retries: int = 1  # extra attempts after an invalid reply
    max_hypotheses: int = 4  # per ingest or refine
    experts_per_step: int = 2


@dataclasses.dataclass
class Session:
    """What the agents of one case share."""
    case: Case
    roles: Roles
    asker: Asker
    budget: Budget
    limits: Limits
    graph: CausalGraph = dataclasses.field(default_factory=CausalGraph)
    observations: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def level_name(self, level: int) -> str:
        names = self.roles.levels
        return names[min(level, len(names) - 1)]


def _lines(graph: CausalGraph, ids: list[str]) -> str:
    return "\n".join(f"{h} (confidence {graph.nodes[h].confidence:.2f}, support "
                     f"{graph.support(h)}): {graph.nodes[h].label}" for h in ids) or "none"


def ingest(s: Session) -> list[str]:
    """Signals into the graph and coarse (level-0) hypotheses explaining them."""
    signal_ids = [s.graph.add_signal(text) for text in s.case.signals]
    signals = "\n".join(f"{sid}: {text}" for sid, text in zip(signal_ids, s.case.signals))
    found = s.asker.ask("central.ingest", s.roles.messages(
        s.roles.central, "ingest", context=s.case.context, signals=signals,
        max_hypotheses=s.limits.max_hypotheses),
        schemas.hypotheses(signal_ids, s.limits.max_hypotheses)) or []
    added = []
    for h in found:
        hid = s.graph.add_hypothesis(h["label"], h["confidence"], 0, h["rationale"])
        for sid in h["explains"]:
            s.graph.add_edge(hid, sid, "causal")
        added.append(hid)
    return added


def plan(s: Session, state: State) -> tuple[list[dict[str, str]], bool]:
    """Expert calls for this step, and whether they came from the model (False: fallback)."""
    ids = candidates(s.graph, state)
    experts = "\n".join(f"{e.name}: {', '.join(e.tools)}" for e in s.roles.experts)
    calls = s.asker.ask("central.plan", s.roles.messages(
        s.roles.central, "plan", context=s.case.context, graph=s.graph.describe(),
        level_name=s.level_name(state.level), candidates=_lines(s.graph, ids), experts=experts,
        max_calls=s.limits.experts_per_step),
        schemas.plan([e.name for e in s.roles.experts], ids or list(state.path),
                     s.limits.experts_per_step))
    if calls is not None:
        return calls, True
    target = focus(s.graph, state)
    label = s.graph.nodes[target].label
    return [{"expert": e.name, "hypothesis": target, "task": f"test hypothesis {target}: {label}"}
            for e in s.roles.experts[:s.limits.experts_per_step]], False


def _observe(s: Session, expert: Role, tool: str, target: str, step: int) -> dict[str, Any]:
    for seen in s.observations:
        if (seen["tool"], seen["target"]) == (tool, target):
            return seen
    obs = {"id": f"O{len(s.observations) + 1}", "tool": tool, "target": target,
           "text": s.case.request(tool, target), "expert": expert.name, "step": step}
    s.observations.append(obs)
    return obs


def retrieve(s: Session, expert: Role, call: dict[str, str], step: int) -> list[dict[str, Any]]:
    """Up to `retrieval_steps` tool requests chosen by the expert; the outputs it saw."""
    tools = "\n".join(f"{t}: {s.case.tools[t]}" for t in expert.tools)
    tools += f"\nTargets: {', '.join(f'{n} ({k})' for n, k in s.case.targets.items())}"
    hypothesis = s.graph.nodes[call["hypothesis"]]
    seen: list[dict[str, Any]] = []
    for _ in range(s.budget.retrieval_steps):
        shown = "\n".join(f"{o['tool']} {o['target']}:\n{o['text']}" for o in seen) or "nothing"
        choice = s.asker.ask(f"{expert.name}.retrieve", s.roles.messages(
            expert, "retrieve", context=s.case.context, task=call["task"],
            hypothesis=f"{hypothesis.id}: {hypothesis.label}", tools=tools, seen=shown),
            schemas.retrieve(expert.tools))
        if choice is None or choice.get("done"):
            break
        obs = _observe(s, expert, choice["tool"], choice["target"], step)
        if obs not in seen:
            seen.append(obs)
    return seen


def analyze(s: Session, expert: Role, seen: list[dict[str, Any]], state: State
            ) -> list[dict[str, Any]]:
    """The expert's findings on the outputs it saw, each marked grounded or not."""
    ids = list(state.path) + candidates(s.graph, state)
    texts = "\n".join(f"{o['id']} ({o['tool']} {o['target']}):\n{o['text']}" for o in seen)
    found = s.asker.ask(f"{expert.name}.analyze", s.roles.messages(
        expert, "analyze", hypotheses=_lines(s.graph, ids), observations=texts),
        schemas.findings(ids)) or []
    every_output = [o["text"] for o in s.observations]
    return [{**f, "expert": expert.name, "grounded": grounded(f["quote"], every_output)}
            for f in found]


def record_evidence(s: Session, found: list[dict[str, Any]]) -> list[str]:
    """Grounded findings as Evidence nodes with support / refute edges; ungrounded ones are
    kept out of the graph (they are counted as fabricated claims)."""
    lines = []
    for f in (f for f in found if f["grounded"]):
        source = next((f"{o['tool']} {o['target']}" for o in s.observations
                       if grounded(f["quote"], [o["text"]])), "")
        eid = s.graph.add_evidence(f["quote"], source, f["claim"])
        s.graph.add_edge(eid, f["hypothesis"], f["relation"])
        lines.append(f"{eid} ({f['relation']}s {f['hypothesis']}, from {source}): "
                     f"{f['quote']} -- {f['claim']}")
    return lines


def update(s: Session, state: State, evidence: list[str]) -> dict[str, Any]:
    """The central agent's confidence edits (applied) and its decision (report or refine)."""
    ids = candidates(s.graph, state)
    active = [h for h in s.graph.nodes.values()
              if h.kind == "hypothesis" and h.status == "active"]
    edits = s.asker.ask("central.update", s.roles.messages(
        s.roles.central, "update", context=s.case.context, graph=s.graph.describe(),
        evidence="\n".join(evidence) or "none", level_name=s.level_name(state.level),
        candidate_ids=", ".join(ids) or "none"),
        schemas.update([h.id for h in active]))
    if edits is None:
        return {"confidence": {}, "decision": "refine", "fallback": True}
    for hid, value in edits["confidence"].items():
        s.graph.set_confidence(hid, value)
    return edits


def refine(s: Session, parent: str) -> list[str]:
    """Finer hypotheses under `parent`, one level down."""
    node = s.graph.nodes[parent]
    found = s.asker.ask("central.refine", s.roles.messages(
        s.roles.central, "refine", context=s.case.context, graph=s.graph.describe(),
        parent=parent, parent_label=node.label, level_name=s.level_name(node.level + 1),
        max_hypotheses=s.limits.max_hypotheses),
        schemas.hypotheses([], s.limits.max_hypotheses)) or []
    return [s.graph.add_hypothesis(h["label"], h["confidence"], node.level + 1, h["rationale"],
                                   parent=parent) for h in found]

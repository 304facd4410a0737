"""The state machine over hypothesis levels.

The state is the focus path (the hypothesis drilled into at each coarser level) plus step
counters. After each investigation step `transition` applies the first rule that fires:

1. budget      steps >= max_steps                                   -> report ("budget")
2. backtrack   an ancestor on the path is no longer the top of its siblings
               (a sibling's confidence is strictly higher)          -> back to that level,
               its descendants pruned, that level's step count reset
3. drill down  the top candidate leads the next by >= gap_delta and has >= min_support
               supporting evidence, or the level's steps are spent  -> into the top candidate
               (at the finest level: report, "ready" or "level_budget")
4. report      the central agent asked to report and the path is at the finest level with a
               candidate -> report ("requested"); above the finest level the request is refused
               (recorded), since stopping at a coarse category is the failure this prevents
5. stay        gather more evidence at this level

The transition is pure: it returns the new state and the hypotheses to prune.
"""
from __future__ import annotations

import dataclasses

from jaxrl.agents.graph import CausalGraph


@dataclasses.dataclass(frozen=True)
class Budget:
    """Thresholds and budgets (defaults from the Graph of States reference code)."""
    gap_delta: float = 0.3
    min_support: int = 3
    max_steps_per_level: int = 2
    max_steps: int = 3  # investigation steps per case
    retrieval_steps: int = 3  # tool requests per expert call
    depth: int = 2  # hypothesis levels: 0 (coarse) .. depth - 1 (finest)

    def __post_init__(self):
        for name in ("min_support", "max_steps_per_level", "max_steps", "retrieval_steps",
                     "depth"):
            if getattr(self, name) < (0 if name == "min_support" else 1):
                raise ValueError(f"{name} must be >= {0 if name == 'min_support' else 1}; "
                                 f"got {getattr(self, name)}")
        if not 0.0 <= self.gap_delta <= 1.0:
            raise ValueError(f"gap_delta must be in [0, 1]; got {self.gap_delta}")


@dataclasses.dataclass(frozen=True)
class State:
    path: tuple[str, ...] = ()
    steps_at_level: int = 0
    steps: int = 0
    backtracks: int = 0

    @property
    def level(self) -> int:
        return len(self.path)

    def after_step(self) -> State:
        return dataclasses.replace(self, steps=self.steps + 1,
                                   steps_at_level=self.steps_at_level + 1)


@dataclasses.dataclass(frozen=True)
class Transition:
    kind: str  # stay | drill_down | backtrack | report
    state: State
    reason: str = ""
    pruned: tuple[str, ...] = ()


def ranked(graph: CausalGraph, ids: list[str], incumbent: str | None = None) -> list[str]:
    """ids by confidence, highest first; on a tie the incumbent, then the older node, wins."""
    order = {node_id: i for i, node_id in enumerate(graph.nodes)}
    return sorted(ids, key=lambda h: (-graph.nodes[h].confidence, h != incumbent, order[h]))


def candidates(graph: CausalGraph, state: State) -> list[str]:
    """The active hypotheses at the state's level under its focus path, best first."""
    return ranked(graph, graph.children(state.path[-1] if state.path else None))


def focus(graph: CausalGraph, state: State) -> str | None:
    """The hypothesis under investigation: the top candidate, else the deepest on the path."""
    found = candidates(graph, state)
    return found[0] if found else (state.path[-1] if state.path else None)


def belief_path(graph: CausalGraph) -> list[str]:
    """The current best explanation from the coarsest level down: the top child at each level."""
    path: list[str] = []
    while kids := graph.children(path[-1] if path else None):
        path.append(ranked(graph, kids)[0])
    return path


def _demoted(graph: CausalGraph, state: State) -> int | None:
    """The shallowest level whose path hypothesis is no longer the top of its siblings."""
    for level, node_id in enumerate(state.path):
        siblings = graph.children(state.path[level - 1] if level else None)
        if ranked(graph, siblings, incumbent=node_id)[0] != node_id:
            return level
    return None


def _ready(graph: CausalGraph, ids: list[str], budget: Budget) -> bool:
    top = graph.nodes[ids[0]]
    gap = top.confidence - (graph.nodes[ids[1]].confidence if len(ids) > 1 else 0.0)
    return gap >= budget.gap_delta - 1e-9 and graph.support(top.id) >= budget.min_support


def transition(graph: CausalGraph, state: State, budget: Budget,
               report_requested: bool = False) -> Transition:
    """The state after an investigation step (see the module docstring for the rules)."""
    if state.steps >= budget.max_steps:
        return Transition("report", state, "budget")
    level = _demoted(graph, state)
    if level is not None:
        pruned = tuple(h for h in graph.descendants(state.path[level])
                       if graph.nodes[h].status == "active")
        new = dataclasses.replace(state, path=state.path[:level], steps_at_level=0,
                                  backtracks=state.backtracks + 1)
        return Transition("backtrack", new, f"{state.path[level]} demoted at level {level}",
                          pruned)
    ids = candidates(graph, state)
    finest = state.level >= budget.depth - 1
    if ids:
        ready = _ready(graph, ids, budget)
        if ready or state.steps_at_level >= budget.max_steps_per_level:
            if finest:
                return Transition("report", state, "ready" if ready else "level_budget")
            new = dataclasses.replace(state, path=state.path + (ids[0],), steps_at_level=0)
            return Transition("drill_down", new, "ready" if ready else "level_budget")
    if report_requested:
        if finest and ids:
            return Transition("report", state, "requested")
        return Transition("stay", state, "report refused: no hypothesis at the finest level yet")
    return Transition("stay", state)

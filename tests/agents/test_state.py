"""The state machine on scripted graph updates: one test per rule."""
import pytest

from jaxrl.agents.graph import CausalGraph, GraphError
from jaxrl.agents.state import Budget, State, belief_path, candidates, transition

BUDGET = Budget()  # gap 0.3, min support 3, 2 steps per level, 3 steps, depth 2


def _support(graph, hypothesis, n, tag="e"):
    for i in range(n):
        graph.add_edge(graph.add_evidence(f"{tag}{hypothesis}{i}", "tool x"), hypothesis,
                       "support")


def _coarse(conf_a=0.8, conf_b=0.4):
    graph = CausalGraph()
    a = graph.add_hypothesis("disk", conf_a, 0)
    b = graph.add_hypothesis("memory", conf_b, 0)
    return graph, a, b


def test_defaults_match_the_reference_code():
    assert (BUDGET.gap_delta, BUDGET.min_support, BUDGET.max_steps_per_level,
            BUDGET.max_steps, BUDGET.retrieval_steps) == (0.3, 3, 2, 3, 3)


def test_stay_when_gap_or_support_is_short():
    state = State().after_step()
    graph, a, _ = _coarse(0.8, 0.6)  # 3 supports, but a gap of 0.2 < 0.3
    _support(graph, a, 3)
    assert transition(graph, state, BUDGET).kind == "stay"
    graph, a, _ = _coarse(0.9, 0.6)  # a gap of 0.3, but 2 supports < 3
    _support(graph, a, 2)
    assert transition(graph, state, BUDGET).kind == "stay"


def test_drill_down_on_gap_and_support():
    graph, a, _ = _coarse(0.9, 0.6)  # gap exactly 0.3 counts
    _support(graph, a, 3)
    move = transition(graph, State().after_step(), BUDGET)
    assert (move.kind, move.reason, move.state.path, move.state.steps_at_level) == (
        "drill_down", "ready", (a,), 0)


def test_drill_down_when_the_level_step_budget_is_spent():
    graph, _, b = _coarse(0.5, 0.45)
    graph.set_confidence(b, 0.55)  # b leads, without gap or support
    state = State().after_step()
    assert transition(graph, state, BUDGET).kind == "stay"
    move = transition(graph, state.after_step(), BUDGET)
    assert (move.kind, move.reason, move.state.path) == ("drill_down", "level_budget", (b,))


def test_backtrack_when_an_ancestor_is_no_longer_top():
    graph, a, b = _coarse(0.8, 0.4)
    fine = [graph.add_hypothesis(f"fine {i}", 0.5, 1, parent=a) for i in range(2)]
    state = State(path=(a,), steps_at_level=1, steps=2)
    graph.set_confidence(b, 0.85)  # new evidence made the sibling lead
    move = transition(graph, state, BUDGET)
    assert move.kind == "backtrack" and move.state.path == ()
    assert move.state.backtracks == 1 and move.state.steps_at_level == 0
    assert sorted(move.pruned) == sorted(fine)
    graph.prune(move.pruned)
    assert candidates(graph, move.state) == [b, a] and belief_path(graph) == [b]


def test_backtrack_goes_to_the_shallowest_demoted_level():
    budget = Budget(depth=3, max_steps=9)
    graph, a, b = _coarse(0.8, 0.4)
    a1 = graph.add_hypothesis("a1", 0.7, 1, parent=a)
    a2 = graph.add_hypothesis("a2", 0.2, 1, parent=a)
    deep = graph.add_hypothesis("a1x", 0.6, 2, parent=a1)
    state = State(path=(a, a1), steps=3)
    graph.set_confidence(a2, 0.9)  # level 1 demoted ...
    graph.set_confidence(b, 0.95)  # ... and level 0 too: level 0 wins
    move = transition(graph, state, budget)
    assert move.state.path == () and set(move.pruned) == {a1, a2, deep}


def test_a_tie_keeps_the_incumbent():
    graph, a, b = _coarse(0.8, 0.4)
    graph.set_confidence(b, 0.8)
    assert transition(graph, State(path=(a,), steps=1), BUDGET).kind != "backtrack"


def test_report_when_ready_at_the_finest_level():
    graph, a, _ = _coarse()
    x = graph.add_hypothesis("xfs corruption", 0.9, 1, parent=a)
    graph.add_hypothesis("disk full", 0.2, 1, parent=a)
    _support(graph, x, 3)
    move = transition(graph, State(path=(a,), steps=2, steps_at_level=1), BUDGET)
    assert (move.kind, move.reason) == ("report", "ready")


def test_report_when_the_finest_level_budget_is_spent():
    budget = Budget(max_steps=9)
    graph, a, _ = _coarse()
    graph.add_hypothesis("xfs corruption", 0.5, 1, parent=a)
    move = transition(graph, State(path=(a,), steps=3, steps_at_level=2), budget)
    assert (move.kind, move.reason) == ("report", "level_budget")


def test_report_when_out_of_steps():
    graph, _, _ = _coarse(0.5, 0.45)
    move = transition(graph, State(steps=3, steps_at_level=1), BUDGET)
    assert (move.kind, move.reason) == ("report", "budget")


def test_a_report_request_is_refused_above_the_finest_level():
    graph, a, _ = _coarse(0.5, 0.45)
    move = transition(graph, State().after_step(), BUDGET, report_requested=True)
    assert move.kind == "stay" and "refused" in move.reason
    x = graph.add_hypothesis("xfs corruption", 0.5, 1, parent=a)
    move = transition(graph, State(path=(a,), steps=2, steps_at_level=1), BUDGET,
                      report_requested=True)
    assert (move.kind, move.reason) == ("report", "requested") and belief_path(graph) == [a, x]


def test_graph_rejects_bad_edits():
    graph, a, _ = _coarse()
    s = graph.add_signal("alert")
    with pytest.raises(GraphError, match="causal"):
        graph.add_edge(s, a, "causal")  # signal -> hypothesis is the wrong direction
    with pytest.raises(GraphError, match="kinds: support"):
        graph.add_edge(a, s, "explains")
    with pytest.raises(GraphError, match=r"\[0, 1\]"):
        graph.set_confidence(a, 1.5)
    with pytest.raises(GraphError, match="needs a parent"):
        graph.add_hypothesis("orphan", 0.5, 1)
    assert graph.add_evidence("same quote", "a") == graph.add_evidence("same quote", "b")

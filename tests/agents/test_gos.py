"""Graph of States end to end with scripted models: a competent one, one that fabricates, one
whose replies are mostly invalid, and the chain-of-thought baseline."""
import json

import pytest

from jaxrl.agents.agents import Limits
from jaxrl.agents.baseline import chain_of_thought
from jaxrl.agents.gos import investigate
from jaxrl.agents.metrics import case_metrics, summarize
from jaxrl.agents.roles import load_roles
from jaxrl.envs.diagnosis import catalog, generate_case
from tests.agents.scripted import Investigator, ScriptedChat

XFS = next(i for i, f in enumerate(catalog()["faults"]) if f["fine"] == "xfs metadata corruption")


@pytest.fixture
def case():
    return generate_case(seed=0, index=0, fault_index=XFS)


@pytest.fixture
def roles(case):
    return load_roles(case.domain, set(case.tools))


def _investigator(case, **kw):
    host = case.gold.component
    service = next(c for c in case.gold.components if c != host)
    return Investigator(case, [("dmesg", host), ("mount", host), ("logs", service)], **kw)


def test_a_competent_model_drills_down_to_the_fine_root_cause(case, roles):
    out = investigate(case, ScriptedChat(_investigator(case)), roles)
    report = out.report
    assert (report["reason"], report["steps"], report["backtracks"]) == ("ready", 2, 0)
    assert report["root_cause"] == f"xfs metadata corruption on {case.gold.component}"
    assert [p["level"] for p in report["path"]] == [0, 1]
    kinds = [(e["event"], e.get("kind")) for e in out.trace]
    assert ("transition", "drill_down") in kinds and ("transition", "report") in kinds
    row = case_metrics(case, out, price_in=1.0, price_out=4.0)
    assert row["match"] and row["relevant"] and row["fabricated"] == 0 and row["claims"] == 6
    assert row["cost_usd"] == pytest.approx((row["prompt_tokens"] + 4 * row["completion_tokens"])
                                            / 1e6)
    edges = {(e["src"], e["dst"], e["kind"]) for e in out.graph["edges"]}
    assert ("H3", "H1", "refines") in edges and ("H1", "S1", "causal") in edges


def test_fabricated_quotes_are_counted_and_kept_out_of_the_graph(case, roles):
    out = investigate(case, ScriptedChat(_investigator(case, fabricate=True)), roles)
    assert out.claims > 0 and out.fabricated == out.claims
    assert not [n for n in out.graph["nodes"] if n["kind"] == "evidence"]
    # without evidence the top hypothesis never has support: the level budgets move it on
    assert out.report["reason"] == "level_budget" or out.report["reason"] == "budget"
    assert summarize([case_metrics(case, out)])["fabrication_rate"] == 1.0


def test_invalid_json_gets_its_fallbacks_and_never_crashes(case, roles):
    def mostly_garbage(messages):
        if "candidate fault categories" in messages[1]["content"]:
            return '{"hypotheses": [{"label": "disk", "confidence": 0.6}]}'
        return "I think it is the disk. {not json"

    client = ScriptedChat(mostly_garbage)
    out = investigate(case, client, roles, limits=Limits(retries=1, experts_per_step=1))
    events = [e["event"] for e in out.trace]
    assert out.usage["invalid"] == out.usage["calls"] - 1 and out.usage["failed"] > 0
    plans = [e for e in out.trace if e["event"] == "plan"]
    assert plans and not any(p["from_model"] for p in plans)  # the fallback plan ran
    assert [e["kind"] for e in out.trace if e["event"] == "transition"] == [
        "stay", "drill_down", "report"]
    assert "refine" in events and out.report["reason"] == "budget"
    assert out.report["root_cause"] == "disk"


def test_a_model_with_no_valid_reply_ends_undetermined(case, roles):
    out = investigate(case, ScriptedChat(lambda m: "```json\n{oops"), roles)
    assert out.report["reason"] == "no_hypotheses" and out.report["root_cause"] == ""
    assert out.usage["calls"] == 2 and out.usage["failed"] == 1
    assert not case_metrics(case, out)["match"]


def test_the_token_budget_ends_a_case(case, roles):
    out = investigate(case, ScriptedChat(_investigator(case)), roles,
                      limits=Limits(token_budget=60))
    assert out.report["reason"] == "token_budget"
    assert out.usage["completion_tokens"] <= 60 and out.usage["skipped"] >= 1


def test_the_baseline_answers_in_one_prompt(case, roles):
    answer = {"category": "disk", "root_cause": "xfs metadata corruption",
              "component": case.gold.component,
              "evidence": [case.signals[1], "kernel: XFS shutdown on /data"]}
    client = ScriptedChat(lambda m: "Let me think. The writes fail.\n" + json.dumps(answer))
    out = chain_of_thought(case, client, roles)
    row = case_metrics(case, out)
    assert row["match"] and row["relevant"] and row["calls"] == 1
    assert (out.claims, out.fabricated) == (2, 1)  # the second quote is in no alert
    assert "Alerts:" in client.chats[0][1]["content"] and case.signals[0] in client.chats[0][1][
        "content"]

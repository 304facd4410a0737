"""Per-case metrics and their summary over cases.

match, relevant   the root cause named at the fine / coarse granularity (grounding.judge)
fabrication_rate  claims not backed by retrieved evidence / all claims (pooled over cases)
backtracks, steps, tokens, cost   per case; cost = tokens x the given USD prices per 1M tokens
invalid_replies   model replies that did not validate (each one retried or given its fallback)
"""
from __future__ import annotations

from typing import Any

from jaxrl.agents.gos import Outcome
from jaxrl.agents.grounding import judge
from jaxrl.envs.base import Case


def case_metrics(case: Case, outcome: Outcome, price_in: float = 0.0, price_out: float = 0.0
                 ) -> dict[str, Any]:
    report, usage = outcome.report, outcome.usage
    fine_text = report["root_cause"]
    coarse_text = " ".join([report["category"], fine_text,
                            *(p["label"] for p in report.get("path", []))])
    tokens = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"case": case.id, "method": report["method"], "gold": case.gold.fine,
            "answer": fine_text, **judge(fine_text, coarse_text, case.gold),
            "claims": outcome.claims, "fabricated": outcome.fabricated,
            "backtracks": report["backtracks"], "steps": report["steps"],
            "calls": usage["calls"], "invalid_replies": usage["invalid"],
            "failed_turns": usage["failed"], "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"], "tokens": tokens,
            "cost_usd": (usage["prompt_tokens"] * price_in
                         + usage["completion_tokens"] * price_out) / 1e6,
            "reason": report["reason"]}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over cases (rates as fractions), with fabrication pooled over all claims."""
    n = len(rows)
    claims = sum(r["claims"] for r in rows)

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in rows) / n

    return {"cases": n, "match": mean("match"), "relevant": mean("relevant"),
            "fabrication_rate": sum(r["fabricated"] for r in rows) / claims if claims else 0.0,
            "claims": claims, "backtracks": mean("backtracks"), "steps": mean("steps"),
            "calls": mean("calls"), "invalid_replies": mean("invalid_replies"),
            "tokens": mean("tokens"), "cost_usd": mean("cost_usd")}

"""The chain-of-thought baseline: one prompt with the case's context and every signal, one answer
(category, root cause, component, quoted evidence), within the same per-case token budget and
retry policy as the agents. It requests no tool output, so its evidence quotes are grounded only
in the prompt. An answer that never validates leaves the report's root cause empty."""
from __future__ import annotations

import dataclasses

from jaxrl.agents import schemas
from jaxrl.agents.agents import Limits
from jaxrl.agents.chat import ChatClient
from jaxrl.agents.gos import Outcome
from jaxrl.agents.grounding import grounded
from jaxrl.agents.replies import Asker
from jaxrl.agents.roles import Roles
from jaxrl.envs.base import Case


def chain_of_thought(case: Case, client: ChatClient, roles: Roles, limits: Limits = Limits()
                     ) -> Outcome:
    trace: list[dict] = []
    # The whole case budget may go to the one reply: the same budget as the agents, spent at once.
    asker = Asker(client, limits.token_budget, limits.token_budget, limits.retries, trace.append)
    signals = "\n".join(case.signals)
    answer = asker.ask("baseline", roles.messages(
        roles.central, "baseline", context=case.context, signals=signals), schemas.diagnosis)
    answer = answer or {"category": "", "root_cause": "", "component": "", "evidence": []}
    seen = [case.context, *case.signals]
    quotes = [{"quote": q, "grounded": grounded(q, seen)} for q in answer["evidence"]]
    root_cause = " on ".join(x for x in (answer["root_cause"], answer["component"]) if x)
    report = {"case": case.id, "method": "cot", "reason": "answered" if answer["root_cause"]
              else "no_valid_answer", "root_cause": root_cause, "category": answer["category"],
              "evidence": quotes, "steps": 1, "backtracks": 0}
    trace.append({"event": "report", "root_cause": root_cause})
    return Outcome(report=report, graph={"nodes": [], "edges": []}, trace=trace,
                   claims=len(quotes), fabricated=sum(not q["grounded"] for q in quotes),
                   usage=dataclasses.asdict(asker.usage))

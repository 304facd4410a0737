"""Validators of the agents' JSON replies: each takes the decoded object and returns the cleaned
value or raises ReplyError saying which field is wrong and what is allowed."""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from jaxrl.agents.replies import ReplyError


def _list(obj: dict[str, Any], key: str, most: int, least: int = 1) -> list[Any]:
    value = obj.get(key)
    if not isinstance(value, list) or not least <= len(value) <= most:
        raise ReplyError(f"{key!r} must be a list of {least} to {most} items")
    return value


def _text(item: Any, key: str, required: bool = True) -> str:
    value = item.get(key, None if required else "") if isinstance(item, dict) else None
    if not isinstance(value, str) or (required and not value.strip()):
        raise ReplyError(f"{key!r} must be a non-empty string" if required
                         else f"{key!r} must be a string")
    return value.strip()


def _confidence(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ReplyError(f"confidence of {what} must be a number in [0, 1]; got {value!r}")
    return float(value)


def _one_of(value: Any, allowed: Collection[str], what: str) -> str:
    if value not in allowed:
        raise ReplyError(f"{what} {value!r} is not one of: {', '.join(sorted(allowed))}")
    return value


def hypotheses(signal_ids: Collection[str], most: int) -> Callable[[dict], list[dict]]:
    """{"hypotheses": [{label, confidence, rationale?, explains?: [signal ids]}]}"""
    def check(obj: dict[str, Any]) -> list[dict[str, Any]]:
        found = []
        for item in _list(obj, "hypotheses", most):
            label = _text(item, "label")
            explains = item.get("explains", [])
            if not isinstance(explains, list):
                raise ReplyError("'explains' must be a list of signal ids")
            found.append({"label": label, "rationale": _text(item, "rationale", False),
                          "confidence": _confidence(item.get("confidence"), label),
                          "explains": [_one_of(s, signal_ids, "signal") for s in explains]})
        return found
    return check


def plan(experts: Collection[str], hypothesis_ids: Collection[str], most: int
         ) -> Callable[[dict], list[dict]]:
    """{"calls": [{expert, hypothesis, task}]}"""
    def check(obj: dict[str, Any]) -> list[dict[str, str]]:
        return [{"expert": _one_of(call.get("expert") if isinstance(call, dict) else None,
                                   experts, "expert"),
                 "hypothesis": _one_of(call.get("hypothesis"), hypothesis_ids, "hypothesis"),
                 "task": _text(call, "task")}
                for call in _list(obj, "calls", most)]
    return check


def retrieve(tools: Collection[str]) -> Callable[[dict], dict]:
    """{"tool", "target"}, or {"done": true}."""
    def check(obj: dict[str, Any]) -> dict[str, Any]:
        if obj.get("done") is True:
            return {"done": True}
        return {"tool": _one_of(obj.get("tool"), tools, "tool"),
                "target": _text(obj, "target")}
    return check


def findings(hypothesis_ids: Collection[str], most: int = 8) -> Callable[[dict], list[dict]]:
    """{"findings": [{hypothesis, relation: support|refute, quote, claim}]} (may be empty)."""
    def check(obj: dict[str, Any]) -> list[dict[str, str]]:
        return [{"hypothesis": _one_of(f.get("hypothesis") if isinstance(f, dict) else None,
                                       hypothesis_ids, "hypothesis"),
                 "relation": _one_of(f.get("relation"), ("support", "refute"), "relation"),
                 "quote": _text(f, "quote"), "claim": _text(f, "claim")}
                for f in _list(obj, "findings", most, least=0)]
    return check


def update(hypothesis_ids: Collection[str]) -> Callable[[dict], dict]:
    """{"confidence": {id: value}, "decision": refine|report}"""
    def check(obj: dict[str, Any]) -> dict[str, Any]:
        confidence = obj.get("confidence")
        if not isinstance(confidence, dict):
            raise ReplyError("'confidence' must be an object from hypothesis id to a number")
        return {"confidence": {_one_of(h, hypothesis_ids, "hypothesis"): _confidence(v, h)
                               for h, v in confidence.items()},
                "decision": _one_of(obj.get("decision"), ("refine", "report"), "decision")}
    return check


def diagnosis(obj: dict[str, Any]) -> dict[str, Any]:
    """The baseline's answer: {category, root_cause, component, evidence: [quotes]}."""
    evidence = obj.get("evidence", [])
    if not isinstance(evidence, list) or not all(isinstance(q, str) for q in evidence):
        raise ReplyError("'evidence' must be a list of quoted strings")
    return {"category": _text(obj, "category", False), "root_cause": _text(obj, "root_cause"),
            "component": _text(obj, "component", False), "evidence": evidence}

"""Gold formal traces of the logic puzzles (knk, zebra): the completion Spring's reward scores
highest, written from what the generator knows (the formal clues and the unique solution), as
chat records for `jaxrl sft` (Spring warms the policy up on such traces before RL).

    <think>
    (assert CLUE_1)            ; every gold formal clue, in the puzzle's order
    ...
    (step 1 ATOM)              ; atoms of the solution: (knight X) / (knave X), (= value house)
    ...
    </think><answer>GOLD ANSWER</answer>

An atom becomes a step only when the step checker calls it novel after the steps before it
(not entailed by them and the domain rules, not a restated clue), so every step of a gold trace
is novel and its `spring` reward is the maximum, 1.55. In a zebra grid the last value of an
attribute follows from the others and is left to the answer. A puzzle whose clues already state
every atom of its solution (each one restates a clue under the domain rules) has no novel step;
its trace has premises and answer only and scores 0.85.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from jaxrl.logic.sexpr import FormalTrace, Form, parse, write
from jaxrl.logic.step_checker import StepChecker
from jaxrl.logic.z3_theory import theory_for
from jaxrl.rewards.puzzles import ANSWER_EXPRS

KINDS = tuple(ANSWER_EXPRS)


class TraceError(ValueError):
    """A record that has no gold trace (not a knk / zebra puzzle, or no formal clues)."""


def _premises(record: Mapping) -> list[str]:
    clues = record.get("metadata", {}).get("clues_formal")
    if not isinstance(clues, list) or not clues:
        raise TraceError(f"record {record.get('id', '?')!r} has no metadata 'clues_formal'; "
                         "gold traces are written from generated knk / zebra puzzles")
    return clues


def novel_steps(record: Mapping, check_ms: int = 2000) -> list[tuple]:
    """The solution's atoms that the step checker calls novel, in answer order, each judged
    after those kept before it."""
    kind = record.get("verifier", {}).get("kind")
    if kind not in ANSWER_EXPRS:
        raise TraceError(f"record {record.get('id', '?')!r} has verifier kind {kind!r}; gold "
                         f"traces exist for {', '.join(KINDS)}")
    theory = theory_for(record["verifier"]["theory"])
    checker = StepChecker(theory, check_ms, budget_s=60.0)
    premises = tuple(Form("premise", str(i + 1), parse(c))
                     for i, c in enumerate(_premises(record)))
    kept: list[tuple] = []
    for atom in ANSWER_EXPRS[kind](record["answer"], record):
        steps = tuple(Form("step", str(i + 1), s) for i, s in enumerate([*kept, atom]))
        result = checker.check(FormalTrace(premises, steps))
        if not result.s_sat:
            raise TraceError(f"record {record.get('id', '?')!r}: its formal clues do not have "
                             f"a unique solution ({result.base})")
        if result.steps[-1].verdict == "novel":
            kept.append(atom)
    return kept


def gold_trace(record: Mapping) -> str:
    """The completion text of the gold trace (see the module doc)."""
    lines = [f"(assert {clue})" for clue in _premises(record)]
    lines += [f"(step {i} {write(atom)})" for i, atom in enumerate(novel_steps(record), 1)]
    return "<think>\n" + "\n".join(lines) + f"\n</think><answer>{record['answer']}</answer>"


def trace_records(records: Sequence[Mapping]) -> list[dict]:
    """Chat records for `jaxrl sft`: each puzzle's prompt with its gold trace as the reply."""
    return [{"id": r["id"], "task": r["task"], "split": r.get("split", "all"),
             "messages": [*r["messages"], {"role": "assistant", "content": gold_trace(r)}]}
            for r in records]


def write_traces(records: Sequence[Mapping], path: str | os.PathLike) -> int:
    """Writes trace_records(records) to `path` as JSONL; returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = trace_records(records)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return len(rows)

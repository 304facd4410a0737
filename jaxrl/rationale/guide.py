"""Rationale-guided decoding (RATIONALYST's inference), over three injected roles.

Each step: the rationale model writes a rationale r for the context (question and trajectory
so far, `prompts.reasoning_context`); the agent proposes k candidate next steps (sentences);
the scorer gives each candidate c the mean log p(c | context, r), with r inserted as the
filter inserts it, optionally minus the mean log p(c | context) (`contrastive`); the best
candidate joins the trajectory. Implicit supervision: the agent proposes without seeing r.
Explicit supervision: r is put into the agent's context before it proposes (candidates are
scored the same way). Decoding stops when the chosen step matches the answer pattern, when
the agent ends its reply, when no candidate is left, or after `max_steps` steps.

The roles are plain functions (jaxrl/rationale/roles.py builds them from local models, one
base with an adapter per role, or OpenAI-compatible endpoints), so selection can be tested
with scripted roles.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.rationale.prompts import DEFAULT_TEMPLATE, insert_rationale, reasoning_context

IMPLICIT, EXPLICIT = "implicit", "explicit"
DEFAULT_ANSWER_PATTERN = r"[Tt]he (?:final )?answer is:?\s*\$?(-?[\d,]*\.?\d+)"


@dataclasses.dataclass(frozen=True)
class Candidate:
    text: str  # with the whitespace that joins it to the trajectory, none at the end
    final: bool = False  # the agent ended its reply here (not at a sentence boundary)


Propose = Callable[[str, str, "str | None", int], Sequence[Candidate]]  # question, trajectory,
# rationale shown to the agent (explicit) or None, k
WriteRationale = Callable[[str], str]  # context -> rationale
Score = Callable[[Sequence[tuple[str, str]]], Sequence[float]]  # (context, continuation) ->
# mean log-prob per continuation token


@dataclasses.dataclass(frozen=True)
class GuideSettings:
    k: int = 3
    max_steps: int = 12
    mode: str = IMPLICIT
    contrastive: bool = False
    answer_pattern: str = DEFAULT_ANSWER_PATTERN
    template: str = DEFAULT_TEMPLATE

    def __post_init__(self):
        if self.mode not in (IMPLICIT, EXPLICIT):
            raise ValueError(f"mode must be {IMPLICIT} or {EXPLICIT}; got {self.mode!r}")
        if self.k < 1 or self.max_steps < 1:
            raise ValueError(f"k and max_steps must be >= 1; got {self.k}, {self.max_steps}")
        re.compile(self.answer_pattern)


@dataclasses.dataclass(frozen=True)
class Step:
    rationale: str
    candidates: tuple[str, ...]
    scores: tuple[float, ...]
    chosen: int


@dataclasses.dataclass(frozen=True)
class GuideResult:
    trajectory: str
    answer: str | None
    finish: str  # answer | end | no_candidates | budget
    steps: tuple[Step, ...]


def candidate_scores(context: str, rationale: str, candidates: Sequence[str], score: Score,
                     settings: GuideSettings) -> np.ndarray:
    """[k]: mean log p(candidate | context, rationale) [- mean log p(candidate | context)]."""
    guided = context + insert_rationale(rationale, settings.template)
    pairs = [(guided, c) for c in candidates]
    if settings.contrastive:
        pairs += [(context, c) for c in candidates]
    values = np.asarray(score(pairs), np.float64)
    k = len(candidates)
    return values[:k] - values[k:] if settings.contrastive else values


def find_answer(step: str, pattern: str) -> str | None:
    match = re.search(pattern, step)
    return None if match is None else match.group(1).replace(",", "").strip()


def _distinct(candidates: Sequence[Candidate], first: bool) -> list[Candidate]:
    """Non-empty candidates, duplicates dropped, trailing whitespace (and on the first step
    all leading whitespace) removed."""
    seen, kept = set(), []
    for c in candidates:
        text = c.text.strip() if first else c.text.rstrip()
        if text.strip() and text not in seen:
            seen.add(text)
            kept.append(Candidate(text, c.final))
    return kept


def guide(question: str, propose: Propose, write_rationale: WriteRationale, score: Score,
          settings: GuideSettings = GuideSettings()) -> GuideResult:
    """Decode a reasoning trajectory for `question` step by step (module docstring)."""
    trajectory, steps = "", []
    for _ in range(settings.max_steps):
        context = reasoning_context(question, trajectory)
        rationale = " ".join(write_rationale(context).split())
        shown = rationale if settings.mode == EXPLICIT else None
        candidates = _distinct(propose(question, trajectory, shown, settings.k), not trajectory)
        if not candidates:
            return GuideResult(trajectory, None, "no_candidates", tuple(steps))
        texts = [c.text for c in candidates]
        scores = candidate_scores(context, rationale, texts, score, settings)
        best = int(np.argmax(scores))
        trajectory += texts[best]
        steps.append(Step(rationale, tuple(texts), tuple(float(s) for s in scores), best))
        answer = find_answer(texts[best], settings.answer_pattern)
        if answer is not None or candidates[best].final:
            return GuideResult(trajectory, answer, "answer" if answer else "end", tuple(steps))
    return GuideResult(trajectory, None, "budget", tuple(steps))

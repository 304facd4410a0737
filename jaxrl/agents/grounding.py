"""Grounding and scoring: is a claim backed by what was retrieved, does an answer name the gold
root cause.

A quote is grounded when, after normalization (lower case, runs of anything but letters and
digits turned into one space), it is at least MIN_QUOTE characters long and occurs in one of the
texts the method saw. Answers are scored by naming: Match needs a fine-grained phrasing of the
gold cause and one of the faulty components; Relevant needs the coarse category or the fine
cause.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from jaxrl.envs.base import Gold

MIN_QUOTE = 8  # shorter quotes ("error", "ok") would match almost any output


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def grounded(quote: str, seen: Iterable[str]) -> bool:
    needle = normalize(quote)
    return len(needle) >= MIN_QUOTE and any(needle in normalize(text) for text in seen)


def names(text: str, phrases: Iterable[str]) -> bool:
    """Whether text names any of phrases, as whole words."""
    padded = f" {normalize(text)} "
    return any(f" {normalize(p)} " in padded for p in phrases if normalize(p))


def judge(fine_text: str, coarse_text: str, gold: Gold) -> dict[str, bool]:
    """Match: fine_text names the fine cause and a faulty component. Relevant: coarse_text (which
    includes the fine answer) names the category or the fine cause."""
    fine = names(fine_text, gold.fine_aliases)
    return {"match": fine and names(fine_text, gold.components),
            "relevant": fine or names(coarse_text, gold.coarse_aliases + gold.fine_aliases)}

"""Rationale filtration: keep a rationale when it makes the text after it more predictable.

For a record {preceding, rationale, following}, with f the first `max_following_tokens` tokens
of `following`:
    score_with    = sum_i decay^i log p(f_i | preceding, rationale, f_<i)
    score_without = sum_i decay^i log p(f_i | preceding, f_<i)
    gain          = score_with - score_without;  kept when gain >= tau of the record's source
(decay 0.9). The rationale is inserted as text by a template (default: a space and the
rationale). Each piece is tokenized on its own, so `following` has the same tokens, and the
same targets, in both conditions; `preceding` is tokenized with the tokenizer's own special
tokens (a BOS where the model expects one). Both conditions of every record are scored
together, batched and bucketed by length (jaxrl/rationale/scoring.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.hf.pretrained import Pretrained
from jaxrl.rationale.prompts import DEFAULT_TEMPLATE, insert_rationale
from jaxrl.rationale.scoring import ScoreOptions, score_pairs

FIELDS = ("preceding", "rationale", "following")


@dataclasses.dataclass(frozen=True)
class FilterSettings:
    tau: float = 0.0  # for sources without a threshold of their own
    tau_by_source: Mapping[str, float] = dataclasses.field(default_factory=dict)
    source_field: str = "source"
    template: str = DEFAULT_TEMPLATE
    max_following_tokens: int = 128  # 0.9 ** 128 < 2e-6: later tokens change nothing
    score: ScoreOptions = ScoreOptions()

    def tau_for(self, record: Mapping[str, Any]) -> float:
        return self.tau_by_source.get(str(record.get(self.source_field)), self.tau)


def record_problem(record: Any) -> str | None:
    """Why a record cannot be scored, or None."""
    if not isinstance(record, dict):
        return f"a record must be a JSON object with {', '.join(FIELDS)}"
    for name in FIELDS:
        if not isinstance(record.get(name), str) or not record[name].strip():
            return f"field {name!r} must be a non-empty string"
    return None


def record_pairs(model: Pretrained, record: Mapping[str, str], settings: FilterSettings):
    """((context with rationale, following), (context without, following)) as token ids."""
    preceding = list(model.tokenizer(record["preceding"])["input_ids"])
    rationale = model.ids(insert_rationale(record["rationale"], settings.template))
    following = model.ids(record["following"])[:settings.max_following_tokens]
    return (preceding + rationale, following), (preceding, following)


def _scored(record: dict, with_: float, without: float, tau: float) -> dict:
    gain = with_ - without
    return {**record, "score_with": with_, "score_without": without, "gain": gain,
            "kept": bool(gain >= tau)}


def filter_records(model: Pretrained, records: Sequence[Any],
                   settings: FilterSettings = FilterSettings()) -> list[dict]:
    """Each record plus score_with, score_without, gain and kept; a record that cannot be
    scored gets kept false and an `error` saying why (the others are scored regardless)."""
    out: list[dict | None] = [None] * len(records)
    pairs, owners = [], []
    for i, record in enumerate(records):
        problem = record_problem(record)
        if problem is None:
            with_pair, without_pair = record_pairs(model, record, settings)
            problem = None if with_pair[1] and without_pair[0] else \
                "'following' has no tokens or 'preceding' gives no context token"
        if problem is not None:
            base = record if isinstance(record, dict) else {"record": record}
            out[i] = {**base, "score_with": None, "score_without": None, "gain": None,
                      "kept": False, "error": problem}
            continue
        pairs += [with_pair, without_pair]
        owners.append(i)
    scores = score_pairs(model.params, model.spec, pairs, model.lora, settings.score) \
        if pairs else []
    for k, i in enumerate(owners):
        out[i] = _scored(records[i], float(scores[2 * k]), float(scores[2 * k + 1]),
                         settings.tau_for(records[i]))
    return out

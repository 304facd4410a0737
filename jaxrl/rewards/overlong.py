"""DAPO's soft overlong punishment: a length penalty added to the summed reward.

With L = sampling.max_new_tokens and a buffer of C = rewards.overlong_buffer tokens, a
completion of n tokens (its EOS included) gets

    penalty(n) = -overlong_penalty * clip((n - (L - C)) / C, 0, 1)

0 up to L - C tokens, then growing linearly to -overlong_penalty at L (DAPO eq. 13 with
overlong_penalty 1; the sampler never exceeds L, where DAPO's third case gives -1 as well).
The penalty needs token counts, which only the sampler knows, so it is applied to a scored
batch after the reward functions ran; it is reported as its own entry `overlong_penalty` of the
batch's results (samples.jsonl components, metric reward/overlong_penalty/mean).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl.rewards.base import RewardResult
from jaxrl.rewards.pool import ScoredBatch, reward_metrics

NAME = "overlong_penalty"


def overlong_penalties(lengths: Sequence[int], max_new_tokens: int, buffer: int,
                       penalty: float) -> np.ndarray:
    """[B] float64 penalties (<= 0) for completions of `lengths` tokens; all 0 when buffer is 0."""
    lengths = np.asarray(lengths, np.float64)
    if buffer == 0:
        return np.zeros_like(lengths)
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer must be in [0, max_new_tokens={max_new_tokens}]; "
                         f"got {buffer}")
    return -penalty * np.clip((lengths - (max_new_tokens - buffer)) / buffer, 0.0, 1.0)


def with_overlong_penalty(scored: ScoredBatch, lengths: Sequence[int], max_new_tokens: int,
                          buffer: int, penalty: float) -> ScoredBatch:
    """`scored` with each completion's penalty added to its summed reward and listed under
    results[NAME]; the score metrics recomputed (timings kept)."""
    penalties = overlong_penalties(lengths, max_new_tokens, buffer, penalty)
    rewards = tuple(float(r + p) for r, p in zip(scored.rewards, penalties))
    results = {**scored.results, NAME: tuple(RewardResult(float(p)) for p in penalties)}
    metrics = {**scored.metrics, **reward_metrics(rewards, results),
               f"rewards/{NAME}/frac": float(np.mean(penalties < 0))}
    return dataclasses.replace(scored, rewards=rewards, results=results, metrics=metrics)

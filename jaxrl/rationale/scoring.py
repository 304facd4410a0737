"""Weighted log-likelihood of continuations given contexts, batched and bucketed by length.

Glossary: B rows in a batch, W bucketed row width, C context tokens, N continuation tokens.

A pair (context ids, continuation ids) becomes one left-padded row context + continuation, so
the continuations of a batch all end in the last column and the LM head runs only on the last
C columns (C: the longest continuation of the batch, bucketed), not on every context position;
its score is sum_i decay^i log p(continuation_i | context, continuation_<i) over the N
continuation tokens. With decay 0.9 that is RATIONALYST's future-text criterion (filtration);
with decay 1 and a division by N it is the mean log-prob of a candidate step (guided decoding).

Rows are sorted by length and grouped by their power-of-two width bucket; each group runs in
batches of a power-of-two size that keeps B * W near `tokens_per_batch`, the last batch padded
with empty rows, so the number of compiled programs stays bounded by (widths x batch sizes x
continuation buckets).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.backends.numerics import Numerics, numerics_of
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import Params, positions_from_mask
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.sampling.buckets import bucket

Pair = tuple[Sequence[int], Sequence[int]]


@dataclasses.dataclass(frozen=True)
class ScoreOptions:
    decay: float = 0.9  # weight of continuation token i is decay ** i
    tokens_per_batch: int = 8192  # B * W per forward pass
    max_tokens: int = 2048  # longer rows keep the end of their context (the part nearest)
    numerics: Numerics | None = None  # the backend forms; None: the default device's choice


@functools.partial(jax.jit, static_argnames=("spec", "start", "numerics"))
def _weighted_sums(params: Params, lora: Lora | None, tokens: jax.Array, mask: jax.Array,
                   weights: jax.Array, *, spec: ModelSpec, start: int,
                   numerics: Numerics) -> jax.Array:
    """sum_j weights[:, j] * log p(tokens[:, start + j] | tokens[:, :start + j]): [B] float32."""
    logp, _ = token_logprobs(params, spec, tokens, positions_from_mask(mask), mask, lora,
                             start=start, remat="none", numerics=numerics)  # [B, W - start]
    return jnp.sum(logp * weights, axis=1)


def _row(pair: Pair, max_tokens: int) -> tuple[list[int], int]:
    """(row ids, index of the first continuation token), the context cut from the left."""
    context, continuation = list(pair[0]), list(pair[1])
    if not continuation:
        raise ValueError("a scored pair needs at least one continuation token")
    if len(continuation) >= max_tokens:
        raise ValueError(f"a continuation of {len(continuation)} tokens leaves no room for "
                         f"context within max_tokens = {max_tokens}; cap the continuation first")
    context = context[-(max_tokens - len(continuation)):]
    if not context:
        raise ValueError("a scored pair needs at least one context token (a BOS id will do)")
    return context + continuation, len(context)


def _batch_arrays(rows: list[tuple[list[int], int]], size: int, width: int, decay: float):
    """(tokens, mask [size, width], weights [size, width - start], start): rows left-padded,
    rows beyond len(rows) empty; start leaves room for the longest continuation."""
    longest = max(len(ids) - first for ids, first in rows)
    start = max(width - bucket(longest), 1)
    tokens = np.zeros((size, width), np.int32)
    mask = np.zeros((size, width), bool)
    weights = np.zeros((size, width - start), np.float32)
    for r, (ids, first) in enumerate(rows):
        tokens[r, width - len(ids):] = ids
        mask[r, width - len(ids):] = True
        n = len(ids) - first  # continuation tokens, in the last n columns
        weights[r, width - start - n:] = decay ** np.arange(n)
    return tokens, mask, weights, start


def _plan(lengths: Sequence[int], tokens_per_batch: int) -> list[tuple[list[int], int, int]]:
    """[(row indices, batch size, width)]: rows by length, grouped by width bucket."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(bucket(lengths[i]), []).append(i)
    plan = []
    for width, members in groups.items():
        most = 1 << (max(tokens_per_batch // width, 1).bit_length() - 1)  # a power of two <= budget
        size = min(most, bucket(len(members), minimum=1))
        plan += [(members[s:s + size], size, width) for s in range(0, len(members), size)]
    return plan


def score_pairs(params: Params, spec: ModelSpec, pairs: Sequence[Pair], lora: Lora | None = None,
                opts: ScoreOptions = ScoreOptions()) -> np.ndarray:
    """The weighted continuation log-likelihood [len(pairs)] float64 of each (context ids,
    continuation ids) pair under the model (with `lora` when given)."""
    rows = [_row(pair, opts.max_tokens) for pair in pairs]
    numerics = numerics_of(None) if opts.numerics is None else opts.numerics
    scores = np.zeros(len(rows), np.float64)
    for members, size, width in _plan([len(ids) for ids, _ in rows], opts.tokens_per_batch):
        *arrays, start = _batch_arrays([rows[i] for i in members], size, width, opts.decay)
        sums = _weighted_sums(params, lora, *map(jnp.asarray, arrays), spec=spec, start=start,
                              numerics=numerics)
        scores[members] = np.asarray(jax.device_get(sums))[:len(members)]
    return scores

"""Group-relative advantages for GRPO, with DAPO's zero-spread group filter.

Glossary: P prompts, G generations per prompt (`grpo.num_generations`), B = P * G rows.
Rewards arrive as [B] with the G rows of a prompt contiguous: row p * G + g.

    A = (r - mean of r's group) / (std + eps)

where std is chosen by `scale`:
  group  the std of r's own group (GRPO, TRL's default);
  batch  the std of all B rewards about the batch mean (TRL's `scale_rewards="batch"`);
  none   no division (Dr. GRPO): A = r - group mean.
The std estimator is the unbiased one (divide by n - 1), as TRL computes it with torch's
`Tensor.std()`; eps = 1e-4 is TRL's, so a group whose rewards are all equal gets A = 0, not 0/0.

The functions are jnp so the train step can jit them: under jit they see the global batch, so the
`batch` std covers every host's rows rather than one host's slice. Called eagerly on host numpy
arrays they work as well (the arrays are moved to the default device; B floats cost nothing).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.config import REWARD_SCALINGS

EPS = 1e-4


class Advantages(NamedTuple):
    """advantages [B]; keep [B] float32, 1.0 for rows that train and 0.0 for rows dropped by the
    zero-spread filter (multiply it into the completion mask); metrics: scalars for logging."""

    advantages: jax.Array
    keep: jax.Array
    metrics: dict[str, jax.Array]


def _grouped(rewards: jax.Array, num_generations: int) -> jax.Array:
    """rewards [B] as [P, G] float32."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or rewards.shape[0] % num_generations:
        raise ValueError(f"rewards must be 1-D with a length divisible by num_generations="
                         f"{num_generations} (G rows per prompt); got shape {rewards.shape}")
    return rewards.reshape(-1, num_generations)


def zero_spread(rewards: jax.Array, num_generations: int) -> jax.Array:
    """[P] bool: True for groups whose G rewards are all exactly equal (nothing to learn)."""
    r = _grouped(rewards, num_generations)  # [P, G]
    return r.max(axis=1) == r.min(axis=1)


def group_advantages(rewards: jax.Array, num_generations: int, scale: str = "group",
                     eps: float = EPS) -> jax.Array:
    """[B] float32 advantages; see the module docstring for `scale` and the std estimator."""
    if scale not in REWARD_SCALINGS:
        raise ValueError(f"scale_rewards must be one of {', '.join(REWARD_SCALINGS)}; "
                         f"got {scale!r}")
    r = _grouped(rewards, num_generations)  # [P, G]
    centered = r - r.mean(axis=1, keepdims=True)
    if scale == "group":
        centered = centered / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    elif scale == "batch":
        centered = centered / (r.std(ddof=1) + eps)
    return centered.reshape(-1)


def compute_advantages(rewards: jax.Array, num_generations: int, *, scale: str = "group",
                       filter_zero_spread: bool = False, eps: float = EPS) -> Advantages:
    """Advantages plus the DAPO dynamic-sampling filter.

    With filter_zero_spread, rows of zero-spread groups get keep = 0 (their advantage is 0
    anyway, but DAPO also takes them out of the loss's token and sequence counts). The `batch`
    std is still taken over all B rewards, as TRL does. Metrics: zero_spread_groups (count),
    zero_spread_frac (of the P groups), kept_frac (of the B rows).
    """
    flat = group_advantages(rewards, num_generations, scale, eps)
    spread_zero = zero_spread(rewards, num_generations)  # [P]
    if filter_zero_spread:
        keep = jnp.repeat(~spread_zero, num_generations).astype(jnp.float32)
    else:
        keep = jnp.ones_like(flat)
    metrics = {"zero_spread_groups": spread_zero.sum(),
               "zero_spread_frac": spread_zero.mean(dtype=jnp.float32),
               "kept_frac": keep.mean()}
    return Advantages(advantages=flat * keep, keep=keep, metrics=metrics)

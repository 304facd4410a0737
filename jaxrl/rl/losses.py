"""The GRPO objective: clipped importance-ratio surrogate, k3 KL to the reference, aggregation.

Glossary: B completions (rows), T completion positions. All per-token inputs are [B, T] and
aligned with the completion mask: mask[b, t] is True for real completion tokens (the EOS
included) and False for padding and anything after EOS. The mask may also carry the zero-spread
filter (`mask * keep[:, None]`, see advantages.py): a row with no valid token is not counted.

Per token, with r = exp(logp - logp_old) and the row's advantage A:
    surrogate = min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A)
    loss      = -surrogate + beta * k3,   k3 = exp(ref - logp) - (ref - logp) - 1  (>= 0)
beta == 0 skips the KL term and needs no reference log-probs. logp_old, ref_logp and the
advantages are constants: gradients flow through logp only.

num_iterations (mu): logp_old are the sampler's log-probs (pi_old), fixed for all mu updates on a
batch, so the ratio is exactly exp(logp - logp_old). With mu == 1 and logp_old equal to logp in
value (pass `stop_gradient(logp)` to make it exact; the sampler's own log-probs differ by
numerics), r == 1 but d r / d logp == 1, so the gradient is that of A * logp: the policy
gradient. The loss VALUE then is -sum(w * A) over tokens. With seq-mean-token-mean that is
-mean over rows of A, which is 0 because every group's advantages sum to 0 (the group mean is
subtracted, whatever the scaling): the loss is 0 while the gradient is not. With token-mean and
Dr. GRPO the value is -sum_i len_i * A_i / normalizer, which is 0 only when a group's
completions have equal lengths.

Aggregation (`grpo.loss_agg`), as weights w [B, T] with loss = sum(w * per_token_loss):
  seq-mean-token-mean      mean over each row's valid tokens, then mean over rows (GRPO)
  token-mean               sum over all valid tokens / number of valid tokens (DAPO)
  seq-mean-token-sum-norm  sum over all valid tokens / (rows * max_new_tokens) (Dr. GRPO): the
                           constant is the configured `sampling.max_new_tokens`, not the
                           longest completion in the batch, so it does not depend on lengths.
"Rows" counts rows with at least one valid token (TRL counts all B rows; the two agree unless
rows are filtered out, since a real completion holds at least its EOS).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.config import LOSS_AGGS, GrpoConfig


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 with d = ref - logp."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def token_weights(mask: jax.Array, loss_agg: str, max_new_tokens: int | None = None) -> jax.Array:
    """[B, T] float32 weights such that loss = sum(weights * per_token_loss); see the module
    docstring for each mode. A batch without valid tokens gets all-zero weights."""
    m = mask.astype(jnp.float32)  # [B, T]
    lengths = m.sum(axis=1)  # [B]
    rows = jnp.maximum((lengths > 0).sum(), 1).astype(jnp.float32)
    if loss_agg == "seq-mean-token-mean":
        return m / (jnp.maximum(lengths, 1.0)[:, None] * rows)
    if loss_agg == "token-mean":
        return m / jnp.maximum(m.sum(), 1.0)
    if loss_agg == "seq-mean-token-sum-norm":
        if max_new_tokens is None or max_new_tokens < m.shape[1]:
            raise ValueError(
                "loss_agg 'seq-mean-token-sum-norm' (Dr. GRPO) normalizes by max_new_tokens, the "
                f"longest completion the sampler may produce; need an int >= the mask's "
                f"{m.shape[1]} completion positions, got {max_new_tokens!r}")
        return m / (rows * max_new_tokens)
    raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}; got {loss_agg!r}")


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x [B, T] over the valid tokens (0 when there are none)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(m.sum(), 1.0)


def grpo_loss(logp: jax.Array, logp_old: jax.Array, advantages: jax.Array, mask: jax.Array,
              cfg: GrpoConfig, *, ref_logp: jax.Array | None = None,
              max_new_tokens: int | None = None, weights: jax.Array | None = None):
    """(loss scalar, metrics) for per-token log-probs [B, T], advantages [B], mask [B, T].

    Uses cfg.beta, cfg.epsilon_low, cfg.epsilon_high and cfg.loss_agg. ref_logp is required when
    beta > 0 and ignored otherwise; max_new_tokens is required by Dr. GRPO aggregation.
    weights [B, T] replaces `token_weights(mask, ...)`: a micro-batch passes its slice of the
    whole batch's weights, so the accumulated loss and gradient equal the whole batch's.
    Metrics (token means over valid tokens, no gradient): ratio_mean; clip_frac_low, the
    fraction of tokens with r < 1 - epsilon_low and A < 0 (the clip holds the ratio up);
    clip_frac_high, r > 1 + epsilon_high and A > 0 (the clip holds it down); clip_frac, either
    (TRL's clip_ratio/low_mean, high_mean, region_mean); kl, the mean k3, when beta > 0.
    """
    if cfg.beta > 0 and ref_logp is None:
        raise ValueError(f"grpo.beta = {cfg.beta} > 0 needs ref_logp (the reference policy's "
                         "log-probs); pass them, or set grpo.beta = 0 to drop the KL term")
    valid = mask.astype(bool)
    if weights is None:
        weights = token_weights(valid, cfg.loss_agg, max_new_tokens)  # [B, T]
    # where() before exp: padded positions may hold anything, and exp(junk) * 0 can be nan.
    log_ratio = jnp.where(valid, logp - jax.lax.stop_gradient(logp_old), 0.0)
    ratio = jnp.exp(log_ratio)  # [B, T]
    a = jax.lax.stop_gradient(advantages).astype(jnp.float32)[:, None]  # [B, 1]
    clipped = jnp.clip(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    per_token = -jnp.minimum(ratio * a, clipped * a)  # [B, T]
    metrics = {"ratio_mean": masked_mean(ratio, valid),
               "clip_frac_low": masked_mean((ratio < 1.0 - cfg.epsilon_low) & (a < 0), valid),
               "clip_frac_high": masked_mean((ratio > 1.0 + cfg.epsilon_high) & (a > 0), valid)}
    metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    if cfg.beta > 0:
        ref = jax.lax.stop_gradient(ref_logp)
        kl = k3_kl(jnp.where(valid, logp, 0.0), jnp.where(valid, ref, 0.0))  # [B, T]; 0 at pads
        per_token = per_token + cfg.beta * kl
        metrics["kl"] = masked_mean(kl, valid)
    loss = jnp.sum(weights * per_token)
    return loss, jax.tree_util.tree_map(jax.lax.stop_gradient, metrics)

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
                           constant is the configured `sampling.max_new_tokens` (an episode's
                           `env.max_tokens` with data.env), not the longest completion in the
                           batch, so it does not depend on lengths.
"Rows" counts rows with at least one valid token (TRL counts all B rows; the two agree unless
rows are filtered out, since a real completion holds at least its EOS).

Variants (`grpo.*`, all off by default; README's GRPO section names the paper of each):

importance_sampling: sequence (GSPO). The ratio of row b is one number,
    s_b = exp(sum_t m_bt (logp_bt - logp_old_bt) / len_b),
  used in place of every token's r; it is clipped per sequence and broadcast to the row's
  tokens for the aggregation. Its gradient reaches each token's logp with weight s_b / len_b.
  GSPO's paper clips it much tighter than tokens are clipped (epsilon 3e-4 / 4e-4).

kl_ratio_weighted (TRL's use_bias_correction_kl, from DeepSeek-V3.2): the KL term becomes
  r * k3 with the same r as the surrogate (token or sequence) and NOT detached, as TRL 1.16
  does. Per token, d(k3)/d logp = 1 - exp(d), whose expectation under pi is the gradient of
  KL(ref || pi); d(r * k3)/d logp = r * (logp - ref), whose expectation under the sampler's
  pi_old is the gradient of KL(pi || ref), the divergence k3 estimates.

delta (two-sided clipping, INTELLECT-2): the unclipped side uses min(r, delta),
    surrogate = min(min(r, delta) * A, clip(r, 1 - eps_low, 1 + eps_high) * A),
  which changes only tokens with A < 0 and r > delta (for A > 0 the clip already holds the
  ratio at 1 + eps_high < delta, which the config requires).

loss: cispo (MiniMax-M1). The ratio only weights the policy gradient:
    loss_t = -stop_gradient(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp_t,
  so every token keeps a gradient, scaled by its clipped ratio; MiniMax-M1 sets no lower
  bound (eps_low = 1) and normalizes by the batch's token count (loss_agg token-mean, which
  the config requires). TRL's epsilon_high for cispo is the cap itself: TRL's 5.0 is
  epsilon_high 4.0 here.

top_entropy_quantile rho < 1 ("Beyond the 80/20 rule"): the policy term (not the KL term) of
  a token counts only if its entropy (of the tempered distribution, no gradient) is at least
  the (1 - rho) quantile of the entropies of all valid tokens of the batch, interpolated
  linearly between order statistics (torch.quantile's default, which TRL uses). The weights
  are not renormalized: unselected tokens still count in the aggregation's denominators, as
  in TRL. "The batch" is the whole step's batch: with micro-batches, train_step.py selects
  the tokens before splitting it (TRL takes the quantile per micro-batch).

tis_cap c > 0 (truncated importance sampling, as verl's and TRL's correction of the mismatch
  between sampler and learner): the proximal policy pi_prox is the adapter at the update's
  start, prox = stop_gradient(logp) (the config requires num_iterations 1, so that adapter is
  the one being updated). The clipped ratio is taken against it, r = exp(logp - prox) (1 in
  value, d r / d logp = 1; with sequence, the row's ratio against prox), and each token's
  policy term (grpo's surrogate or cispo's, not the KL term) is weighted by
    w_t = stop_gradient(min(exp(prox_t - logp_old_t), c)),
  the sampler's share of the learner/sampler mismatch, truncated at c. With
  seq-mean-token-mean and r inside the clip range, d loss / d logp_t = -w_t * A / (len * rows).
  The KL term (kl_ratio_weighted included) keeps its form with the ratio against pi_prox, and
  the ratio metrics (ratio_mean, clip_frac*) describe that ratio. Tokens decoded by an older
  adapter (partial rollouts) are where the weights move away from 1.
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


def sequence_log_ratio(logp: jax.Array, logp_old: jax.Array, valid: jax.Array) -> jax.Array:
    """[B] mean over each row's valid tokens of logp - logp_old (0 for a row without any)."""
    log_ratio = jnp.where(valid, logp - jax.lax.stop_gradient(logp_old), 0.0)  # [B, T]
    lengths = valid.sum(axis=1).astype(jnp.float32)
    return log_ratio.sum(axis=1) / jnp.maximum(lengths, 1.0)


def importance_log_ratio(logp: jax.Array, logp_old: jax.Array, valid: jax.Array,
                         level: str = "token") -> jax.Array:
    """[B, T] log r at valid tokens, 0 elsewhere: per token, or (sequence, GSPO) the row's
    `sequence_log_ratio` broadcast to its tokens."""
    if level == "token":
        # where() before exp: padded positions may hold anything, and exp(junk) * 0 can be nan
        return jnp.where(valid, logp - jax.lax.stop_gradient(logp_old), 0.0)
    if level == "sequence":
        return jnp.where(valid, sequence_log_ratio(logp, logp_old, valid)[:, None], 0.0)
    raise ValueError(f"importance_sampling must be token or sequence; got {level!r}")


def entropy_mask(entropy: jax.Array, valid: jax.Array, quantile: float) -> jax.Array:
    """[B, T] bool: valid tokens whose entropy is at least the (1 - quantile) quantile of the
    valid tokens' entropies (linear interpolation between order statistics, as
    torch.quantile); quantile 1 keeps every valid token, 0 the highest-entropy ones only."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1]; got {quantile}")
    e = jax.lax.stop_gradient(entropy).astype(jnp.float32)
    ordered = jnp.sort(jnp.where(valid, e, jnp.inf).reshape(-1))  # valid ones first
    n = valid.sum()
    position = (1.0 - quantile) * jnp.maximum(n - 1, 0).astype(jnp.float32)
    low = jnp.floor(position).astype(jnp.int32)
    high = jnp.minimum(low + 1, jnp.maximum(n - 1, 0))
    threshold = ordered[low] + (position - low) * (ordered[high] - ordered[low])
    return valid & (e >= threshold)


def policy_term(log_ratio: jax.Array, logp: jax.Array, a: jax.Array, valid: jax.Array,
                cfg: GrpoConfig) -> jax.Array:
    """[B, T] policy loss per token for ratios exp(log_ratio) and advantages a [B, 1]: the
    clipped surrogate (grpo, with the two-sided cap `delta` when set) or CISPO's clipped,
    detached weight times logp. See the module docstring."""
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    if cfg.loss == "cispo":
        return -jax.lax.stop_gradient(clipped) * a * jnp.where(valid, logp, 0.0)
    if cfg.loss != "grpo":
        raise ValueError(f"loss must be grpo or cispo; got {cfg.loss!r}")
    capped = jnp.minimum(ratio, cfg.delta) if cfg.delta else ratio
    return -jnp.minimum(capped * a, clipped * a)


ROW_METRICS = frozenset({"seq_clip_frac"})
"""Metrics that are means over rows with a valid token; the others are means over valid tokens
(micro-batches combine each kind with its own counts)."""


def _clipped(ratio: jax.Array, a: jax.Array, cfg: GrpoConfig):
    """(held up, held down) bool: ratios the clip moved. For grpo only where it binds (r low
    with A < 0, r high with A > 0); CISPO clips the weight whatever the sign of A."""
    low, high = ratio < 1.0 - cfg.epsilon_low, ratio > 1.0 + cfg.epsilon_high
    if cfg.loss == "cispo":
        return low, high
    return low & (a < 0), high & (a > 0)


def tis_weights(prox: jax.Array, logp_old: jax.Array, valid: jax.Array, cap: float):
    """([B, T] truncated importance weights min(exp(prox - logp_old), cap) at valid tokens, 0
    elsewhere; [B, T] bool: valid tokens whose weight the cap cut), both without gradient."""
    prox, logp_old = jax.lax.stop_gradient(prox), jax.lax.stop_gradient(logp_old)
    ratio = jnp.exp(jnp.where(valid, prox - logp_old, 0.0))  # where() first: pads hold junk
    return jnp.where(valid, jnp.minimum(ratio, cap), 0.0), valid & (ratio > cap)


def carried_metrics(logp: jax.Array, logp_old: jax.Array, valid: jax.Array,
                    carried: jax.Array) -> dict:
    """Counts over the valid tokens marked carried (decoded under an older adapter): their
    number, the sum and the max of their learner/sampler ratio exp(logp - logp_old) (max 0 when
    there are none); sums and a max, not means, so that micro-batches combine them exactly."""
    on = valid & carried.astype(bool)
    ratio = jnp.where(on, jnp.exp(jnp.where(on, logp - logp_old, 0.0)), 0.0)
    return {"carried_tokens": on.sum().astype(jnp.float32), "carried_ratio_sum": ratio.sum(),
            "carried_ratio_max": ratio.max(initial=0.0)}


def _ratio_metrics(log_ratio, logp, logp_old, a, valid, cfg: GrpoConfig) -> dict:
    ratio = jnp.exp(log_ratio)
    low, high = _clipped(ratio, a, cfg)
    metrics = {"ratio_mean": masked_mean(ratio, valid), "clip_frac_low": masked_mean(low, valid),
               "clip_frac_high": masked_mean(high, valid)}
    metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    if cfg.importance_sampling == "sequence":
        rows = valid.any(axis=1)
        seq_low, seq_high = _clipped(jnp.exp(sequence_log_ratio(logp, logp_old, valid)),
                                     a[:, 0], cfg)
        metrics["seq_clip_frac"] = ((seq_low | seq_high) & rows).sum() / jnp.maximum(
            rows.sum(), 1)
    if cfg.delta:
        metrics["delta_clip_frac"] = masked_mean((ratio > cfg.delta) & (a < 0), valid)
    return metrics


def grpo_loss(logp: jax.Array, logp_old: jax.Array, advantages: jax.Array, mask: jax.Array,
              cfg: GrpoConfig, *, ref_logp: jax.Array | None = None,
              max_new_tokens: int | None = None, weights: jax.Array | None = None,
              entropy: jax.Array | None = None, selected: jax.Array | None = None,
              carried: jax.Array | None = None):
    """(loss scalar, metrics) for per-token log-probs [B, T], advantages [B], mask [B, T].

    cfg supplies beta, the epsilons, loss_agg and the variants of the module docstring.
    ref_logp is required when beta > 0 and ignored otherwise; max_new_tokens is required by
    Dr. GRPO aggregation. weights [B, T] replaces `token_weights(mask, ...)`: a micro-batch
    passes its slice of the whole batch's weights, so the accumulated loss and gradient equal
    the whole batch's. With top_entropy_quantile < 1, selected [B, T] (the whole batch's
    `entropy_mask`, sliced like weights) or else entropy [B, T] (this batch's) is required.
    Metrics (no gradient), token means over valid tokens unless in ROW_METRICS: ratio_mean;
    clip_frac_low, tokens the clip holds up (r < 1 - epsilon_low with A < 0; for cispo any A);
    clip_frac_high, held down (r > 1 + epsilon_high with A > 0; for cispo any A); clip_frac,
    either (TRL's clip_ratio/low_mean, high_mean, region_mean); seq_clip_frac (sequence
    ratios), the rows whose ratio was clipped; delta_clip_frac (delta), tokens with A < 0 and
    r > delta; entropy_selected_frac (top_entropy_quantile < 1); kl, the mean k3, and
    kl_weighted, the mean r * k3 (kl_ratio_weighted), when beta > 0; tis_weight_mean, the mean
    truncated importance weight, and tis_capped_frac, the tokens whose weight the cap cut
    (tis_cap > 0). carried [B, T] bool marks tokens decoded under an adapter older than the one
    this update starts from; given, it adds the counts carried_tokens (valid and carried),
    carried_ratio_sum and carried_ratio_max (sum and max over them of exp(logp - logp_old)).
    """
    if cfg.beta > 0 and ref_logp is None:
        raise ValueError(f"grpo.beta = {cfg.beta} > 0 needs ref_logp (the reference policy's "
                         "log-probs); pass them, or set grpo.beta = 0 to drop the KL term")
    valid = mask.astype(bool)
    if weights is None:
        weights = token_weights(valid, cfg.loss_agg, max_new_tokens)  # [B, T]
    # the ratio's denominator: the sampler's log-probs, or with tis_cap the proximal policy's
    old = jax.lax.stop_gradient(logp) if cfg.tis_cap > 0 else logp_old
    log_ratio = importance_log_ratio(logp, old, valid, cfg.importance_sampling)  # [B, T]
    a = jax.lax.stop_gradient(advantages).astype(jnp.float32)[:, None]  # [B, 1]
    per_token = policy_term(log_ratio, logp, a, valid, cfg)  # [B, T]
    metrics = _ratio_metrics(log_ratio, logp, old, a, valid, cfg)
    if cfg.tis_cap > 0:
        w, capped = tis_weights(old, logp_old, valid, cfg.tis_cap)
        per_token = per_token * w
        metrics["tis_weight_mean"] = masked_mean(w, valid)
        metrics["tis_capped_frac"] = masked_mean(capped, valid)
    if carried is not None:
        metrics.update(carried_metrics(logp, logp_old, valid, carried))
    if cfg.top_entropy_quantile < 1.0:
        if selected is None:
            if entropy is None:
                raise ValueError(f"grpo.top_entropy_quantile = {cfg.top_entropy_quantile} < 1 "
                                 "needs the tokens' entropy (or the selection `selected`)")
            selected = entropy_mask(entropy, valid, cfg.top_entropy_quantile)
        per_token = per_token * selected
        metrics["entropy_selected_frac"] = masked_mean(selected, valid)
    if cfg.beta > 0:
        ref = jax.lax.stop_gradient(ref_logp)
        kl = k3_kl(jnp.where(valid, logp, 0.0), jnp.where(valid, ref, 0.0))  # [B, T]; 0 at pads
        metrics["kl"] = masked_mean(kl, valid)
        if cfg.kl_ratio_weighted:
            kl = jnp.exp(log_ratio) * kl
            metrics["kl_weighted"] = masked_mean(kl, valid)
        per_token = per_token + cfg.beta * kl
    loss = jnp.sum(weights * per_token)
    return loss, jax.tree_util.tree_map(jax.lax.stop_gradient, metrics)

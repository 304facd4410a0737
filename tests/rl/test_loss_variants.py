"""The GRPO variants (GSPO, ratio-weighted KL, two-sided clip, CISPO, entropy-selected tokens)
against hand-computed values and float64 central differences of an independent reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import GrpoConfig
from jaxrl.rl.losses import entropy_mask, grpo_loss

LN2 = np.log(2.0)
_loss = jax.jit(grpo_loss, static_argnames=("cfg", "max_new_tokens"))


def _cfg(**kw):
    base = dict(beta=0.0, epsilon_low=0.2, epsilon_high=0.28, loss_agg="token-mean")
    return GrpoConfig(**{**base, **kw})


def _f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


def test_sequence_ratio_is_clipped_per_row_by_hand():
    # row 0: log ratios [0.2, 0.4] -> s = exp(0.3) = 1.349859; row 1: [-0.1] -> s = 0.904837
    # epsilon 0.2 / 0.28: row 0 (A = 1) is held at 1.28, row 1 (A = -1) is inside the range.
    # seq-mean-token-mean: (-1.28 + 0.904837) / 2 = -0.1875815
    logp = _f32([[0.2, 0.4], [-0.1, 50.0]])
    mask = np.array([[1, 1], [1, 0]], bool)
    adv = _f32([1.0, -1.0])
    cfg = _cfg(importance_sampling="sequence", loss_agg="seq-mean-token-mean")
    loss, m = _loss(logp, jnp.zeros((2, 2)), adv, mask, cfg)
    assert np.isclose(loss, (-1.28 + np.exp(-0.1)) / 2, atol=1e-6)
    assert np.isclose(m["seq_clip_frac"], 0.5) and np.isclose(m["clip_frac_high"], 2 / 3)
    assert np.isclose(m["ratio_mean"], (2 * np.exp(0.3) + np.exp(-0.1)) / 3, atol=1e-6)
    # row 1's loss is s * w with w = 1 / 2, and ds / dlogp = s / len: 0.904837 / 2
    grad = jax.grad(lambda lp: _loss(lp, jnp.zeros((2, 2)), adv, mask, cfg)[0])(logp)
    np.testing.assert_allclose(grad, [[0, 0], [np.exp(-0.1) / 2, 0]], atol=1e-6)
    # epsilon_high 0.4 leaves row 0 unclipped: its loss -s * (2 tokens x 1/4) spreads over both
    # tokens, ds / dlogp_t = s / 2: -0.25 * 1.349859 = -0.337465 each
    wide = dataclasses.replace(cfg, epsilon_high=0.4)
    grad = jax.grad(lambda lp: _loss(lp, jnp.zeros((2, 2)), adv, mask, wide)[0])(logp)
    np.testing.assert_allclose(grad[0], [-0.25 * np.exp(0.3)] * 2, atol=1e-6)


def test_ratio_weighted_kl_by_hand():
    # one token, A = 0: only the KL term. r = 0.5 / 0.25 = 2, d = ln(0.25 / 0.5) = -ln 2,
    # k3 = 0.5 + ln 2 - 1 = 0.193147. beta 0.1: plain 0.0193147, weighted 2 x that.
    # gradients: plain beta * (1 - exp(d)) = 0.05; weighted beta * r * (logp - ref) = 0.2 ln 2
    logp, old, ref = _f32([[np.log(0.5)]]), _f32([[np.log(0.25)]]), _f32([[np.log(0.25)]])
    mask, adv = np.ones((1, 1), bool), jnp.zeros(1)
    for weighted, value, slope in ((False, 0.0193147, 0.05), (True, 0.0386294, 0.2 * LN2)):
        cfg = _cfg(beta=0.1, kl_ratio_weighted=weighted)
        f = lambda lp: _loss(lp, old, adv, mask, cfg, ref_logp=ref)  # noqa: E731
        (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
        assert np.isclose(loss, value, atol=1e-6) and np.isclose(grad[0, 0], slope, atol=1e-6)
        assert np.isclose(m["kl"], 0.193147, atol=1e-6)
        assert ("kl_weighted" in m) == weighted


def test_two_sided_clip_caps_negative_advantages_by_hand():
    # one token per row, epsilon 0.2 / 0.28, delta 2; ratios [3, 1.5, 3], A [-1, -1, 1]
    # row 0: min(min(3, 2) * -1, 1.28 * -1) = -2 -> 2 (without delta: 3), no gradient
    # row 1: r < delta, min(-1.5, -1.28) = -1.5 -> 1.5, gradient r / 3 = 0.5
    # row 2: A > 0 is held at 1.28 by the clip either way -> -1.28
    logp, old = _f32(np.log([[3.0], [1.5], [3.0]])), jnp.zeros((3, 1))
    adv, mask = _f32([-1.0, -1.0, 1.0]), np.ones((3, 1), bool)
    for delta, value, grad0 in ((2.0, (2 + 1.5 - 1.28) / 3, 0.0), (0.0, (3 + 1.5 - 1.28) / 3, 1.0)):
        f = lambda lp: _loss(lp, old, adv, mask, _cfg(delta=delta))  # noqa: E731
        (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
        assert np.isclose(loss, value, atol=1e-6)
        np.testing.assert_allclose(grad[:, 0], [grad0, 0.5, 0.0], atol=1e-6)
        assert ("delta_clip_frac" in m) == bool(delta)
    assert np.isclose(m["clip_frac_high"], 1 / 3)


def test_cispo_weights_every_token_by_its_clipped_detached_ratio_by_hand():
    # one row, A = 2; ratios [2, 0.5, 1]; epsilon_low 1 (no lower bound), epsilon_high 0.5 (cap
    # 1.5): weights [1.5, 0.5, 1]. loss_t = -w * A * logp:
    # [-1.5 * 2 * ln 0.5, -0.5 * 2 * ln 0.25, -1 * 2 * ln 0.8] = [2.079442, 1.386294, 0.446287],
    # token-mean 1.304008; gradient -w * A / 3 = [-1, -1/3, -2/3]: the capped token keeps its own
    logp = _f32(np.log([[0.5, 0.25, 0.8]]))
    old = _f32(np.log([[0.25, 0.5, 0.8]]))
    cfg = _cfg(loss="cispo", epsilon_low=1.0, epsilon_high=0.5)
    f = lambda lp: _loss(lp, old, _f32([2.0]), np.ones((1, 3), bool), cfg)  # noqa: E731
    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
    assert np.isclose(loss, (2.079442 + 1.386294 + 0.446287) / 3, atol=1e-6)
    np.testing.assert_allclose(grad[0], [-1.0, -1 / 3, -2 / 3], atol=1e-6)
    assert np.isclose(m["clip_frac_high"], 1 / 3) and m["clip_frac_low"] == 0


ENTROPY = np.array([[0.1, 0.5, 0.3], [0.9, 0.7, 10.0]])  # 10.0 sits on padding
EMASK = np.array([[1, 1, 1], [1, 1, 0]], bool)


def test_entropy_quantile_by_hand():
    # valid entropies sorted [0.1, 0.3, 0.5, 0.7, 0.9]; rho 0.4 -> the 0.6 quantile: position
    # 0.6 * 4 = 2.4 -> 0.5 + 0.4 * (0.7 - 0.5) = 0.58 (numpy agrees): keeps 0.9 and 0.7
    assert np.isclose(np.quantile(ENTROPY[EMASK], 0.6), 0.58)
    got = entropy_mask(_f32(ENTROPY), EMASK, 0.4)
    np.testing.assert_array_equal(got, [[0, 0, 0], [1, 1, 0]])
    np.testing.assert_array_equal(entropy_mask(_f32(ENTROPY), EMASK, 1.0), EMASK)
    np.testing.assert_array_equal(entropy_mask(_f32(ENTROPY), EMASK, 0.0), [[0, 0, 0], [1, 0, 0]])
    assert not entropy_mask(_f32(ENTROPY), np.zeros_like(EMASK), 0.5).any()


def test_entropy_selection_drops_the_policy_term_only_by_hand():
    # r = 1 everywhere, A = 1: each selected token adds -1; token-mean over all 5 valid tokens
    # (unselected ones stay in the denominator): -2 / 5. With beta 0.1 and ref = logp - ln 2 on
    # every token (d = -ln 2, k3 = 0.5 + ln 2 - 1 = 0.193147) the KL counts on all 5:
    # -0.4 + 0.1 * 0.193147
    logp = jnp.full((2, 3), -1.0)
    cfg = _cfg(top_entropy_quantile=0.4)
    loss, m = _loss(logp, logp, _f32([1.0, 1.0]), EMASK, cfg, entropy=_f32(ENTROPY))
    assert np.isclose(loss, -0.4, atol=1e-6) and np.isclose(m["entropy_selected_frac"], 0.4)
    loss, _ = _loss(logp, logp, _f32([1.0, 1.0]), EMASK, dataclasses.replace(cfg, beta=0.1),
                    entropy=_f32(ENTROPY), ref_logp=logp + np.log(0.5))
    assert np.isclose(loss, -0.4 + 0.1 * (LN2 - 0.5), atol=1e-6)
    with pytest.raises(ValueError, match="needs the tokens' entropy"):
        grpo_loss(logp, logp, jnp.ones(2), EMASK, cfg)


def _np_loss(logp, old, ref, adv, mask, entropy, cfg: GrpoConfig, max_new=6):
    """Independent float64 reference, written the way TRL 1.16's _compute_loss writes it."""
    m = mask.astype(np.float64)
    log_ratio = logp - old
    if cfg.importance_sampling == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1))[:, None]
    coef1, a = np.exp(log_ratio), adv[:, None]
    kl = np.exp(ref - logp) - (ref - logp) - 1
    if cfg.kl_ratio_weighted:
        kl = kl * coef1
    if cfg.loss == "cispo":
        per = -np.minimum(coef1, 1 + cfg.epsilon_high) * a * logp  # weights are constants
    else:
        coef2 = np.clip(coef1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
        coef1 = np.minimum(coef1, cfg.delta) if cfg.delta else coef1
        per = -np.minimum(coef1 * a, coef2 * a)
    if cfg.top_entropy_quantile < 1:
        per = per * (entropy >= np.quantile(entropy[mask], 1 - cfg.top_entropy_quantile))
    per = per + cfg.beta * kl
    if cfg.loss_agg == "seq-mean-token-mean":
        return np.mean((per * m).sum(1) / m.sum(1))
    if cfg.loss_agg == "token-mean":
        return (per * m).sum() / m.sum()
    return (per * m).sum() / (len(m) * max_new)


VARIANTS = {
    "gspo+weighted-kl": _cfg(importance_sampling="sequence", epsilon_low=0.05, epsilon_high=0.1,
                             kl_ratio_weighted=True, loss_agg="seq-mean-token-mean"),
    "delta+weighted-kl": _cfg(delta=1.5, kl_ratio_weighted=True),
    "cispo": _cfg(loss="cispo", epsilon_low=1.0, epsilon_high=0.3, kl_ratio_weighted=True),
    "entropy+dr-grpo": _cfg(top_entropy_quantile=0.5, loss_agg="seq-mean-token-sum-norm"),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_gradient_matches_float64_central_differences(name):
    cfg = dataclasses.replace(VARIANTS[name], beta=0.04)
    rng = np.random.RandomState(4)
    b, t = 3, 5
    logp = rng.uniform(-3, -0.1, (b, t))
    old = logp + rng.normal(0, 0.4, (b, t))
    ref = logp + rng.normal(0, 0.5, (b, t))
    entropy = rng.uniform(0, 3, (b, t))
    adv = np.array([1.3, -0.7, 0.4])
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], bool)
    f = lambda lp: _np_loss(lp, old, ref, adv, mask, entropy, cfg)  # noqa: E731
    want, step = np.zeros_like(logp), 1e-6
    for idx in np.ndindex(b, t):
        e = np.zeros_like(logp)
        e[idx] = step
        want[idx] = (f(logp + e) - f(logp - e)) / (2 * step)
    if cfg.loss == "cispo":  # the weight is detached: differentiate with it held fixed
        ratio = np.exp(logp - old)
        want = want - _cispo_weight_slope(logp, old, ref, adv, mask, cfg, ratio)

    def loss_fn(lp):
        return _loss(lp, _f32(old), _f32(adv), mask, cfg, ref_logp=_f32(ref), max_new_tokens=6,
                     entropy=_f32(entropy))[0]
    loss, grad = jax.value_and_grad(loss_fn)(_f32(logp))
    assert np.isclose(loss, f(logp), atol=1e-6)
    np.testing.assert_allclose(grad, want, atol=2e-6, rtol=1e-4)
    assert np.all(np.asarray(grad)[~mask] == 0)


def _cispo_weight_slope(logp, old, ref, adv, mask, cfg, ratio):
    """The part of CISPO's finite differences that comes from moving the weight itself:
    -(d w / d logp) * A * logp / tokens, with d w / d logp = r where the cap does not bind."""
    inside = ratio < 1 + cfg.epsilon_high
    return -(inside * ratio) * adv[:, None] * logp * mask / mask.sum()

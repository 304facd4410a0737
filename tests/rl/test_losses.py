"""The GRPO loss against hand-computed values and a float64 finite-difference reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import LOSS_AGGS, GrpoConfig
from jaxrl.rl.advantages import group_advantages
from jaxrl.rl.losses import grpo_loss, k3_kl, token_weights

LN2 = np.log(2.0)
_loss = jax.jit(grpo_loss, static_argnames=("cfg", "max_new_tokens"))  # one compile per shape


def _cfg(loss_agg="token-mean", beta=0.0, low=0.2, high=0.28):
    return GrpoConfig(beta=beta, epsilon_low=low, epsilon_high=high, loss_agg=loss_agg)


def test_clipped_surrogate_both_sides_by_hand():
    # One token per row, epsilon_low 0.2, epsilon_high 0.28: clip range [0.8, 1.28].
    ratio = np.array([1.5, 0.5, 0.5, 2.0])
    adv = np.array([2.0, -1.0, 1.0, -1.0])
    # row 0: min(1.5 * 2, 1.28 * 2) = 2.56 -> loss -2.56, clipped high (r > 1.28, A > 0)
    # row 1: min(-0.5, 0.8 * -1) = -0.8 -> loss 0.8, clipped low (r < 0.8, A < 0)
    # row 2: min(0.5, 0.8) = 0.5 -> loss -0.5, unclipped: the pessimistic side is r * A
    # row 3: min(-2, -1.28) = -2 -> loss 2, unclipped
    # token-mean: (-2.56 + 0.8 - 0.5 + 2) / 4 = -0.065
    logp = jnp.asarray(np.log(ratio)[:, None], jnp.float32)
    old = jnp.zeros((4, 1))
    mask = jnp.ones((4, 1), bool)
    loss, m = _loss(logp, old, jnp.asarray(adv), mask, _cfg())
    assert np.isclose(loss, -0.065, atol=1e-6)
    assert np.isclose(m["ratio_mean"], (1.5 + 0.5 + 0.5 + 2.0) / 4, atol=1e-6)
    assert np.isclose(m["clip_frac_low"], 0.25) and np.isclose(m["clip_frac_high"], 0.25)
    assert np.isclose(m["clip_frac"], 0.5)
    assert "kl" not in m
    # d loss / d logp = -r * A / 4 where the unclipped side is taken, 0 where the clip holds:
    # [0, 0, -0.5 * 1 / 4, -2 * -1 / 4]
    grad = jax.grad(lambda lp: _loss(lp, old, jnp.asarray(adv), mask, _cfg())[0])(logp)
    np.testing.assert_allclose(grad[:, 0], [0.0, 0.0, -0.125, 0.5], atol=1e-6)


def test_k3_kl_by_hand():
    # d = ref - logp. d = ln(1/2): 0.5 - (-0.693147) - 1 = 0.193147
    #                 d = ln 2:   2 - 0.693147 - 1 = 0.306853;  d = 0: 0
    got = k3_kl(jnp.log(jnp.array([0.5, 0.5, 0.3])), jnp.log(jnp.array([0.25, 1.0, 0.3])))
    np.testing.assert_allclose(got, [0.5 + LN2 - 1, 2 - LN2 - 1, 0.0], atol=1e-6)
    assert np.isclose(got[0], 0.193147, atol=1e-6) and np.isclose(got[1], 0.306853, atol=1e-6)


# Two rows of 3 and 1 valid tokens; padded slots hold junk that must not leak (exp(50) * 0 = nan).
MASK = np.array([[1, 1, 1], [1, 0, 0]], bool)
JUNK = 50.0


def test_aggregation_modes_with_unequal_lengths_by_hand():
    # epsilon 0.2 / 0.28; every ratio is inside the clip range, so per token loss = -r * A.
    # row 0, A = 1, r = [1.0, 1.1, 0.9]: losses [-1.0, -1.1, -0.9], sum -3.0, mean -1.0
    # row 1, A = -1, r = [1.1]:          loss 1.1
    logp = np.log(np.array([[1.0, 1.1, 0.9], [1.1, 1.0, 1.0]]))
    logp[1, 1:] = JUNK
    args = (jnp.asarray(logp, jnp.float32), jnp.zeros((2, 3)), jnp.array([1.0, -1.0]), MASK)
    want = {"seq-mean-token-mean": (-1.0 + 1.1) / 2,       # 0.05
            "token-mean": (-3.0 + 1.1) / 4,                # -0.475
            "seq-mean-token-sum-norm": (-3.0 + 1.1) / (2 * 4)}  # -0.2375, max_new_tokens = 4
    for agg, value in want.items():
        loss, m = _loss(*args, _cfg(agg), max_new_tokens=4)
        assert np.isclose(loss, value, atol=1e-6), (agg, float(loss), value)
        assert np.isclose(m["ratio_mean"], (3.0 + 1.1) / 4, atol=1e-6)


def test_kl_term_per_aggregation_by_hand():
    # A = 0 and r = 1: only beta * k3 remains. k3 (see test_k3_kl_by_hand):
    # row 0: [0.193147, 0.306853, 0], sum (0.5 + ln 2 - 1) + (2 - ln 2 - 1) = 0.5
    # row 1: [0.193147];  all four tokens: 0.5 + 0.193147 = 0.693147 = ln 2
    logp = np.log(np.array([[0.5, 0.5, 0.3], [0.5, 1.0, 1.0]]))
    ref = np.log(np.array([[0.25, 1.0, 0.3], [0.25, 1.0, 1.0]]))
    logp[1, 1:], ref[1, 1:] = JUNK, -JUNK
    lp = jnp.asarray(logp, jnp.float32)
    k3 = 0.5 + LN2 - 1
    want = {"seq-mean-token-mean": 0.1 * ((0.5 / 3) + k3) / 2,  # 0.1 * 0.179907
            "token-mean": 0.1 * LN2 / 4,                       # 0.1 * 0.173287
            "seq-mean-token-sum-norm": 0.1 * LN2 / (2 * 4)}    # 0.1 * 0.086643
    for agg, value in want.items():
        loss, m = _loss(lp, lp, jnp.zeros(2), MASK, _cfg(agg, beta=0.1),
                            ref_logp=jnp.asarray(ref, jnp.float32), max_new_tokens=4)
        assert np.isclose(loss, value, atol=1e-6), (agg, float(loss), value)
        assert np.isclose(m["kl"], LN2 / 4, atol=1e-6)


def test_rows_without_valid_tokens_do_not_count():
    weights = token_weights(np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool),
                            "seq-mean-token-mean")
    np.testing.assert_allclose(weights, [[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(token_weights(np.zeros((2, 3), bool), "token-mean"), 0.0)


def _np_loss(logp, old, ref, adv, mask, beta, low, high, agg, max_new):
    """Independent float64 reference, written the way TRL writes it."""
    ratio = np.exp(logp - old)
    a = adv[:, None]
    per = -np.minimum(ratio * a, np.clip(ratio, 1 - low, 1 + high) * a)
    d = ref - logp
    per = per + beta * (np.exp(d) - d - 1)
    m = mask.astype(np.float64)
    if agg == "seq-mean-token-mean":
        return np.mean((per * m).sum(1) / m.sum(1))
    if agg == "token-mean":
        return (per * m).sum() / m.sum()
    return (per * m).sum() / (len(m) * max_new)


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_gradient_matches_float64_central_differences(agg):
    rng = np.random.RandomState(1)
    b, t, max_new = 3, 5, 6
    logp = rng.uniform(-3, -0.1, (b, t))
    old = logp + rng.normal(0, 0.4, (b, t))  # ratios on both sides of both clip edges
    ref = logp + rng.normal(0, 0.5, (b, t))
    adv = np.array([1.3, -0.7, 0.4])
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], bool)
    consts = (old, ref, adv, mask, 0.04, 0.2, 0.28, agg, max_new)
    f = lambda lp: _np_loss(lp, *consts)
    want, step = np.zeros_like(logp), 1e-6
    for idx in np.ndindex(b, t):
        e = np.zeros_like(logp)
        e[idx] = step
        want[idx] = (f(logp + e) - f(logp - e)) / (2 * step)
    loss_fn = lambda lp: _loss(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv), mask,
                                   _cfg(agg, beta=0.04), ref_logp=jnp.asarray(ref, jnp.float32),
                                   max_new_tokens=max_new)[0]
    loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp, jnp.float32))
    assert np.isclose(loss, f(logp), atol=1e-6)
    np.testing.assert_allclose(grad, want, atol=2e-6, rtol=1e-4)
    assert np.all(np.asarray(grad)[~mask] == 0)
    ratio = np.exp(logp - old)[mask]
    assert (ratio < 0.8).any() and (ratio > 1.28).any()  # the check covered clipped tokens


def test_one_iteration_without_kl_has_zero_loss_but_a_policy_gradient():
    # mu = 1: logp_old equals logp in value. Rewards [1, 0, 0, 1] give A = +-a with
    # a = 0.5 / (sqrt(1/3) + 1e-4) = 0.865876, which sum to 0 over the group.
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), 4)
    lengths = np.array([3, 1, 2, 2])
    mask = np.arange(3)[None, :] < lengths[:, None]  # [4, 3]
    logp = jnp.asarray(np.random.RandomState(2).uniform(-3, -0.1, (4, 3)), jnp.float32)

    def loss_fn(lp, agg):
        return _loss(lp, jax.lax.stop_gradient(lp), adv, mask, _cfg(agg))[0]

    loss, grad = jax.value_and_grad(loss_fn)(logp, "seq-mean-token-mean")
    assert abs(float(loss)) < 1e-6
    assert float(jnp.linalg.norm(grad)) > 0.1
    # d loss / d logp[i, t] = -A_i / (len_i * 4): row 0 -0.865876 / 12 = -0.072156
    assert np.isclose(grad[0, 0], -0.865876 / 12, atol=1e-6)
    # token-mean weighs rows by length, so its value is -sum(len_i * A_i) / 8, not 0:
    # -(3 - 1 - 2 + 2) * 0.865876 / 8 = -0.216469
    assert np.isclose(loss_fn(logp, "token-mean"), -0.216469, atol=1e-6)


def test_missing_inputs_are_named():
    lp, mask, adv = jnp.zeros((2, 3)), MASK, jnp.zeros(2)
    with pytest.raises(ValueError, match="grpo.beta = 0.04 > 0 needs ref_logp"):
        grpo_loss(lp, lp, adv, mask, _cfg(beta=0.04))
    with pytest.raises(ValueError, match="need an int >= the mask's 3 completion positions"):
        grpo_loss(lp, lp, adv, mask, _cfg("seq-mean-token-sum-norm"))
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        grpo_loss(lp, lp, adv, mask, _cfg("sum"))

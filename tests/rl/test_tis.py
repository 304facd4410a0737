"""Truncated importance sampling (grpo.tis_cap) and the carried-token metrics, by hand first,
then through the jitted update with one and two micro-batches."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import Config, ConfigError, GrpoConfig, apply_overrides
from jaxrl.lora.lora import init_lora
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.losses import grpo_loss
from tests.rl.test_train_step import N, P, _run, setup  # noqa: F401  (setup is a fixture)

_loss = jax.jit(grpo_loss, static_argnames=("cfg", "max_new_tokens"))
LN15, LN2, LN3 = np.log(1.5), np.log(2.0), np.log(3.0)
JUNK = 50.0

# Two rows of 3 positions; row 1's last position is padding holding junk (exp(100) * 0 = nan
# if it leaked). Learner log-probs and the sampler's, chosen so that exp(logp - logp_old) is
#   row 0: [1.5, e^20 (the sampler far below the learner), 0.5]
#   row 1: [3, 1, junk]
LOGP = np.array([[-1.0, -2.0, -0.5], [-1.5, -0.7, JUNK]])
OLD = np.array([[-1.0 - LN15, -22.0, -0.5 + LN2], [-1.5 - LN3, -0.7, -JUNK]])
ADV = np.array([1.0, -0.5])
MASK = np.array([[1, 1, 1], [1, 1, 0]], bool)


def _f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


def _cfg(**kw):
    base = dict(beta=0.0, epsilon_low=0.2, epsilon_high=0.28, loss_agg="seq-mean-token-mean")
    return GrpoConfig(**{**base, **kw})


def _value_and_grad(cfg, logp=LOGP, old=OLD, adv=ADV, mask=MASK, **kw):
    f = lambda lp: _loss(lp, _f32(old), _f32(adv), mask, cfg, **kw)  # noqa: E731
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(_f32(logp))
    return float(loss), metrics, np.asarray(grad)


def test_tis_cap_zero_is_the_loss_without_it():
    """tis_cap 0 (the default) and a carried mask change neither loss nor gradient, bit for bit,
    for every variant; on random input with a KL term."""
    rng = np.random.RandomState(0)
    b, t = 4, 6
    logp = rng.uniform(-3, -0.1, (b, t))
    old = logp + rng.normal(0, 0.5, (b, t))
    ref = logp + rng.normal(0, 0.5, (b, t))
    adv = rng.normal(size=b)
    mask = np.ones((b, t), bool)
    mask[1, 3:] = mask[3, 1:] = False
    carried = rng.rand(b, t) < 0.5
    for kw in ({}, dict(importance_sampling="sequence"), dict(delta=1.5, kl_ratio_weighted=True),
               dict(loss="cispo", loss_agg="token-mean", epsilon_low=1.0)):
        plain = _cfg(beta=0.04, **kw)
        assert plain.tis_cap == 0.0
        off = dataclasses.replace(plain, tis_cap=0.0)
        base = _value_and_grad(plain, logp, old, adv, mask, ref_logp=_f32(ref))
        for cfg, extra in ((off, {}), (plain, {"carried": jnp.asarray(carried)})):
            loss, metrics, grad = _value_and_grad(cfg, logp, old, adv, mask, ref_logp=_f32(ref),
                                                  **extra)
            assert loss == base[0]
            np.testing.assert_array_equal(grad, base[2])
            for key, value in base[1].items():
                np.testing.assert_array_equal(metrics[key], value)
            assert not any(k.startswith("tis_") for k in metrics)


def test_truncated_weights_and_gradient_by_hand():
    # tis_cap 2: w = min(exp(prox - old), 2) with prox = logp (the adapter at the update's start)
    #   row 0: [1.5, 2 (e^20, capped), 0.5]; row 1: [2 (3, capped), 1, 0 (padding)]
    # the ratio against prox is 1 (inside the clip), so per token loss = -w * A, gradient -w * A.
    # seq-mean-token-mean weights: row 0 1 / (3 * 2) = 1/6, row 1 1 / (2 * 2) = 1/4
    #   loss = 1/6 * -(1.5 + 2 + 0.5) * 1 + 1/4 * -(2 + 1) * -0.5 = -2/3 + 3/8 = -7/24
    #   d loss / d logp = -w * A * weight: row 0 [-1.5, -2, -0.5] / 6, row 1 [2, 1, 0] * 0.5 / 4
    loss, m, grad = _value_and_grad(_cfg(tis_cap=2.0))
    assert np.isclose(loss, -7 / 24, atol=1e-6)
    np.testing.assert_allclose(grad, [[-0.25, -1 / 3, -1 / 12], [0.25, 0.125, 0.0]], atol=1e-6)
    assert np.isclose(m["tis_weight_mean"], (1.5 + 2 + 0.5 + 2 + 1) / 5, atol=1e-6)
    assert np.isclose(m["tis_capped_frac"], 2 / 5)
    # the clipped ratio is against prox: 1 everywhere, nothing clipped
    assert np.isclose(m["ratio_mean"], 1.0) and float(m["clip_frac"]) == 0.0
    assert "carried_tokens" not in m

    # a cap above every ratio: each token weighted by exactly exp(prox - old), except the far one
    _, m, grad = _value_and_grad(_cfg(tis_cap=2.5))
    np.testing.assert_allclose(grad, [[-1.5 / 6, -2.5 / 6, -0.5 / 6], [2.5 / 8, 1 / 8, 0]],
                               atol=1e-6)
    assert np.isclose(m["tis_capped_frac"], 2 / 5)  # e^20 and 3 both exceed 2.5
    _, m, grad = _value_and_grad(_cfg(tis_cap=4.0))
    assert np.isclose(m["tis_capped_frac"], 1 / 5)
    np.testing.assert_allclose(grad[1], [3 / 8, 1 / 8, 0], atol=1e-6)


def test_truncated_weights_compose_with_sequence_ratios_and_cispo_by_hand():
    # sequence: s_b = exp(mean over the row of logp - prox) = 1 in value, ds_b / dlogp_t = 1 / len
    # per token loss = -s_b * A * w_t, so d loss / d logp_t = -A / len * sum_t' weight_t' w_t'
    #   row 0: -1 / 3 * (1/6 * 4) = -2/9 each; row 1: 0.5 / 2 * (1/4 * 3) = 0.1875 each
    loss, m, grad = _value_and_grad(_cfg(tis_cap=2.0, importance_sampling="sequence"))
    assert np.isclose(loss, -7 / 24, atol=1e-6)
    np.testing.assert_allclose(grad, [[-2 / 9] * 3, [0.1875, 0.1875, 0.0]], atol=1e-6)
    assert float(m["seq_clip_frac"]) == 0.0 and np.isclose(m["tis_weight_mean"], 1.4)
    # cispo (token-mean): per token -clip(1) * A * logp * w, weights 1/5
    #   row 0: -(1.5 * -1 + 2 * -2 + 0.5 * -0.5) = 5.75; row 1: 0.5 * (2 * -1.5 + 1 * -0.7) = -1.85
    #   loss (5.75 - 1.85) / 5 = 0.78; gradient -w * A / 5
    loss, m, grad = _value_and_grad(_cfg(tis_cap=2.0, loss="cispo", loss_agg="token-mean",
                                         epsilon_low=1.0))
    assert np.isclose(loss, 0.78, atol=1e-6)
    np.testing.assert_allclose(grad, [[-0.3, -0.4, -0.1], [0.2, 0.1, 0.0]], atol=1e-6)


def test_kl_term_is_not_weighted():
    # beta 0.5, ref = logp + ln 2 at every token: k3 = 2 - ln 2 - 1, d k3 / d logp = 1 - 2 = -1.
    # With tis_cap the KL adds 0.5 * k3 (weights sum to 1) and 0.5 * -1 * weight to each token's
    # gradient, unweighted by w.
    ref = np.where(MASK, LOGP + LN2, 0.0)
    plain, _, plain_grad = _value_and_grad(_cfg(tis_cap=2.0))
    loss, m, grad = _value_and_grad(_cfg(tis_cap=2.0, beta=0.5), ref_logp=_f32(ref))
    assert np.isclose(loss, plain + 0.5 * (1 - LN2), atol=1e-6)
    weight = np.array([[1 / 6] * 3, [0.25, 0.25, 0.0]])
    np.testing.assert_allclose(grad, plain_grad - 0.5 * weight, atol=1e-6)
    assert np.isclose(m["kl"], 1 - LN2, atol=1e-6)


def test_carried_metrics_by_hand():
    # learner/sampler ratios exp(logp - old): row 0 [1.5, e^20, 0.5], row 1 [3, 1, junk]
    # carried valid tokens: (0, 0) 1.5, (0, 2) 0.5, (1, 0) 3; (1, 2) is carried but padding
    carried = jnp.asarray([[1, 0, 1], [1, 0, 1]], bool)
    _, m, _ = _value_and_grad(_cfg(), carried=carried)
    assert float(m["carried_tokens"]) == 3.0
    assert np.isclose(m["carried_ratio_sum"], 1.5 + 0.5 + 3, rtol=1e-6)
    assert np.isclose(m["carried_ratio_max"], 3.0, rtol=1e-6)
    none = jnp.zeros((2, 3), bool)
    _, m, _ = _value_and_grad(_cfg(), carried=none)
    assert [float(m[k]) for k in ("carried_tokens", "carried_ratio_sum", "carried_ratio_max")] \
        == [0.0, 0.0, 0.0]
    # with tis_cap as well, the metrics still describe the sampler: the same numbers
    _, m, _ = _value_and_grad(_cfg(tis_cap=2.0), carried=carried)
    assert np.isclose(m["carried_ratio_max"], 3.0, rtol=1e-6)


def test_carried_metrics_through_train_step_agree_across_micro_batches(setup):  # noqa: F811
    spec, params, batch = setup
    b = batch.tokens.shape[0]
    rng = np.random.RandomState(3)
    carried = rng.rand(b, N) < 0.5
    carried[:, 0] = True  # both halves of the batch hold carried tokens
    batch = batch.replace(carried=jnp.asarray(carried))
    grpo = GrpoConfig(beta=0.04, tis_cap=2.0)
    _, m1, _ = _run(setup, 1, batch=batch, grpo=grpo)
    _, m2, _ = _run(setup, 2, batch=batch, grpo=grpo)

    # independently: the learner's log-probs under the adapter _run starts from
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=4, alpha=8)
    lora = lora.replace(weights=jax.tree_util.tree_map(
        lambda x: x + 0.1 if x.ndim == 3 and x.shape[1] == 4 else x, lora.weights))
    logp = token_logprobs(params, spec, batch.tokens, batch.positions, batch.attn_mask, lora,
                          start=P)[0]
    on = carried & np.asarray(batch.completion_mask)
    ratio = np.exp(np.asarray(logp, np.float64) - np.asarray(batch.logp_old, np.float64))[on]
    half = on[: b // 2].sum()
    assert 0 < half < on.sum()
    # the largest ratio of each half differs: a sum of the halves' maxima would not pass
    assert not np.isclose(ratio[:half].max(), ratio[half:].max())
    for m in (m1, m2):
        assert float(m["carried_tokens"]) == on.sum()
        np.testing.assert_allclose(m["carried_ratio_mean"], ratio.mean(), rtol=1e-5)
        np.testing.assert_allclose(m["carried_ratio_max"], ratio.max(), rtol=1e-5)
        assert "carried_ratio_sum" not in m
    for key in ("carried_ratio_mean", "carried_ratio_max", "tis_weight_mean", "tis_capped_frac",
                "loss", "grad_norm"):
        np.testing.assert_allclose(m1[key], m2[key], rtol=1e-5, atol=1e-7)

    # a batch without `carried` reports exactly the metrics it did before
    _, plain, _ = _run(setup, 2, grpo=grpo)
    carried_keys = {"carried_tokens", "carried_ratio_mean", "carried_ratio_max"}
    assert set(m2) == set(plain) | carried_keys and not carried_keys & set(plain)
    np.testing.assert_allclose(plain["loss"], m2["loss"], rtol=1e-6, atol=1e-7)


def test_config_refuses_tis_cap_with_several_iterations():
    with pytest.raises(ConfigError, match=r"'grpo\.tis_cap' \(2\.0\) needs 'grpo\.num_iterations'"
                       r" = 1; got 2"):
        apply_overrides(Config(), ["grpo.tis_cap=2", "grpo.num_iterations=2"])
    with pytest.raises(ConfigError, match=r"'grpo\.tis_cap' must be >= 0"):
        apply_overrides(Config(), ["grpo.tis_cap=-1"])
    ok = apply_overrides(Config(), ["grpo.tis_cap=2", "grpo.loss=cispo",
                                    "grpo.loss_agg=token-mean",
                                    "grpo.importance_sampling=sequence"])
    assert ok.grpo.tis_cap == 2.0 and ok.grpo.num_iterations == 1
    assert apply_overrides(Config(), ["grpo.num_iterations=2"]).grpo.tis_cap == 0.0

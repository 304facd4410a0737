"""Group-relative advantages against values worked out by hand."""
import jax
import numpy as np
import pytest

from jaxrl.rl.advantages import EPS, compute_advantages, group_advantages, zero_spread

G = 4
# Three prompts of four completions each: mixed, all correct (zero spread), one of four correct.
REWARDS = np.array([1, 0, 0, 1,
                    1, 1, 1, 1,
                    0, 0, 0, 1], np.float32)
# Group means 0.5, 1, 0.25; centred rewards r - group mean:
CENTRED = np.array([0.5, -0.5, -0.5, 0.5,
                    0.0, 0.0, 0.0, 0.0,
                    -0.25, -0.25, -0.25, 0.75])


def test_group_scaling_uses_the_unbiased_group_std():
    # group 0: squared deviations 4 * 0.25 = 1, / (4 - 1) -> std sqrt(1/3) = 0.57735
    # group 1: std 0 -> advantages 0 / (0 + eps) = 0
    # group 2: squared deviations 3 * 0.0625 + 0.5625 = 0.75, / 3 = 0.25 -> std 0.5
    std = np.repeat([np.sqrt(1 / 3), 0.0, 0.5], G)
    want = CENTRED / (std + EPS)  # e.g. 0.5 / 0.57745 = 0.86588, 0.75 / 0.5001 = 1.49970
    got = group_advantages(REWARDS, G, "group")
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.isclose(got[0], 0.865876, atol=1e-6) and np.isclose(got[11], 1.499700, atol=1e-6)


def test_batch_scaling_divides_by_the_std_of_the_whole_batch():
    # 12 rewards, seven ones: mean 7/12; sum of squared deviations 7 - 12 * (7/12)^2 = 35/12;
    # unbiased variance (35/12) / 11 = 35/132 -> std 0.514929
    want = CENTRED / (np.sqrt(35 / 132) + EPS)
    np.testing.assert_allclose(group_advantages(REWARDS, G, "batch"), want, rtol=1e-6)


def test_no_scaling_is_dr_grpo_centring_only():
    np.testing.assert_allclose(group_advantages(REWARDS, G, "none"), CENTRED, atol=1e-7)


def test_zero_spread_filter_drops_whole_groups_and_counts_them():
    assert zero_spread(REWARDS, G).tolist() == [False, True, False]
    out = compute_advantages(REWARDS, G, filter_zero_spread=True)
    np.testing.assert_array_equal(out.keep, [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    assert int(out.metrics["zero_spread_groups"]) == 1
    assert np.isclose(out.metrics["zero_spread_frac"], 1 / 3)
    assert np.isclose(out.metrics["kept_frac"], 8 / 12)
    np.testing.assert_allclose(out.advantages, group_advantages(REWARDS, G), atol=1e-7)
    unfiltered = compute_advantages(REWARDS, G)
    np.testing.assert_array_equal(unfiltered.keep, np.ones(12))
    assert int(unfiltered.metrics["zero_spread_groups"]) == 1  # still reported


def test_group_advantages_sum_to_zero_in_every_mode():
    rewards = np.random.RandomState(0).rand(5 * G).astype(np.float32)
    for scale in ("group", "batch", "none"):
        sums = np.asarray(group_advantages(rewards, G, scale)).reshape(-1, G).sum(axis=1)
        np.testing.assert_allclose(sums, 0.0, atol=1e-5)


def test_runs_under_jit_with_the_same_values():
    jitted = jax.jit(compute_advantages, static_argnums=1,
                     static_argnames=("scale", "filter_zero_spread"))
    out = jitted(REWARDS, G, scale="batch", filter_zero_spread=True)
    want = compute_advantages(REWARDS, G, scale="batch", filter_zero_spread=True)
    np.testing.assert_allclose(out.advantages, want.advantages, rtol=1e-6)


def test_bad_inputs_name_what_is_wrong():
    with pytest.raises(ValueError, match="divisible by num_generations=4"):
        group_advantages(np.zeros(6), G)
    with pytest.raises(ValueError, match="scale_rewards must be one of group, batch, none"):
        group_advantages(REWARDS, G, "std")

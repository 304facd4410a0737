"""Sampling controls: exact masks on fixed logits (by hand and against transformers' warpers),
exact categorical draws (statistical test with a fixed seed), log-prob semantics, and per-row
settings (each row as if alone)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (MinPLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from jaxrl.config import SamplingConfig
from jaxrl.sampling import sampling_fns
from jaxrl.sampling.sampling_fns import (Decoding, History, RowSettings, categorical,
                                         filter_logits, greedy, min_p_mask, next_token,
                                         top_k_mask, top_p_mask)

# probabilities 0.4, 0.3, 0.2, 0.05, 0.05 (ranks 0..4), shuffled
PROBS = np.array([0.05, 0.3, 0.05, 0.4, 0.2])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]  # [1, 5]


def _hf(warper, logits):
    out = warper(None, torch.tensor(np.asarray(logits)))
    return np.isfinite(out.numpy())


def test_top_k_by_hand_keeps_ties():
    np.testing.assert_array_equal(top_k_mask(LOGITS, 2)[0], [0, 1, 0, 1, 0])
    np.testing.assert_array_equal(top_k_mask(LOGITS, 4)[0], [1, 1, 1, 1, 1])  # 0.05 tie kept
    np.testing.assert_array_equal(top_k_mask(LOGITS, 9)[0], [1, 1, 1, 1, 1])


def test_top_p_by_hand():
    # mass ranked above: 0.4 -> 0, 0.3 -> 0.4, 0.2 -> 0.7, 0.05 -> 0.9 (both)
    np.testing.assert_array_equal(top_p_mask(LOGITS, 0.3)[0], [0, 0, 0, 1, 0])
    np.testing.assert_array_equal(top_p_mask(LOGITS, 0.5)[0], [0, 1, 0, 1, 0])
    np.testing.assert_array_equal(top_p_mask(LOGITS, 0.8)[0], [0, 1, 0, 1, 1])
    np.testing.assert_array_equal(top_p_mask(LOGITS, 0.95)[0], [1, 1, 1, 1, 1])


def test_min_p_by_hand():
    # p_i / p_max: 0.125, 0.75, 0.125, 1, 0.5
    np.testing.assert_array_equal(min_p_mask(LOGITS, 0.6)[0], [0, 1, 0, 1, 0])
    np.testing.assert_array_equal(min_p_mask(LOGITS, 0.4)[0], [0, 1, 0, 1, 1])
    np.testing.assert_array_equal(min_p_mask(LOGITS, 0.1)[0], [1, 1, 1, 1, 1])


@pytest.mark.parametrize("vocab", [50, 1000])  # 1000: flat rows whose top 256 miss p (bisection)
def test_masks_equal_transformers_warpers(vocab):
    rng = np.random.RandomState(vocab)
    logits = (rng.randn(16, vocab) * rng.uniform(0.1, 4, (16, 1))).astype(np.float32)
    x = jnp.asarray(logits)
    for k in (1, 5, 40, 300, 999):  # past 256 candidates: bisection
        if k < vocab:
            np.testing.assert_array_equal(top_k_mask(x, k), _hf(TopKLogitsWarper(k), logits))
    for p in (0.1, 0.5, 0.9, 0.99):
        np.testing.assert_array_equal(top_p_mask(x, p), _hf(TopPLogitsWarper(p), logits))
    for p in (0.01, 0.2, 0.7):
        np.testing.assert_array_equal(min_p_mask(x, p), _hf(MinPLogitsWarper(p), logits))


def test_top_p_bisection_is_the_path_taken_for_flat_rows():
    flat = jnp.zeros((2, 1000)).at[1, :3].set(8.0)  # row 0: the top 256 hold only 26% of the mass
    probs = jax.nn.softmax(flat, axis=-1)
    assert float(jnp.sum(jax.lax.top_k(probs[0], 256)[0])) < 0.5
    got = np.asarray(top_p_mask(flat, 0.5))
    assert got[0].all()  # uniform: every token ties with the last one kept
    np.testing.assert_array_equal(np.flatnonzero(got[1]), [0, 1, 2])
    # where both apply, the bisection keeps what the candidate path keeps
    peaked = jnp.asarray(np.random.RandomState(4).randn(8, 1000) * 3, jnp.float32)
    by_bisection = jax.nn.softmax(peaked) >= sampling_fns._bisect_top_p(jax.nn.softmax(peaked),
                                                                        jnp.full((8, 1), 0.7))
    np.testing.assert_array_equal(by_bisection, top_p_mask(peaked, 0.7))


def test_filter_order_is_hfs():
    """top-p after top-k renormalizes over the k survivors, as HF does."""
    d = Decoding(temperature=1.0, top_k=3, top_p=0.6)
    got = np.isfinite(np.asarray(filter_logits(LOGITS, RowSettings.of([d]))))[0]
    # survivors 0.4, 0.3, 0.2 renormalize to 4/9, 3/9, 2/9: 0.2 has 7/9 above it -> removed
    np.testing.assert_array_equal(got, [0, 1, 0, 1, 0])
    hf = _hf(TopPLogitsWarper(0.6), np.where(_hf(TopKLogitsWarper(3), LOGITS), LOGITS, -np.inf))
    np.testing.assert_array_equal(got, hf[0])


def test_greedy_takes_first_index_of_a_tie():
    np.testing.assert_array_equal(greedy(jnp.array([[0.0, 2.0, 2.0, 1.0], [5, 5, 5, 5.0]])),
                                  [1, 0])


def _next(keys, logits, rows):
    """(tokens, log-probs) of next_token with no history."""
    picked = next_token(keys, logits, RowSettings.of(rows), History.empty(*logits.shape))
    return picked.token, picked.logprob


def _draws(logits_row, n, seed, decoding=None):
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n, len(logits_row)))
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    if decoding is None:
        return np.asarray(categorical(keys, logits))
    return np.asarray(_next(keys, logits, [decoding] * n)[0])


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                      dict(temperature=1.3, top_p=0.8),
                                      dict(temperature=0.9, min_p=0.05, top_k=6)])
def test_sampled_frequencies_match_the_masked_distribution(settings):
    rng = np.random.RandomState(0)
    row = rng.randn(300).astype(np.float32) * 1.5  # 300 > 128: two-level draws over 3 blocks
    decoding = Decoding(**settings)
    scaled = jnp.asarray(row)[None] / decoding.temperature
    masked = np.asarray(filter_logits(scaled, RowSettings.of([decoding])))[0]
    expected = np.asarray(jax.nn.softmax(masked), np.float64)
    expected /= expected.sum()
    draws = _draws(row, 100_000, seed=1, decoding=decoding)
    counts = np.bincount(draws, minlength=len(row))
    assert counts[expected == 0].sum() == 0  # removed tokens are never drawn
    keep = expected * len(draws) >= 5  # chi-square needs expected counts >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum()) * len(draws)
    obs, exp = obs[exp > 0], exp[exp > 0]
    p_value = stats.chisquare(obs, exp).pvalue
    assert p_value > 1e-3, (p_value, settings)


def test_categorical_never_draws_zero_weight_entries_at_block_edges():
    row = np.full(256, -np.inf, np.float32)
    row[[0, 127, 128, 255]] = 0.0  # first and last entry of each block
    draws = _draws(row, 50_000, seed=3)
    assert set(np.unique(draws)) == {0, 127, 128, 255}


def test_same_seed_same_draws_and_different_seed_different_draws():
    row = np.random.RandomState(1).randn(500)
    d = Decoding(temperature=1.0, top_p=0.9)
    a, b, c = (_draws(row, 64, 5, d), _draws(row, 64, 5, d), _draws(row, 64, 6, d))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_logprob_is_of_the_tempered_unfiltered_distribution():
    logits = jnp.asarray(np.random.RandomState(2).randn(4, 64), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    tok, lp = _next(keys, logits, [Decoding(temperature=0.5, top_k=3)] * 4)
    want = jax.nn.log_softmax(logits / 0.5)[jnp.arange(4), tok]
    np.testing.assert_allclose(lp, want, atol=1e-6)
    tok, lp = _next(keys, logits, [Decoding(temperature=0.0)] * 4)
    np.testing.assert_array_equal(tok, np.argmax(logits, -1))
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[jnp.arange(4), tok], atol=1e-6)


def test_decoding_validation_names_the_field():
    with pytest.raises(ValueError, match="top_p"):
        Decoding(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        Decoding(temperature=-1.0)
    assert Decoding.from_config(SamplingConfig(temperature=0, top_k=5)) == Decoding(0.0, 5)


def test_each_row_draws_as_if_alone_under_its_own_settings():
    """Rows with different settings (greedy, top-k, top-p, min-p, plain) in one call give what
    each gives alone: settings and keys are per row."""
    logits = jnp.asarray(np.random.RandomState(5).randn(5, 700) * 2, jnp.float32)
    rows = [Decoding(0.0), Decoding(0.7, top_k=300), Decoding(1.2, top_p=0.8),
            Decoding(0.9, min_p=0.1), Decoding(1.0)]
    keys = jax.random.split(jax.random.PRNGKey(9), 5)
    tok, lp = _next(keys, logits, rows)
    for i, d in enumerate(rows):
        alone_tok, alone_lp = _next(keys[i:i + 1], logits[i:i + 1], [d])
        assert int(tok[i]) == int(alone_tok[0])
        np.testing.assert_allclose(lp[i], alone_lp[0], atol=1e-6)
    assert int(tok[0]) == int(np.argmax(logits[0]))


def test_a_draw_inside_a_block_depends_on_that_block_alone():
    """Logits that differ in their last bits (one device against a mesh) must draw the same
    tokens nearly always: other blocks' weights move only which block a row lands in, never the
    entry it draws inside that block. Block 0's weights grow by 0.1% here, which shifts the
    cumulative weight before every later block by ~0.1 of one entry's mean weight; rows that
    stay in the same later block keep their token (drawing the entry from what is left of one
    uniform past the earlier blocks moved 5% of them)."""
    block = sampling_fns._BLOCK
    logits = np.random.RandomState(4).randn(1, 64 * block).astype(np.float32)  # 64 blocks
    moved = logits.copy()
    moved[:, :block] += 1e-3
    rows = 512
    keys = jax.random.split(jax.random.PRNGKey(7), rows)
    a, b = (np.asarray(categorical(keys, jnp.broadcast_to(jnp.asarray(x), (rows, x.shape[1]))))
            for x in (logits, moved))
    kept = (a // block == b // block) & (a >= block)
    assert kept.sum() > 0.9 * rows
    np.testing.assert_array_equal(a[kept], b[kept])


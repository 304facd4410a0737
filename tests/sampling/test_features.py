"""The static sampling features: what `Features.of` sets for rows of settings, and that every
program the host picks from them chooses, for each row it covers, the token, log-prob and top
log-probs the program with every part on chooses; its jaxpr holds no cond."""
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.sampling import sampling_fns
from jaxrl.sampling.sampling_fns import (ALL, Decoding, Features, History, RowSettings,
                                         next_token, top_k_mask)

V = 700  # > the 256 candidates: wide top-k and top-p's bisection take part
ROWS = [Decoding(0.0), Decoding(1.0), Decoding(0.7, top_k=5), Decoding(0.9, top_k=300),
        Decoding(1.2, top_p=0.8), Decoding(1.0, top_p=0.97), Decoding(0.9, min_p=0.1),
        Decoding(0.0, repetition_penalty=1.3), Decoding(0.8, presence_penalty=0.5,
                                                        frequency_penalty=0.3),
        Decoding(0.6, logit_bias=((3, 4.0), (9, -2.0))), Decoding(0.0, top_logprobs=4),
        Decoding(1.1, top_k=800, top_p=0.9, min_p=0.01, top_logprobs=2),
        Decoding(0.0, top_k=3, top_p=0.5)]


def test_features_of_rows():
    assert Features.of([]) == Features()
    assert Features.of([Decoding(0.7)] * 8) == Features(sampled=True)
    assert Features.of([Decoding(0.0, top_k=5, top_p=0.5)]) == Features(greedy=True)
    assert Features.of([Decoding(1.0, top_k=5), Decoding(0.0)]) == Features(
        greedy=True, sampled=True, top_k=True)
    assert Features.of([Decoding(1.0, top_k=257)]).wide_top_k
    assert not Features.of([Decoding(1.0, top_k=256)]).wide_top_k
    assert Features.of([Decoding(0.0, logit_bias=((1, 0.5),))]).penalties
    assert Features.of([Decoding(0.0, top_logprobs=1)]).top_logprobs
    # settings as the float32 the rows hold them in: a temperature that rounds to 0 is greedy
    assert Features.of([Decoding(1e-46)]) == Features(greedy=True)
    assert Features.of(ROWS) == ALL
    assert Features.from_bits(Features(top_p=True).bits() | Features(greedy=True).bits()) == \
        Features(top_p=True) | Features(greedy=True) == Features(greedy=True, top_p=True)
    assert ALL.covers(ROWS) and not Features(sampled=True).covers([Decoding(0.0)])
    hash(ALL)


def _inputs(scale: float):
    rng = np.random.RandomState(int(scale * 10))
    b = len(ROWS)
    logits = jnp.asarray(rng.randn(b, V) * scale, jnp.float32)
    history = History(prompt=jnp.asarray(rng.rand(b, V) < 0.05),
                      counts=jnp.asarray(rng.poisson(0.05, (b, V)), jnp.int32))
    keys = jax.random.split(jax.random.PRNGKey(3), b)
    return keys, logits, RowSettings.of(ROWS), history


@functools.partial(jax.jit, static_argnames="features")
def _pick(keys, logits, settings, history, features):
    return next_token(keys, logits, settings, history, features=features)


def _variants() -> list[Features]:
    """What the host picks for each row alone, for pairs of rows and for the first half."""
    rows = [[d] for d in ROWS] + list(itertools.combinations(ROWS[1:7], 2)) + [ROWS[:6]]
    return sorted({Features.of(r) for r in rows} - {ALL}, key=Features.bits)


@pytest.mark.parametrize("scale", [0.3, 3.0], ids=["flat", "peaked"])
def test_every_variant_picks_what_all_picks_for_the_rows_it_covers(scale):
    inputs = _inputs(scale)
    want = jax.device_get(_pick(*inputs, features=ALL))
    covered = np.zeros(len(ROWS), bool)
    for features in _variants():
        got = jax.device_get(_pick(*inputs, features=features))
        rows = np.asarray([features.covers([d]) for d in ROWS])
        covered |= rows
        np.testing.assert_array_equal(got.token[rows], want.token[rows], err_msg=str(features))
        np.testing.assert_array_equal(got.logprob[rows], want.logprob[rows])
        if features.top_logprobs:
            np.testing.assert_array_equal(got.top_ids[rows], want.top_ids[rows])
            np.testing.assert_array_equal(got.top_logprobs[rows], want.top_logprobs[rows])
        else:
            np.testing.assert_array_equal(got.top_logprobs, 0.0)
    assert covered.all()


def test_no_part_of_the_choice_is_a_cond():
    jaxpr = str(jax.make_jaxpr(functools.partial(next_token, features=ALL))(*_inputs(1.0)))
    assert not re.search(r"\bcond\[", jaxpr) and not re.search(r"\bwhile\[", jaxpr)
    assert "scan[" in jaxpr  # the bisections: loops of fixed length


def test_top_k_mask_beyond_the_candidates():
    """k past the candidates takes the bisection only where wide says it may; k past V keeps
    every token."""
    x = jnp.asarray(np.random.RandomState(1).randn(3, V), jnp.float32)
    n = sampling_fns._CANDIDATES
    for k in (n - 1, n):
        np.testing.assert_array_equal(top_k_mask(x, k, wide=False), top_k_mask(x, k))
    got = np.asarray(top_k_mask(x, n + 50))
    assert (got.sum(-1) == n + 50).all()
    assert np.asarray(top_k_mask(x, V + 1, wide=False)).all()
    small = x[:, :100]  # V <= the candidates: no bisection needed at any k
    assert np.asarray(top_k_mask(small, 101, wide=False)).all()

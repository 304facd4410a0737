"""The XLA decode attention over filled columns (jaxrl/backends/attention_blocks.py) against the
plain-jnp reference of the same contract, and what it reads: only layer `layer` and only the
blocks up to the batch's fullest row (columns past a row's fill weigh nothing, whatever they
hold)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.backends.attention_blocks import blocked_decode_attention
from jaxrl.backends.attention_gpu import decode_attention_reference
from jaxrl.model.attention import EMPTY_LSE
from tests.backends.test_decode_attention import BF16, F32, _clean, _close, _inputs


def _blocked(q, k, v, layer, lengths, **kw):
    return jax.jit(lambda *a: blocked_decode_attention(*a, **kw))(q, k, v, jnp.int32(layer),
                                                                   lengths)


@pytest.mark.parametrize("dtype", [F32, BF16])
# 32: 80 columns end in an overlapping block; None: the default for 4 rows, one block of all 80
@pytest.mark.parametrize("block", [16, 32, 128, None])
def test_matches_reference(dtype, block):
    q, k, v, lengths = _inputs(0, m=4, dtype=dtype)  # unfilled columns hold NaN
    got = _blocked(q, k, v, 1, lengths, block=block)
    assert got[0].shape == q.shape and got[0].dtype == F32
    assert got[1].shape == q.shape[:3] and got[1].dtype == F32
    assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()
    _close(got, decode_attention_reference(q, *_clean(k, v, lengths), 1, lengths), dtype)


def test_bfloat16_queries_on_a_float32_cache():
    q, k, v, lengths = _inputs(6, m=3)
    q = q.astype(BF16)
    got = _blocked(q, k, v, 0, lengths, block=16)
    _close(got, decode_attention_reference(q, *_clean(k, v, lengths), 0, lengths), BF16)


def test_reads_only_its_layer_and_the_blocks_up_to_the_fullest_row():
    q, k, v, _ = _inputs(2, layers=3, b=3, s=96, poison=False)
    lengths = jnp.array([5, 33, 20], jnp.int32)  # fullest row 33: blocks [0, 16) .. [32, 48)
    beyond = (jnp.arange(96) >= 48)[None, None, None, :, None]
    others = (jnp.arange(3) != 1)[:, None, None, None, None]
    poison = lambda x: jnp.where(others | beyond, jnp.nan, x)  # noqa: E731
    got = _blocked(q, poison(k), poison(v), 1, lengths, block=16)
    _close(got, decode_attention_reference(q, k, v, 1, lengths), F32)


def test_by_hand():
    # one row, one head, D = 4: keys e0 and e1 score 2 * 0.5 = 1 and 0; weights e / (e + 1)
    q = jnp.array([[[[2.0, 0.0, 0.0, 0.0]]]])
    k = jnp.zeros((1, 1, 1, 4, 4)).at[0, 0, 0, 0, 0].set(1.0)
    v = jnp.zeros((1, 1, 1, 4, 4)).at[0, 0, 0, 0, 1].set(1.0).at[0, 0, 0, 1, 2].set(1.0)
    out, lse = _blocked(q, k, v, 0, jnp.array([2], jnp.int32), block=1)
    e = math.e
    np.testing.assert_allclose(out[0, 0, 0], [0, e / (e + 1), 1 / (e + 1), 0], rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0, 0], math.log(e + 1), rtol=1e-6)


def test_empty_rows():
    q, k, v, _ = _inputs(3, b=2, poison=False)
    nan = jnp.full_like(k, jnp.nan)  # no row is filled: no block is read
    out, lse = _blocked(q, nan, nan, 0, jnp.array([0, 0], jnp.int32), block=16)
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_array_equal(lse, np.float32(EMPTY_LSE))


def test_rejects_mismatched_shapes():
    q, k, v, lengths = _inputs(5, poison=False)
    with pytest.raises(ValueError, match="q must be"):
        blocked_decode_attention(q[:, :1], k, v, 0, lengths)
    with pytest.raises(ValueError, match="lengths"):
        blocked_decode_attention(q, k, v, 0, lengths[:1])

"""Attention over query blocks equals the single pass, in values and gradients, and only long
query lengths take it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.model.attention import QUERY_BLOCK, attend
from jaxrl.model.transformer import attention_mask

B, T, H, K, D = 2, 10, 4, 2, 8


def _inputs(slots: int, keys_transposed: bool):
    """q, k, v and the mask of a batch whose T tokens are written at slot 2 of `slots` key
    slots, the slots after them still empty; row 1 is left-padded up to slot 4, so its first
    queries see no valid key at all."""
    rq, rk, rv = (np.random.RandomState(i) for i in range(3))
    q = jnp.asarray(rq.randn(B, T, H, D), jnp.float32)
    k = jnp.asarray(rk.randn(B, K, slots, D), jnp.float32)
    v = jnp.asarray(rv.randn(B, K, slots, D), jnp.float32)
    valid = np.zeros((B, slots), bool)
    valid[:, :2 + T] = True
    valid[1, :4] = False
    mask = attention_mask(jnp.asarray(valid), T, jnp.int32(2))  # [B, T, S]
    return q, (k.swapaxes(2, 3) if keys_transposed else k), v, mask


@pytest.mark.parametrize("keys_transposed", [False, True])
@pytest.mark.parametrize("block", [3, 5])  # 3 pads T = 10 up to 12 queries
def test_blocks_equal_single_pass_values_and_gradients(block, keys_transposed):
    q, k, v, mask = _inputs(slots=16, keys_transposed=keys_transposed)
    weights = jnp.asarray(np.random.RandomState(3).randn(B, T, H * D), jnp.float32)

    def run(query_block):
        fn = lambda q, k, v: attend(q, k, v, mask, keys_transposed=keys_transposed,
                                    query_block=query_block)
        loss = lambda q, k, v: jnp.sum(fn(q, k, v) * weights)
        return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    single, blocked = run(T), run(block)
    np.testing.assert_allclose(blocked[0], single[0], rtol=0, atol=1e-6)
    for got, want in zip(blocked[1], single[1]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _has_loop(t: int) -> bool:
    sds = jax.ShapeDtypeStruct
    jaxpr = jax.make_jaxpr(attend)(sds((1, t, H, D), jnp.float32), sds((1, K, t, D), jnp.float32),
                                   sds((1, K, t, D), jnp.float32), sds((1, t, t), jnp.bool_))
    return any(e.primitive.name == "scan" for e in jaxpr.eqns)


def test_only_queries_beyond_the_block_take_the_blocked_path():
    assert not _has_loop(1) and not _has_loop(QUERY_BLOCK)
    assert _has_loop(QUERY_BLOCK + 1)

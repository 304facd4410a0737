"""Forward-pass properties that need no reference implementation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.model.attention import apply_rope, inv_frequencies
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.kv_cache import init_cache
from jaxrl.model.params import count_params, declare, init_params
from jaxrl.model.transformer import forward, positions_from_mask, rms_norm
from tests.tiny_models import hf_config


def _spec(family="qwen3", **kw):
    return spec_from_hf_config(hf_config(family, **kw).to_dict())


def test_rms_norm_by_hand():
    x = jnp.array([[3.0, 4.0]])  # mean square = 12.5
    out = rms_norm(x, jnp.array([1.0, 2.0]), eps=0.0)
    np.testing.assert_allclose(out, [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-6)


def test_rope_rotates_pairs_by_position_times_frequency():
    spec = _spec("llama")  # head_dim 16, theta 10000
    inv = inv_frequencies(spec)
    assert inv[0] == 1.0 and np.isclose(inv[1], 10000 ** (-2 / 16))
    x = jnp.zeros((1, 1, 1, 16)).at[..., 1].set(1.0)  # unit vector in the 2nd pair's first half
    pos = 3.0
    angle = pos * inv[1]
    cos = jnp.cos(jnp.full((1, 1, 16), 0.0)).at[..., 1].set(np.cos(angle)).at[..., 9].set(np.cos(angle))
    sin = jnp.zeros((1, 1, 16)).at[..., 1].set(np.sin(angle)).at[..., 9].set(np.sin(angle))
    out = np.asarray(apply_rope(x, cos, sin))[0, 0, 0]
    np.testing.assert_allclose(out[[1, 9]], [np.cos(angle), np.sin(angle)], rtol=1e-6)


def test_positions_from_mask_left_and_right_padding():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    np.testing.assert_array_equal(positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]])


def test_param_count_matches_declared_shapes():
    spec = _spec("qwen2", tie=False)
    e, f, v, n = 64, 128, 128, 2
    q, kv = 64, 32
    per_layer = 2 * e + e * q + 2 * e * kv + q * e + 3 * e * f + q + 2 * kv
    assert count_params(spec) == n * per_layer + v * e + e + e * v
    assert declare(spec)["layers/q_proj/kernel"].axes == ("layers", "embed", "heads")


@pytest.mark.accelerator
def test_cache_prefill_then_decode_equals_full_forward():
    spec = _spec("qwen3")
    params = init_params(spec, jax.random.PRNGKey(0), std=0.2)
    tokens, mask = np.random.RandomState(0).randint(0, 128, (2, 10)), np.ones((2, 10), bool)
    mask[1, :3] = False  # left padded
    pos = positions_from_mask(jnp.asarray(mask))
    full, _ = forward(params, tokens, pos, spec, attn_mask=jnp.asarray(mask))
    slots = np.zeros((2, 16), bool)
    slots[:, :10] = mask
    cache = init_cache(spec, batch=2, max_len=16)
    step = jax.jit(lambda c, t, p: forward(params, t, p, spec, attn_mask=jnp.asarray(slots), cache=c))
    logits, cache = step(cache, tokens[:, :6], pos[:, :6])
    outs = [logits]
    for i in range(6, 10):
        logits, cache = step(cache, tokens[:, i:i + 1], pos[:, i:i + 1])
        outs.append(logits)
    assert cache.index.tolist() == [10, 10]
    np.testing.assert_allclose(np.concatenate(outs, 1)[mask], np.asarray(full)[mask], atol=1e-5)


def _scans(jaxpr):
    """Every scan equation of a closed jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from _scans(sub)


def test_layer_scan_reads_the_cache_without_carrying_it():
    # Carrying the stacked cache [L, B, K, S, D] through the layer scan makes every decode
    # step pass all of it in and out of the loop; the scan reads each layer's slice as an
    # input and returns only the new tokens' keys and values [L, B, T, K, D].
    spec = _spec("qwen3")
    params = init_params(spec, jax.random.PRNGKey(0))
    cache = init_cache(spec, batch=2, max_len=16)
    tokens, pos = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda c: forward(params, tokens, pos, spec, cache=c))(cache).jaxpr
    (scan,) = _scans(jaxpr)
    n_carry, n_consts = scan.params["num_carry"], scan.params["num_consts"]
    carried = [v.aval.shape for v in scan.invars[n_consts:n_consts + n_carry]]
    scanned = [v.aval.shape for v in scan.invars[n_consts + n_carry:]]
    new = [v.aval.shape for v in scan.outvars[n_carry:]]
    assert cache.k.shape not in carried and scanned.count(cache.k.shape) == 2
    assert new == [(spec.num_layers, 2, 1, spec.num_kv_heads, spec.head_dim)] * 2

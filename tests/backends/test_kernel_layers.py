"""The GPU choice's kernels inside the layer loop, in Pallas interpret mode: a decode step of
`hidden_states` whose layers read the stacked NF4 weights and the KV cache in place (filled
columns only, with and without a shared prompt; the NF4 kernel with the LoRA term in its
epilogue and SwiGLU) gives the XLA reference's hidden states and cache."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.backends.numerics import REFERENCE, numerics_for
from jaxrl.model.kv_cache import init_cache
from jaxrl.model.transformer import hidden_states
from tests.sharding.common import SPEC, quantized_model

KERNELS = dataclasses.replace(numerics_for("gpu"), interpret=True)
# the XLA loop over blocks of filled columns (BLOCK 8 below: 16-column blocks for 4 rows, so
# that 32 columns take several)
BLOCKS = dataclasses.replace(REFERENCE, attention="xla_blocks")


def _random_cache(rng, rows, columns, index):
    cache = init_cache(SPEC, rows, columns, jnp.float32)
    normal = lambda a: jnp.asarray(rng.randn(*a.shape), jnp.float32)  # noqa: E731
    return cache.replace(k=normal(cache.k), v=normal(cache.v),
                         index=jnp.asarray(index, jnp.int32))


@pytest.mark.parametrize("shared", [False, True], ids=["own-columns", "shared-prompt"])
@pytest.mark.parametrize("form", ["kernels", "blocks"])
def test_a_decode_step_through_the_kernels_equals_the_reference(shared, form, monkeypatch):
    numerics = KERNELS if form == "kernels" else BLOCKS
    if form == "kernels":
        assert KERNELS.in_place_layers and KERNELS.nf4_decode == "kernel"
    else:  # the cache is indexed by layer, the weights scanned as the XLA forms scan them
        assert not BLOCKS.in_place_layers and BLOCKS.filled_attention() is not None
        monkeypatch.setattr("jaxrl.backends.attention_blocks.BLOCK", 8)
    params, lora = quantized_model()
    rng = np.random.RandomState(0)
    # rows filled 0 (nothing), 5, 17 and 32 (every column) of 32
    cache = _random_cache(rng, 4, 32, [0, 5, 17, 32])
    prefix = _random_cache(rng, 2, 16, [9, 16]) if shared else None
    tokens = jnp.asarray([[3], [4], [5], [6]], jnp.int32)
    positions = cache.index[:, None] + (0 if prefix is None else 16)

    def step(numerics):
        run = jax.jit(lambda p, a, c, q: hidden_states(p, tokens, positions, SPEC, cache=c,
                                                       prefix=q, lora=a, numerics=numerics))
        return jax.device_get(run(params, lora, cache, prefix))

    (h, new), (want_h, want_new) = step(numerics), step(REFERENCE)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new.k, want_new.k, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new.index, want_new.index)


@pytest.mark.parametrize("numerics", [KERNELS, BLOCKS], ids=["kernels", "blocks"])
def test_rows_not_read_attend_to_nothing_and_leave_the_others_alone(numerics):
    """A decode step's finished rows (reading False) read no cache column: NaN in their
    columns, filled to the end, changes neither the live rows' hidden states nor where the
    step writes."""
    params, lora = quantized_model()
    rng = np.random.RandomState(1)
    cache = _random_cache(rng, 4, 32, [3, 32, 9, 32])
    dead = jnp.asarray([False, True, False, True])
    poisoned = cache.replace(k=jnp.where(dead[None, :, None, None, None], jnp.nan, cache.k),
                             v=jnp.where(dead[None, :, None, None, None], jnp.nan, cache.v))
    tokens = jnp.asarray([[3], [4], [5], [6]], jnp.int32)

    def step(numerics, c, reading):
        return jax.device_get(jax.jit(lambda p, a, c: hidden_states(
            p, tokens, c.index[:, None], SPEC, cache=c, lora=a, numerics=numerics,
            reading=reading))(params, lora, c))

    h, new = step(numerics, poisoned, ~dead)
    want_h, want_new = step(REFERENCE, cache, None)
    live = np.asarray(~dead)
    np.testing.assert_allclose(h[live], want_h[live], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new.index, want_new.index)
    np.testing.assert_allclose(new.k[:, live], want_new.k[:, live], rtol=1e-5, atol=1e-5)


def test_sampling_adapters_join_a_before_the_cpu_holds_them_as_bits():
    """The kernels' joined A matrices are made from the adapters' arrays, then held as the
    numerics holds every bfloat16 layer weight (the CPU: as bits), not joined from held
    leaves."""
    from jaxrl.backends.numerics import dense_tree

    _, lora = quantized_model()
    numerics = dataclasses.replace(numerics_for("cpu"), nf4_decode="kernel",
                                   attention="pallas_gpu", interpret=True)
    held = numerics.hold_adapters(lora, jnp.bfloat16).weights["layers"]
    joined = dense_tree(held)["q_proj+k_proj+v_proj"]["a"]
    layers = lora.weights["layers"]
    want = jnp.concatenate([layers[n]["a"] for n in ("q_proj", "k_proj", "v_proj")], axis=-1)
    np.testing.assert_array_equal(joined, want.astype(jnp.bfloat16))

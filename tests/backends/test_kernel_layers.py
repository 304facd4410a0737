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


def _random_cache(rng, rows, columns, index):
    cache = init_cache(SPEC, rows, columns, jnp.float32)
    normal = lambda a: jnp.asarray(rng.randn(*a.shape), jnp.float32)  # noqa: E731
    return cache.replace(k=normal(cache.k), v=normal(cache.v),
                         index=jnp.asarray(index, jnp.int32))


@pytest.mark.parametrize("shared", [False, True], ids=["own-columns", "shared-prompt"])
def test_a_decode_step_through_the_kernels_equals_the_reference(shared):
    assert KERNELS.in_place_layers and KERNELS.nf4_decode == "kernel"
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

    (h, new), (want_h, want_new) = step(KERNELS), step(REFERENCE)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new.k, want_new.k, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new.index, want_new.index)


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

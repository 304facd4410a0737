"""The GPU decode-attention kernel (jaxrl/backends/attention_gpu.py) in the Pallas interpreter
against its plain-jnp reference, `merge` of attention parts, and the kernel's lowering for CUDA
from this host: one Triton custom call reading the whole layer-stacked cache, no slice of it."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.backends.attention_gpu import decode_attention, decode_attention_reference
from jaxrl.model.attention import EMPTY_LSE, merge

BF16, F32 = jnp.bfloat16, jnp.float32
# (out atol/rtol, lse atol/rtol) per q/cache dtype: float32 to float32 rounding; bfloat16 to
# the rounding of the weights in bfloat16 (the kernel rounds exp(score - running max) block by
# block, the reference the normalized probabilities)
TOLERANCE = {F32: (2e-5, 1e-5), BF16: (1e-2, 1e-5)}


def _inputs(seed, *, layers=3, b=4, kv=2, m=4, s=80, d=32, dtype=F32, poison=True):
    """q [B, K, M, D], k, v [L, B, K, S, D], lengths [B] = 0, 1, a partial block, S (more rows
    repeat them). With poison, every column at or past a row's length holds NaN."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, kv, m, d))
    k = rng.normal(size=(layers, b, kv, s, d))
    v = rng.normal(size=(layers, b, kv, s, d))
    lengths = np.resize(np.array([0, 1, 37, s]), b).astype(np.int32)
    if poison:
        unfilled = (np.arange(s)[None, :] >= lengths[:, None])[None, :, None, :, None]
        k, v = np.where(unfilled, np.nan, k), np.where(unfilled, np.nan, v)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(lengths))


def _close(got, want, dtype):
    (out_tol, lse_tol) = TOLERANCE[dtype]
    np.testing.assert_allclose(got[0], want[0], atol=out_tol, rtol=out_tol)
    np.testing.assert_allclose(got[1], want[1], atol=lse_tol, rtol=lse_tol)


def _kernel(q, k, v, layer, lengths, **kw):
    return jax.jit(lambda *a: decode_attention(*a, interpret=True, **kw))(
        q, k, v, jnp.int32(layer), lengths)


def _clean(k, v, lengths):
    """k, v with the poisoned unfilled columns zeroed, for the reference (which reads them)."""
    filled = (jnp.arange(k.shape[3])[None, :] < lengths[:, None])[None, :, None, :, None]
    return jnp.where(filled, k, 0), jnp.where(filled, v, 0)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("m", [4, 16])
def test_matches_reference(dtype, m):
    q, k, v, lengths = _inputs(0, m=m, dtype=dtype)
    got = _kernel(q, k, v, 1, lengths, block_k=16)
    assert got[0].shape == q.shape and got[0].dtype == F32
    assert got[1].shape == q.shape[:3] and got[1].dtype == F32
    assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()
    _close(got, decode_attention_reference(q, *_clean(k, v, lengths), 1, lengths), dtype)


def test_bfloat16_queries_on_a_float32_cache():
    q, k, v, lengths = _inputs(6, m=4)
    q = q.astype(BF16)  # scores and values in float32, the weights rounded to bfloat16
    got = _kernel(q, k, v, 0, lengths, block_k=32)
    _close(got, decode_attention_reference(q, *_clean(k, v, lengths), 0, lengths), BF16)


@pytest.mark.parametrize("d, block_k, splits", [(16, 16, 1), (32, 32, 3), (64, 16, 7)])
def test_head_dims_blocks_and_splits(d, block_k, splits):
    q, k, v, lengths = _inputs(1, b=5, d=d, m=8)
    got = _kernel(q, k, v, 2, lengths, block_k=block_k, splits=splits)
    _close(got, decode_attention_reference(q, *_clean(k, v, lengths), 2, lengths), F32)


def test_layer_index_reads_only_that_layer():
    q, k, v, lengths = _inputs(2, layers=4, poison=False)
    for layer in range(4):
        # every other layer NaN: a read of any of them would show in the result
        others = (jnp.arange(4) != layer)[:, None, None, None, None]
        k_l, v_l = jnp.where(others, jnp.nan, k), jnp.where(others, jnp.nan, v)
        got = _kernel(q, k_l, v_l, layer, lengths, block_k=16)
        want = decode_attention_reference(q, k[layer:layer + 1], v[layer:layer + 1], 0, lengths)
        _close(got, want, F32)


def test_empty_rows():
    q, k, v, _ = _inputs(3, b=2, poison=False)
    lengths = jnp.array([0, 0], jnp.int32)
    nan = jnp.full_like(k, jnp.nan)  # no column is filled: the kernel reads none
    for out, lse in (_kernel(q, nan, nan, 0, lengths, block_k=16, splits=2),
                     decode_attention_reference(q, k, v, 0, lengths)):
        np.testing.assert_array_equal(out, 0)
        np.testing.assert_array_equal(lse, np.float32(EMPTY_LSE))


def test_merge_by_hand():
    # two single-column parts with scores 0 and ln 3: weights 1/4 and 3/4, lse ln 4
    v1, v2 = jnp.array([[1.0, 0.0]]), jnp.array([[0.0, 8.0]])
    out, lse = merge([(v1, jnp.array([0.0])), (v2, jnp.array([math.log(3.0)]))])
    np.testing.assert_allclose(out, [[0.25, 6.0]], rtol=1e-6)
    np.testing.assert_allclose(lse, [math.log(4.0)], rtol=1e-6)
    # an empty part (out 0, lse EMPTY_LSE) changes nothing, and two empty parts stay finite
    out2, lse2 = merge([(jnp.zeros((1, 2)), jnp.array([EMPTY_LSE])), (out, lse)])
    np.testing.assert_allclose(out2, out, rtol=1e-6)
    np.testing.assert_allclose(lse2, lse, rtol=1e-6)
    out3, lse3 = merge([(jnp.zeros((1, 2)), jnp.array([EMPTY_LSE]))] * 2)
    np.testing.assert_array_equal(out3, 0)
    assert np.isfinite(lse3).all() and lse3[0] < -1e29


def test_merge_of_parts_is_attention_over_their_union():
    q, k, v, lengths = _inputs(4, b=4, s=80, poison=False)
    split = 30  # the kernel on columns [0, 30) and [30, 80), merged
    first = _kernel(q, k[:, :, :, :split], v[:, :, :, :split], 2,
                    jnp.minimum(lengths, split), block_k=16)
    second = _kernel(q, k[:, :, :, split:], v[:, :, :, split:], 2,
                     jnp.maximum(lengths - split, 0), block_k=16)
    want = decode_attention_reference(q, k, v, 2, lengths)
    _close(merge([first, second]), want, F32)


def test_rejects_unsupported_shapes():
    q, k, v, lengths = _inputs(5, d=24, poison=False)
    with pytest.raises(ValueError, match="head dim"):
        decode_attention(q, k, v, 0, lengths, interpret=True)
    q, k, v, lengths = _inputs(5, poison=False)
    with pytest.raises(ValueError, match="block_k"):
        decode_attention(q, k, v, 0, lengths, block_k=24, interpret=True)
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(q[:, :1], k, v, 0, lengths, interpret=True)


# The Triton custom call's target: jaxlib 0.10.2 hands XLA the Triton IR to compile; later
# jaxlibs compile it in JAX and call the kernel through an FFI target.
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def _export_for_cuda(f, *, layers=36, b=2, kv=8, s=8192, d=128, m=4):
    """The StableHLO text of f(q, k, v, layer, lengths) lowered for CUDA, at Qwen3-4B's cache
    shapes, and the type of the k and v stacks in it."""
    stack = jax.ShapeDtypeStruct((layers, b, kv, s, d), BF16)
    exported = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t)
                         for t in TRITON_TARGETS],
    )(jax.ShapeDtypeStruct((b, kv, m, d), BF16), stack, stack,
      jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
    return exported.mlir_module(), f"tensor<{layers}x{b}x{kv}x{s}x{d}xbf16>"


def _ops(module: str) -> list[str]:
    return [line.strip() for line in module.splitlines() if re.search(r"= \"?stablehlo\.", line)]


def test_lowers_for_cuda_reading_the_stack_in_place():
    module, stack_type = _export_for_cuda(lambda *a: decode_attention(*a))
    ops = _ops(module)
    calls = [op for op in ops if "stablehlo.custom_call" in op]
    assert len(calls) == 1 and any(t in calls[0] for t in TRITON_TARGETS)
    # the call takes both whole stacks as operands (its signature follows its attributes) ...
    operand_types = calls[0].rsplit("} : (", 1)[1].split(") -> ")[0]
    assert operand_types.count(stack_type) == 2
    # ... and no other op in the module reads them: no slice, gather or copy of a layer
    readers = [op for op in ops if stack_type in op and "stablehlo.custom_call" not in op]
    assert not readers, readers


def test_one_triton_call_per_decode_attention_call():
    def two_layers(q, k, v, layer, lengths):  # distinct block sizes: two distinct kernels
        first = decode_attention(q, k, v, layer, lengths, block_k=64)
        second = decode_attention(q, k, v, layer + 1, lengths, block_k=32)
        return merge([first, second])

    module, stack_type = _export_for_cuda(two_layers)
    ops = _ops(module)
    calls = [op for op in ops if "stablehlo.custom_call" in op]
    assert len(calls) == 2 and all(any(t in op for t in TRITON_TARGETS) for op in calls)
    assert not [op for op in ops if stack_type in op and "stablehlo.custom_call" not in op]

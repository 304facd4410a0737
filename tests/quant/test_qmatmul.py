"""The quantized matmul: each form against hand-worked numbers and a float64 reference."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.quant.nf4 import QTensor, dequantize_np, quantize_np
from jaxrl.quant.qmatmul import FORMS, qmatmul


@pytest.mark.parametrize("form", FORMS)
def test_hand_worked_two_blocks(form):
    # Block size 2, one column. Rows 0..3 hold NF4 codes 15, 0, 7, 15 (levels 1, -1, 0, 1):
    # byte 0 = 15 | 0 << 4 = 15, byte 1 = 7 | 15 << 4 = 247. Scales 2 and 0.5 make the dense
    # column [2, -2, 0, 0.5], so x = [3, 1, 5, 2] gives 6 - 2 + 0 + 1 = 5.
    q = QTensor(np.array([[15], [247]], np.uint8), np.array([[2.0], [0.5]], np.float32),
                2, "nf4", "float32")
    np.testing.assert_array_equal(dequantize_np(q)[:, 0], [2, -2, 0, 0.5])
    x = jnp.array([[3.0, 1.0, 5.0, 2.0]])
    np.testing.assert_array_equal(np.asarray(qmatmul(x, q, form=form)), [[5.0]])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kwargs", [dict(), dict(double_quant=True), dict(mode="int4"),
                                    dict(block_size=32)])
def test_equals_the_dequantized_kernel_to_float32_rounding(form, kwargs):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(512, 96)).astype(np.float32) * 0.02
    q = quantize_np(w, **kwargs)
    x = rng.normal(size=(6, 512)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize_np(q).astype(np.float64)  # [R, O]
    got = np.asarray(qmatmul(jnp.asarray(x.reshape(2, 3, 512)), q, form=form))
    got = got.reshape(6, -1)
    scale = np.abs(x).astype(np.float64) @ np.abs(dequantize_np(q)).astype(np.float64)
    assert np.all(np.abs(got - want) <= 1e-6 * scale)  # 512 float32 products and sums


def test_bfloat16_inputs_round_only_the_kernel_entries():
    rng = np.random.default_rng(1)
    q = quantize_np(rng.normal(size=(256, 64)).astype(np.float32), double_quant=True)
    x = jnp.asarray(rng.normal(size=(4, 256)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ dequantize_np(q).astype(np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(dequantize_np(q)).astype(np.float64)
    for form in FORMS:
        got = np.asarray(qmatmul(x, q, form=form))
        assert np.all(np.abs(got - want) <= 2.0**-8 * scale)  # each entry rounded once


@pytest.mark.parametrize("form", FORMS)
def test_a_bfloat16_result_is_the_float32_one_rounded_once(form):
    """dtype=bfloat16 rounds the float32 sums once at the end (what lets a row-parallel layer
    reduce its partial sums in bfloat16), not each product or partial sum."""
    rng = np.random.default_rng(2)
    q = quantize_np(rng.normal(size=(256, 64)).astype(np.float32), double_quant=True)
    x = jnp.asarray(rng.normal(size=(4, 1, 256)), jnp.bfloat16)
    got = qmatmul(x, q, form=form, dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    want = qmatmul(x, q, form=form).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match="form 'rows'"):
        qmatmul(jnp.ones((1, 64)), quantize_np(np.ones((64, 8), np.float32)), form="rows")

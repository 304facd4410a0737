"""The CPU's own forms (jaxrl/backends/cpu.py) as the CPU numerics choice uses them: bfloat16
products with float32 sums and a hand-written backward, and bfloat16 layer weights held as their
bits (`Bits`)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.lora.lora import init_lora
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import init_params
from jaxrl.backends.cpu import Bits
from jaxrl.backends.numerics import numerics_for
from jaxrl.model.transformer import forward, positions_from_mask
from tests.tiny_models import hf_config

BF16 = jnp.bfloat16
CPU, GPU = numerics_for("cpu"), numerics_for("gpu")
product = CPU.product


def test_which_products_take_the_cpu_form():
    def custom(numerics, dtype):  # whether the product takes the hand-written backward
        x = jnp.ones((2, 8), dtype)
        return "custom_vjp" in str(jax.make_jaxpr(numerics.product)(x, x.T))

    assert custom(CPU, BF16) and custom(CPU, jnp.float16)
    assert not custom(CPU, jnp.float32)
    assert not custom(GPU, BF16) and not custom(numerics_for("tpu"), BF16)


@pytest.mark.parametrize("transposed", [False, True])
def test_values_and_gradients_by_hand(transposed):
    # x = [1, 2], w = [[1, 0, 1], [0, 1, 1]]: y = [1, 2, 3]; for loss = sum(c * y) with
    # c = [1, 2, 4]: dx = w @ c = [5, 6], dw = x^T c = [[1, 2, 4], [2, 4, 8]]
    x = jnp.array([[1.0, 2.0]], BF16)
    w = jnp.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], BF16)
    c = jnp.array([1.0, 2.0, 4.0])
    ww = w.T if transposed else w
    loss = lambda x, w: jnp.sum(c * product(x, w, transposed=transposed))  # noqa: E731
    y = product(x, ww, transposed=transposed)
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, ww)
    assert y.dtype == jnp.float32 and y.tolist() == [[1.0, 2.0, 3.0]]
    assert dx.dtype == BF16 and dx.astype(float).tolist() == [[5.0, 6.0]]
    want = np.array([[1.0, 2.0, 4.0], [2.0, 4.0, 8.0]])
    assert dw.dtype == BF16
    np.testing.assert_array_equal(np.asarray(dw, np.float32), want.T if transposed else want)


@pytest.mark.parametrize("transposed", [False, True])
def test_cpu_form_agrees_with_the_plain_product(transposed):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 64)), BF16)
    w = jnp.asarray(rng.standard_normal((48, 64) if transposed else (64, 48)), BF16)

    def grads(numerics):
        loss = lambda x, w: jnp.sum(jnp.sin(numerics.product(  # noqa: E731
            x, w, transposed=transposed, dtype=BF16)))
        return jax.grad(loss, argnums=(0, 1))(x, w)

    for got, want in zip(grads(CPU), grads(GPU)):
        assert got.dtype == want.dtype == BF16
        # one bfloat16 rounding of float32 sums taken in another order
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2 ** -7, atol=0.05)


def test_cpu_backward_multiplies_bfloat16_operands_only():
    x, w = jnp.ones((8, 16), BF16), jnp.ones((16, 32), BF16)
    loss = lambda x, w: jnp.sum(product(x, w, dtype=BF16).astype(jnp.float32) ** 2)  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    operands = re.findall(r"dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
    assert len(operands) == 3  # the forward, dx and dw
    assert all("bf16" in a and "bf16" in b for a, b in operands), operands


def _tiny():
    spec = spec_from_hf_config(hf_config("qwen3").to_dict())
    return spec, init_params(spec, jax.random.PRNGKey(0), dtype=BF16, std=0.2)


def test_bfloat16_layer_stack_is_sliced_without_a_float32_copy():
    spec, params = _tiny()
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 128, (2, 6)))
    pos = positions_from_mask(jnp.ones((2, 6), bool))
    fn = jax.jit(lambda p: forward(p, tokens, pos, spec, numerics=CPU)[0])
    text = fn.lower(params).compile().as_text()
    kernels = {"f32[" + ",".join(map(str, k.shape)) + "]"
               for k in jax.tree_util.tree_leaves(params["layers"]) if k.ndim == 3}
    assert len(kernels) >= 3
    copies = [k for k in kernels if k in text]
    assert not copies, copies  # no float32 copy of a stacked [L, in, out] kernel
    assert np.isfinite(np.asarray(fn(params))).all()


def test_base_weights_are_not_differentiable_through_the_bits():
    spec, params = _tiny()
    tokens = jnp.zeros((1, 4), jnp.int32)
    pos = positions_from_mask(jnp.ones((1, 4), bool))
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=2, alpha=4.0)
    loss = lambda p, a: jnp.sum(forward(p, tokens, pos, spec, lora=a,  # noqa: E731
                                        numerics=CPU)[0])
    grads = jax.grad(loss, argnums=1)(params, lora)  # the adapter: fine
    assert all(np.isfinite(np.asarray(g, np.float32)).all()
               for g in jax.tree_util.tree_leaves(grads))
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(loss)(params, lora)


def test_weights_held_as_bits_give_the_same_logits_and_decode_without_copying_the_stack():
    spec, params = _tiny()
    held = CPU.hold(params)  # as a run holds them on the CPU
    leaves = jax.tree_util.tree_leaves(held["layers"], is_leaf=lambda x: isinstance(x, Bits))
    assert all(isinstance(a, Bits) and a.bits.dtype == jnp.uint16 for a in leaves)
    assert CPU.hold(held) == held  # holding held weights changes nothing
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 128, (2, 5)))
    pos = positions_from_mask(jnp.ones((2, 5), bool))
    fn = jax.jit(lambda p: forward(p, tokens, pos, spec, numerics=CPU)[0])
    np.testing.assert_array_equal(np.asarray(fn(held)), np.asarray(fn(params)))
    kernels = {f"[{','.join(map(str, k.shape))}]"
               for k in jax.tree_util.tree_leaves(params["layers"]) if k.ndim == 3}

    def makes_a_stack(line):  # an instruction computing a [L, in, out] array (not a parameter)
        result = line.split("=", 1)[-1][:40]
        return (any(op in line for op in (" fusion(", "convert(", " copy("))
                and any(f"{t}{k}" in result for t in ("u16", "bf16") for k in kernels))

    made = [line for line in fn.lower(held).compile().as_text().splitlines()
            if makes_a_stack(line)]
    assert not made, made  # no stack is bitcast (copied) inside the program


def test_other_platforms_keep_bfloat16_weights():
    _, params = _tiny()
    for platform in ("gpu", "tpu"):  # e.g. a TPU slice `jaxrl plan` compiles for from a CPU
        held = numerics_for(platform).hold(params)
        assert jax.tree_util.tree_all(jax.tree_util.tree_map(
            lambda a, b: a is b, held["layers"], params["layers"]))


def test_abstract_params_are_held_with_their_shardings():
    _, params = _tiny()
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), params)
    held = CPU.hold(abstract)["layers"]["q_proj"]["kernel"]
    assert isinstance(held, Bits) and held.bits.dtype == jnp.uint16
    assert held.bits.sharding == sharding and held.shape == params["layers"]["q_proj"][
        "kernel"].shape

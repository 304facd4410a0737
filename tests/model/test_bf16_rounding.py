"""Where a bfloat16 model rounds: RoPE and the MLP's activation computed in float32 and
rounded once, projections saved for the backward as float32 on the CPU, and adapters cast once
for the sampling programs (`Numerics.hold_adapters`)."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl.backends.cpu import Bits
from jaxrl.backends.numerics import numerics_for
from jaxrl.lora.lora import init_lora
from jaxrl.model.attention import apply_rope
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import init_params
from jaxrl.model.transformer import forward, hidden_states, positions_from_mask, swiglu
from tests.tiny_models import hf_config

BF16 = jnp.bfloat16
CPU = numerics_for("cpu")


def _bf16(a) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even) and back, in numpy."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_swiglu_by_hand():
    # silu(1) = 1 / (1 + e^-1) = 0.7310586 = 1.4621172 x 2^-1; 0.4621172 x 128 = 59.15, so in
    # bfloat16 (7 stored mantissa bits) 1 + 59/128 = 1.4609375 x 2^-1 = 0.73046875. Times 3:
    # 2.19140625 = 1.0957031 x 2; 0.0957031 x 128 = 12.25 -> 12: 1.09375 x 2 = 2.1875.
    # silu(-2) = -2 / (1 + e^2) = -0.2384058 = -1.9072464 x 2^-3; 0.9072464 x 128 = 116.13 ->
    # 116: -1.90625 x 2^-3 = -0.23828125; times 0.5 exactly -0.119140625.
    gate = jnp.array([1.0, -2.0], BF16)
    up = jnp.array([3.0, 0.5], BF16)
    out = swiglu(gate, up)
    assert out.dtype == BF16
    assert np.asarray(out, np.float32).tolist() == [2.1875, -0.119140625]


def test_swiglu_rounds_silu_once_then_the_product():
    rng = np.random.default_rng(0)
    gate = jnp.asarray(rng.standard_normal((4, 96)) * 3, BF16)
    up = jnp.asarray(rng.standard_normal((4, 96)), BF16)
    g, u = np.asarray(gate, np.float32), np.asarray(up, np.float32)
    silu = _bf16(g / (1 + np.exp(-g)))  # torch's silu kernel: float32 inside, one rounding
    want = _bf16(silu * u)
    got = np.asarray(swiglu(gate, up), np.float32)
    # the exponential may differ in its last float32 bit between numpy and XLA, which can move
    # a rounding: allow one bfloat16 step on a few elements
    ulp = np.abs(want) * 2 ** -7 + 1e-30
    assert (np.abs(got - want) <= ulp).all()
    assert (got == want).mean() > 0.97


def test_rope_gradient_is_rounded_once():
    rng = np.random.default_rng(1)
    b, t, n, d = 2, 3, 2, 8
    x = jnp.asarray(rng.standard_normal((b, t, n, d)), BF16)
    angles = rng.uniform(0, 6.3, (b, t, d // 2)).astype(np.float32)
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles), np.sin(angles)
    w = rng.standard_normal((b, t, n, d)).astype(np.float32)

    def loss(x):
        return jnp.sum(apply_rope(x, jnp.asarray(cos), jnp.asarray(sin)).astype(jnp.float32) * w)

    got = np.asarray(jax.grad(loss)(x), np.float32)
    # the cotangent reaching the bfloat16 output is w rounded; then in float32: dx = g cos +
    # the rotation's transpose of g sin, rounded once
    g = _bf16(w)
    r = g * sin[:, :, None, :]
    h = d // 2
    dx = g * cos[:, :, None, :] + np.concatenate([r[..., h:], -r[..., :h]], axis=-1)
    np.testing.assert_array_equal(got, _bf16(dx))
    # the forward: x cos + rotate(x) sin in float32, one rounding
    xf = np.asarray(x, np.float32)
    rot = np.concatenate([-xf[..., h:], xf[..., :h]], axis=-1)
    want = _bf16(xf * cos[:, :, None, :] + rot * sin[:, :, None, :])
    np.testing.assert_array_equal(
        np.asarray(apply_rope(x, jnp.asarray(cos), jnp.asarray(sin)), np.float32), want)


def _tiny(dtype=BF16):
    spec = spec_from_hf_config(hf_config("llama", layers=3).to_dict())
    params = CPU.hold(init_params(spec, jax.random.PRNGKey(0), dtype=dtype, std=0.2))
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=4, alpha=8.0)
    lora = lora.replace(weights=jax.tree_util.tree_map(  # nonzero B, so the adapters count
        lambda a: a + 0.05, lora.weights))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 128, (2, 7)))
    return spec, params, lora, tokens, positions_from_mask(jnp.ones((2, 7), bool))


def test_dots_saves_bfloat16_projections_as_float32_and_stacks_them_in_place():
    spec, params, lora, tokens, pos = _tiny()

    def grads(remat):
        loss = lambda a: jnp.sum(forward(params, tokens, pos, spec, lora=a,  # noqa: E731
                                         remat=remat, numerics=CPU)[0])
        return jax.jit(jax.grad(loss)), loss

    dots, _ = grads("dots")
    text = dots.lower(lora).compile().as_text()
    # the projections of widths other than the hidden size's (the layer's input, also saved,
    # stays bfloat16): gate and up, k and v
    widths = "|".join(str(w) for w in (spec.intermediate_size, spec.num_kv_heads * spec.head_dim))
    stacked = re.compile(rf"= (bf16|f32)\[{spec.num_layers},2,7,({widths})\]")
    updates = [line for line in text.splitlines()
               if "dynamic-update-slice" in line.split("=", 1)[0] and stacked.search(line)]
    assert len(updates) >= 2, updates  # the scan stacks the saved projections
    assert not [u for u in updates if "= bf16[" in u], updates  # none as a bfloat16 stack
    # the same gradients as saving everything (the saved float32 values are exact)
    for a, b in zip(jax.tree_util.tree_leaves(dots(lora)),
                    jax.tree_util.tree_leaves(grads("none")[0](lora))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("platform,stored", [("cpu", jnp.uint16), ("gpu", BF16)])
def test_adapters_are_cast_once_and_change_nothing(platform, stored):
    spec, params, lora, tokens, pos = _tiny()
    numerics = numerics_for(platform)
    cast = numerics.hold_adapters(lora, BF16)
    leaves = jax.tree_util.tree_leaves(cast.weights["layers"])  # Bits hold their uint16 bits
    assert {a.dtype for a in leaves} == {jnp.dtype(stored)}
    assert numerics.hold_adapters(None, BF16) is None
    if platform != "cpu":
        return
    assert all(isinstance(a, Bits) for a in jax.tree_util.tree_leaves(
        cast.weights["layers"], is_leaf=lambda x: isinstance(x, Bits)))
    run = jax.jit(lambda a: hidden_states(params, tokens, pos, spec, lora=a, numerics=CPU)[0])
    np.testing.assert_array_equal(np.asarray(run(cast), np.float32),
                                  np.asarray(run(lora), np.float32))

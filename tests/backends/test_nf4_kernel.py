"""The Pallas NF4 kernels (jaxrl/backends/nf4_gpu.py): in interpret mode on the CPU against
their XLA references, a case worked by hand, gradients, and lowering for CUDA from this host."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.backends import nf4_gpu
from jaxrl.backends.nf4_gpu import (
    TRITON_CALL_TARGET,
    nf4_matmul,
    nf4_matmul_reference,
    nf4_swiglu,
    nf4_swiglu_reference,
)
from jaxrl.lora.lora import scaled_xa
from jaxrl.quant.nf4 import QTensor, quantize_np

BF16, F32 = jnp.bfloat16, jnp.float32
L, I, O, R = 3, 192, 96, 8  # I = 3 steps of 64 rows; O not a multiple of the 64-column tile
MS = (1, 5, 33)
SCALES = {"f32": {"scale_dtype": "float32"}, "bf16": {"scale_dtype": "bfloat16"},
          "dq": {"double_quant": True}}


@functools.cache
def stacked(mode: str, scales: str, seed: int = 0, n_in: int = I, n_out: int = O,
            block_size: int = 64) -> QTensor:
    """A quantized [L, n_in, n_out] stack with layers of distinct magnitude."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((L, n_in, n_out)).astype(np.float32)
    w *= np.array([0.5, 1.0, 2.0], np.float32)[:, None, None]
    q = quantize_np(w, block_size, mode, **SCALES[scales])
    return jax.tree_util.tree_map(jnp.asarray, q)


def inputs(m: int, dtype, seed: int = 1, n_in: int = I, n_out: int = O, stacked_b=True):
    """x [m, n_in] and a LoRA (xa [m, R], b) in dtype; b [L, R, n_out] or one layer's."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, n_in)), dtype)
    a = jnp.asarray(rng.standard_normal((n_in, R)) / np.sqrt(n_in), dtype)
    b_shape = (L, R, n_out) if stacked_b else (R, n_out)
    b = jnp.asarray(rng.standard_normal(b_shape), dtype)
    return x, (scaled_xa(x, a, 2.0), b)


def fast(fn):
    """fn jitted and compiled without LLVM's optimizations (the interpreted kernels' programs
    compile in about half the time; the float semantics are the same)."""
    compiled = {}

    def run(*args):
        key = jax.tree_util.tree_structure(args), tuple(
            (a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args))
        if key not in compiled:
            compiled[key] = jax.jit(fn).lower(*args).compile(
                compiler_options={"xla_backend_optimization_level": 0})
        return compiled[key](*args)
    return run


def assert_close(y, want, dtype):
    """float32: within 1e-5 of the largest value; bfloat16: within bfloat16 rounding (two
    units in the last place, the sums' order being the only difference)."""
    assert y.shape == want.shape and y.dtype == want.dtype
    y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
    scale = np.abs(want).max()
    rtol = 1e-5 if dtype == F32 else 2.0 ** -7
    np.testing.assert_allclose(y, want, rtol=rtol, atol=1e-5 * scale)


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["x32", "x16"])
@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("mode", ["nf4", "int4"])
def test_matmul_matches_reference(mode, scales, dtype, with_lora):
    """M = 1, 5 and 33 (one row tile of 16, a masked one, and a tile of 64): rows of x are
    independent, so each is compared with the first M rows of the reference on 33 rows; one
    program holds the three kernels and the reference (one compile)."""
    q = stacked(mode, scales)
    x, (xa, b) = inputs(33, dtype)
    layer = jnp.int32(1 if with_lora else 2)

    @fast
    def run(x, xa, b, layer):
        def lora(m):
            return (xa[:m], b) if with_lora else None
        ys = [nf4_matmul(x[:m], q, layer, lora=lora(m), interpret=True) for m in MS]
        return ys, nf4_matmul_reference(x, q, layer, lora=lora(33))

    ys, want = run(x, xa, b, layer)
    for m, y in zip(MS, ys):
        assert_close(y, want[:m], dtype)


@pytest.mark.parametrize("m, dtype, mode, scales, loras", [
    (1, F32, "nf4", "f32", "both"),
    (5, BF16, "nf4", "dq", "both"),
    (33, BF16, "int4", "bf16", "gate"),
    (33, F32, "int4", "dq", "none"),
    (5, F32, "nf4", "bf16", "up"),
])
def test_swiglu_matches_reference(m, dtype, mode, scales, loras):
    """gate's B stacked [L, r, F], up's one layer's [r, F]."""
    gate, up = stacked(mode, scales, seed=0), stacked(mode, scales, seed=1)
    x, gate_lora = inputs(m, dtype, seed=2)
    _, up_lora = inputs(m, dtype, seed=3, stacked_b=False)
    gate_lora = gate_lora if loras in ("both", "gate") else None
    up_lora = up_lora if loras in ("both", "up") else None

    @fast
    def run(x, gate_lora, up_lora, layer):
        return (nf4_swiglu(x, gate, up, layer, gate_lora=gate_lora, up_lora=up_lora,
                           interpret=True),
                nf4_swiglu_reference(x, gate, up, layer, gate_lora=gate_lora, up_lora=up_lora))

    assert_close(*run(x, gate_lora, up_lora, jnp.int32(2)), dtype)


def test_split_k_sums_the_parts_before_the_epilogue():
    """Three steps of I in 2 parts (2 + 1 steps) and in 3 (one each); the LoRA term (B
    stacked for gate, one layer's for up) and SwiGLU follow the sum."""
    q, up = stacked("nf4", "dq"), stacked("nf4", "f32", seed=1)
    x, lora = inputs(5, BF16)
    _, up_lora = inputs(5, BF16, seed=3, stacked_b=False)

    @fast
    def run(x, lora, up_lora):
        got = [f(split_k=k) for k in (2, 3) for f in (
            functools.partial(nf4_matmul, x, q, jnp.int32(0), lora=lora, interpret=True),
            functools.partial(nf4_swiglu, x, q, up, jnp.int32(1), gate_lora=lora,
                              up_lora=up_lora, interpret=True))]
        want = [nf4_matmul_reference(x, q, jnp.int32(0), lora=lora),
                nf4_swiglu_reference(x, q, up, jnp.int32(1), gate_lora=lora,
                                     up_lora=up_lora)]
        return got, want * 2

    for y, want in zip(*run(x, lora, up_lora)):
        assert_close(y, want, BF16)


@pytest.mark.parametrize("block_size, n_in, tiles", [
    (32, 128, {}),  # two scale rows per 64-row step
    (128, 256, {}),
    (64, 256, {"block_m": 32, "block_o": 32, "block_k": 128}),  # M = 33: two row tiles
])
def test_other_block_sizes_and_tiles(block_size, n_in, tiles):
    q = stacked("nf4", "dq", n_in=n_in, block_size=block_size)
    x, lora = inputs(33, F32, n_in=n_in)

    @fast
    def run(x, lora):
        return (nf4_matmul(x, q, jnp.int32(1), lora=lora, interpret=True, **tiles),
                nf4_matmul_reference(x, q, jnp.int32(1), lora=lora))

    assert_close(*run(x, lora), F32)


def hand_stack(double_quant: bool) -> QTensor:
    """Two layers of a one-block kernel [64, 3]; in layer 1, with scale 2: column 0 all
    level +1, column 1 level -1 on the even rows (low nibbles) and +1 on the odd rows, column
    2 level 0. Layer 0 is all level +1 with scale 1."""
    plus, minus, zero = 15, 0, 7  # NF4 codes of the levels +1, -1, 0
    layer1 = np.array([plus | plus << 4, minus | plus << 4, zero | zero << 4], np.uint8)
    layer0 = np.full(3, plus | plus << 4, np.uint8)
    codes = np.stack([np.broadcast_to(layer0, (32, 3)), np.broadcast_to(layer1, (32, 3))])
    if not double_quant:
        scales = np.array([[[1.0] * 3], [[2.0] * 3]], np.float32)  # [L, N=1, O]
        return QTensor(jnp.asarray(codes), jnp.asarray(scales), 64, "nf4", "float32")
    # s = (code - 128) * step + offset: step 0.5, offset 1 -> code 128 is 1, code 130 is 2
    scales = np.array([[[128] * 3], [[130] * 3]], np.uint8)
    return QTensor(jnp.asarray(codes), jnp.asarray(scales), 64, "nf4", "float32",
                   jnp.full((2, 1), 0.5, F32), jnp.ones((2,), F32))


@pytest.mark.parametrize("double_quant", [False, True], ids=["f32", "dq"])
def test_worked_by_hand(double_quant):
    """x = [1, 2, ..., 64]: column 0 is 2 * 2080 = 4160; column 1 is 2 * (odd rows' x:
    2 + 4 + ... + 64 = 1056, minus even rows' 1 + 3 + ... + 63 = 1024) = 64; column 2 is 0.
    LoRA xa = [1, 2], B = [[1, 0, 1], [0, 1, 1]] adds [1, 2, 3]. Layer 0: 2080 each. SwiGLU
    with gate = up = layer 1: silu(4160) * 4160 = 4160^2, silu(64) * 64, 0."""
    q = hand_stack(double_quant)
    x = jnp.arange(1, 65, dtype=F32)[None, :]
    lora = (jnp.array([[1.0, 2.0]], F32), jnp.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], F32))

    @fast
    def run(layer):
        return (nf4_matmul(x, q, layer, interpret=True),
                nf4_matmul(x, q, layer, lora=lora, interpret=True),
                nf4_matmul_reference(x, q, layer, lora=lora),
                nf4_swiglu(x, q, q, layer, interpret=True))

    base, fused, ref, swiglu = run(jnp.int32(1))
    assert base.tolist() == [[4160, 64, 0]]
    assert fused.tolist() == ref.tolist() == [[4161, 66, 3]]
    np.testing.assert_allclose(swiglu[0], [4160.0 ** 2, 64 * 64 / (1 + np.exp(-64.0)), 0],
                               rtol=1e-6)
    base, fused, ref, _ = run(jnp.int32(0))
    assert base.tolist() == [[2080] * 3]
    assert fused.tolist() == ref.tolist() == [[2081, 2082, 2083]]


def test_layer_index_is_traced_and_selects_its_layer():
    q = stacked("int4", "bf16")
    x, lora = inputs(5, F32)
    run = fast(lambda layer: (nf4_matmul(x, q, layer, lora=lora, interpret=True),
                              nf4_matmul_reference(x, q, layer, lora=lora)))
    outs = [run(jnp.int32(i)) for i in range(L)]  # one program, three layers
    for y, want in outs:
        assert_close(y, want, F32)
    assert not np.allclose(outs[0][0], outs[1][0]) and not np.allclose(outs[1][0], outs[2][0])


def test_gradients_are_the_references():
    q, up = stacked("nf4", "f32"), stacked("nf4", "bf16", seed=1)
    x, (xa, b) = inputs(5, F32)
    c = jnp.asarray(np.random.default_rng(4).standard_normal((5, O)), F32)

    def loss(f, x, xa, b):
        return jnp.sum(c * f(x, xa, b))

    def kernel(x, xa, b):
        return nf4_swiglu(x, q, up, jnp.int32(1), gate_lora=(xa, b), up_lora=(xa, b),
                          interpret=True)

    def reference(x, xa, b):
        return nf4_swiglu_reference(x, q, up, jnp.int32(1), gate_lora=(xa, b),
                                    up_lora=(xa, b))

    got, want = fast(lambda *a: [jax.grad(functools.partial(loss, f), argnums=(0, 1, 2))(*a)
                                 for f in (kernel, reference)])(x, xa, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


def test_rejects_bad_tiles():
    q = stacked("nf4", "f32")
    x, _ = inputs(1, F32)
    with pytest.raises(ValueError, match="block_k"):
        nf4_matmul(x, q, 0, block_k=96, interpret=True)
    with pytest.raises(ValueError, match="block_o"):
        nf4_matmul(x, q, 0, block_o=8, interpret=True)


# -- lowering for CUDA from this host (no GPU needed: Pallas emits Triton IR itself) ----------
def spec_of(n_layers, n_in, n_out, block_size=64, double_quant=False):
    n = n_in // block_size
    sds = jax.ShapeDtypeStruct
    scales = sds((n_layers, n, n_out), jnp.uint8 if double_quant else F32)
    extra = ((sds((n_layers, -(-n * n_out // 256)), F32), sds((n_layers,), F32))
             if double_quant else (None, None))
    return QTensor(sds((n_layers, n_in // 2, n_out), jnp.uint8), scales, block_size, "nf4",
                   "bfloat16", *extra)


def cuda_module(f, *args) -> str:
    exported = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL_TARGET)])(*args)
    return exported.mlir_module()


def triton_calls(module: str) -> list[str]:
    return [line for line in module.splitlines()
            if re.search(r"stablehlo\.custom_call @" + re.escape(TRITON_CALL_TARGET), line)]


@pytest.mark.parametrize("m, n_in, n_out, double_quant", [
    (1, 2560, 9728, True),  # Qwen3-4B gate/up at decode (split-K)
    (16, 9728, 2560, False),  # down_proj at decode
    (64, 2560, 1024, True),  # k/v_proj at a larger decode batch
    (2048, 2560, 4096, False),  # q_proj over a prefill
])
def test_lowers_for_cuda_reading_the_stack_in_place(m, n_in, n_out, double_quant):
    n_layers, sds = 36, jax.ShapeDtypeStruct
    q = spec_of(n_layers, n_in, n_out, double_quant=double_quant)
    x, layer = sds((m, n_in), BF16), sds((), jnp.int32)
    xa, b = sds((m, 16), BF16), sds((16, n_out), BF16)
    codes_type = f"tensor<{n_layers}x{n_in // 2}x{n_out}xui8>"
    matmul = cuda_module(lambda x, q, layer, xa, b: nf4_matmul(x, q, layer, lora=(xa, b)),
                         x, q, layer, xa, b)
    swiglu = cuda_module(lambda x, g, u, layer, xa, b: nf4_swiglu(
        x, g, u, layer, gate_lora=(xa, b), up_lora=(xa, b)), x, q, q, layer, xa, b)
    for module, n_stacks in [(matmul, 1), (swiglu, 2)]:
        [call] = triton_calls(module)  # one kernel per call
        assert call.count(codes_type) == n_stacks  # the whole stacks are its operands
        assert "slice" not in module  # nothing sliced outside the kernel
    # decode calls of few rows split I (too few [bm, bo] tiles otherwise); others do not
    assert (nf4_gpu.default_tiles(m, n_in, n_out, 64).split_k > 1) == (m <= 16)


def test_lowers_for_cuda_with_the_lora_in_the_kernel_under_split_k():
    """Under split-K the LoRA product is computed in the kernel too: outside the one Triton
    call the module holds no dot and no slice (a stacked B is read at the layer in the
    kernel), for a matmul and a SwiGLU with stacked and one-layer Bs."""
    sds = jax.ShapeDtypeStruct
    q = spec_of(4, 256, 512)
    x, layer, xa = sds((1, 256), BF16), sds((), jnp.int32), sds((1, 8), BF16)
    b_stack, b_one = sds((4, 8, 512), BF16), sds((8, 512), BF16)
    matmul = cuda_module(lambda x, q, layer, xa, b: nf4_matmul(
        x, q, layer, lora=(xa, b), block_k=128, split_k=2), x, q, layer, xa, b_stack)
    swiglu = cuda_module(lambda x, g, u, layer, xa, bg, bu: nf4_swiglu(
        x, g, u, layer, gate_lora=(xa, bg), up_lora=(xa, bu), block_k=128, split_k=2),
                         x, q, q, layer, xa, b_stack, b_one)
    for module in (matmul, swiglu):
        assert len(triton_calls(module)) == 1
        assert module.count("stablehlo.dot_general") == 0
        assert "slice" not in module
    assert nf4_gpu.default_tiles(1, 256, 512, 64).split_k == 1  # one step of I: nothing to split

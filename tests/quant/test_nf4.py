"""Tests for blockwise NF4 / int4 quantization: hand-worked codes, bounds, layouts, parity."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.quant.nf4 import (
    INT4_CODEBOOK,
    NF4_CODEBOOK,
    QTensor,
    dequantize,
    dequantize_np,
    nbytes,
    quantize_np,
    quantized_bytes_per_param,
)

# Appendix E of the QLoRA paper (the NF4 data type), as published.
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
CODEBOOK = {"nf4": NF4_CODEBOOK, "int4": INT4_CODEBOOK}


def unpack(codes: np.ndarray) -> np.ndarray:
    """[..., I/2, O] bytes -> [..., I, O] 4-bit codes: row 2i from the low nibble, 2i+1 high."""
    out = np.empty(codes.shape[:-2] + (2 * codes.shape[-2], codes.shape[-1]), np.uint8)
    out[..., 0::2, :] = codes & 0x0F
    out[..., 1::2, :] = codes >> 4
    return out


def block_absmax(w: np.ndarray, block: int) -> np.ndarray:
    """absmax of every block, repeated over its rows: [..., I, O]."""
    *lead, n_in, n_out = w.shape
    a = np.abs(w.reshape(*lead, n_in // block, block, n_out)).max(axis=-2, keepdims=True)
    return np.broadcast_to(a, (*lead, n_in // block, block, n_out)).reshape(w.shape)


def reference_quantize(w: np.ndarray, block: int, codebook: np.ndarray):
    """QLoRA's definition, element by element: absmax-normalize each block, nearest level, pack."""
    n_in, n_out = w.shape
    codes = np.zeros((n_in, n_out), np.uint8)
    scales = np.zeros((n_in // block, n_out), np.float32)
    for col in range(n_out):
        for b in range(n_in // block):
            x = w[b * block:(b + 1) * block, col].astype(np.float32)
            absmax = np.abs(x).max()
            scales[b, col] = absmax
            normed = x / absmax if absmax > 0 else np.zeros_like(x)
            for r, v in enumerate(normed):
                # argmin returns the first minimum: exact ties go to the lower level.
                dist = np.abs(np.float64(v) - codebook.astype(np.float64))
                codes[b * block + r, col] = np.argmin(dist)
    packed = codes[0::2] | (codes[1::2] << 4)
    return packed, scales


def rng_weights(shape, seed=0, scale=0.02):
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


def test_nf4_codebook_is_the_published_table():
    assert NF4_CODEBOOK.dtype == np.float32
    np.testing.assert_array_equal(NF4_CODEBOOK, np.array(PUBLISHED_NF4, np.float32))
    assert np.all(np.diff(NF4_CODEBOOK) > 0)


def test_int4_codebook_is_code_minus_8_over_7():
    assert INT4_CODEBOOK.dtype == np.float32
    np.testing.assert_array_equal(INT4_CODEBOOK, np.float32([(k - 8) / 7 for k in range(16)]))
    assert INT4_CODEBOOK[1] == -1.0 and INT4_CODEBOOK[8] == 0.0 and INT4_CODEBOOK[15] == 1.0


def test_hand_worked_nf4_block_and_bytes():
    w = np.zeros((64, 2), np.float32)
    w[:8, 0] = [4.0, -2.0, 0.3, 1.0, -3.0, 0.0, -0.1, 2.5]
    w[:, 1] = -w[:, 0]
    q = quantize_np(w)  # one block of 64 per column; absmax 4.0 in both
    np.testing.assert_array_equal(q.scales, [[4.0, 4.0]])
    # Column 0, x = w / 4 and the nearest NF4 level (index):
    #   1.0 -> 1.0 (15); -0.5 -> -0.5251 (2, vs -0.3949); 0.075 -> 0.0796 (8, vs 0.0);
    #   0.25 -> 0.2461 (10); -0.75 -> -0.6962 (1, vs -1.0); 0 -> 0 (7); -0.025 -> 0 (7, vs -0.0911);
    #   0.625 -> 0.5626 (13, midpoint with 0.7230 is 0.6428).
    # Column 1 (negated; NF4 is asymmetric, so not a mirror): -1 -> 0; 0.5 -> 0.4407 (12, midpoint
    #   with 0.5626 is 0.5017); -0.075 -> -0.0911 (6); -0.25 -> -0.2844 (4, midpoint -0.2346);
    #   0.75 -> 0.7230 (14); 0 -> 7; 0.025 -> 0 (7); -0.625 -> -0.6962 (1, midpoint -0.6106).
    col0 = [15, 2, 8, 10, 1, 7, 7, 13] + [7] * 56
    col1 = [0, 12, 6, 4, 14, 7, 7, 1] + [7] * 56
    np.testing.assert_array_equal(unpack(q.codes), np.array([col0, col1], np.uint8).T)
    # Byte i = code[2i] | code[2i+1] << 4: (15 | 2<<4) = 0x2F, (8 | 10<<4) = 0xA8,
    # (1 | 7<<4) = 0x71, (7 | 13<<4) = 0xD7, then 0x77 for the zero rows;
    # column 1: 0xC0, 0x46, 0x7E, 0x17, 0x77...
    np.testing.assert_array_equal(q.codes[:5, 0], [0x2F, 0xA8, 0x71, 0xD7, 0x77])
    np.testing.assert_array_equal(q.codes[:5, 1], [0xC0, 0x46, 0x7E, 0x17, 0x77])
    assert q.codes.shape == (32, 2) and q.codes.dtype == np.uint8
    np.testing.assert_array_equal(dequantize_np(q)[:, 0], 4.0 * NF4_CODEBOOK[col0])


def test_nibble_order_on_one_byte_per_column():
    # Two input rows, one byte per column; x = +1 -> code 15, x = -1 -> code 0.
    q = quantize_np(np.array([[1.0, -1.0], [-1.0, 1.0]], np.float32), block_size=2)
    np.testing.assert_array_equal(q.codes, [[0x0F, 0xF0]])  # row 0 low nibble, row 1 high


def test_hand_worked_int4_block():
    w = np.array([[7.0], [-7.0], [1.0], [2.0], [-3.0], [0.0], [0.4], [0.6]], np.float32)
    q = quantize_np(w, block_size=8, mode="int4")
    # x = w / 7 on the grid k/7 stored as code k + 8; 0.4/7 and 0.6/7 sit either side of the
    # midpoint 0.5/7, so they go to k = 0 and k = 1.
    codes = [15, 1, 9, 10, 5, 8, 8, 9]
    np.testing.assert_array_equal(unpack(q.codes)[:, 0], codes)
    np.testing.assert_array_equal(q.codes[:, 0], [0x1F, 0xA9, 0x85, 0x98])
    np.testing.assert_allclose(dequantize_np(q)[:, 0], [7, -7, 1, 2, -3, 0, 0, 1], rtol=1e-6)


@pytest.mark.parametrize("mode", ["nf4", "int4"])
def test_nearest_level_with_ties_to_the_lower_level(mode):
    book = CODEBOOK[mode]
    for k in range(15):
        mid = (np.float64(book[k]) + np.float64(book[k + 1])) / 2  # exact
        if mid < -1:  # int4 code 0 (-8/7) lies outside [-1, 1]: no x reaches it
            continue
        below = np.float32(mid)
        if below > mid:
            below = np.nextafter(below, np.float32(-2))
        above = np.nextafter(below, np.float32(2))
        w = np.array([[1.0], [below], [above], [0.0]], np.float32)  # absmax 1: x == w
        codes = unpack(quantize_np(w, block_size=4, mode=mode).codes)[:, 0]
        # below <= mid: nearer to level k or tied with it (a tie goes low); above > mid: k + 1.
        assert (codes[1], codes[2]) == (k, k + 1), (mode, k, below == mid)
    # The midpoint of 0.0 and the next level is level / 2, exact in float32: a true tie.
    zero = int(np.flatnonzero(book == 0)[0])
    tie = np.array([[1.0], [book[zero + 1] / 2], [0.0], [0.0]], np.float32)
    assert unpack(quantize_np(tie, block_size=4, mode=mode).codes)[1, 0] == zero


@pytest.mark.parametrize("mode", ["nf4", "int4"])
def test_round_trip_error_within_half_gap_of_block_absmax(mode):
    w = rng_weights((512, 96), seed=1)
    q = quantize_np(w, mode=mode)
    err = np.abs(dequantize_np(q) - w)
    half_gap = np.diff(CODEBOOK[mode].astype(np.float64)).max() / 2  # NF4: (1 - 0.6962) / 2
    bound = block_absmax(w, 64) * half_gap * (1 + 1e-6)
    assert np.all(err <= bound)
    # The bound is nearly reached, so a looser quantizer would fail it.
    assert (err / bound).max() > 0.9


@pytest.mark.parametrize("mode,block", [("nf4", 64), ("nf4", 32), ("int4", 64)])
def test_matches_reference_implementation(mode, block):
    w = rng_weights((256, 24), seed=2)
    w[:, 5] *= 100.0  # scales spanning orders of magnitude
    q = quantize_np(w, block_size=block, mode=mode)
    packed, scales = reference_quantize(w, block, CODEBOOK[mode])
    np.testing.assert_array_equal(q.codes, packed)
    np.testing.assert_array_equal(q.scales, scales)


def test_matches_bitsandbytes_nf4():
    pytest.importorskip("bitsandbytes")
    torch = pytest.importorskip("torch")
    from bitsandbytes import functional as bnb

    w = np.clip(rng_weights((256, 32), seed=3, scale=1.0), -3.5, 3.5)
    # A power-of-two absmax makes bitsandbytes' w * (1 / absmax) equal our w / absmax exactly.
    w[::64] = np.where(np.random.default_rng(4).random((4, 32)) < 0.5, -4.0, 4.0)
    q = quantize_np(w)
    # A torch Linear weight is [out, in]; bitsandbytes blocks its flattened rows, which are our
    # columns, and packs the first element of a pair in the HIGH nibble.
    packed, state = bnb.quantize_4bit(torch.from_numpy(w.T.copy()), blocksize=64, quant_type="nf4")
    flat = packed.numpy().reshape(-1)
    theirs = np.empty(2 * flat.size, np.uint8)
    theirs[0::2], theirs[1::2] = flat >> 4, flat & 0x0F
    np.testing.assert_array_equal(unpack(q.codes), theirs.reshape(32, 256).T)
    np.testing.assert_array_equal(q.scales, state.absmax.numpy().reshape(32, 4).T)
    dense = bnb.dequantize_4bit(packed, state).numpy()
    np.testing.assert_array_equal(dequantize_np(q), dense.T)


@pytest.mark.parametrize("shape", [(256, 96), (3, 128, 40)])
def test_storage_counts_and_bytes_per_param(shape):
    w = rng_weights(shape, seed=5)
    n = w.size
    for kwargs, expected in [({}, 0.5625), ({"scale_dtype": "bfloat16"}, 0.53125),
                             ({"double_quant": True}, None)]:
        q = quantize_np(w, **kwargs)
        assert q.codes.nbytes == n // 2
        assert q.scales.size == n // 64
        bpp = quantized_bytes_per_param(shape, 64, **kwargs)
        assert nbytes(q) == round(bpp * n)
        if expected is not None:  # 0.5 + 4/64 and 0.5 + 2/64, exact in binary
            assert bpp == expected
    # Double quant on [256, 96]: 384 scale codes + 2 group steps * 4 + 4 offset = 396 bytes.
    assert quantized_bytes_per_param((256, 96), 64, True) == (256 * 96 // 2 + 396) / (256 * 96)


def test_double_quant_bytes_per_param_for_qwen3_mlp_kernel():
    shape = (2560, 9728)
    n = 2560 * 9728
    # 40 * 9728 = 389120 one-byte scale codes, 389120 / 256 = 1520 float32 steps, one offset.
    expected = (n // 2 + 389120 + 1520 * 4 + 4) / n
    bpp = quantized_bytes_per_param(shape, 64, double_quant=True)
    assert bpp == expected and bpp <= 0.52
    assert quantized_bytes_per_param((36,) + shape, 64, double_quant=True) == expected
    abstract = jax.eval_shape(lambda: QTensor(
        jnp.zeros((1280, 9728), jnp.uint8), jnp.zeros((40, 9728), jnp.uint8), 64, "nf4",
        "bfloat16", jnp.zeros((1520,), jnp.float32), jnp.zeros((), jnp.float32)))
    assert nbytes(abstract) == round(bpp * n)


def test_double_quant_hand_worked():
    w = np.zeros((64, 6), np.float32)
    # Column absmaxes with mean 4.0; deviations -127/64, +127/64, 0, 0, +33/128, -33/128.
    w[0] = [2.015625, 5.984375, 4.0, 4.0, 4.2578125, 3.7421875]
    q = quantize_np(w, double_quant=True)
    # step = max|dev| / 127 = 1/64 (already 16-bit); codes rint(dev * 64) = -127, 127, 0, 0,
    # rint(16.5) = 16, rint(-16.5) = -16 (ties to even), stored + 128.
    np.testing.assert_array_equal(q.scale_offset, np.float32(4.0))
    np.testing.assert_array_equal(q.scale_scales, [1 / 64])
    np.testing.assert_array_equal(q.scales, [[1, 255, 128, 128, 144, 112]])
    # Row 0 is each column's absmax, so it dequantizes to the dequantized scale itself; the
    # last two are off by 1/128 = step / 2, the documented bound, reached exactly.
    expected = np.zeros((64, 6), np.float32)
    expected[0] = [2.015625, 5.984375, 4.0, 4.0, 4.25, 3.75]
    np.testing.assert_array_equal(dequantize_np(q), expected)


def test_double_quant_scale_error_within_half_step():
    rng = np.random.default_rng(6)
    column_scale = np.exp(rng.normal(size=(3, 1, 160))).astype(np.float32)
    w = rng_weights((3, 1024, 160), seed=7) * column_scale
    plain = quantize_np(w)
    q = quantize_np(w, double_quant=True)
    np.testing.assert_array_equal(q.codes, plain.codes)  # codes use the float32 absmax
    s = plain.scales.reshape(3, -1).astype(np.float64)  # [3, 2560] = 10 groups of 256
    steps = q.scale_scales.astype(np.float64)  # [3, 10]
    assert steps.shape == (3, 10) and q.scale_offset.shape == (3,)
    dev = np.abs(s - q.scale_offset[:, None]).reshape(3, 10, 256).max(axis=2)
    assert np.all(steps >= dev / 127) and np.all(steps <= dev / 127 * (1 + 2.0**-15))
    step_per_scale = np.repeat(steps, 256, axis=1)
    s_deq = (q.scales.reshape(3, -1).astype(np.float32) - 128) * np.repeat(
        q.scale_scales, 256, axis=1) + q.scale_offset[:, None]
    assert np.all(np.abs(s - s_deq) <= step_per_scale / 2 + 2.0**-23 * np.abs(s_deq))
    # Weight error: the 4-bit bound plus at most step / 2 from the scale.
    half_gap = np.diff(NF4_CODEBOOK.astype(np.float64)).max() / 2
    step_dense = np.repeat(step_per_scale.reshape(3, 16, 160), 64, axis=1)
    bound = (block_absmax(w, 64) * half_gap + step_dense / 2) * (1 + 1e-5)
    assert np.all(np.abs(dequantize_np(q) - w) <= bound)


def test_bfloat16_scales():
    w = rng_weights((256, 48), seed=8)
    plain = quantize_np(w)
    q = quantize_np(w, scale_dtype="bfloat16")
    assert q.scales.dtype == jnp.bfloat16 and q.dtype == "float32"
    np.testing.assert_array_equal(q.codes, plain.codes)
    s, s16 = plain.scales.astype(np.float64), q.scales.astype(np.float64)
    assert np.all(np.abs(s - s16) <= 2.0**-8 * s)
    half_gap = np.diff(NF4_CODEBOOK.astype(np.float64)).max() / 2
    absmax = block_absmax(w, 64)
    bound = absmax * (half_gap + 2.0**-8) * (1 + 1e-6)
    assert np.all(np.abs(dequantize_np(q) - w) <= bound)


@pytest.mark.parametrize("double_quant", [False, True])
def test_layer_axis_slices_are_per_layer_quantizations(double_quant):
    w = rng_weights((3, 128, 40), seed=9)
    q = quantize_np(w, double_quant=double_quant)
    dense = dequantize_np(q)
    assert q.shape == (3, 128, 40) and q.double_quant == double_quant
    for i in range(3):
        qi = quantize_np(w[i], double_quant=double_quant)
        sliced = jax.tree_util.tree_map(lambda a, i=i: a[i], q)
        assert jax.tree_util.tree_structure(sliced) == jax.tree_util.tree_structure(qi)
        for a, b in zip(jax.tree_util.tree_leaves(sliced), jax.tree_util.tree_leaves(qi)):
            np.testing.assert_array_equal(a, b)
        assert sliced.shape == (128, 40)
        np.testing.assert_array_equal(dequantize_np(sliced), dense[i])
        np.testing.assert_array_equal(dequantize_np(qi), dense[i])


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.uint16 if np.asarray(a).dtype.itemsize == 2 else np.uint32)


CONFIGS = [dict(), dict(scale_dtype="bfloat16"), dict(double_quant=True), dict(mode="int4"),
           dict(mode="int4", double_quant=True)]


@pytest.mark.accelerator
@pytest.mark.parametrize("kwargs", CONFIGS)
@pytest.mark.parametrize("dtype", [None, "bfloat16", "float32"])
def test_jax_dequantize_equals_numpy_bit_for_bit(kwargs, dtype):
    w = rng_weights((2, 512, 320), seed=10).astype(jnp.bfloat16)  # 10 scale groups per layer
    q = quantize_np(w, **kwargs)
    assert q.dtype == "bfloat16"
    ours, host = np.asarray(dequantize(q, dtype)), dequantize_np(q, dtype)
    assert ours.dtype == host.dtype == jnp.dtype(dtype or "bfloat16")
    np.testing.assert_array_equal(bits(ours), bits(host))


@pytest.mark.accelerator
@pytest.mark.parametrize("n_out", [512, 64, 8, 320])  # O = 2 * 256; 256 = 4 * O, 32 * O; neither
def test_double_quant_scales_follow_the_row_major_group_numbering(n_out):
    w = rng_weights((2, 128, n_out), seed=13) * np.exp(
        np.random.default_rng(14).normal(size=(2, 1, n_out))).astype(np.float32)
    q = quantize_np(w, double_quant=True)
    # Scale (n, o) of a [2, O] grid is number n * O + o, in group (n * O + o) // 256.
    group = (np.arange(2)[:, None] * n_out + np.arange(n_out)[None, :]) // 256
    for layer in range(2):
        scales = ((q.scales[layer].astype(np.float32) - 128) * q.scale_scales[layer][group]
                  + q.scale_offset[layer])
        dense = NF4_CODEBOOK[unpack(q.codes[layer])] * np.repeat(scales, 64, axis=0)
        np.testing.assert_array_equal(dequantize_np(q)[layer], dense)
        np.testing.assert_array_equal(np.asarray(dequantize(q))[layer], dense)


@pytest.mark.accelerator
@pytest.mark.parametrize("kwargs", [dict(), dict(double_quant=True), dict(mode="int4")])
@pytest.mark.parametrize("n_out", [512, 64])
def test_dequantize_has_no_gather_to_keep_it_fusable_into_the_matmul(kwargs, n_out):
    # A table lookup (gather) cannot fuse into the dot that consumes the kernel: the dense
    # layer would be written to memory and read back, about 4.5 bytes per parameter a step.
    q = quantize_np(rng_weights((256, n_out), seed=15), **kwargs)
    hlo = jax.jit(lambda q: dequantize(q, jnp.bfloat16)).lower(q).as_text()
    assert "gather" not in hlo and "select" in hlo


@pytest.mark.accelerator
@pytest.mark.parametrize("kwargs", CONFIGS)
def test_dequantize_under_jit_and_scan(kwargs):
    w = rng_weights((3, 256, 272), seed=11)  # 1088 scales: a partial last group of 256
    q = jax.device_put(quantize_np(w, **kwargs))
    host = dequantize_np(quantize_np(w, **kwargs))
    jitted = jax.jit(dequantize, static_argnames="dtype")(q)
    np.testing.assert_array_equal(np.asarray(jitted), host)

    def layer(carry, q_layer):
        return carry, dequantize(q_layer)

    _, scanned = jax.jit(lambda q: jax.lax.scan(layer, None, q))(q)
    np.testing.assert_array_equal(np.asarray(scanned), host)


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_zero_blocks_do_not_divide_by_zero(kwargs):
    w = rng_weights((2, 128, 8), seed=12)
    w[0, :64, 3] = 0.0  # one zero block
    w[1] = 0.0  # a whole zero layer: zero absmax, and under double quant zero steps
    with np.errstate(all="raise"):
        q = quantize_np(w, **kwargs)
        dense = dequantize_np(q)
    assert np.all(dense[0, :64, 3] == 0) and np.all(dense[1] == 0)
    assert np.all(np.isfinite(dense))


@pytest.mark.parametrize("shape,kwargs,message", [
    ((100, 8), {}, "input dim 100 .* not divisible by block_size 64"),
    ((63, 8), {}, "input dim 63 .* is odd"),
    ((64, 8), {"block_size": 63}, "block_size must be a positive even integer"),
    ((64, 8), {"block_size": 0}, "block_size must be a positive even integer"),
    ((64, 8), {"mode": "fp4"},
     r"unknown quantization mode 'fp4'; expected one of \['nf4', 'int4'\]"),
    ((64, 8), {"scale_dtype": "float16"}, "unknown scale_dtype 'float16'"),
    ((64, 8), {"double_quant": True, "scale_dtype": "bfloat16"}, "scale_dtype must be 'float32'"),
    ((64,), {}, r"expected a kernel shaped \[..., in, out\]"),
])
def test_bad_inputs_raise_clear_errors(shape, kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_np(np.ones(shape, np.float32), **kwargs)
    if "mode" not in kwargs:  # the planner is mode-independent
        with pytest.raises(ValueError, match=message):
            quantized_bytes_per_param(shape, **kwargs)


def test_non_finite_and_integer_weights_raise():
    w = np.ones((64, 2), np.float32)
    w[5, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_np(w)
    with pytest.raises(ValueError, match="floating-point weights, got dtype int32"):
        quantize_np(np.ones((64, 2), np.int32))

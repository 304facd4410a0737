"""Blockwise 4-bit quantization of linear kernels: NF4 (QLoRA) and symmetric int4.

A kernel is stored [in, out] (y = x @ W), stacked over layers as [L, in, out]. Blocks run along
the input dim: `block_size` consecutive input rows of one output column share one absmax scale.
Every [..., in, out] slice is quantized on its own, and every array leaf of a `QTensor` keeps the
leading (layer) dims first, so `lax.scan` over layers, or `tree_map(lambda a: a[i], q)`, yields
the per-layer QTensor, and a leaf shards like the dense kernel's axes.

Glossary (shapes below use these letters):
  ...  leading dims of the dense kernel, e.g. the layer stack L (may be empty)
  I    input dim (rows of the kernel), O output dim
  Bk   block_size, the input rows sharing a scale; N = I / Bk blocks per column
  G    groups of 256 consecutive scales (row-major over [N, O]) under double quantization

Quantization: x = w / absmax (float32 division, so |x| <= 1), then the code of the codebook
level nearest to x. An exact tie between two levels goes to the LOWER level (toward -1), as
bitsandbytes' CPU quantizer (bucketize on the midpoints) does. All-zero blocks get absmax 0 and
the code of level 0.0, so they dequantize to exact zeros. Codes pack two per byte along the input
dim: byte i of a column holds input row 2i in its low nibble and row 2i+1 in its high nibble.

Double quantization (QLoRA): the float32 absmax scales s of a slice have their mean m (the
`scale_offset`) subtracted, then each group of 256 consecutive scales is quantized to a linear
symmetric 8-bit grid: code c = rint((s - m) / step) in [-127, 127], stored as c + 128 (uint8),
step = max|s - m| / 127 over the group (`scale_scales`), rounded up to 16 significant bits.
Dequantized scale s' = c * step + m, so |s - s'| <= step / 2 (+ float32 rounding of the sum).
Codes are chosen against the float32 absmax, so since |level| <= 1 this adds at most step / 2 to
each weight's error; bfloat16 scales (8 significant bits) likewise add |s - bf16(s)| <= 2**-8 * s.
"""
from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.quant.formats import SCALE_DTYPES

# The 16 NormalFloat4 levels as published with QLoRA (Dettmers et al., 2023, appendix E).
NF4_CODEBOOK = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)

# Symmetric linear int4: level(code) = (code - 8) / 7, so codes 1..15 span -1..1 in steps of 1/7
# with code 8 = 0.0. Code 0 (-8/7) lies outside [-1, 1] and is never produced; it is kept so the
# table obeys one formula for all 16 codes.
INT4_CODEBOOK = ((np.arange(16) - 8) / 7).astype(np.float32)

CODEBOOKS = {"nf4": NF4_CODEBOOK, "int4": INT4_CODEBOOK}
DQ_GROUP = 256  # first-level scales per 8-bit group, as in QLoRA
_DQ_MAX_CODE = 127
_DQ_ZERO = 128  # stored uint8 value of 8-bit code 0


@flax.struct.dataclass
class QTensor:
    """A quantized kernel [..., I, O]; array leaves keep the leading dims first.

    codes: uint8 [..., I/2, O], two 4-bit codes per byte (row 2i low nibble, 2i+1 high).
    scales: float32 or bfloat16 absmax [..., N, O]; under double quantization, uint8 8-bit codes
        of the scales (stored code + 128) [..., N, O].
    scale_scales: float32 [..., G], the 8-bit step of each group (double quantization only).
    scale_offset: float32 [...], the mean subtracted from the scales (double quantization only).
    """
    codes: Any
    scales: Any
    block_size: int = flax.struct.field(pytree_node=False)
    mode: str = flax.struct.field(pytree_node=False)
    dtype: str = flax.struct.field(pytree_node=False)  # dtype name of the dense result
    scale_scales: Any = None
    scale_offset: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense shape, read from the leaves so that it stays right after slicing them."""
        *lead, half_in, n_out = self.codes.shape
        return (*lead, 2 * half_in, n_out)

    @property
    def double_quant(self) -> bool:
        return self.scale_scales is not None


def _decision_bounds(codebook: np.ndarray) -> np.ndarray:
    """float32 thresholds t [15] with code(x) = #{t < x}: nearest level, ties to the lower one.

    The exact midpoint of two float32 levels may need 25 bits; rounding it DOWN to float32 keeps
    `x <= t` equivalent to `x <= midpoint` for every float32 x, so ties stay exact.
    """
    mid = (codebook[:-1].astype(np.float64) + codebook[1:]) / 2
    mid32 = mid.astype(np.float32)
    return np.where(mid32 > mid, np.nextafter(mid32, np.float32(-np.inf)), mid32)


_BOUNDS = {mode: _decision_bounds(book) for mode, book in CODEBOOKS.items()}


def _check_layout(shape: tuple[int, ...], block_size: int) -> None:
    if len(shape) < 2:
        raise ValueError(f"expected a kernel shaped [..., in, out], got shape {tuple(shape)}")
    if not isinstance(block_size, (int, np.integer)) or block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even integer (two 4-bit codes share a "
                         f"byte along the input dim), got {block_size!r}")
    n_in = shape[-2]
    if n_in % 2:
        raise ValueError(f"input dim {n_in} (axis -2 of shape {tuple(shape)}) is odd; 4-bit "
                         f"codes pack two per byte along the input dim, so it must be even")
    if n_in % block_size:
        raise ValueError(f"input dim {n_in} (axis -2 of shape {tuple(shape)}) is not divisible "
                         f"by block_size {block_size}; choose a block_size that divides it")


def _check_options(mode: str, double_quant: bool, scale_dtype: str) -> None:
    if mode not in CODEBOOKS:
        raise ValueError(f"unknown quantization mode {mode!r}; expected one of {list(CODEBOOKS)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"unknown scale_dtype {scale_dtype!r}; expected one of {SCALE_DTYPES}")
    if double_quant and scale_dtype != "float32":
        raise ValueError(f"double_quant quantizes float32 scales to 8 bits, so scale_dtype must "
                         f"be 'float32', got {scale_dtype!r}")


def _quantize_slice(w: np.ndarray, block_size: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Packed codes uint8 [I/2, O] and absmax float32 [N, O] of one float32 kernel [I, O]."""
    n_in, n_out = w.shape
    blocks = w.reshape(n_in // block_size, block_size, n_out)  # [N, Bk, O]
    absmax = np.abs(blocks).max(axis=1)  # [N, O]
    safe = np.where(absmax > 0, absmax, np.float32(1))  # zero blocks: x = 0 -> level 0.0
    x = blocks / safe[:, None, :]  # [N, Bk, O]
    codes = np.searchsorted(_BOUNDS[mode], x.ravel(), side="left").astype(np.uint8)
    codes = codes.reshape(n_in, n_out)
    return codes[0::2] | (codes[1::2] << 4), absmax


def _round_up_16_bits(x: np.ndarray) -> np.ndarray:
    """x rounded up to 16 significant bits, as float32.

    With |code| <= 127 (7 bits), code * step is then exact in float32, so a separate multiply and
    add and a fused multiply-add give the same dequantized scale: numpy and every XLA backend agree.
    """
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.ceil(mantissa * 2.0**16), exponent - 16).astype(np.float32)


def _double_quantize(absmax: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """8-bit codes uint8 [..., N, O], steps float32 [..., G], offsets float32 [...]."""
    *lead, n_blocks, n_out = absmax.shape
    n = n_blocks * n_out
    groups = -(-n // DQ_GROUP)
    flat = absmax.reshape(-1, n).astype(np.float64)  # [S, N*O], S = prod(lead)
    offset = flat.mean(axis=1).astype(np.float32)  # [S]
    dev = np.zeros((flat.shape[0], groups * DQ_GROUP))
    dev[:, :n] = flat - offset[:, None]
    dev = dev.reshape(-1, groups, DQ_GROUP)  # [S, G, 256]
    step = _round_up_16_bits(np.abs(dev).max(axis=2) / _DQ_MAX_CODE)  # [S, G]
    safe = np.where(step > 0, step, 1.0)[:, :, None]
    codes = np.rint(dev / safe).reshape(-1, groups * DQ_GROUP)[:, :n] + _DQ_ZERO
    return (codes.astype(np.uint8).reshape(absmax.shape), step.reshape(*lead, groups),
            offset.reshape(lead))


def quantize_np(w: np.ndarray, block_size: int = 64, mode: str = "nf4",
                double_quant: bool = False, scale_dtype: str = "float32") -> QTensor:
    """Quantize a kernel [..., I, O] on the host; each [I, O] slice independently."""
    w = np.asarray(w)
    _check_options(mode, double_quant, scale_dtype)
    _check_layout(w.shape, block_size)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"expected floating-point weights, got dtype {w.dtype}")
    w32 = w.astype(np.float32)
    if not np.isfinite(w32).all():
        raise ValueError("weights contain NaN or inf; a non-finite value has no 4-bit code and "
                         "would poison its block's absmax scale")
    lead = w.shape[:-2]
    parts = [_quantize_slice(w32[index], block_size, mode) for index in np.ndindex(lead)]
    codes = np.stack([c for c, _ in parts]).reshape(*lead, *parts[0][0].shape)
    absmax = np.stack([s for _, s in parts]).reshape(*lead, *parts[0][1].shape)
    dtype = jnp.dtype(w.dtype).name
    if double_quant:
        scales, steps, offset = _double_quantize(absmax)
        return QTensor(codes, scales, block_size, mode, dtype, steps, offset)
    return QTensor(codes, absmax.astype(jnp.dtype(scale_dtype)), block_size, mode, dtype)


def _group_steps(xp: Any, steps: Any, n_blocks: int, n_out: int) -> Any:
    """steps [..., G] spread to the scale grid [..., N, O]: scale (n, o) is number n * O + o in
    row-major order, of group (n * O + o) // 256. When O is a multiple of 256, or divides it,
    that is a broadcast, which fuses into the dequantization; otherwise a gather."""
    lead = steps.shape[:-1]
    if n_out % DQ_GROUP == 0:  # a row of scales spans O / 256 whole groups
        per_row = steps.reshape(*lead, n_blocks, n_out // DQ_GROUP, 1)
        return xp.broadcast_to(per_row, (*lead, n_blocks, n_out // DQ_GROUP, DQ_GROUP)
                               ).reshape(*lead, n_blocks, n_out)
    if DQ_GROUP % n_out == 0:  # a group spans 256 / O whole rows
        rows = DQ_GROUP // n_out
        per_group = xp.broadcast_to(steps[..., None], (*lead, steps.shape[-1], rows))
        per_row = per_group.reshape(*lead, -1)[..., :n_blocks, None]
        return xp.broadcast_to(per_row, (*lead, n_blocks, n_out))
    group = (xp.arange(n_blocks)[:, None] * n_out + xp.arange(n_out)[None, :]) // DQ_GROUP
    return steps[..., group]


def dense_scales(xp: Any, q: QTensor) -> Any:
    """float32 scales [..., N, O], undoing double quantization when present."""
    scales = xp.asarray(q.scales)
    if not q.double_quant:
        return scales.astype(np.float32)
    step = _group_steps(xp, xp.asarray(q.scale_scales), *scales.shape[-2:])  # [..., N, O]
    offset = xp.asarray(q.scale_offset)[..., None, None]
    return (scales.astype(np.float32) - _DQ_ZERO) * step + offset


def select_levels(codes: jax.Array, codebook: np.ndarray) -> jax.Array:
    """codebook[codes] (float32) for 4-bit codes as a tree of selects on the code's bits,
    lowest bit first. A gather from a table cannot fuse into the matmul that consumes the
    kernel, so it would write the dense layer to memory and read it back; selects fuse. Every
    step picks one of the table's float32 values, so the result is exactly the table's.

    The table's values enter as zero + value with zero = float(codes & 0): XLA folds that back
    to the constant, but to jax it depends on the codes. A constant broadcast to the kernel's
    shape depends on no input, and jax.checkpoint computes such values once outside the layer
    loop and keeps them: sixteen kernel-sized float32 arrays."""
    zero = (codes & 0).astype(jnp.float32)
    level = [zero + np.float32(v) for v in codebook]
    for shift in range(4):
        on = (codes >> shift) & 1 == 1
        level = [jnp.where(on, hi, lo) for lo, hi in zip(level[0::2], level[1::2])]
    return level[0]


def _dequantize_with(xp: Any, q: QTensor, dtype: Any) -> Any:
    """One formula for numpy and jax.numpy, so both give the same values bit for bit; jax picks
    the levels with selects (`select_levels`), numpy by indexing the table."""
    *lead, n_in, n_out = q.shape
    packed = xp.asarray(q.codes)  # [..., I/2, O]
    nibbles = xp.stack([packed & 0xF, packed >> 4], axis=-2).reshape(*lead, n_in, n_out)
    book = CODEBOOKS[q.mode]
    levels = book[nibbles] if xp is np else select_levels(nibbles, book)  # [..., I, O]
    blocks = levels.reshape(*lead, n_in // q.block_size, q.block_size, n_out)
    dense = blocks * dense_scales(xp, q)[..., :, None, :]  # [..., N, Bk, O]
    return dense.reshape(*lead, n_in, n_out).astype(jnp.dtype(dtype or q.dtype))


def dequantize(q: QTensor, dtype: Any = None) -> jax.Array:
    """Dense kernel [..., I, O] in `dtype` (default: the quantized tensor's dtype); jit-safe,
    and free of gathers, so it fuses into the matmul that consumes it."""
    return _dequantize_with(jnp, q, dtype)


def dequantize_np(q: QTensor, dtype: Any = None) -> np.ndarray:
    """Host twin of `dequantize` with identical values, for tests and export."""
    return _dequantize_with(np, q, dtype)


def nbytes(q: QTensor) -> int:
    """Resident bytes of all array leaves (also works on jax.ShapeDtypeStruct leaves)."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(q))


def quantized_bytes_per_param(shape: tuple[int, ...], block_size: int = 64,
                              double_quant: bool = False, scale_dtype: str = "float32") -> float:
    """Bytes per dense parameter of a quantized kernel, from its shape alone (memory planning)."""
    _check_options("nf4", double_quant, scale_dtype)
    _check_layout(tuple(shape), block_size)
    n_in, n_out = shape[-2:]
    n_slices = math.prod(shape[:-2])
    n_scales = n_in // block_size * n_out
    if double_quant:
        slice_scale_bytes = n_scales + 4 * -(-n_scales // DQ_GROUP) + 4  # codes, steps, offset
    else:
        slice_scale_bytes = n_scales * jnp.dtype(scale_dtype).itemsize
    n = math.prod(shape)
    return (n // 2 + n_slices * slice_scale_bytes) / n


def as_dense(w: Any, dtype: Any) -> jax.Array:
    """A kernel ready for a matmul in `dtype`: dequantized when it is a QTensor (the LM head;
    the layers' linears take `jaxrl.quant.qmatmul`, which never writes the dense kernel)."""
    return dequantize(w, dtype) if isinstance(w, QTensor) else w.astype(dtype)

"""Pallas GPU (Triton) kernels: x @ W for one layer of a layer-stacked NF4/int4 `QTensor`, with
the LoRA term added in the epilogue, and a SwiGLU variant over a gate and an up projection.

Glossary: M rows of x (decode batch or prefill tokens), I input dim, O output dim, L layers,
Bk the QTensor's block_size, N = I / Bk scale blocks, r the LoRA rank, S split-K parts.
Tiles: bm rows of x, bo output columns, bk input rows per loop step (a multiple of Bk).

What a kernel reads: the packed codes and the scales of layer `layer` of the whole stacked
QTensor ([L, I/2, O] codes, [L, N, O] scales, and under double quantization the [L, G] steps and
[L] offsets), indexed inside the kernel by the traced int32 `layer` (passed as a one-element
int32 operand), so no slice of the stack is ever formed outside it. Per loop step a program
loads a [bk/2, bo] tile of code bytes and the [bk/Bk, bo] scales it needs, decodes the low
nibbles (input rows 2i) and the high nibbles (rows 2i + 1) through the 16-entry level table as
a tree of selects on the code bits (registers only, no table in memory), multiplies each level
by its block's scale in float32 (a double-quantized scale decoded in the kernel as
(code - 128) * step[group] + offset, group = (n * O + o) // 256), rounds the weights to x's
dtype, and accumulates x_even @ W_even + x_odd @ W_odd in float32 (x's even and odd columns
are read with an index vector, no copy of x). Rows of x past M and columns past O are masked.

Rounding (the same as the XLA reference `nf4_matmul_reference`, which is `linear` plus
`lora_delta` as `jaxrl.model.transformer.projector` adds them):
  weights   w = (level * scale in float32) rounded to x's dtype (qmatmul's dense form);
  base      sum_i x[m, i] * w[i, o] accumulated in float32, rounded once to `dtype`;
  LoRA      xa @ B accumulated in float32 (xa [M, r] and B in x's dtype), rounded to x's dtype;
  result    base + LoRA added in float32 from those two rounded values, rounded to `dtype`
            (for bfloat16 exactly what XLA does when it adds two bfloat16 arrays in float32).
  SwiGLU    gate = gate base + gate LoRA and up likewise, each as above in x's dtype; then
            silu(gate) computed in float32, rounded to x's dtype, times up in float32 and
            rounded to x's dtype (`jaxrl.model.transformer.swiglu`).
So the kernel and the reference differ only in the order of the float32 sums.

Split-K (small M, where O / bo tiles alone give too few programs): the grid gains an axis of S
parts of I, and each program writes its float32 partial sums to plane s of an [S, M, O]
output per weight. The programs of part 0 also compute the LoRA product xa @ B of their
[bm, bo] tile in float32 (B read at `layer` in the kernel when stacked) and write it to a
float32 [M, O] output per weight with a LoRA. XLA then adds the S planes and applies the
epilogue (rounding, the LoRA addition, SwiGLU) to the [M, O] sums and LoRA products, with the
same rounding as above; no product of x, xa or B is formed outside the kernel.

The kernels are differentiable: the backward pass is the reference's (x, xa and B get
gradients; the QTensor and the layer index get zeros).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl.quant.nf4 import CODEBOOKS, DQ_GROUP, QTensor
from jaxrl.quant.qmatmul import qmatmul

_DQ_ZERO = 128  # stored uint8 value of double quantization's 8-bit code 0
_MIN_DOT = 16  # the smallest M, N and K of a Triton dot
# programs a decode call's split-K aims for: two per streaming multiprocessor of an H100/H200
_TARGET_PROGRAMS = 264
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"  # the custom call a Pallas Triton kernel lowers to


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch options of one kernel call (module docstring: glossary).

    block_m, block_o: powers of two >= 16; block_k: a power of two, a multiple of the
    QTensor's block_size, >= 32, dividing I; split_k: parts of I (>= 1, at most I / block_k);
    num_warps, num_stages: Triton's."""
    block_m: int
    block_o: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, int(n - 1).bit_length()))


def default_tiles(m: int, n_in: int, n_out: int, block_size: int, *, n_weights: int = 1) -> Tiles:
    """Tiles for x [m, n_in] @ one layer's [n_in, n_out] kernel (n_weights kernels per tile for
    SwiGLU). Decode (m <= 64): bm = the power of two >= max(m, 16), bo = 64, bk = 256 (or the
    largest power-of-two multiple of block_size below it dividing n_in), 4 warps, 3 stages,
    and split-K raising the program count toward two per SM of an H100/H200 (132 SMs) while
    the float32 partial sums stay at most 1/8 of the codes' bytes. Prefill: bm = bo = 128
    (bo = 64 with two kernels per tile), bk = 64 (or block_size when larger), 8 warps,
    3 stages, no split. These are starting points sized for Qwen3-4B shapes (I, O among
    1024, 2560, 4096, 9728), not measured optima."""
    decode = m <= 64
    bm = _pow2_at_least(m, _MIN_DOT) if decode else 128
    bo = 64 if decode or n_weights > 1 else 128
    bo = min(bo, _pow2_at_least(n_out, _MIN_DOT))
    bk = max(block_size, 32)
    target = max(bk, 256 if decode else 64)
    while bk * 2 <= target and n_in % (bk * 2) == 0:
        bk *= 2
    split = 1
    if decode:
        chunks = n_in // bk if n_in % bk == 0 else 1
        tiles = -(-m // bm) * -(-n_out // bo)
        cap = max(1, n_in // (32 * m * n_weights))  # S*M*O*4 <= I*O/8: a quarter of the codes
        split = max(1, min(-(-_TARGET_PROGRAMS // tiles), chunks, cap))
        per = -(-chunks // split)
        split = -(-chunks // per)  # no empty part
    return Tiles(bm, bo, bk, split, 4 if decode else 8, 3)


def _check_tiles(t: Tiles, n_in: int, block_size: int) -> None:
    def pow2(v):
        return v > 0 and v & (v - 1) == 0
    if block_size & (block_size - 1):
        raise ValueError(f"the Pallas NF4 kernel needs a power-of-two block_size, got {block_size}")
    for name in ("block_m", "block_o"):
        v = getattr(t, name)
        if not pow2(v) or v < _MIN_DOT:
            raise ValueError(f"{name} must be a power of two >= {_MIN_DOT}, got {v}")
    if (not pow2(t.block_k) or t.block_k < 2 * _MIN_DOT or t.block_k % block_size
            or n_in % t.block_k):
        raise ValueError(f"block_k must be a power of two >= {2 * _MIN_DOT}, a multiple of the "
                         f"block_size {block_size} and divide the input dim {n_in}; "
                         f"got {t.block_k}")
    if not 1 <= t.split_k <= n_in // t.block_k:
        raise ValueError(f"split_k must lie in [1, {n_in // t.block_k}], got {t.split_k}")


def _tiles(m, n_in, n_out, block_size, n_weights, overrides) -> Tiles:
    tiles = default_tiles(m, n_in, n_out, block_size, n_weights=n_weights)
    tiles = dataclasses.replace(tiles, **{k: v for k, v in overrides.items() if v is not None})
    if overrides.get("block_k") is not None and overrides.get("split_k") is None:
        tiles = dataclasses.replace(tiles, split_k=min(tiles.split_k, n_in // tiles.block_k))
    _check_tiles(tiles, n_in, block_size)
    return tiles


# -- the epilogue, shared by the kernel, the split-K path and the reference -------------------
def _combine(base32, lora32, dtype, x_dtype):
    """base (float32 sums) rounded to dtype, plus the LoRA product (float32 sums) rounded to
    x's dtype, added in float32 and rounded to dtype."""
    y = base32.astype(dtype)
    if lora32 is None:
        return y
    return (y.astype(jnp.float32) + lora32.astype(x_dtype).astype(jnp.float32)).astype(dtype)


def _swiglu32(gate, up, dtype):
    """silu(gate) in float32 rounded to dtype, times up (both in dtype), rounded to dtype."""
    g = gate.astype(jnp.float32)
    s = (g * jax.lax.logistic(g)).astype(dtype)  # jax.nn.silu's formula
    return (s.astype(jnp.float32) * up.astype(jnp.float32)).astype(dtype)


# -- the kernel ------------------------------------------------------------------------------
def _levels(codes, codebook: np.ndarray):
    """codebook[codes] (float32) for int32 codes in [0, 16): a tree of selects, lowest bit
    first; every value is one of the table's float32 entries."""
    bit = (codes & 1) == 1
    level = [jnp.where(bit, np.float32(hi), np.float32(lo))
             for lo, hi in zip(codebook[0::2], codebook[1::2])]
    for shift in (1, 2, 3):
        bit = ((codes >> shift) & 1) == 1
        level = [jnp.where(bit, hi, lo) for lo, hi in zip(level[0::2], level[1::2])]
    return level[0]


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of one kernel call."""
    m: int
    n_in: int
    n_out: int
    block_size: int
    modes: tuple[str, ...]  # per weight
    double_quant: tuple[bool, ...]  # per weight
    lora: tuple[int, ...]  # per weight: 0 none, 2 b [r, O], 3 b stacked [L, r, O]
    rank_pad: tuple[int, ...]  # per weight: padded rank (power of two >= 16)
    rank: tuple[int, ...]
    x_dtype: Any
    dtype: Any
    swiglu: bool
    tiles: Tiles


def _kernel(layer_ref, x_ref, *refs, spec: _Spec):
    t = spec.tiles
    bm, bo, bk = t.block_m, t.block_o, t.block_k
    half = bk // 2
    nb = max(1, bk // spec.block_size)  # scale rows per step
    n_chunks = spec.n_in // bk
    per = -(-n_chunks // t.split_k)
    n_w = len(spec.modes)

    # unpack the refs: per weight codes, scales[, steps, offset][, xa, b]; then the outputs:
    # one without split-K; under split-K the partial sums per weight, then the LoRA products
    # per weight with a LoRA
    weights, it = [], iter(refs)
    for w in range(n_w):
        codes, scales = next(it), next(it)
        dq = (next(it), next(it)) if spec.double_quant[w] else None
        lora = (next(it), next(it)) if spec.lora[w] else None
        weights.append((codes, scales, dq, lora))
    outs = list(it)

    pm, po, ps = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    rows = pm * bm + jnp.arange(bm, dtype=jnp.int32)
    cols = po * bo + jnp.arange(bo, dtype=jnp.int32)
    row_ok, col_ok = rows < spec.m, cols < spec.n_out
    safe_rows = jnp.minimum(rows, spec.m - 1)
    pair = 2 * jnp.arange(half, dtype=jnp.int32)  # x column of the low nibble, per code row
    x_dtype = spec.x_dtype

    def weight_tiles(w, c):
        """The even and odd input rows' weights [bk/2, bo] of step c, in x's dtype."""
        codes_ref, scales_ref, dq, _ = weights[w]
        packed = plgpu.load(codes_ref.at[layer, pl.ds(c * half, half), pl.ds(po * bo, bo)],
                            mask=col_ok[None, :], other=0).astype(jnp.int32)
        s = plgpu.load(scales_ref.at[layer, pl.ds(c * nb, nb), pl.ds(po * bo, bo)],
                       mask=col_ok[None, :], other=0).astype(jnp.float32)  # [nb, bo]
        if dq is not None:
            steps_ref, offset_ref = dq
            n_idx = c * nb + jnp.arange(nb, dtype=jnp.int32)
            group = (n_idx[:, None] * spec.n_out + cols[None, :]) // DQ_GROUP
            group = jnp.where(col_ok[None, :], group, 0)
            step = plgpu.load(steps_ref.at[layer, group])  # [nb, bo] gather, in L1
            s = (s - _DQ_ZERO) * step + offset_ref[layer]
        s = jnp.broadcast_to(s[:, None, :], (nb, half // nb, bo)).reshape(half, bo)
        book = CODEBOOKS[spec.modes[w]]
        lo = (_levels(packed & 0xF, book) * s).astype(x_dtype)
        hi = (_levels(packed >> 4, book) * s).astype(x_dtype)
        return lo, hi

    def x_tile(c, j):
        """x's columns c * bk + 2k + j for k < bk/2, [bm, bk/2]."""
        return plgpu.load(x_ref.at[safe_rows[:, None], (c * bk + j + pair)[None, :]],
                          mask=row_ok[:, None], other=0)

    def body(c, accs):
        x_even, x_odd = x_tile(c, 0), x_tile(c, 1)
        new = []
        for w in range(n_w):
            lo, hi = weight_tiles(w, c)
            acc = accs[w] + jnp.dot(x_even, lo, preferred_element_type=jnp.float32)
            new.append(acc + jnp.dot(x_odd, hi, preferred_element_type=jnp.float32))
        return tuple(new)

    start = ps * per
    stop = jnp.minimum(start + per, n_chunks)
    zero = jnp.zeros((bm, bo), jnp.float32)
    accs = jax.lax.fori_loop(start, stop, body, (zero,) * n_w)
    out_mask = row_ok[:, None] & col_ok[None, :]

    def lora_product(w):
        """xa @ B of this program's [bm, bo] tile in float32 (B at `layer` when stacked)."""
        xa_ref, b_ref = weights[w][3]
        rp, r = spec.rank_pad[w], spec.rank[w]
        ranks = jnp.arange(rp, dtype=jnp.int32)
        r_ok = ranks < r
        safe_r = jnp.minimum(ranks, r - 1)
        xa = plgpu.load(xa_ref.at[safe_rows[:, None], safe_r[None, :]],
                        mask=row_ok[:, None] & r_ok[None, :], other=0)
        safe_cols = jnp.minimum(cols, spec.n_out - 1)
        b_index = (safe_r[:, None], safe_cols[None, :])
        if spec.lora[w] == 3:
            b_index = (layer,) + b_index
        b = plgpu.load(b_ref.at[b_index], mask=r_ok[:, None] & col_ok[None, :], other=0)
        return jnp.dot(xa, b, preferred_element_type=jnp.float32)

    if t.split_k > 1:  # float32 partial sums and LoRA products; the epilogue runs in XLA
        for w in range(n_w):
            plgpu.store(outs[w].at[ps, pl.ds(pm * bm, bm), pl.ds(po * bo, bo)], accs[w],
                        mask=out_mask)
        lora_outs = list(zip([w for w in range(n_w) if spec.lora[w]], outs[n_w:]))
        if lora_outs:
            @pl.when(ps == 0)
            def _():
                for w, out in lora_outs:
                    plgpu.store(out.at[pl.ds(pm * bm, bm), pl.ds(po * bo, bo)],
                                lora_product(w), mask=out_mask)
        return

    results = []
    for w in range(n_w):
        lora32 = lora_product(w) if spec.lora[w] else None
        out_dtype = x_dtype if spec.swiglu else spec.dtype
        results.append(_combine(accs[w], lora32, out_dtype, x_dtype))
    y = _swiglu32(results[0], results[1], x_dtype) if spec.swiglu else results[0]
    plgpu.store(outs[0].at[pl.ds(pm * bm, bm), pl.ds(po * bo, bo)], y, mask=out_mask)


def _check_q(q: QTensor, n_in: int, what: str) -> None:
    if not isinstance(q, QTensor):
        raise TypeError(f"{what} must be a QTensor, got {type(q).__name__}")
    if q.codes.ndim != 3:
        raise ValueError(f"{what} must be a layer-stacked QTensor [L, I, O]; its codes have "
                         f"shape {q.codes.shape}")
    if q.shape[1] != n_in:
        raise ValueError(f"{what} has input dim {q.shape[1]}, x has {n_in}")


def _lora_operands(lora, q: QTensor, m: int, x_dtype, what: str):
    """(xa, b) in x's dtype and the b layout code (2: [r, O], 3: [L, r, O])."""
    xa, b = lora
    n_layers, _, n_out = q.shape
    if xa.ndim != 2 or xa.shape[0] != m:
        raise ValueError(f"{what}: xa must be [M={m}, r], got {xa.shape}")
    r = xa.shape[1]
    if b.shape not in ((r, n_out), (n_layers, r, n_out)):
        raise ValueError(f"{what}: b must be [r={r}, O={n_out}] or [L={n_layers}, r, O], "
                         f"got {b.shape}")
    return xa.astype(x_dtype), b.astype(x_dtype), b.ndim


def _run(x, qs, layer, loras, *, dtype, swiglu, interpret, overrides):
    """The fused kernel's forward: x [M, I], qs (one or two stacked QTensors), loras (one
    (xa, b) or None per QTensor)."""
    m, n_in = x.shape
    n_layers, _, n_out = qs[0].shape
    block_size = qs[0].block_size
    for q in qs[1:]:
        if q.shape != qs[0].shape or q.block_size != block_size:
            raise ValueError(f"gate and up must share shape and block_size, got {qs[0].shape}/"
                             f"{qs[0].block_size} and {q.shape}/{q.block_size}")
    tiles = _tiles(m, n_in, n_out, block_size, len(qs), overrides)
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, n_layers - 1)

    operands, lora_kind, ranks = [jnp.reshape(layer, (1,)), x], [], []
    for q, lora in zip(qs, loras):
        operands += [q.codes, q.scales]
        if q.double_quant:
            operands += [q.scale_scales, q.scale_offset]
        if lora is None:
            lora_kind.append(0)
            ranks.append(0)
        else:
            xa, b, kind = _lora_operands(lora, q, m, x.dtype, "lora")
            operands += [xa, b]
            lora_kind.append(kind)
            ranks.append(xa.shape[1])
    spec = _Spec(m=m, n_in=n_in, n_out=n_out, block_size=block_size,
                 modes=tuple(q.mode for q in qs), double_quant=tuple(q.double_quant for q in qs),
                 lora=tuple(lora_kind), rank=tuple(ranks),
                 rank_pad=tuple(_pow2_at_least(r, _MIN_DOT) for r in ranks),
                 x_dtype=jnp.dtype(x.dtype), dtype=jnp.dtype(dtype), swiglu=swiglu, tiles=tiles)
    grid = (pl.cdiv(m, tiles.block_m), pl.cdiv(n_out, tiles.block_o), tiles.split_k)
    if tiles.split_k > 1:
        out_shape = ([jax.ShapeDtypeStruct((tiles.split_k, m, n_out), jnp.float32)] * len(qs)
                     + [jax.ShapeDtypeStruct((m, n_out), jnp.float32)
                        for kind in lora_kind if kind])
    else:
        out_shape = [jax.ShapeDtypeStruct((m, n_out), x.dtype if swiglu else dtype)]
    outs = pl.pallas_call(
        functools.partial(_kernel, spec=spec), out_shape=out_shape, grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                             num_stages=tiles.num_stages),
        interpret=interpret, name="nf4_swiglu" if swiglu else "nf4_matmul")(*operands)
    if tiles.split_k == 1:
        return outs[0]

    lora_parts = iter(outs[len(qs):])
    results = []
    for part, kind in zip(outs[:len(qs)], lora_kind):
        lora32 = next(lora_parts) if kind else None
        out_dtype = x.dtype if swiglu else dtype
        results.append(_combine(part.sum(axis=0), lora32, out_dtype, x.dtype))
    return _swiglu32(results[0], results[1], x.dtype) if swiglu else results[0]


# -- the XLA reference -----------------------------------------------------------------------
def _layer_of(q: QTensor, layer) -> QTensor:
    return jax.tree_util.tree_map(
        lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), q)


def _reference_linear(x, q, layer, lora, dtype, x_dtype):
    base = qmatmul(x, _layer_of(q, layer), form="dense", dtype=jnp.float32)
    lora32 = None
    if lora is not None:
        xa, b = lora
        b = jax.lax.dynamic_index_in_dim(b, layer, keepdims=False) if b.ndim == 3 else b
        lora32 = jnp.einsum("mr,ro->mo", xa.astype(x_dtype), b.astype(x_dtype),
                            preferred_element_type=jnp.float32)
    return _combine(base, lora32, dtype, x_dtype)


def nf4_matmul_reference(x: jax.Array, q: QTensor, layer, *, lora=None, dtype=None) -> jax.Array:
    """What `nf4_matmul` computes, in plain XLA: layer `layer` of q sliced, x @ it in
    qmatmul's dense form (weights level * scale rounded to x's dtype, float32 sums rounded
    once to dtype), plus the LoRA product xa @ B (float32 sums rounded to x's dtype), added
    in float32 and rounded to dtype (`projector`'s linear(x) + lora_delta(x))."""
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, q.shape[0] - 1)
    return _reference_linear(x, q, layer, lora, jnp.dtype(dtype or x.dtype), x.dtype)


def nf4_swiglu_reference(x: jax.Array, gate: QTensor, up: QTensor, layer, *, gate_lora=None,
                         up_lora=None) -> jax.Array:
    """What `nf4_swiglu` computes, in plain XLA: swiglu of the two `nf4_matmul_reference`
    projections in x's dtype (`jaxrl.model.transformer.swiglu`)."""
    # imported here: jaxrl.model.transformer imports jaxrl.backends
    from jaxrl.model.transformer import swiglu

    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, gate.shape[0] - 1)
    g = _reference_linear(x, gate, layer, gate_lora, x.dtype, x.dtype)
    u = _reference_linear(x, up, layer, up_lora, x.dtype, x.dtype)
    return swiglu(g, u)


# -- differentiable entry points -------------------------------------------------------------
def _zero_cotangent(a):
    if a is None:
        return None
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static, x, qs, layer, loras):
    dtype, swiglu, interpret, overrides = static
    return _run(x, qs, layer, loras, dtype=dtype, swiglu=swiglu, interpret=interpret,
                overrides=dict(overrides))


def _reference_of(static, x, qs, layer, loras):
    dtype, swiglu, _, _ = static
    if swiglu:
        return nf4_swiglu_reference(x, qs[0], qs[1], layer, gate_lora=loras[0],
                                    up_lora=loras[1])
    return nf4_matmul_reference(x, qs[0], layer, lora=loras[0], dtype=dtype)


def _fused_fwd(static, x, qs, layer, loras):
    return _fused(static, x, qs, layer, loras), (x, qs, layer, loras)


def _fused_bwd(static, residuals, g):
    x, qs, layer, loras = residuals
    _, vjp = jax.vjp(lambda x, loras: _reference_of(static, x, qs, layer, loras), x, loras)
    dx, dloras = vjp(g)
    return (dx, jax.tree_util.tree_map(_zero_cotangent, qs), _zero_cotangent(layer), dloras)


_fused.defvjp(_fused_fwd, _fused_bwd)
# jitted so that repeated eager calls with the same static options and shapes reuse one
# compiled program (a fresh kernel closure would otherwise miss every cache)
_fused_jit = jax.jit(_fused, static_argnums=0)


def _overrides(block_m, block_o, block_k, split_k, num_warps, num_stages):
    return (("block_m", block_m), ("block_o", block_o), ("block_k", block_k),
            ("split_k", split_k), ("num_warps", num_warps), ("num_stages", num_stages))


def _flat(x: jax.Array):
    if x.ndim < 1:
        raise ValueError(f"x must be [..., I], got shape {x.shape}")
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def nf4_matmul(x: jax.Array, q: QTensor, layer, *, lora=None, dtype=None,
               interpret: bool = False, block_m: int | None = None,
               block_o: int | None = None, block_k: int | None = None,
               split_k: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None) -> jax.Array:
    """x [..., I] @ layer `layer` of the stacked QTensor q [L, I, O], plus the LoRA term, as
    [..., O] in `dtype` (default x's dtype), in one Pallas Triton kernel that reads that
    layer's codes and scales in place (module docstring: reading and rounding).

    layer: an int32 scalar, traced or not, clamped to [0, L). lora: None or (xa, b), xa the
    scaled, rounded [M, r] product (`jaxrl.lora.lora.scaled_xa`) with M the rows of x
    flattened, b one layer's [r, O] or the stack [L, r, O] (read at `layer` in the kernel);
    both taken in x's dtype.
    Modes nf4 and int4; scales float32, bfloat16 or double-quantized; block_size a power of
    two. Tile options left None take `default_tiles`. interpret: run the kernel in Pallas
    interpret mode (any backend)."""
    x2, lead = _flat(x)
    _check_q(q, x2.shape[1], "q")
    layer = jnp.asarray(layer, jnp.int32)
    static = (jnp.dtype(dtype or x.dtype), False, bool(interpret),
              _overrides(block_m, block_o, block_k, split_k, num_warps, num_stages))
    y = _fused_jit(static, x2, (q,), layer, (lora,))
    return y.reshape(*lead, y.shape[-1])


def nf4_swiglu(x: jax.Array, gate: QTensor, up: QTensor, layer, *, gate_lora=None,
               up_lora=None, interpret: bool = False, block_m: int | None = None,
               block_o: int | None = None, block_k: int | None = None,
               split_k: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None) -> jax.Array:
    """swiglu(x @ gate + gate LoRA, x @ up + up LoRA) [..., F] in x's dtype for layer `layer`
    of the stacked QTensors gate and up [L, I, F] (same shape and block_size), in one kernel:
    each program reads both layers' tiles and applies SwiGLU in its epilogue, so the [M, F]
    gate and up products are never written (except as float32 partial sums and LoRA products
    under split-K).
    gate_lora, up_lora: as `nf4_matmul`'s lora. Rounding: module docstring."""
    x2, lead = _flat(x)
    _check_q(gate, x2.shape[1], "gate")
    _check_q(up, x2.shape[1], "up")
    layer = jnp.asarray(layer, jnp.int32)
    static = (jnp.dtype(x.dtype), True, bool(interpret),
              _overrides(block_m, block_o, block_k, split_k, num_warps, num_stages))
    y = _fused_jit(static, x2, (gate, up), layer, (gate_lora, up_lora))
    return y.reshape(*lead, y.shape[-1])

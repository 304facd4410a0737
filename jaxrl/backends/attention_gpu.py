"""Decode attention on GPUs: a Pallas (Triton) kernel that reads the layer-stacked KV cache in
place and only its filled columns, and its plain-jnp reference. Parts of attention over
consecutive column ranges join through `jaxrl.model.attention.merge`.

Glossary: L layers, B rows, K kv heads, S cache columns, D head dim, M query rows per kv head
(the G query heads of one token, or R*G when R rows share one cache row), P splits of a row's
filled columns.

    decode_attention(q, k, v, layer, lengths, *, block_k=64, splits=None, interpret=False)
        -> (out, lse)

      q        [B, K, M, D], bfloat16 or float32.
      k, v     [L, B, K, S, D] stacked cache, bfloat16 or float32, read in place: only layer
               `layer` (int32 scalar, may be traced) and, for row b, only the columns
               [0, lengths[b]); blocks of columns at or past the fill are never read.
      lengths  [B] int32, 0 <= lengths[b] <= S.

      Scores are q . k scaled by D**-0.5 in float32; the softmax is in float32; the weights
      are rounded to q's dtype before they weight v; sums are in float32.

      out      [B, K, M, D] float32, the attention normalized over this part's columns.
      lse      [B, K, M] float32, the log-sum-exp of the scaled scores over those columns.

      A row with length 0 gives out 0 and lse `EMPTY_LSE` (-1e30, finite), so that `merge`
      with other parts gives the other parts' result and no NaN.

`decode_attention_reference` has the same contract in plain jnp (it normalizes the softmax
before rounding the weights, as `jaxrl.model.attention` does; the kernel rounds each block's
weights exp(score - running max), so the two differ by the weights' rounding in q's dtype).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl.model.attention import EMPTY_LSE, check_decode_inputs

# Query rows per dot: Triton's dot wants every dimension at least 16.
_MIN_ROWS = 16
# Enough programs to keep every streaming multiprocessor of an H100 / H200 (132) busy a few
# times over; `splits=None` splits each row's columns until the grid reaches this, keeping at
# least `_MIN_SPLIT_BLOCKS` blocks per split of a full row (the splits' float32 partial results
# are written and read back, so very short splits cost more than they spread).
_TARGET_PROGRAMS = 512
_MIN_SPLIT_BLOCKS = 4
_NUM_WARPS = 4
_NUM_STAGES = 2


def _default_splits(b: int, kv: int, s: int, block_k: int) -> int:
    """Splits of each row's columns: enough that B * K * splits reaches `_TARGET_PROGRAMS`,
    never so many that a full row's split has fewer than `_MIN_SPLIT_BLOCKS` blocks."""
    want = pl.cdiv(_TARGET_PROGRAMS, b * kv)
    return max(1, min(want, pl.cdiv(s, _MIN_SPLIT_BLOCKS * block_k)))


def _kernel(layer_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
            block_k: int, splits: int, scale: float, q_dtype, score_dtype, value_dtype):
    """One (row b, kv head h, split j) program: the online softmax over split j of row b's
    filled columns, block by block. Writes the unnormalized accumulator, the running max and
    the running sum; a split without columns writes 0, `EMPTY_LSE` and 0."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    length = lengths_ref[b]
    # each split covers a whole number of blocks of the row's filled columns
    chunk = pl.cdiv(pl.cdiv(length, splits), block_k) * block_k
    start = j * chunk
    stop = jnp.minimum(start + chunk, length)
    blocks = jnp.where(stop > start, pl.cdiv(stop - start, block_k), 0)

    q = q_ref[...].astype(score_dtype)  # [Mp, D]
    rows, d = q.shape
    exact = None if score_dtype == jnp.bfloat16 else False  # no TF32 for float32 scores
    exact_v = None if value_dtype == jnp.bfloat16 else False

    def body(i, carry):
        acc, top, total = carry
        first = start + i * block_k
        filled = first + jnp.arange(block_k) < stop  # [block_k]
        cols = pl.ds(first, block_k)
        kb = plgpu.load(k_ref.at[layer, b, h, cols, :], mask=filled[:, None], other=0)
        scores = plgpu.dot(q, kb.astype(score_dtype), trans_b=True, allow_tf32=exact) * scale
        scores = jnp.where(filled[None, :], scores, -jnp.inf)  # [Mp, block_k] float32
        new_top = jnp.maximum(top, scores.max(axis=1))
        rescale = jnp.exp(top - new_top)
        weights = jnp.exp(scores - new_top[:, None])
        total = total * rescale + weights.sum(axis=1)
        vb = plgpu.load(v_ref.at[layer, b, h, cols, :], mask=filled[:, None], other=0)
        weights = weights.astype(q_dtype).astype(value_dtype)
        acc = acc * rescale[:, None] + plgpu.dot(weights, vb.astype(value_dtype),
                                                 allow_tf32=exact_v)
        return acc, new_top, total

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), EMPTY_LSE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, top, total = jax.lax.fori_loop(0, blocks, body, init)
    plgpu.store(o_ref, acc)  # a plain store (`ref[...] = x` would also read the block)
    plgpu.store(m_ref, top)
    plgpu.store(l_ref, total)


def _combine(o, m, l):
    """(out, lse) [B, K, M, D], [B, K, M] from the splits' unnormalized accumulators o
    [B, K, P, M, D], running maxima m and running sums l [B, K, P, M]."""
    top = m.max(axis=2, keepdims=True)
    scale = jnp.exp(m - top)  # 0 for a split without columns
    total = (l * scale).sum(axis=2)
    acc = (o * scale[..., None]).sum(axis=2)
    filled = total > 0
    out = acc / jnp.where(filled, total, 1.0)[..., None]
    lse = jnp.where(filled, top[:, :, 0] + jnp.log(jnp.where(filled, total, 1.0)), EMPTY_LSE)
    return out, lse


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "interpret"))
def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array,
                     lengths: jax.Array, *, block_k: int = 64, splits: int | None = None,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Attention of q [B, K, M, D] over layer `layer` of the stacked cache k, v [L, B, K, S, D],
    row b's columns [0, lengths[b]) only; returns (out [B, K, M, D], lse [B, K, M]) in float32.
    The full contract is in this module's docstring.

    One Pallas program per (row, kv head, split): split j of P covers row b's filled columns
    cdiv(cdiv(lengths[b], P), block_k) * block_k * [j, j + 1), clipped to lengths[b], so the
    work follows the fill, not S. The cache stack is passed whole and indexed inside the kernel
    (no slice of it is formed outside). q's M rows are padded with zero rows up to a power of
    two of at least 16 (Triton's dot). `splits=None` picks enough splits for ~512 programs, at
    most S / (4 * block_k): Qwen3-4B decoding (K 8, S 8192) gets 32 splits of up to 256
    columns at batch 1, 1 split at batch 64. D and block_k must be powers of two of at least
    16. `interpret=True` runs the kernel in the Pallas interpreter (any backend)."""
    check_decode_inputs(q, k, v, lengths)
    _, b, kv, s, d = k.shape
    m_rows = q.shape[2]
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k {block_k} must be a power of two >= 16")
    if splits is None:
        splits = _default_splits(b, kv, s, block_k)
    rows = max(_MIN_ROWS, 1 << (m_rows - 1).bit_length())
    q_padded = jnp.pad(q, ((0, 0), (0, 0), (0, rows - m_rows), (0, 0)))
    score_dtype = jnp.promote_types(q.dtype, k.dtype)
    value_dtype = jnp.promote_types(q.dtype, v.dtype)
    kernel = functools.partial(_kernel, block_k=block_k, splits=splits, scale=d ** -0.5,
                               q_dtype=q.dtype, score_dtype=score_dtype,
                               value_dtype=value_dtype)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, kv, splits),
        in_specs=[
            whole,  # layer [1]
            whole,  # lengths [B]
            pl.BlockSpec((None, None, rows, d), lambda i, h, j: (i, h, 0, 0)),
            whole,  # k stack
            whole,  # v stack
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda i, h, j: (i, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, j: (i, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kv, splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kv, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kv, splits, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES),
        interpret=interpret,
        name="decode_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths.astype(jnp.int32), q_padded, k, v)
    out, lse = _combine(o, m, l)
    return out[:, :, :m_rows], lse[:, :, :m_rows]


def decode_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array,
                               lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`decode_attention` in plain jnp (the contract in this module's docstring): every column
    of layer `layer` is scored and the columns at or past lengths[b] are masked; the softmax
    is normalized in float32 before its probabilities are rounded to q's dtype."""
    check_decode_inputs(q, k, v, lengths)
    d = q.shape[-1]
    k_layer = jax.lax.dynamic_index_in_dim(k, layer, axis=0, keepdims=False)
    v_layer = jax.lax.dynamic_index_in_dim(v, layer, axis=0, keepdims=False)
    scores = jnp.einsum("bkmd,bksd->bkms", q, k_layer,
                        preferred_element_type=jnp.float32) * (d ** -0.5)
    filled = jnp.arange(k.shape[3])[None, :] < lengths[:, None]  # [B, S]
    scores = jnp.where(filled[:, None, None, :], scores, -jnp.inf)
    top = jnp.maximum(scores.max(axis=-1, keepdims=True), EMPTY_LSE)  # finite when empty
    weights = jnp.exp(scores - top)
    total = weights.sum(axis=-1)
    empty = total == 0
    probs = (weights / jnp.where(empty, 1.0, total)[..., None]).astype(q.dtype)
    out = jnp.einsum("bkms,bksd->bkmd", probs, v_layer, preferred_element_type=jnp.float32)
    lse = jnp.where(empty, EMPTY_LSE, top[..., 0] + jnp.log(jnp.where(empty, 1.0, total)))
    return out, lse

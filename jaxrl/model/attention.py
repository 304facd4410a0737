"""RoPE and grouped-query attention.

Glossary: B batch, T query tokens, S key slots, H query heads, K kv heads, G = H / K query heads
per kv head, M = T * G query rows per kv head, D head dim, C queries per block, N = ceil(T / C)
query blocks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.model.families import ModelSpec

# Finite, so a row whose keys are all masked (a pad token) gives a uniform softmax, not NaN.
_MASKED = -1e30
# The log-sum-exp of an attention part without columns: finite, so merging never forms inf - inf.
EMPTY_LSE = -1e30
# Calls with more queries than this (the GRPO step's full sequences) attend one block of queries
# at a time, so one block's float32 scores [B, K, C*G, S] exist at once rather than all T rows'
# (heads x 8,192 x 8,192 x 4 bytes per row at an 8,192-token context, several copies in the
# backward pass). Decoding and prompt prefill up to this length take the single pass.
QUERY_BLOCK = 1024


def inv_frequencies(spec: ModelSpec) -> np.ndarray:
    """RoPE inverse frequencies [D/2] in float32, with Llama 3.1 scaling when configured."""
    d = spec.head_dim
    inv = (1.0 / (np.float32(spec.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / d)))
    inv = inv.astype(np.float32)
    s = spec.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, spec: ModelSpec) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, D] for integer positions [B, T] (halves repeated, as rotate_half wants)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_frequencies(spec))
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, D]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, D] rotated by the tables [B, T, D], in float32 and rounded once to x's dtype
    (its gradient too: rotated in x's dtype, a bfloat16 x's backward pass rounded each piece
    of the rotation, one conversion after another on XLA:CPU)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
           cache: tuple[jax.Array, jax.Array] | None = None,
           prefix: tuple[jax.Array, jax.Array] | None = None, keys_transposed: bool = False,
           query_block: int = QUERY_BLOCK) -> jax.Array:
    """Softmax attention. q [B, T, H, D], k and v [B, K, S, D] (k [B, K, D, S] when
    keys_transposed), mask [B, T, S] (True = may attend). Returns [B, T, H*D]. More than
    query_block queries are attended in blocks of query_block (`_attend_blocks`).

    cache: keys and values [B, K, C, D] of earlier tokens, attended where they lie (no copy
    joins them to k and v): the keys are then the C cache slots followed by k's S, and mask is
    [B, T, C + S]. prefix: keys and values [B / R, K, P, D] before those, each shared by a
    block of R consecutive rows (a GRPO group's prompt): the block's queries are one product
    against them, so each block reads them once; mask is then [B, T, P + C + S]."""
    parts = [] if prefix is None else [(*prefix, False)]
    parts += ([] if cache is None else [(*cache, False)]) + [(k, v, keys_transposed)]
    if q.shape[1] <= query_block:
        return _attend(q, parts, mask)
    return _attend_blocks(q, parts, mask, query_block)


def _attend_blocks(q, parts, mask, c: int) -> jax.Array:
    """`_attend` over blocks of C queries in `lax.map`, T padded up to N * C with fully masked
    rows that are dropped again. Each block is rematerialized, so the backward pass keeps only
    the blocks' inputs and recomputes one block's scores at a time instead of saving all N."""
    b, t, h, d = q.shape
    pad = -t % c
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    mask = jnp.pad(mask, ((0, 0), (0, pad), (0, 0)))
    qs = q.reshape(b, -1, c, h, d).swapaxes(0, 1)  # [N, B, C, H, D]
    masks = mask.reshape(b, -1, c, mask.shape[-1]).swapaxes(0, 1)  # [N, B, C, S]
    block = jax.checkpoint(lambda qc, mc: _attend(qc, parts, mc), prevent_cse=False)
    out = jax.lax.map(lambda xs: block(*xs), (qs, masks))  # [N, B, C, H*D]
    return out.swapaxes(0, 1).reshape(b, -1, h * d)[:, :t]


def _softmax_parts(scores: list[jax.Array]) -> list[jax.Array]:
    """softmax over the last axis of the scores' concatenation, returned in the same parts,
    without joining them (one part: `jax.nn.softmax`). With the cache's slots and the call's
    own keys as two parts, the decode step never copies its [.., C + T] scores into one array."""
    if len(scores) == 1:
        return [jax.nn.softmax(scores[0], axis=-1)]
    top = jax.lax.stop_gradient(
        functools.reduce(jnp.maximum, [s.max(axis=-1, keepdims=True) for s in scores]))
    exps = [jnp.exp(s - top) for s in scores]
    total = sum(e.sum(axis=-1, keepdims=True) for e in exps)
    return [e / total for e in exps]


def _blocks(x: jax.Array, share: int) -> jax.Array:
    """x [B, K, M, ...] as [B / R, K, R * M, ...]: the M rows of R consecutive batch rows as
    one matrix per block (R = share)."""
    if share == 1:
        return x
    (b, kv, m), rest = x.shape[:3], x.shape[3:]
    x = x.reshape(b // share, share, kv, m, *rest).swapaxes(1, 2)
    return x.reshape(b // share, kv, share * m, *rest)


def _unblocks(x: jax.Array, share: int) -> jax.Array:
    """The inverse of `_blocks`: [B / R, K, R * M, ...] -> [B, K, M, ...]."""
    if share == 1:
        return x
    (n, kv, rm), rest = x.shape[:3], x.shape[3:]
    x = x.reshape(n, kv, share, rm // share, *rest).swapaxes(1, 2)
    return x.reshape(n * share, kv, rm // share, *rest)


def _attend(q: jax.Array, parts, mask: jax.Array) -> jax.Array:
    """`attend` in one pass over all T queries; parts: (k, v, keys_transposed) of consecutive
    key ranges (a shared prefix's, the cache's, then the call's own), each read in place; a
    part with fewer rows than q is shared by blocks of consecutive rows (`_blocks`).

    The G query heads of a kv head and the T tokens form one matrix of M = T*G rows, so each
    (b, k) pair is a single [M, D] x [D, S] product; with T and G as separate dims XLA's CPU
    backend lowers decoding (T = 1, M = G) to a slow batched dot plus transposing copies.
    Probabilities are rounded to q's dtype before they weight the values, whatever the
    values' dtype (a float32 CPU cache holds values of q's dtype, so products are exact).
    """
    b, t, h, d = q.shape
    kv = parts[0][0].shape[1]
    g = h // kv
    q = q.reshape(b, t, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, d)  # [B,K,M,D]
    scores, start = [], 0
    for k, v, tr in parts:  # each part's scores [B, K, T, G, S_part], masked
        width, share = v.shape[2], b // v.shape[0]
        part = jnp.einsum(f"bkmd,{'bkds' if tr else 'bksd'}->bkms", _blocks(q, share), k,
                          preferred_element_type=jnp.float32)
        part = _unblocks(part, share).reshape(b, kv, t, g, width) * (d ** -0.5)
        scores.append(jnp.where(mask[:, None, :, None, start:start + width], part, _MASKED))
        start += width
    out = 0.0
    for (_, v, _), probs in zip(parts, _softmax_parts(scores)):
        share = b // v.shape[0]
        probs = _blocks(probs.astype(q.dtype).reshape(b, kv, t * g, -1), share)
        out = out + _unblocks(jnp.einsum("bkms,bksd->bkmd", probs, v,
                                         preferred_element_type=jnp.float32), share)
    out = out.reshape(b, kv, t, g, d).transpose(0, 2, 1, 3, 4)  # [B, T, K, G, D]
    return out.reshape(b, t, h * d).astype(q.dtype)


def check_decode_inputs(q, k, v, lengths) -> None:
    """Raise ValueError unless q [B, K, M, D], k and v one [L, B, K, S, D] stack and lengths
    [B] fit together (the decode-attention contract, jaxrl/backends/attention_gpu.py)."""
    if k.ndim != 5 or v.shape != k.shape:
        raise ValueError(f"k and v must be the same [L, B, K, S, D] stack: {k.shape}, {v.shape}")
    _, b, kv, _, d = k.shape
    if q.ndim != 4 or q.shape[:2] != (b, kv) or q.shape[3] != d:
        raise ValueError(f"q must be [B, K, M, D] = [{b}, {kv}, M, {d}]: {q.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B] = [{b}]: {lengths.shape}")


def merge(parts) -> tuple[jax.Array, jax.Array]:
    """The attention over the union of consecutive key ranges from each range's (out, lse):
    lse = logaddexp of the parts' lse, out = sum_i exp(lse_i - lse) * out_i, in float32.
    out [..., D] and lse [...] as `decode_attention` returns them; a part without columns
    (lse `EMPTY_LSE`) adds nothing."""
    parts = list(parts)
    if not parts:
        raise ValueError("merge needs at least one part")
    lses = [jnp.asarray(lse, jnp.float32) for _, lse in parts]
    lse = functools.reduce(jnp.logaddexp, lses)
    out = sum(jnp.exp(part_lse - lse)[..., None] * jnp.asarray(part_out, jnp.float32)
              for (part_out, _), part_lse in zip(parts, lses))
    return out, lse


def attend_filled(q: jax.Array, k: jax.Array, v: jax.Array, kernel, cache, prefix=None):
    """A decode step's attention (one query per row) over filled cache columns only: q [B, 1,
    H, D], k and v [B, 1, K, D] the step's own key and value; cache (k_stack, v_stack, layer,
    lengths [B]): keys and values [L, B, K, C, D] of which `kernel` reads layer `layer`'s
    columns [0, lengths[b]) of row b; prefix: (k_stack, v_stack, layer, lengths [B / R]) of a
    prompt [L, B / R, K, P, D] that blocks of R consecutive rows share, or None. The parts are
    merged by their log-sum-exps (`merge`). `kernel(q [N, K, M, D], k_stack, v_stack,
    layer, lengths [N]) -> (out [N, K, M, D], lse [N, K, M])` float32, as
    `jaxrl.backends.attention_gpu.decode_attention`. Returns [B, 1, H*D] in q's dtype, what
    `attend` returns for these keys unmasked up to each row's fill."""
    b, _, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    q4 = q.reshape(b, kv, g, d)  # heads are kv-major: head kv*G + g
    parts = []
    if prefix is not None:
        share = b // prefix[3].shape[0]
        out, lse = kernel(_blocks(q4, share), *prefix)  # the block's R*G rows at once
        parts.append((_unblocks(out, share), _unblocks(lse[..., None], share)[..., 0]))
    parts.append(kernel(q4, *cache))
    # the step's own key: an elementwise product and a sum (no matmul for D-long rows)
    own = jnp.sum(q4.astype(jnp.float32) * k[:, 0, :, None].astype(jnp.float32), axis=-1)
    parts.append((jnp.broadcast_to(v[:, 0, :, None].astype(jnp.float32), (b, kv, g, d)),
                  own * (d ** -0.5)))
    out, _ = merge(parts)
    return out.reshape(b, 1, h * d).astype(q.dtype)

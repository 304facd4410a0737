"""Decode attention over filled columns in plain XLA: a loop over blocks of cache columns that
stops at the batch's fullest row, for backends without a decode-attention kernel whose loops
run on the device (the CPU; `Numerics.attention` "xla_blocks").

    blocked_decode_attention(q, k, v, layer, lengths, *, block=None) -> (out, lse)

has the contract of `jaxrl.backends.attention_gpu.decode_attention` (its module docstring):
q [B, K, M, D]; k, v [L, B, K, S, D] stacked caches of which only layer `layer` and columns
[0, max(lengths)) are read, in blocks of `block` columns (a block starting at or past the
fullest row's fill is never sliced; None: 128 columns, or 1,024 / B for fewer than 8 rows,
whose blocks hold so little work that the loop's own cost shows; a cache of one block is
read whole, without the loop); scores in float32 scaled by D**-0.5, each block's weights
exp(score - running max) rounded to q's dtype before they weight v; out [B, K, M, D] and lse
[B, K, M] float32; a row with length 0 gives out 0 and lse `EMPTY_LSE`.

The work follows the batch's fullest row rather than the capacity: a served engine's 16 slots
over a 2,048-column cache with a short prompt in each score one block, not 2,048 columns (the
whole-capacity form was about 70% of a decode step there; docs/benchmarks.md, "Attention over
filled columns on the CPU"). Rows shorter than the fullest are masked inside its blocks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.model.attention import EMPTY_LSE, check_decode_inputs

BLOCK = 128


def blocked_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array,
                             lengths: jax.Array, *, block: int | None = None
                             ) -> tuple[jax.Array, jax.Array]:
    """Attention of q over layer `layer` of the stacked cache, row b's columns [0,
    lengths[b]) only, in blocks of `block` columns up to the fullest row (module
    docstring)."""
    check_decode_inputs(q, k, v, lengths)
    _, b, kv, s, d = k.shape
    m = q.shape[2]
    width = min(max(BLOCK, 8 * BLOCK // b) if block is None else block, s)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    blocks = (jnp.max(lengths) + width - 1) // width
    layer = jnp.asarray(layer, jnp.int32)
    qf = q.astype(jnp.promote_types(q.dtype, k.dtype))
    scale = d ** -0.5

    def body(j, carry):
        acc, top, total = carry
        first = j * width
        start = jnp.minimum(first, s - width)  # the last block may overlap the one before
        at = (layer, 0, 0, start, 0)
        kb = jax.lax.dynamic_slice(k, at, (1, b, kv, width, d))[0]
        cols = start + jnp.arange(width)
        seen = (cols[None, :] >= first) & (cols[None, :] < lengths[:, None])  # [B, W]
        vb = jnp.where(seen[:, None, :, None],  # unfilled columns weigh nothing, whatever
                       jax.lax.dynamic_slice(v, at, (1, b, kv, width, d))[0], 0)  # they hold
        scores = jnp.einsum("bkmd,bkwd->bkmw", qf, kb,
                            preferred_element_type=jnp.float32) * scale
        scores = jnp.where(seen[:, None, None, :], scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(axis=-1))  # finite: top starts at EMPTY_LSE
        weights = jnp.exp(scores - new_top[..., None])
        rescale = jnp.exp(top - new_top)
        total = total * rescale + weights.sum(axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "bkmw,bkwd->bkmd", weights.astype(q.dtype), vb, preferred_element_type=jnp.float32)
        return acc, new_top, total

    init = (jnp.zeros((b, kv, m, d), jnp.float32), jnp.full((b, kv, m), EMPTY_LSE, jnp.float32),
            jnp.zeros((b, kv, m), jnp.float32))
    if width == s:  # one block holds every column: no loop (its slice feeds its products)
        acc, top, total = body(0, init)
    else:
        acc, top, total = jax.lax.fori_loop(0, blocks, body, init)
    filled = total > 0
    safe = jnp.where(filled, total, 1.0)
    out = jnp.where(filled[..., None], acc / safe[..., None], 0.0)
    lse = jnp.where(filled, top + jnp.log(safe), EMPTY_LSE)
    return out, lse

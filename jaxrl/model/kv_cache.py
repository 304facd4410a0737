"""Static-shape KV cache, stacked over layers for the scanned forward.

Layout [L, B, K, S, D]: keys of one kv head are contiguous along the slot axis, which is the
layout attention reads without a transpose each decode step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.model.families import ModelSpec


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, D]
    v: jax.Array  # [L, B, K, S, D]
    index: jax.Array  # [B] int32: row b's slots [0, index[b]) are filled

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init_cache(spec: ModelSpec, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (spec.num_layers, batch, spec.num_kv_heads, max_len, spec.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   index=jnp.zeros((batch,), jnp.int32))


def write_tokens(cache: KVCache, k: jax.Array, v: jax.Array) -> KVCache:
    """The cache with every layer's keys and values k, v [L, B, T, K, D] of T new tokens
    written at row b's slots [index[b], index[b] + T) and index advanced by T; slots past the
    cache's end are dropped. One scatter of the new tokens alone: inside a jitted loop or on a
    donated cache it updates the buffer in place, so a decode step writes T slots per row.
    Every dim but D is indexed, so each update is one D-long row: a scatter of [K, D] windows
    makes the TPU compiler lay the cache out slot-major, which the attention reads only after
    copying each layer's cache (tools/decode_traffic.py measures it)."""
    n_layers, b, t, n_kv = k.shape[:4]
    layers = jnp.arange(n_layers)[:, None, None, None]  # [L, 1, 1, 1]
    rows = jnp.arange(b)[None, :, None, None]  # [1, B, 1, 1]
    heads = jnp.arange(n_kv)[None, None, :, None]  # [1, 1, K, 1]
    slots = (cache.index[:, None] + jnp.arange(t))[None, :, None, :]  # [1, B, 1, T]
    put = lambda stack, new: stack.at[layers, rows, heads, slots].set(  # noqa: E731
        new.transpose(0, 1, 3, 2, 4).astype(stack.dtype), mode="drop")  # new as [L, B, K, T, D]
    return cache.replace(k=put(cache.k, k), v=put(cache.v, v), index=cache.index + t)

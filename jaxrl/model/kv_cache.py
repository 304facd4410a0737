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

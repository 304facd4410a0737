"""Static-shape KV caches: stacked over layers for the scanned forward, or one array per layer
for the unrolled decode loop.

Stacked layout [L, B, K, S, D]: keys of one kv head are contiguous along the slot axis, which is
the layout attention reads without a transpose each decode step.

Per-layer layout (`LayerKVCache`): a tuple of L arrays each for keys and values, so a decode loop
updates every layer's slot in place instead of slicing a layer out of a stack and writing it back
(which XLA's CPU backend does as two copies of the whole layer cache per step). Keys are stored
transposed, [B, K, D, S], so the q.k product reads them as a plain [D, S] matrix.
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
    index: jax.Array  # [] int32: slots [0, index) are filled

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init_cache(spec: ModelSpec, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (spec.num_layers, batch, spec.num_kv_heads, max_len, spec.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   index=jnp.zeros((), jnp.int32))


@struct.dataclass
class LayerKVCache:
    kt: tuple[jax.Array, ...]  # L x [B, K, D, S]: keys, transposed
    v: tuple[jax.Array, ...]  # L x [B, K, S, D]
    index: jax.Array  # [] int32: slots [0, index) are filled

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2]


def init_layer_cache(spec: ModelSpec, batch: int, max_len: int,
                     dtype=jnp.float32) -> LayerKVCache:
    kt = (batch, spec.num_kv_heads, spec.head_dim, max_len)
    v = (batch, spec.num_kv_heads, max_len, spec.head_dim)
    layers = range(spec.num_layers)
    return LayerKVCache(kt=tuple(jnp.zeros(kt, dtype) for _ in layers),
                        v=tuple(jnp.zeros(v, dtype) for _ in layers),
                        index=jnp.zeros((), jnp.int32))

"""RoPE and grouped-query attention.

Glossary: B batch, T query tokens, S key slots, H query heads, K kv heads, G = H / K query heads
per kv head, D head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.model.families import ModelSpec

# Finite, so a row whose keys are all masked (a pad token) gives a uniform softmax, not NaN.
_MASKED = -1e30


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
    """x [B, T, N, D] rotated by the tables [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention. q [B, T, H, D], k and v [B, K, S, D], mask [B, T, S] (True = may
    attend). Returns [B, T, H*D]."""
    b, t, h, d = q.shape
    kv = k.shape[1]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h * d).astype(q.dtype)

"""LoRA parameters, applied inside the forward, and merged for export.

Per target linear: A [L, in, r], B [L, r, out], output += scale * dropout(x) @ A @ B with
scale = alpha / r. A starts as PEFT starts it (kaiming-uniform with a = sqrt(5), i.e.
U(-1/sqrt(in), 1/sqrt(in))) and B at zero, so a fresh adapter leaves the model unchanged.

Rows of several adapters (`Lora.rows`, made by `jaxrl.lora.adapters.AdapterSet.for_rows`): the
adapters' A and B side by side along the rank, and per row a scale for each rank column (its
adapter's scale in its own adapter's columns, 0 elsewhere), so one product gives every row its
own adapter's term; a sampling form, not differentiated.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.model.families import ModelSpec
from jaxrl.model.params import LINEAR_NAMES, linear_shape


@struct.dataclass
class Lora:
    """Adapter weights {"layers": {target: {"a": [L, in, r], "b": [L, r, out]}}} plus the
    static scale and dropout rate (not differentiated, not optimized)."""

    weights: dict[str, Any]
    scale: float = struct.field(pytree_node=False)
    dropout: float = struct.field(pytree_node=False, default=0.0)
    # [B, r] float32: per row, the scale of each rank column, in place of `scale` (module
    # docstring: rows of several adapters); None: `scale` for every row
    rows: jax.Array | None = None

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.weights["layers"])

    @property
    def rank(self) -> int:
        first = next(iter(self.weights["layers"].values()))
        return first["a"].shape[-1]

    def scale_for(self, x: jax.Array):
        """The scale of x [B, T, in]'s low-rank term: `scale`, or the rows' [B, 1, r]."""
        return self.scale if self.rows is None else self.rows[:, None, :]


def init_lora(spec: ModelSpec, key: jax.Array, *, rank: int, alpha: float,
              targets: tuple[str, ...] = LINEAR_NAMES, dropout: float = 0.0,
              dtype=jnp.float32) -> Lora:
    unknown = [t for t in targets if t not in LINEAR_NAMES]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not linears; choose from {LINEAR_NAMES}")
    layers = {}
    for k, name in zip(jax.random.split(key, len(targets)), targets):
        fan_in, fan_out = linear_shape(spec, name)
        bound = 1.0 / fan_in ** 0.5
        a = jax.random.uniform(k, (spec.num_layers, fan_in, rank), jnp.float32, -bound, bound)
        layers[name] = {"a": a.astype(dtype),
                        "b": jnp.zeros((spec.num_layers, rank, fan_out), dtype)}
    return Lora(weights={"layers": layers}, scale=alpha / rank, dropout=dropout)


def lora_delta(x: jax.Array, ab: dict[str, jax.Array], scale,
               dropout: float = 0.0, rng: jax.Array | None = None) -> jax.Array:
    """scale * dropout(x) @ A @ B for one layer's A [in, r], B [r, out]; x [..., in]. scale: a
    number, or per-row column scales broadcasting against x @ A (`Lora.scale_for`), then
    forward only."""
    if dropout > 0.0 and rng is not None:
        keep = jax.random.bernoulli(rng, 1.0 - dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - dropout), 0).astype(x.dtype)
    if not isinstance(scale, (int, float)):
        return _low_rank_fwd(x, ab["a"], ab["b"], scale)[0]
    return _low_rank(x, ab["a"], ab["b"], scale)


def scaled_xa(x: jax.Array, a: jax.Array, scale) -> jax.Array:
    """scale * x @ A [..., r] of x [..., in] and A [in, r], summed in float32 and rounded to
    x's dtype: the low-rank product's first half, scaled on the small [tokens, r] product,
    never on a [tokens, out] array. scale: a number or an array broadcasting against it."""
    xa = jnp.einsum("...i,ir->...r", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    return (scale * xa).astype(x.dtype)


def _low_rank_fwd(x, a, b, scale):
    xa = scaled_xa(x, a, scale)
    y = jnp.einsum("...r,ro->...o", xa, b.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype), (x, a, b, xa)


def _low_rank_bwd(scale, residuals, g):
    """Gradients written as plain 2-D products with the small [tokens, r] operand transposed:
    differentiated automatically, dB = xa^T g made XLA's CPU backend transpose the large
    [tokens, out] cotangent in a slow loop. The cotangent g [tokens, out] is read as it comes
    (scale goes to B [r, out]), twice: for dB and dxa."""
    x, a, b, xa = residuals  # xa: the scaled x @ A
    dtype = x.dtype
    x2 = x.reshape(-1, x.shape[-1])  # [T, in]
    g2 = g.reshape(-1, g.shape[-1]).astype(dtype)  # [T, out]
    db = jnp.dot(xa.reshape(-1, xa.shape[-1]).T, g2, preferred_element_type=jnp.float32)
    scaled_b = (scale * b.astype(jnp.float32)).astype(dtype)  # [r, out]
    dxa = jnp.dot(g2, scaled_b.T, preferred_element_type=jnp.float32).astype(dtype)  # [T, r]
    da = jnp.dot(x2.T, dxa, preferred_element_type=jnp.float32)  # [in, r]
    dx = jnp.dot(dxa, a.astype(dtype).T, preferred_element_type=jnp.float32)  # [T, in]
    return dx.reshape(x.shape).astype(dtype), da.astype(a.dtype), db.astype(b.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _low_rank(x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    return _low_rank_fwd(x, a, b, scale)[0]


_low_rank.defvjp(_low_rank_fwd, _low_rank_bwd)


def merged_kernel(kernel: jax.Array, ab: dict[str, jax.Array], scale: float) -> jax.Array:
    """Dense kernel [..., in, out] + scale * A @ B, in float32 (for export and checks)."""
    delta = jnp.einsum("...ir,...ro->...io", ab["a"].astype(jnp.float32),
                       ab["b"].astype(jnp.float32))
    return kernel.astype(jnp.float32) + scale * delta

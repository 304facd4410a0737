"""The CPU's own forms, chosen by `jaxrl.backends.numerics` for programs that run on XLA:CPU.

Products. XLA:CPU multiplies bfloat16 operands fast only when the result is float32 (figures in
docs/benchmarks.md, "bfloat16 products on the CPU"). Differentiated by JAX, a product with a
float32 result gets a float32 cotangent, so its backward would multiply float32 by a float32
copy of the bfloat16 weight, at the float32 rate. `product` therefore takes a custom backward:
the cotangent is rounded to the operands' dtype (exact where it came from a bfloat16 value, as
it does from a linear's rounded output) and each gradient is a product of two bfloat16 operands
with a float32 result, rounded once to its operand's dtype, as torch's bfloat16 autocast
computes a linear's gradients.

Held bits. XLA:CPU converts a bfloat16 stack whole to float32 before a loop slices it, and each
slice back to bfloat16. So the CPU holds each bfloat16 array of the stacked layers as a `Bits`
leaf, its uint16 bit patterns, which the layer scan slices as they are and each layer turns
back into bfloat16 (`Bits.as_dense`): the same values, read once. Converting a stack inside a
program copies it, so a run holds its weights this way from load (`hold`).

Gathers. XLA:CPU gathers bfloat16 rows through float32, converting the whole table first, so
`embed` gathers the table's bits.

Decode head. A tied head on one device runs vocab-major, [V, E] x [S, E] -> [V, S], then
transposed behind a barrier: XLA:CPU's matmul takes the long [V, E] table as its long side.

Glossary: T tokens (all leading dims of x), I inner (contracted) dim, O output dim, V vocab,
E hidden size, S decode slots.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl.quant.nf4 import QTensor


@flax.struct.dataclass
class Bits:
    """A bfloat16 array [...] held as its uint16 bit patterns `bits` [...] (module docstring).
    Slicing its leaf (a scan over layers, `tree_map(lambda a: a[i], ...)`) slices the array."""

    bits: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)

    def as_dense(self, dtype=None) -> jax.Array:
        """The bfloat16 array (cast to `dtype` when given)."""
        dense = jax.lax.bitcast_convert_type(self.bits, jnp.bfloat16)
        return dense if dtype is None else dense.astype(dtype)


def is_held(x) -> bool:
    """Whether x is a leaf that `hold` and `dense` treat whole (Bits, QTensor)."""
    return isinstance(x, (Bits, QTensor))


@jax.custom_jvp
def _to_bits(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, jnp.uint16)


@_to_bits.defjvp
def _to_bits_jvp(primals, tangents):
    raise TypeError("the base weights are held as their bits on the CPU and are not "
                    "differentiable there; differentiate the adapter (LoRA) weights")


def hold(tree):
    """tree with each bfloat16 array as `Bits`; everything else as it is. Abstract leaves
    (ShapeDtypeStructs, for plans) become abstract bits with the same sharding. Differentiating
    through it raises rather than give a zero gradient."""
    def one(a):
        if is_held(a) or a.dtype != jnp.bfloat16:
            return a
        if isinstance(a, jax.ShapeDtypeStruct):
            return Bits(jax.ShapeDtypeStruct(a.shape, jnp.uint16, sharding=a.sharding))
        return Bits(_to_bits(a))
    return jax.tree_util.tree_map(one, tree, is_leaf=is_held)


def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows of a bfloat16 table [V, E] for tokens [...], gathered as bits (module docstring)."""
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16)[tokens]
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def vocab_major_logits(table: jax.Array, h: jax.Array) -> jax.Array:
    """Logits [S, V] float32 of h [S, E] against a tied table [V, E] (module docstring)."""
    vocab_major = jnp.einsum("ve,se->vs", table.astype(h.dtype), h,
                             preferred_element_type=jnp.float32)
    return jax.lax.optimization_barrier(vocab_major).T


def _matmul(a: jax.Array, b: jax.Array, a_t: bool = False, b_t: bool = False) -> jax.Array:
    """a @ b of 2-D operands (either transposed), float32 result."""
    dims = (((0,) if a_t else (1,)), ((1,) if b_t else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _product_fwd(x, w, transposed):
    x2 = x.reshape(-1, x.shape[-1])
    y = _matmul(x2, w, b_t=transposed)
    return y.reshape(*x.shape[:-1], y.shape[-1]), (x, w)


def _product_bwd(transposed, residuals, g):
    x, w = residuals
    x2 = x.reshape(-1, x.shape[-1])  # [T, I]
    g2 = g.reshape(-1, g.shape[-1]).astype(x.dtype)  # [T, O]
    dx = _matmul(g2, w, b_t=not transposed)  # [T, O] x [O, I]
    dw = _matmul(g2, x2, a_t=True) if transposed else _matmul(x2, g2, a_t=True)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def product(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """x [..., I] @ w ([I, O], or [O, I] when transposed), operands of one dtype below float32,
    -> [..., O] float32, with the custom backward of the module docstring."""
    return _product_fwd(x, w, transposed)[0]


product.defvjp(_product_fwd, _product_bwd)

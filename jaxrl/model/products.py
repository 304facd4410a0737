"""The model's weight products, x @ W and x @ W^T, with float32 sums.

XLA:CPU multiplies bfloat16 operands fast only when the result is float32: [2048, 576] x
[576, 1536] ran at 428 GFLOP/s that way on a Zen 4 (AVX512-BF16), against 197 GFLOP/s with a
bfloat16 result and 210 GFLOP/s in float32 (docs/benchmarks.md, "bfloat16 products on the
CPU"). Differentiated by JAX, a product with a float32 result gets a float32 cotangent, so its
backward multiplies float32 by a float32 copy of the bfloat16 weight, at the float32 rate.
`product` therefore takes a custom backward on the CPU for operands below float32: the
cotangent is rounded to the operands' dtype (exact where it came from a bfloat16 value, as
it does from a linear's rounded output) and each gradient is a product of two bfloat16
operands with a float32 result, rounded once to its operand's dtype, as torch's bfloat16
autocast computes a linear's gradients. Elsewhere (float32 operands, GPUs and TPUs, whose
compilers accumulate a bfloat16 result's sums in float32 within the product) `product` is
the plain einsum, differentiated by JAX.

Glossary: T tokens (all leading dims of x), I inner (contracted) dim, O output dim.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def fast_low_precision(dtype, backend: str | None = None) -> bool:
    """Whether products of `dtype` operands take the custom backward (module docstring)."""
    return (backend or jax.default_backend()) == "cpu" and jnp.dtype(dtype).itemsize < 4


def product(x: jax.Array, w: jax.Array, *, transposed: bool = False,
            dtype=jnp.float32, backend: str | None = None) -> jax.Array:
    """x [..., I] @ w ([I, O], or [O, I] when transposed) -> [..., O], summed in float32 and
    rounded to `dtype`; w is taken in x's dtype."""
    w = w.astype(x.dtype)
    if not fast_low_precision(x.dtype, backend):
        spec = "...i,oi->...o" if transposed else "...i,io->...o"
        return jnp.einsum(spec, x, w, preferred_element_type=dtype)
    return _product(x, w, transposed).astype(dtype)


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
def _product(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    return _product_fwd(x, w, transposed)[0]


_product.defvjp(_product_fwd, _product_bwd)

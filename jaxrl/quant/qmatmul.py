"""x @ W for a quantized kernel W [I, O] (one layer's), without the dense [I, O] kernel.

Glossary: I input dim, O output dim, Bk block size, N = I / Bk scale blocks, K = Bk / 2 packed
rows per block, J = 2 nibbles per byte.

Byte (i, o) packs the codes of rows 2i (low nibble) and 2i + 1 (high nibble). Unpacking into
an [I, O] kernel interleaves the nibbles, a relayout that an accelerator's compiler does not
fuse into the matmul; nor does it fuse a block scale broadcast along the contracted dim. So
the forms here keep the packed order, level[n, j, k, o] = the codebook value of nibble j of
byte (n*K + k, o) (`select_levels`: selects, no gather), and regroup the inputs to match
(x[..., n*Bk + 2k + j] as [..., n, k, j], a view of x, not a copy of W):

  block form (calls bound by reading the kernel, e.g. a decode step): one matmul per scale
      block, scaled after it:
      y[r, o] = sum_n scale[n, o] * sum_{j, k} x[r, n*Bk + 2k + j] * level[n, j, k, o].
      Only selects sit between the packed bytes and the matmul, so the levels never need to
      reach device memory (the TPU compiler keeps them on chip) and a step reads 0.5 bytes per
      weight plus the scales. The levels are in x's dtype (bfloat16 rounds them, where a dense
      bfloat16 kernel rounds level * scale).
  dense form (prefill, training): the even rows' kernel level * scale in x's dtype, in the
      packed order, and the odd rows' after it ([J, N, K, O]), times the inputs regrouped to
      match ([..., J, N, K]) in one matmul. The kernel is written and read once per call,
      which many tokens amortize, and the matmul runs at full rate, where the block form's
      Bk-long contractions would use the matrix units at a fraction of it (and, where the
      backend does not fuse the block sums, hold [..., N, O] partial products). One matmul
      rounds its float32 sums to the result's dtype once, so on a mesh that splits I (a
      row-parallel layer) the partial sums cross devices in that dtype.
  split form (the GPU's choice, `jaxrl.backends.numerics`): the even rows' kernel
      level * scale and the odd rows', each [I/2, O] in x's dtype and computed elementwise
      from the packed bytes and the scales (no stack, no block sums), times the even and the
      odd inputs in two matmuls whose float32 sums are added and rounded once. On an H200 the
      block form's stacked levels became a concatenate that XLA:GPU wrote to memory, and its
      float32 block sums were as large as the levels (docs/benchmarks.md, "First accelerator
      check: one H200"); here XLA:GPU may fuse each kernel's elementwise work into its
      matmul, and where it does not it writes each kernel once in a plain loop, as the dense
      form does.

All forms give each output the same products as x @ dequantize(W) in x's dtype (the block
form up to its levels' rounding), summed in another order (float32), so they agree with it to
float32 rounding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.quant.nf4 import CODEBOOKS, QTensor, dense_scales, select_levels

def _levels(q: QTensor, nibble: int, dtype) -> jax.Array:
    """level [N, K, O] of nibble `nibble` (0 low, 1 high) of each packed byte, in `dtype`."""
    half_in, n_out = q.codes.shape
    k = q.block_size // 2
    packed = q.codes.reshape(half_in // k, k, n_out)  # [N, K, O]
    codes = packed & 0xF if nibble == 0 else packed >> 4
    return select_levels(codes, CODEBOOKS[q.mode]).astype(dtype)


FORMS = ("block", "dense", "split")


def qmatmul(x: jax.Array, q: QTensor, *, form: str, dtype=jnp.float32) -> jax.Array:
    """x [..., I] @ the dense kernel of q [I, O] (no layer axis), as [..., O] in `dtype`,
    accumulated in float32 and rounded to `dtype` once, in one of FORMS (module docstring)."""
    if form not in FORMS:
        raise ValueError(f"qmatmul form {form!r} is not one of {FORMS}")
    *lead, n_in = x.shape
    k = q.block_size // 2
    xb = x.reshape(*lead, n_in // q.block_size, k, 2)  # [..., N, K, J]
    scales = dense_scales(jnp, q)  # [N, O]
    if form == "block":
        levels = jnp.stack([_levels(q, j, x.dtype) for j in (0, 1)], axis=1)  # [N, J, K, O]
        partial = jnp.einsum("...nkj,njko->...no", xb, levels,
                             preferred_element_type=jnp.float32)  # [..., N, O]
        return jnp.sum(partial * scales, axis=-2).astype(dtype)
    # the even rows' kernel and the odd rows' ([N, K, O] each), each written at most once
    kernels = [(_levels(q, j, jnp.float32) * scales[:, None, :]).astype(x.dtype)
               for j in (0, 1)]
    if form == "dense":  # in one matmul
        return jnp.einsum("...jnk,jnko->...o", jnp.moveaxis(xb, -1, -3), jnp.stack(kernels),
                          preferred_element_type=dtype)
    sums = [jnp.einsum("...nk,nko->...o", xb[..., j], kernels[j],
                       preferred_element_type=jnp.float32) for j in (0, 1)]
    return (sums[0] + sums[1]).astype(dtype)

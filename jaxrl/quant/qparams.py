"""Which params are quantized, and their abstract (shape-only) quantized form.

Abstract params let memory plans and compile checks run for any model size without weights.
"""
from __future__ import annotations

import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxrl.model.families import ModelSpec
from jaxrl.model.params import abstract_params, declare, flatten, unflatten
from jaxrl.quant.nf4 import DQ_GROUP, QTensor, dequantize, nbytes


class QuantSettings(Protocol):
    """What this module reads of the run config's `quant` group (jaxrl.config.QuantConfig)."""
    mode: str
    block_size: int
    double_quant: bool
    scale_dtype: str
    skip: tuple[str, ...]
    dequantize: str


class BlockSizeError(ValueError):
    """The quantization block size does not divide a quantized kernel's input dim: the
    settings do not fit the model (a usage error, like a bad config value)."""


def quantized_paths(spec: ModelSpec, quant: QuantSettings | None) -> set[str]:
    """Param paths stored quantized: linear kernels whose module is not in `quant.skip`.
    Embeddings and norms are never quantized."""
    if quant is None or quant.mode == "none":
        return set()
    return {p for p in declare(spec)
            if p.endswith("/kernel") and p.split("/")[-2] not in quant.skip}


def abstract_qtensor(shape: tuple[int, ...], quant: QuantSettings,
                     dtype=jnp.bfloat16) -> QTensor:
    """A QTensor of ShapeDtypeStructs for a dense kernel of `shape` [..., I, O]."""
    *lead, n_in, n_out = shape
    if n_in % quant.block_size:
        raise BlockSizeError(f"quant.block_size = {quant.block_size} does not divide a kernel's "
                             f"input dim {n_in}; pick a divisor (64 fits most models)")
    blocks = (*lead, n_in // quant.block_size, n_out)
    sds = jax.ShapeDtypeStruct
    codes = sds((*lead, n_in // 2, n_out), jnp.uint8)
    name = jnp.dtype(dtype).name
    if not quant.double_quant:
        return QTensor(codes, sds(blocks, jnp.dtype(quant.scale_dtype)), quant.block_size,
                       quant.mode, name)
    groups = -(-(blocks[-2] * n_out) // DQ_GROUP)
    return QTensor(codes, sds(blocks, jnp.uint8), quant.block_size, quant.mode, name,
                   sds((*lead, groups), jnp.float32), sds(tuple(lead), jnp.float32))


def abstract_quantized_params(spec: ModelSpec, quant: QuantSettings | None,
                              dtype=jnp.bfloat16) -> dict[str, Any]:
    """The params pytree as ShapeDtypeStructs, with quantized kernels as abstract QTensors."""
    flat = flatten(abstract_params(spec, dtype))
    for path in quantized_paths(spec, quant):
        flat[path] = abstract_qtensor(flat[path].shape, quant, dtype)
    return unflatten(flat)


def resident_bytes(params: dict[str, Any]) -> int:
    """Bytes of every array leaf (concrete or abstract) of a params pytree."""
    return sum(nbytes(leaf) if isinstance(leaf, QTensor) else leaf.size * leaf.dtype.itemsize
               for leaf in jax.tree_util.tree_leaves(
                   params, is_leaf=lambda x: isinstance(x, QTensor)))


@functools.partial(jax.jit, static_argnums=1)
def dequantize_params(params: dict[str, Any], dtype) -> dict[str, Any]:
    """The params with every QTensor replaced by its dense kernel in `dtype`: one compiled
    program, so each kernel's codes are read once and its dense form written once. Run op by
    op instead, each kernel's unpacked codes, sixteen candidate levels and selects would exist
    as kernel-sized float32 arrays one after another (docs/benchmarks.md, "Host memory kept
    between calls")."""
    return jax.tree_util.tree_map(
        lambda x: dequantize(x, dtype) if isinstance(x, QTensor) else x, params,
        is_leaf=lambda x: isinstance(x, QTensor))

"""Parameter declarations: every weight's shape, logical axes and init, declared once.

Paths mirror Hugging Face module names (`layers/q_proj/kernel`) so LoRA targets, quantization
skips and the HF key table all speak the same names. Per-layer weights are stacked along a
leading `layers` axis and run with `lax.scan`. Linear kernels are stored [in, out] (x @ W).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxrl.model.families import LINEAR_NAMES as LINEAR_NAMES  # re-exported: the linears below
from jaxrl.model.families import ModelSpec


@dataclasses.dataclass(frozen=True)
class ParamDecl:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dim
    init: str  # "normal" | "ones" | "zeros"


def _linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, int, str, str]]:
    """name -> (in, out, in_axis, out_axis) for every linear in a layer."""
    d, f = spec.hidden_size, spec.intermediate_size
    return {
        "q_proj": (d, spec.q_size, "embed", "heads"),
        "k_proj": (d, spec.kv_size, "embed", "kv_heads"),
        "v_proj": (d, spec.kv_size, "embed", "kv_heads"),
        "o_proj": (spec.q_size, d, "heads", "embed"),
        "gate_proj": (d, f, "embed", "mlp"),
        "up_proj": (d, f, "embed", "mlp"),
        "down_proj": (f, d, "mlp", "embed"),
    }


def linear_shape(spec: ModelSpec, name: str) -> tuple[int, int]:
    """(in, out) of one layer's linear `name`."""
    fan_in, fan_out, _, _ = _linear_shapes(spec)[name]
    return fan_in, fan_out


def declare(spec: ModelSpec) -> dict[str, ParamDecl]:
    """Flat {path: ParamDecl} for the whole model."""
    n, d = spec.num_layers, spec.hidden_size
    decls = {
        "embed_tokens/embedding": ParamDecl((spec.vocab_size, d), ("vocab", "embed"), "normal"),
        "norm/scale": ParamDecl((d,), ("embed",), "ones"),
        "layers/input_layernorm/scale": ParamDecl((n, d), ("layers", "embed"), "ones"),
        "layers/post_attention_layernorm/scale": ParamDecl((n, d), ("layers", "embed"), "ones"),
    }
    for name, (fan_in, fan_out, in_ax, out_ax) in _linear_shapes(spec).items():
        decls[f"layers/{name}/kernel"] = ParamDecl(
            (n, fan_in, fan_out), ("layers", in_ax, out_ax), "normal")
    if spec.qkv_bias:
        for name in ("q_proj", "k_proj", "v_proj"):
            fan_out = _linear_shapes(spec)[name][1]
            decls[f"layers/{name}/bias"] = ParamDecl(
                (n, fan_out), ("layers", _linear_shapes(spec)[name][3]), "zeros")
    if spec.qk_norm:
        for name in ("q_norm", "k_norm"):
            decls[f"layers/{name}/scale"] = ParamDecl((n, spec.head_dim), ("layers", "head_dim"),
                                                      "ones")
    if not spec.tie_word_embeddings:
        decls["lm_head/kernel"] = ParamDecl((d, spec.vocab_size), ("embed", "vocab"), "normal")
    return decls


def count_params(spec: ModelSpec) -> int:
    return sum(int(np.prod(p.shape)) for p in declare(spec).values())


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    return traverse_util.unflatten_dict(flat, sep="/")


def flatten(tree: dict[str, Any]) -> dict[str, Any]:
    return traverse_util.flatten_dict(tree, sep="/")


def abstract_params(spec: ModelSpec, dtype=jnp.float32) -> dict[str, Any]:
    """ShapeDtypeStructs of the params: for memory planning and compiling without weights."""
    return unflatten({k: jax.ShapeDtypeStruct(p.shape, dtype) for k, p in declare(spec).items()})


def init_params(spec: ModelSpec, key: jax.Array, dtype=jnp.float32, std: float = 0.02):
    """Random params (normal(std) for matrices, ones for norms, zeros for biases)."""
    decls = declare(spec)
    keys = jax.random.split(key, len(decls))
    flat = {}
    for k, (path, p) in zip(keys, sorted(decls.items())):
        if p.init == "normal":
            flat[path] = (std * jax.random.normal(k, p.shape, jnp.float32)).astype(dtype)
        else:
            flat[path] = (jnp.ones if p.init == "ones" else jnp.zeros)(p.shape, dtype)
    return unflatten(flat)

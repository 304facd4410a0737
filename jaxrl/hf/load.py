"""Load a Hugging Face checkpoint directory into a jaxrl param pytree.

Shards are read one at a time through mmap and each tensor is placed as it is read: dense params
into preallocated (stacked) host arrays, quantized kernels quantized layer by layer. Peak host
memory stays near one copy of the stored model (dense) or one full-precision tensor plus the
quantized model (NF4 / int4).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import QuantConfig
from jaxrl.hf.keymap import KeyMapError, Slot, check_keys
from jaxrl.hf.safetensors_io import iter_tensors, read_header
from jaxrl.model.families import ModelSpec, load_spec
from jaxrl.model.params import declare, unflatten
from jaxrl.quant.nf4 import QTensor, quantize_np
from jaxrl.quant.qparams import quantized_paths


def shard_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: from its index when sharded."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint index names missing shards: {missing}")
    return files


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    for path in shard_files(model_dir):
        yield from iter_tensors(path)


def checkpoint_keys(model_dir: str | Path) -> list[str]:
    """Every shard's tensor names, from the headers alone (a name in two shards twice)."""
    return [key for path in shard_files(model_dir) for key in read_header(path)]


class _HostParams:
    """Host-side params being filled tensor by tensor."""

    def __init__(self, spec: ModelSpec, dtype: np.dtype, quant: QuantConfig | None):
        self.decls, self.dtype, self.quant = declare(spec), dtype, quant
        self.qpaths = quantized_paths(spec, quant)
        self.dense = {p: np.empty(d.shape, dtype) for p, d in self.decls.items()
                      if p not in self.qpaths}
        self.quantized: dict[str, QTensor] = {}  # filled in place, layer by layer

    def place(self, slot: Slot, key: str, value: np.ndarray) -> None:
        value = value.T if slot.transpose else value
        shape = self.decls[slot.path].shape[0 if slot.layer is None else 1:]
        if tuple(value.shape) != tuple(shape):
            stored = value.shape[::-1] if slot.transpose else value.shape
            implied = shape[::-1] if slot.transpose else shape
            raise KeyMapError(f"checkpoint tensor {key!r} has shape {tuple(stored)}; "
                              f"the config implies {tuple(implied)}")
        if slot.path in self.qpaths:
            self._place_quantized(slot, value)
        elif slot.layer is None:
            self.dense[slot.path][...] = value
        else:
            self.dense[slot.path][slot.layer] = value

    def _place_quantized(self, slot: Slot, value: np.ndarray) -> None:
        q = quantize_np(np.asarray(value, np.float32), self.quant.block_size, self.quant.mode,
                        self.quant.double_quant, self.quant.scale_dtype)
        q = q.replace(dtype=self.dtype.name)
        if slot.layer is None:
            self.quantized[slot.path] = q
            return
        if slot.path not in self.quantized:  # first layer seen: allocate the stacked leaves
            n = self.decls[slot.path].shape[0]
            self.quantized[slot.path] = jax.tree_util.tree_map(
                lambda a: np.empty((n, *a.shape), a.dtype), q)
        stacked = jax.tree_util.tree_leaves(self.quantized[slot.path])
        for dst, src in zip(stacked, jax.tree_util.tree_leaves(q)):
            dst[slot.layer] = src

    def finish(self) -> dict[str, Any]:
        """{path: array or QTensor}."""
        return {**self.dense, **self.quantized}


def load_host_params(model_dir: str | Path, spec: ModelSpec, dtype=np.float32,
                     quant: QuantConfig | None = None) -> dict[str, Any]:
    """Host params {path: array or QTensor}; raises on unmapped, missing or duplicate keys
    before any tensor is read."""
    table = check_keys(spec, checkpoint_keys(model_dir))
    host = _HostParams(spec, np.dtype(dtype), quant)
    tied_head = None
    for key, value in iter_checkpoint(model_dir):
        if key == "lm_head.weight" and spec.tie_word_embeddings:
            tied_head = value  # HF ties it to the embedding; checked below
            continue
        host.place(table[key], key, value)
    params = host.finish()
    if tied_head is not None and not np.array_equal(
            np.asarray(tied_head, params["embed_tokens/embedding"].dtype),
            params["embed_tokens/embedding"]):
        raise KeyMapError("checkpoint has an lm_head.weight that differs from the embedding, "
                          "but config.json says tie_word_embeddings")
    return params


def load_params(model_dir: str | Path, spec: ModelSpec | None = None, dtype=jnp.float32,
                quant: QuantConfig | None = None) -> tuple[ModelSpec, dict[str, Any]]:
    """(spec, params pytree of device arrays) from a local HF directory; linear kernels are
    quantized while loading when `quant.mode` is nf4 or int4."""
    spec = spec or load_spec(model_dir)
    host = load_host_params(model_dir, spec, np.dtype(dtype), quant)
    params = {}
    for path in list(host):
        params[path] = jax.device_put(host.pop(path))  # free each host copy as it moves
    return spec, unflatten(params)

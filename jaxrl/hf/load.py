"""Load a Hugging Face checkpoint directory into a jaxrl param pytree.

Shards are read one at a time through mmap; each tensor is copied once into its preallocated
(stacked) host array, so peak host memory stays near one copy of the weights.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.hf.keymap import KeyMapError, Slot, key_table
from jaxrl.hf.safetensors_io import iter_tensors
from jaxrl.model.families import ModelSpec, load_spec
from jaxrl.model.params import declare, unflatten


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


def _place(host: dict[str, np.ndarray], slot: Slot, key: str, value: np.ndarray) -> None:
    if slot.transpose:
        value = value.T
    target = host[slot.path] if slot.layer is None else host[slot.path][slot.layer]
    if target.shape != value.shape:
        raise KeyMapError(f"checkpoint tensor {key!r} has shape {value.shape[::-1] if slot.transpose else value.shape}"
                          f"; the config implies {target.shape[::-1] if slot.transpose else target.shape}")
    target[...] = value


def load_host_params(model_dir: str | Path, spec: ModelSpec, dtype=np.float32):
    """Numpy params {path: array} in `dtype`; raises on unmapped, missing or duplicate keys."""
    table = key_table(spec)
    host = {p: np.empty(d.shape, dtype) for p, d in declare(spec).items()}
    seen: set[str] = set()
    tied_head = None
    for key, value in iter_checkpoint(model_dir):
        if key in seen:
            raise KeyMapError(f"checkpoint key {key!r} appears twice")
        seen.add(key)
        if key == "lm_head.weight" and spec.tie_word_embeddings:
            tied_head = value  # HF ties it to the embedding; checked below
            continue
        slot = table.get(key)
        if slot is None:
            raise KeyMapError(f"checkpoint key {key!r} maps to no jaxrl param "
                              f"(family {spec.family})")
        _place(host, slot, key, value)
    missing = sorted(set(table) - seen)
    if missing:
        raise KeyMapError(f"checkpoint misses {len(missing)} keys, e.g. {missing[:5]}")
    if tied_head is not None and not np.array_equal(tied_head, host["embed_tokens/embedding"]):
        raise KeyMapError("checkpoint has an lm_head.weight that differs from the embedding, "
                          "but config.json says tie_word_embeddings")
    return host


def load_params(model_dir: str | Path, spec: ModelSpec | None = None,
                dtype=jnp.float32) -> tuple[ModelSpec, dict[str, Any]]:
    """(spec, params pytree of device arrays) from a local HF directory."""
    spec = spec or load_spec(model_dir)
    host = load_host_params(model_dir, spec, np.dtype(dtype))
    params = {}
    for path in list(host):
        params[path] = jax.device_put(host.pop(path))  # free each host copy as it moves
    return spec, unflatten(params)

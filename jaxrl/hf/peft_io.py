"""Load a Hugging Face PEFT LoRA adapter directory (adapter_config.json +
adapter_model.safetensors) as a jaxrl `Lora`, and start a run's adapter (fresh, or the PEFT
adapter of `lora.init_from`). Writing one is jaxrl/hf/export.py's.

PEFT stores, per layer i and target t, `base_model.model.<HF module of t>.lora_A.weight` [r, in]
and `...lora_B.weight` [out, r] (module names from jaxrl/hf/keymap.py, e.g.
`model.layers.{i}.self_attn.q_proj`); jaxrl keeps A [in, r] and B [r, out] stacked over layers,
hence the transposes. The scale is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import ConfigError, LoraConfig
from jaxrl.hf.keymap import hf_key
from jaxrl.hf.safetensors_io import iter_tensors
from jaxrl.lora.lora import Lora, init_lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.params import LINEAR_NAMES, linear_shape

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# adapter_config.json fields that change the adapter's math unless they hold these values.
_NEUTRAL = {"peft_type": ("LORA",), "bias": ("none", None), "lora_bias": (False, None),
            "use_dora": (False, None), "fan_in_fan_out": (False, None),
            "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
            "layers_to_transform": (None,), "layers_pattern": (None, []),
            "layer_replication": (None,), "modules_to_save": (None, []),
            "exclude_modules": (None, []), "trainable_token_indices": (None,),
            "target_parameters": (None, []), "use_qalora": (False, None),
            "alora_invocation_tokens": (None,)}


class AdapterError(ValueError):
    """A PEFT adapter directory jaxrl cannot load exactly."""


def _read_config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError(f"no {ADAPTER_CONFIG} in {adapter_dir}; expected a PEFT LoRA adapter "
                           f"directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    cfg = json.loads(path.read_text())
    for key, allowed in _NEUTRAL.items():
        if cfg.get(key, allowed[0]) not in allowed:
            raise AdapterError(f"{path}: {key} = {cfg[key]!r} is not supported; jaxrl loads "
                               f"plain LoRA ({key} must be {allowed[0]!r})")
    return cfg


def _targets(cfg: dict[str, Any], path: Path) -> tuple[str, ...]:
    """Target linear names; PEFT may list them as module paths ("model.layers.0.mlp.up_proj",
    as it saves 'all-linear'), which name the same linears (the tensors are checked later)."""
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        return LINEAR_NAMES
    names = {t.rsplit(".", 1)[-1] for t in targets} if isinstance(targets, list) else None
    if not names or not names <= set(LINEAR_NAMES):
        raise AdapterError(f"{path}: target_modules {targets!r} must be a list of "
                           f"{', '.join(LINEAR_NAMES)} (or 'all-linear')")
    return tuple(t for t in LINEAR_NAMES if t in names)


def peft_keys(spec: ModelSpec, targets: tuple[str, ...]) -> dict[str, tuple[str, int, str]]:
    """{PEFT key: (target, layer, "a" | "b")}: the names import reads and export writes."""
    keys = {}
    for name in targets:
        for i in range(spec.num_layers):
            module = hf_key(f"layers/{name}/kernel", i).removesuffix(".weight")
            for part, ab in (("lora_A", "a"), ("lora_B", "b")):
                keys[f"base_model.model.{module}.{part}.weight"] = (name, i, ab)
    return keys


def load_peft_adapter(adapter_dir: str | Path, spec: ModelSpec, dtype=jnp.float32) -> Lora:
    """The adapter in `adapter_dir` for a model of `spec`; raises AdapterError on unsupported
    options and on missing, unexpected or misshapen tensors."""
    adapter_dir = Path(adapter_dir)
    cfg = _read_config(adapter_dir)
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    targets = _targets(cfg, adapter_dir / ADAPTER_CONFIG)
    expected = peft_keys(spec, targets)
    weights_path = adapter_dir / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise AdapterError(f"no {ADAPTER_WEIGHTS} in {adapter_dir}")
    stacks = {name: {"a": np.zeros((spec.num_layers, linear_shape(spec, name)[0], rank),
                                   np.float32),
                     "b": np.zeros((spec.num_layers, rank, linear_shape(spec, name)[1]),
                                   np.float32)}
              for name in targets}
    seen = set()
    for key, value in iter_tensors(weights_path):
        if key not in expected:
            raise AdapterError(f"{weights_path}: tensor {key!r} is no LoRA weight of the "
                               f"targets {list(targets)} of this {spec.family} model")
        name, layer, ab = expected[key]
        want = stacks[name][ab].shape[1:]
        if value.T.shape != want:
            raise AdapterError(f"{weights_path}: {key!r} has shape {value.shape}; rank {rank} and "
                               f"the model imply {want[::-1]}")
        stacks[name][ab][layer] = value.T
        seen.add(key)
    missing = sorted(set(expected) - seen)
    if missing:
        raise AdapterError(f"{weights_path} misses {len(missing)} tensors, e.g. {missing[:3]}")
    scale = alpha / (rank ** 0.5 if cfg.get("use_rslora") else rank)
    layers = {name: {ab: jnp.asarray(w, dtype) for ab, w in parts.items()}
              for name, parts in stacks.items()}
    return Lora(weights={"layers": layers}, scale=scale)


def start_lora(lora_cfg: LoraConfig, spec: ModelSpec, key: jax.Array | None) -> Lora:
    """A fresh adapter drawn from `key`, or the PEFT adapter of `lora_cfg.init_from` when set
    (key unused; its rank, targets and scale must be the config's, which the checkpoints and
    exports record, else ConfigError naming the keys to set), with `lora_cfg.dropout`."""
    if not lora_cfg.init_from:
        return init_lora(spec, key, rank=lora_cfg.rank, alpha=lora_cfg.alpha,
                         targets=lora_cfg.targets, dropout=lora_cfg.dropout)
    try:
        lora = load_peft_adapter(lora_cfg.init_from, spec)
    except (AdapterError, OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"config key 'lora.init_from': {error}") from None
    scale = lora_cfg.alpha / lora_cfg.rank
    if (lora.rank, set(lora.targets)) != (lora_cfg.rank, set(lora_cfg.targets)) or not np.isclose(
            lora.scale, scale, rtol=1e-6):
        raise ConfigError(
            f"config key 'lora.init_from' = {lora_cfg.init_from!r} has rank {lora.rank}, targets "
            f"{','.join(lora.targets)} and scale {lora.scale:g}; set lora.rank={lora.rank} "
            f"lora.targets={','.join(lora.targets)} lora.alpha={lora.scale * lora.rank:g} "
            f"(the config gives rank {lora_cfg.rank}, targets {','.join(lora_cfg.targets)}, "
            f"scale {scale:g})")
    return dataclasses.replace(lora, dropout=lora_cfg.dropout)

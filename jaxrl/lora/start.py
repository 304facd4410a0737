"""The adapter a run starts from: a fresh one, or the PEFT adapter of `lora.init_from`."""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from jaxrl.config import Config, ConfigError
from jaxrl.lora.lora import Lora, init_lora
from jaxrl.lora.peft_io import AdapterError, load_peft_adapter
from jaxrl.model.families import ModelSpec


def start_lora(cfg: Config, spec: ModelSpec, key: jax.Array) -> Lora:
    """A fresh adapter, or the PEFT adapter of `lora.init_from` when set (its rank, targets
    and scale must be the config's, which the checkpoints and exports record)."""
    lora_cfg = cfg.lora
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

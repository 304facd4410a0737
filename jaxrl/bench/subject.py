"""The model under test: a checkpoint loaded as `jaxrl train` loads it, or a preset
architecture with random weights in the layout a run holds (NF4 codes and scales where the run
keeps kernels packed, dense kernels where it dequantizes them once; `jaxrl.hf.loader`), so that
no download is needed to measure a model's speed."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.backends.numerics import Numerics, numerics_of
from jaxrl.config import Config, to_dict
from jaxrl.hf.loader import load_model
from jaxrl.hf.peft_io import start_lora
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.sharding import MeshRules


@dataclasses.dataclass
class Subject:
    """What `jaxrl bench` runs: the config, the model's spec, params and adapter as the run
    holds them, the mesh rules its programs take (None: one device) and their numerics."""

    cfg: Config
    spec: ModelSpec
    params: Any
    lora: Lora
    rules: MeshRules | None
    numerics: Numerics
    weights: str  # "checkpoint DIR" or "random weights (architecture of PATH)"


def config_hash(cfg: Config) -> str:
    """The first 12 hex digits of the SHA-256 of the resolved config (secrets removed)."""
    text = json.dumps(to_dict(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def is_checkpoint(path: str) -> bool:
    """Whether model.path holds weights to load: `default`, or a directory with a config.json
    and safetensors files (a directory with only a config.json is an architecture)."""
    folder = Path(path)
    return path == "default" or ((folder / "config.json").is_file()
                                 and any(folder.glob("*.safetensors")))


def load_subject(cfg: Config, log=lambda message: None) -> Subject:
    """The model of cfg.model.path on the run's mesh, through the loader `jaxrl train` uses
    (`jaxrl.hf.loader.load_model`): a local checkpoint's (or `default`'s) weights, else random
    ones of the architecture the path names (a directory's config.json, or the preset its last
    part names), so a hub id such as Qwen/Qwen3-4B is measured without a download."""
    rules = distributed.session_rules(cfg.mesh)
    key = jax.random.PRNGKey(cfg.run.seed)
    checkpoint = is_checkpoint(cfg.model.path)
    numerics = numerics_of(rules)
    model = load_model(cfg.model.path, dtype=cfg.model.dtype, quant=cfg.quant,
                       numerics=numerics, rules=rules,
                       weights="checkpoint" if checkpoint else "random", key=key, log=log)
    weights = (f"checkpoint {model.path}" if checkpoint
               else f"random weights (architecture of {cfg.model.path})")
    lora = start_lora(cfg.lora, model.spec, jax.random.fold_in(key, 1 << 20))
    return Subject(cfg, model.spec, model.params, lora, rules, numerics, weights)


def random_prompts(spec: ModelSpec, lengths, seed: int = 0) -> list[list[int]]:
    """One prompt of random token ids per length (ids below the vocabulary size)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, spec.vocab_size, int(n)).tolist() for n in lengths]

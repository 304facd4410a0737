"""The model under test: a checkpoint loaded as `jaxrl train` loads it, or a preset
architecture with random weights in the layout a run holds (NF4 codes and scales where the run
keeps kernels packed, dense kernels where it dequantizes them once), so that no download is
needed to measure a model's speed."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import Config, MeshConfig, to_dict
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.sharding import MeshRules


@dataclasses.dataclass
class Subject:
    """What `jaxrl bench` runs: the config, the model's spec, params and adapter as the run
    holds them, and the mesh rules its programs take (None: one device)."""

    cfg: Config
    spec: ModelSpec
    params: Any
    lora: Lora
    rules: MeshRules | None
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
    """The model of cfg.model.path on the run's mesh: a local checkpoint's (or `default`'s)
    weights, else random ones of the architecture `jaxrl plan` finds for the path (a directory's
    config.json, or the preset its last part names), so a hub id such as Qwen/Qwen3-4B is
    measured without a download."""
    from jaxrl import distributed
    from jaxrl.commands.plan import architecture
    from jaxrl.lora.start import start_lora
    from jaxrl.rl.session import load_model

    rules = distributed.session_rules(cfg.mesh)
    key = jax.random.PRNGKey(cfg.run.seed)
    if is_checkpoint(cfg.model.path):
        model_dir, spec, _, params = load_model(cfg, rules, log)
        weights = f"checkpoint {model_dir}"
    else:
        spec = architecture(cfg.model.path)
        params = random_params(cfg, spec, rules, key)  # held as `layer_bits` holds them
        weights = f"random weights (architecture of {cfg.model.path})"
    lora = start_lora(cfg, spec, jax.random.fold_in(key, 1 << 20))
    return Subject(cfg, spec, params, lora, rules, weights)


def random_params(cfg: Config, spec: ModelSpec, rules: MeshRules | None, key: jax.Array):
    """Random params with the shapes, dtypes and shardings of `jaxrl plan`'s abstract run (on
    the CPU, bfloat16 layer weights as their bits):
    NF4 codes uniformly random with block scales near 0.05 (the absmax of 64 normal(0.02)
    weights), other matrices normal(0.02), norms 1, biases 0."""
    from jaxrl.commands.plan import abstract_run
    from jaxrl.sharding import make_mesh

    layout = rules or MeshRules(make_mesh(MeshConfig(data=1), jax.devices()[:1]))
    abstract = abstract_run(cfg, spec, layout).params
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shardings = [leaf.sharding for _, leaf in leaves]

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return treedef.unflatten([_random_leaf(path, leaf, k)
                                  for (path, leaf), k in zip(leaves, keys)])

    # on one device, plain arrays as the checkpoint loader gives them (a program compiled for
    # them is not compiled again for the step's outputs)
    placed = {} if rules is None else {"out_shardings": treedef.unflatten(shardings)}
    return jax.jit(make, **placed)(key)


def _random_leaf(path, leaf, key: jax.Array) -> jax.Array:
    name = getattr(path[-1], "name", None) or getattr(path[-1], "key", None)
    shape, dtype = leaf.shape, leaf.dtype
    if dtype == jnp.uint16:  # a bfloat16 weight held as its bits on the CPU (`layer_bits`)
        value = _random_leaf(path, jax.ShapeDtypeStruct(shape, jnp.bfloat16), key)
        return jax.lax.bitcast_convert_type(value, jnp.uint16)
    if dtype == jnp.uint8:  # packed codes, or the 8-bit codes of double-quantized scales
        return jax.random.bits(key, shape, jnp.uint8)
    if name == "scales":
        return jax.random.uniform(key, shape, jnp.float32, 0.04, 0.06).astype(dtype)
    if name == "scale_scales":  # 8-bit steps: scales within offset +- 0.01
        return jnp.full(shape, 0.01 / 127, dtype)
    if name == "scale_offset":
        return jnp.full(shape, 0.05, dtype)
    if name == "scale":  # a norm
        return jnp.ones(shape, dtype)
    if name == "bias":
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_prompts(spec: ModelSpec, lengths, seed: int = 0) -> list[list[int]]:
    """One prompt of random token ids per length (ids below the vocabulary size)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, spec.vocab_size, int(n)).tolist() for n in lengths]

"""The one model loader: every verb that trains, runs, plans or measures a model gets its spec,
params and tokenizer from `load_model`, with the params in the layout a run holds them.

Layout. Linear kernels are quantized while loading when `quant.mode` is nf4 or int4 (those not
in `quant.skip`). The numerics' `dequantize_strategy` of `quant` then says whether they stay
packed, dequantized one layer at a time inside the layer loop, or are dequantized once here.
Under auto the CPU dequantizes once (XLA's per-step dequantization costs more than the memory
it saves); a GPU or TPU dequantizes once when the run fits the device's memory with dense
kernels (`dense_fit`: the planner's memory plan, `jaxrl.planner.dense_fit`), keeps NF4
otherwise and where that is not asked, and the choice is logged in one line with its figures.
The params come back held as `numerics.hold` holds them (on the CPU the stacked
bfloat16 layer weights as their bits) and, given mesh rules, laid out by
`jaxrl.sharding.param_shardings`, each process reading every tensor but transferring only the
slices its devices hold (`jaxrl.distributed.load_params`).

Weights. "checkpoint" reads them from a local Hugging Face directory, a hub id or `default`
(the embedded model, prepared on first use). "abstract" reads none: ShapeDtypeStructs carrying
their shardings on a mesh, to compile and plan without weights (`jaxrl plan`). "random" draws
them (`jaxrl bench` measures an architecture without a download). These two take an
architecture: a ModelSpec, or a path that names one (`architecture`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl import distributed
from jaxrl.backends.numerics import Numerics
from jaxrl.config import QuantConfig, UsageError
from jaxrl.hf.default_model import resolve_model_path
from jaxrl.hf.tokenizer import load_tokenizer
from jaxrl.model.families import ModelSpec, load_spec, spec_from_hf_config
from jaxrl.model.presets import PRESETS, preset_config
from jaxrl.quant.qparams import abstract_quantized_params
from jaxrl.sharding import MeshRules, abstract, param_shardings

WEIGHTS = ("checkpoint", "abstract", "random")


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as a run holds it (`load_model`)."""

    spec: ModelSpec
    params: dict[str, Any]  # held (`Numerics.hold`); ShapeDtypeStructs for abstract weights
    path: Path | None = None  # the checkpoint directory read; None without a checkpoint
    tokenizer: Any = None  # the checkpoint's; None without one


def architecture(path: str) -> ModelSpec:
    """The ModelSpec `path` names: its config.json when it is a local directory holding one
    (`default`: the embedded model's), else the embedded preset (jaxrl/model/presets) its last
    path part names; UsageError naming model.path when it is neither."""
    if path == "default":  # the embedded model, prepared on first use
        path = str(resolve_model_path(path))
    if path and (Path(path) / "config.json").is_file():
        return load_spec(path)
    config = preset_config(path) if path else None
    if config is None:
        raise UsageError(f"config key 'model.path' = {path!r} is neither a directory with a "
                         f"config.json nor a known architecture; presets: {', '.join(PRESETS)}")
    return spec_from_hf_config(config)


def load_model(source: str | Path | ModelSpec, *, dtype, quant: QuantConfig | None,
               numerics: Numerics, rules: MeshRules | None = None,
               weights: str = "checkpoint", key: jax.Array | None = None,
               log: Callable[[str], None] = lambda message: None,
               dense_fit: Callable[[ModelSpec], Any] | None = None) -> Model:
    """The model of `source` in `dtype` (a name or a dtype), its linear kernels quantized per
    `quant` (None: dense) and packed or dequantized once per `numerics.dequantize_strategy`,
    held for `numerics` and laid out on `rules`' mesh (None: plain arrays on the default
    device), as the module docstring says. weights: one of WEIGHTS; "checkpoint" takes a model
    path and loads its tokenizer too (`log` says what is loaded), "abstract" and "random" take
    a ModelSpec or a path naming an architecture, "random" draws from `key`. dense_fit(spec):
    for quant.dequantize auto, whether the run fits the device's memory with dense kernels (a
    `jaxrl.planner.DenseFit`), asked only where the choice turns on memory; None: not asked."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}; got {weights!r}")
    dtype = jnp.dtype(dtype)
    quantized = quant is not None and quant.mode != "none"
    if weights == "checkpoint":
        model_dir = resolve_model_path(str(source))
        spec = load_spec(model_dir)
        once = quantized and _dequantize(spec, quant, numerics, dense_fit, log) == "once"
        log(f"loading {model_dir} ({spec.family}, {spec.num_layers} layers) as "
            f"{quant.mode if quantized else 'none'}")
        params = distributed.load_params(model_dir, spec, dtype, quant, rules)
        if once:
            params = distributed.dequantized(params, dtype, spec, rules)
        return Model(spec, numerics.hold(params), model_dir, load_tokenizer(model_dir))
    spec = source if isinstance(source, ModelSpec) else architecture(str(source))
    once = quantized and _dequantize(spec, quant, numerics, dense_fit, log) == "once"
    params = abstract_quantized_params(spec, None if once else quant, dtype)
    if rules is not None:
        params = abstract(params, param_shardings(rules, params, spec))
    if weights == "random":
        params = _random_params(params, key, placed=rules is not None)
    return Model(spec, numerics.hold(params))


def _dequantize(spec: ModelSpec, quant: QuantConfig, numerics: Numerics,
                dense_fit: Callable[[ModelSpec], Any] | None,
                log: Callable[[str], None]) -> str:
    """numerics.dequantize_strategy of quant, asking dense_fit(spec) where it needs to, and
    logging that choice in one line with its figures."""
    asked = []

    def fits() -> bool | None:
        asked.append(dense_fit(spec))
        return asked[-1].fits

    strategy = numerics.dequantize_strategy(quant, None if dense_fit is None else fits)
    if asked:
        log(f"quant.dequantize auto: {strategy} ({asked[-1].describe()})")
    return strategy


def _random_params(params, key: jax.Array, placed: bool):
    """Random values for abstract params (placed: with the shardings they carry; else plain
    arrays, as the checkpoint loader gives them on one device, so a program compiled for them
    is not compiled again for the step's outputs): NF4 codes uniformly random with block
    scales near 0.05 (the absmax of 64 normal(0.02) weights), other matrices normal(0.02),
    norms 1, biases 0."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return treedef.unflatten([_random_leaf(path, leaf, k)
                                  for (path, leaf), k in zip(leaves, keys)])

    if not placed:
        return jax.jit(make)(key)
    shardings = treedef.unflatten([leaf.sharding for _, leaf in leaves])
    return jax.jit(make, out_shardings=shardings)(key)


def _random_leaf(path, leaf, key: jax.Array) -> jax.Array:
    name = getattr(path[-1], "name", None) or getattr(path[-1], "key", None)
    shape, dtype = leaf.shape, leaf.dtype
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

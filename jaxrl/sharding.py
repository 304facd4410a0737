"""The device mesh, the logical-axis rules, and every sharding derived from them.

This is the only module that writes PartitionSpecs. Model code names logical axes (declared once
per param in jaxrl/model/params.py); `MeshRules` maps each to mesh axes:

  batch -> (data, fsdp)   rows of prompts, completions, caches and train batches
  embed -> fsdp           the hidden dim of every weight: FSDP shards the frozen base
  heads, kv_heads, mlp, vocab -> tensor   Megatron-style splits inside a layer
  layers, seq, head_dim, lora_rank -> replicated

One array may not use a mesh axis twice; such a rule set raises, naming the array's axes. A dim
that its mesh axes do not divide (a KV head count below the tensor size, a batch of 6 rows on 8
devices) stays replicated: the program is the same, only less of it is split.

NF4 kernels (QTensor) shard like their dense kernel: packed codes [L, I/2, O] and block scales
[L, I/Bk, O] keep the kernel's (layers, in, out) axes; the double-quantization groups and
offsets, a few floats per layer, are replicated. LoRA A [L, in, r] and B [L, r, out] take the
axes of the kernel they adapt; the optimizer's moments take those of the LoRA leaf they track.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config import ConfigError, MeshConfig
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.kv_cache import KVCache
from jaxrl.model.params import declare, flatten, unflatten
from jaxrl.quant.nf4 import QTensor

MESH_AXES = ("data", "fsdp", "tensor")
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp",)),
    ("vocab", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("layers", ()),
    ("seq", ()),
    ("head_dim", ()),
    ("lora_rank", ()),
)


def mesh_shape(cfg: MeshConfig, device_count: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes; data -1 takes the devices fsdp * tensor leave over."""
    inner = cfg.fsdp * cfg.tensor
    data = device_count // inner if cfg.data == -1 else cfg.data
    if data < 1 or data * inner != device_count:
        raise ConfigError(
            f"config keys mesh.data={cfg.data}, mesh.fsdp={cfg.fsdp}, mesh.tensor={cfg.tensor} "
            f"do not multiply to the {device_count} devices; their product must equal the device "
            "count (mesh.data=-1 fills in whatever fsdp * tensor leave over)")
    return data, cfg.fsdp, cfg.tensor


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """The (data, fsdp, tensor) mesh over `devices` (default: every device of every process),
    laid out along the physical interconnect where the platform reports one (TPU)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    try:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (NotImplementedError, ValueError):  # a shape the torus layout cannot embed
        grid = np.array(devices).reshape(shape)
    return Mesh(grid, MESH_AXES)


def _check_rules(rules) -> None:
    names = [name for name, _ in rules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"logical axes {twice} have more than one rule; give each one rule")
    for name, axes in rules:
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise ValueError(f"rule for logical axis {name!r} names mesh axes {unknown}; "
                             f"mesh axes are {MESH_AXES}")


@dataclasses.dataclass(frozen=True)
class MeshRules:
    """A mesh plus the logical-axis rules; hashable, so jitted functions take it as static."""

    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_RULES

    def __post_init__(self):
        _check_rules(self.rules)

    def mesh_axes(self, name: str | None) -> tuple[str, ...]:
        if name is None:
            return ()
        for logical, axes in self.rules:
            if logical == name:
                return axes
        raise ValueError(f"logical axis {name!r} has no rule; rules cover "
                         f"{[n for n, _ in self.rules]}")

    def spec(self, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> PartitionSpec:
        """The PartitionSpec of an array with these logical axes and shape (module docstring:
        a dim its mesh axes do not divide stays replicated)."""
        used: dict[str, str] = {}
        parts = []
        for name, size in zip(axes, shape):
            mapped = self.mesh_axes(name)
            for axis in mapped:
                if axis in used:
                    raise ValueError(
                        f"logical axes {used[axis]!r} and {name!r} of an array with axes {axes} "
                        f"both map to mesh axis {axis!r}; map one of them elsewhere or to ()")
                used[axis] = name
            split = tuple(a for a in mapped if self.mesh.shape[a] > 1)
            ways = math.prod(self.mesh.shape[a] for a in split)
            parts.append(split if split and size % ways == 0 else None)
        return PartitionSpec(*parts)

    def named(self, axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(tuple(axes), tuple(shape)))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def batch_ways(self) -> int:
        """How many ways the batch axis splits when the row count allows it."""
        return math.prod(self.mesh.shape[a] for a in self.mesh_axes("batch"))

    def rows(self, shape) -> NamedSharding:
        """Rows (dim 0) split over the batch axes, every other dim replicated."""
        return self.named(("batch",) + (None,) * (len(shape) - 1), shape)


def _qtensor(rules: MeshRules, q: QTensor, axes: tuple[str, ...]) -> QTensor:
    lead = axes[:-2]  # the layer stack, when there is one

    def lead_only(a):  # double-quantization groups and offsets: split like the layers only
        return None if a is None else rules.named(lead + (None,) * (a.ndim - len(lead)), a.shape)

    return q.replace(codes=rules.named(axes, q.codes.shape),
                     scales=rules.named(axes, q.scales.shape),
                     scale_scales=lead_only(q.scale_scales), scale_offset=lead_only(q.scale_offset))


def param_shardings(rules: MeshRules, params, spec: ModelSpec):
    """Shardings for a params pytree (arrays, ShapeDtypeStructs or QTensors of either)."""
    decls = declare(spec)
    out = {}
    for path, leaf in flatten(params).items():
        axes = decls[path].axes
        out[path] = (_qtensor(rules, leaf, axes) if isinstance(leaf, QTensor)
                     else rules.named(axes, leaf.shape))
    return unflatten(out)


def lora_shardings(rules: MeshRules, lora: Lora, spec: ModelSpec) -> Lora:
    """Shardings for LoRA weights: A and B take the axes of the kernel they adapt."""
    decls = declare(spec)
    layers = {}
    for name, ab in lora.weights["layers"].items():
        lead, fan_in, fan_out = decls[f"layers/{name}/kernel"].axes
        layers[name] = {"a": rules.named((lead, fan_in, "lora_rank"), ab["a"].shape),
                        "b": rules.named((lead, "lora_rank", fan_out), ab["b"].shape)}
    return lora.replace(weights={"layers": layers})


def state_shardings(rules: MeshRules, state, optimizer: optax.GradientTransformation,
                    spec: ModelSpec):
    """Shardings for a TrainState: LoRA and the optimizer's copies of it as the LoRA leaves,
    counters and every other optimizer field replicated."""
    lora = lora_shardings(rules, state.lora, spec)
    opt = optax.tree_map_params(optimizer, lambda _, s: s, state.opt_state, lora,
                                transform_non_params=lambda _: rules.replicated)
    return state.replace(lora=lora, opt_state=opt, step=rules.replicated,
                         skipped=rules.replicated)


def cache_shardings(rules: MeshRules, cache: KVCache) -> KVCache:
    """Shardings for a stacked KVCache [L, B, K, S, D]."""
    axes = ("layers", "batch", "kv_heads", "seq", "head_dim")
    return cache.replace(k=rules.named(axes, cache.k.shape), v=rules.named(axes, cache.v.shape),
                         index=rules.rows(cache.index.shape))


def row_shardings(rules: MeshRules, tree):
    """Every leaf split by rows (dim 0); scalars replicated."""
    return jax.tree_util.tree_map(
        lambda a: rules.rows(a.shape) if a.ndim else rules.replicated, tree)


def constrain(tree, shardings):
    """`with_sharding_constraint` over matching trees (QTensors included)."""
    return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, tree, shardings)


def place(tree, shardings):
    """Host values (the same on every process) onto their shardings; each process transfers
    only the slices its own devices hold."""
    def put(value, sharding):
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree_util.tree_map(put, tree, shardings)


def abstract(tree, shardings):
    """ShapeDtypeStructs of `tree` carrying `shardings` (for compiling without data)."""
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def step_shardings(rules: MeshRules, state, params, spec: ModelSpec,
                   optimizer: optax.GradientTransformation, rows: int):
    """(in, out) shardings of the train step (jaxrl/rl/train_step.py) for a batch of `rows`:
    state and params as above, every batch field split by rows, metrics replicated."""
    st = state_shardings(rules, state, optimizer, spec)
    batch = rules.rows((rows,))  # a prefix: dim 0 of every Batch field
    return (st, param_shardings(rules, params, spec), batch), (st, rules.replicated)


def reference_shardings(rules: MeshRules, params, spec: ModelSpec, rows: int):
    """(in, out) shardings of the reference pass (jaxrl/rl/train_step.py) for `rows` rows:
    params as above, tokens, positions, mask and the log-probs split by rows."""
    batch = rules.rows((rows,))
    return (param_shardings(rules, params, spec), batch, batch, batch), batch

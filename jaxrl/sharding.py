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
The embedding table and the LM head split by the vocab alone, over fsdp and tensor together
(`head_rules`), and so do the logits.

Inside the programs (what the model asks for, given the rules): a call with many tokens per row
(prefill, training) gathers each layer's weights over fsdp just before the layer runs
(`layer_weights`: NF4 codes and scales as stored) and keeps the hidden states split by rows
(`split_rows`), so no partial sums of activations cross devices; a decode step (one token per
row) leaves the weights split and reduces its few rows' partial sums instead, which moves far
fewer bytes than the weights. Logits keep the head's vocab split (`head_logits`), and the
sampler's top-k runs per vocab part (`vocab_top_k`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.backends.cpu import Bits
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

    # the model's `Layout` (jaxrl/model/transformer.py): what the forward asks of a mesh
    def constrain_rows(self, x: jax.Array) -> jax.Array:
        return split_rows(self, x)

    def constrain_layer(self, lp, ll, spec: ModelSpec):
        return layer_weights(self, lp, ll, spec)


def _qtensor(rules: MeshRules, q: QTensor, axes: tuple[str, ...]) -> QTensor:
    lead = axes[:-2]  # the layer stack, when there is one

    def lead_only(a):  # double-quantization groups and offsets: split like the layers only
        return None if a is None else rules.named(lead + (None,) * (a.ndim - len(lead)), a.shape)

    return q.replace(codes=rules.named(axes, q.codes.shape),
                     scales=rules.named(axes, q.scales.shape),
                     scale_scales=lead_only(q.scale_scales), scale_offset=lead_only(q.scale_offset))


def _leaf(rules: MeshRules, leaf, axes: tuple[str, ...]):
    """The sharding of one params leaf: an array's, or a held leaf's (a QTensor, `Bits`) of the
    same structure."""
    if isinstance(leaf, QTensor):
        return _qtensor(rules, leaf, axes)
    if isinstance(leaf, Bits):
        return leaf.replace(bits=rules.named(axes, leaf.shape))
    return rules.named(axes, leaf.shape)


HEAD_PATHS = ("embed_tokens/embedding", "lm_head/kernel")  # laid out by `head_rules`


def param_shardings(rules: MeshRules, params, spec: ModelSpec):
    """Shardings for a params pytree (arrays, ShapeDtypeStructs, or held leaves of either:
    QTensors, `jaxrl.backends.cpu.Bits`): each
    weight by its logical axes, the embedding table and LM head by `head_rules`."""
    decls = declare(spec)
    out = {}
    for path, leaf in flatten(params).items():
        axes, use = decls[path].axes, head_rules(rules) if path in HEAD_PATHS else rules
        out[path] = _leaf(use, leaf, axes)
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


def _remapped(rules: MeshRules, moves: dict[str, tuple[str, ...]]) -> MeshRules:
    """`rules` with the logical axes named in `moves` mapped to other mesh axes."""
    return MeshRules(rules.mesh, tuple((n, moves.get(n, axes)) for n, axes in rules.rules))


def compute_rules(rules: MeshRules) -> MeshRules:
    """The layout weights are used in by a call with many tokens per row (prefill, training):
    the hidden dim gathered (FSDP gathers a layer's weights, NF4 codes and scales as stored,
    just before the layer runs), the tensor splits kept."""
    return _remapped(rules, {"embed": ()})


def head_rules(rules: MeshRules) -> MeshRules:
    """The layout of the embedding table, the LM head and the logits [rows, ..., V]: the vocab
    split over every mesh axis that the rules split the hidden dim (FSDP) or the vocab
    (tensor) over, the rows over the batch axes left over, the hidden dim whole. A head that
    contracted over an FSDP-split hidden dim would leave partial float32 logits of every row
    to all-reduce whole; split by the vocab, each device computes its part of the logits from
    its part of the table, and the log-softmax and the sampler reduce only [rows] maxima and
    sums and exchange [rows, k] candidates across the split. Each device holds as many bytes
    of the table as under a hidden-dim split; looking tokens up in it sums [rows, T, E]
    (the looked-up rows, zero where another part holds them) across the split."""
    embed = rules.mesh_axes("embed")
    vocab = embed + tuple(a for a in rules.mesh_axes("vocab") if a not in embed)
    batch = tuple(a for a in rules.mesh_axes("batch") if a not in vocab)
    return _remapped(rules, {"batch": batch, "vocab": vocab, "embed": ()})


def layer_weights(rules: MeshRules | None, lp, ll, spec: ModelSpec):
    """One layer's weights `lp` and adapter `ll` (slices of the stacked layers, QTensors
    included) constrained to `compute_rules`: gathered over the FSDP axes inside the layer
    loop, so each layer's NF4 codes cross the mesh rather than its activations' partial sums.
    Unchanged without a mesh."""
    if rules is None:
        return lp, ll
    use, decls = compute_rules(rules), declare(spec)
    placed = {}
    for path, leaf in flatten(lp).items():
        placed[path] = _leaf(use, leaf, decls[f"layers/{path}"].axes[1:])
    lp = constrain(lp, unflatten(placed))
    if ll is None:
        return lp, None
    adapters = {}
    for name, ab in ll.items():
        fan_in, fan_out = decls[f"layers/{name}/kernel"].axes[1:]
        adapters[name] = {"a": use.named((fan_in, "lora_rank"), ab["a"].shape),
                          "b": use.named(("lora_rank", fan_out), ab["b"].shape)}
    return lp, constrain(ll, adapters)


def split_rows(rules: MeshRules | None, x: jax.Array) -> jax.Array:
    """x [B, ...] constrained to rows split over the batch axes, every other dim whole (the
    hidden states between layers); unchanged without a mesh."""
    return x if rules is None else jax.lax.with_sharding_constraint(x, rules.rows(x.shape))


def head_logits(rules: MeshRules | None, logits: jax.Array) -> jax.Array:
    """Logits [rows, ..., V] constrained to `head_rules` (unchanged without a mesh)."""
    if rules is None:
        return logits
    axes = ("batch",) + (None,) * (logits.ndim - 2) + ("vocab",)
    return jax.lax.with_sharding_constraint(logits, head_rules(rules).named(axes, logits.shape))


def vocab_top_k(rules: MeshRules | None, rows: int, vocab: int):
    """`lax.top_k` for logits [rows, V] laid out by `head_logits`. Where the mesh splits V,
    each device takes the top k of its part (`shard_map`: XLA's partitioner would gather the
    logits whole for a top_k), then the top k of those [rows, parts * k] candidates follows:
    the same values and indices as one top_k over V (ties go to the lower index), with only
    the candidates crossing between devices."""
    spec = None if rules is None else head_rules(rules).spec(("batch", "vocab"), (rows, vocab))
    split = () if spec is None or spec[1] is None else spec[1]
    split = (split,) if isinstance(split, str) else tuple(split)
    if not split:
        return jax.lax.top_k
    width = vocab // math.prod(rules.mesh.shape[a] for a in split)

    def part_top_k(x, k):
        values, ids = jax.lax.top_k(x, min(k, width))
        return values, ids + jax.lax.axis_index(split) * width

    def top_k(x, k):
        values, ids = jax.shard_map(functools.partial(part_top_k, k=k), mesh=rules.mesh,
                                    in_specs=spec, out_specs=(spec, spec))(x)
        values, best = jax.lax.top_k(values, k)
        return values, jnp.take_along_axis(ids, best, axis=-1)
    return top_k


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

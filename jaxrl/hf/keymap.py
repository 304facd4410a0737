"""The one table between Hugging Face checkpoint keys and jaxrl param paths.

Loading reads it forwards and export reads it backwards, so the two can never disagree. HF stores
linear weights [out, in]; jaxrl stores kernels [in, out], hence `transpose`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxrl.model.families import ModelSpec
from jaxrl.model.params import LINEAR_NAMES, declare


class KeyMapError(ValueError):
    """Checkpoint keys do not match the model's declared params."""


@dataclasses.dataclass(frozen=True)
class KeyRule:
    hf: str  # HF key; `{i}` is the layer index
    path: str  # jaxrl param path
    transpose: bool

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def _module(name: str) -> str:
    return "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


RULES: tuple[KeyRule, ...] = (
    KeyRule("model.embed_tokens.weight", "embed_tokens/embedding", False),
    KeyRule("model.norm.weight", "norm/scale", False),
    KeyRule("lm_head.weight", "lm_head/kernel", True),
    KeyRule("model.layers.{i}.input_layernorm.weight", "layers/input_layernorm/scale", False),
    KeyRule("model.layers.{i}.post_attention_layernorm.weight",
            "layers/post_attention_layernorm/scale", False),
    KeyRule("model.layers.{i}.self_attn.q_norm.weight", "layers/q_norm/scale", False),
    KeyRule("model.layers.{i}.self_attn.k_norm.weight", "layers/k_norm/scale", False),
    *(KeyRule(f"model.layers.{{i}}.{_module(n)}.{n}.weight", f"layers/{n}/kernel", True)
      for n in LINEAR_NAMES),
    *(KeyRule(f"model.layers.{{i}}.self_attn.{n}.bias", f"layers/{n}/bias", False)
      for n in ("q_proj", "k_proj", "v_proj")),
)
_BY_PATH = {r.path: r for r in RULES}


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one HF tensor goes: a param path, a layer index (None if not stacked), transpose."""

    path: str
    layer: int | None
    transpose: bool


def key_table(spec: ModelSpec) -> dict[str, Slot]:
    """{hf_key: Slot} for every tensor the model declares."""
    table = {}
    for path in declare(spec):
        rule = _BY_PATH.get(path)
        if rule is None:
            raise KeyMapError(f"param {path!r} has no Hugging Face key rule")
        layers = range(spec.num_layers) if rule.per_layer else [None]
        for i in layers:
            table[rule.hf.format(i=i)] = Slot(path, i, rule.transpose)
    return table


def check_keys(spec: ModelSpec, keys: Iterable[str]) -> dict[str, Slot]:
    """The key table of `spec`, once a checkpoint's `keys` (every shard's tensor names) match it
    one to one; KeyMapError names a key that appears twice, maps to no param or is missing.
    A tied model may still store lm_head.weight (the loader checks it equals the embedding)."""
    table = key_table(spec)
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise KeyMapError(f"checkpoint key {key!r} appears twice")
        seen.add(key)
        if key not in table and not (key == "lm_head.weight" and spec.tie_word_embeddings):
            raise KeyMapError(f"checkpoint key {key!r} maps to no jaxrl param "
                              f"(family {spec.family})")
    missing = sorted(set(table) - seen)
    if missing:
        raise KeyMapError(f"checkpoint misses {len(missing)} keys, e.g. {missing[:5]}")
    return table


def hf_key(path: str, layer: int | None = None) -> str:
    """The HF key of param `path` (layer `layer` of a stacked param)."""
    rule = _BY_PATH.get(path)
    if rule is None:
        raise KeyMapError(f"param {path!r} has no Hugging Face key rule")
    if rule.per_layer != (layer is not None):
        raise KeyMapError(f"param {path!r} {'needs' if rule.per_layer else 'takes no'} layer index")
    return rule.hf.format(i=layer)

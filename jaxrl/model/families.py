"""Model families and the architecture spec read from a Hugging Face config.json.

The spec holds every number the forward needs. Config fields are sorted into three sets: fields
the math reads (mapped into the spec), fields that are harmless bookkeeping, and fields that
change the math only at certain values (checked). Anything else is an error: an unknown field
might change the model, and a silently wrong model is worse than a refusal.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

FAMILIES = ("llama", "qwen2", "qwen3")
# The linears of a decoder layer, named as every family here names them in Hugging Face: LoRA
# targets, quantization skips and the HF key table speak these names. Defined here, free of
# jax, so that the run config can offer them as lora.targets.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# The three sets of config.json fields the module docstring names; any other field is refused.
# Read into the spec (spec_from_hf_config):
_SPEC_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "max_position_embeddings",
    "bos_token_id", "eos_token_id",
})
# Change the math at some values, which _check_math_fields refuses (sliding_window and
# max_window_layers act only with use_sliding_window):
_CHECKED_FIELDS = frozenset({
    "hidden_act", "attention_bias", "mlp_bias", "use_sliding_window", "sliding_window",
    "max_window_layers", "use_mrope", "quantization_config", "layer_types",
})
# Bookkeeping, with no effect on the forward pass:
_BOOKKEEPING_FIELDS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "initializer_range",
    "use_cache", "pad_token_id", "output_hidden_states", "output_attentions", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "_name_or_path", "attention_dropout", "pretraining_tp", "tokenizer_class", "name_or_path",
    "_attn_implementation_autoset", "_attn_implementation", "unsloth_version", "torchscript",
    "tf_legacy_loss", "pruned_heads", "tie_encoder_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "task_specific_params", "finetuning_task", "prefix",
    "sep_token_id", "decoder_start_token_id", "is_decoder",
})


class ModelConfigError(ValueError):
    """A checkpoint's config.json asks for an architecture jaxrl does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 `llama3` frequency scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only model; everything the forward pass reads."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _family(cfg: Mapping[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ModelConfigError(
            f"config.json model_type {model_type!r} is not supported; supported: "
            f"{', '.join(FAMILIES)}")
    return model_type


def _require_false(cfg: Mapping[str, Any], key: str, why: str) -> None:
    if cfg.get(key):
        raise ModelConfigError(f"config.json field {key!r} = {cfg[key]!r} is not supported: {why}")


def _check_math_fields(cfg: Mapping[str, Any], family: str) -> None:
    known = _SPEC_FIELDS | _CHECKED_FIELDS | _BOOKKEEPING_FIELDS
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
        raise ModelConfigError(
            f"config.json fields {unknown} are unknown to jaxrl and may change the model's math; "
            "refusing to load rather than ignore them")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(
            f"config.json hidden_act {cfg['hidden_act']!r} is not supported; only 'silu'")
    if family != "qwen2":
        _require_false(cfg, "attention_bias", "bias on attention projections (llama/qwen3)")
    _require_false(cfg, "mlp_bias", "bias on MLP projections")
    _require_false(cfg, "use_sliding_window", "sliding-window attention")
    _require_false(cfg, "use_mrope", "multimodal rope")
    _require_false(cfg, "quantization_config", "pre-quantized checkpoints; load full precision "
                   "weights and set quant.mode instead")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ModelConfigError(
            f"config.json layer_types {sorted(set(layer_types))} is not supported; only "
            "'full_attention'")


def _rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """Reads rope settings in both the transformers 4 (`rope_theta` + `rope_scaling`) and the
    transformers 5 (`rope_parameters`) layouts."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        if params:
            raise ModelConfigError(f"config.json rope fields {sorted(params)} are not supported "
                                   "with rope_type 'default'")
        return theta, None
    if kind != "llama3":
        raise ModelConfigError(
            f"config.json rope_type {kind!r} is not supported; supported: default, llama3")
    params.pop("attention_factor", None)
    try:
        scaling = RopeScaling(
            factor=float(params.pop("factor")),
            low_freq_factor=float(params.pop("low_freq_factor")),
            high_freq_factor=float(params.pop("high_freq_factor")),
            original_max_position_embeddings=int(params.pop("original_max_position_embeddings")))
    except KeyError as e:
        raise ModelConfigError(f"config.json llama3 rope scaling misses field {e.args[0]!r}") from e
    if params:
        raise ModelConfigError(f"config.json llama3 rope fields {sorted(params)} are not supported")
    return theta, scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def spec_from_hf_config(cfg: Mapping[str, Any]) -> ModelSpec:
    """Builds the spec from a parsed config.json, rejecting what jaxrl cannot run exactly."""
    family = _family(cfg)
    _check_math_fields(cfg, family)
    theta, scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    try:
        return ModelSpec(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise ModelConfigError(f"config.json misses required field {e.args[0]!r}") from e


def load_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"no config.json in {model_dir}; expected a Hugging Face model dir")
    return spec_from_hf_config(json.loads(path.read_text()))

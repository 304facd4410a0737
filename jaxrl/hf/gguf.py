"""Convert a llama-architecture GGUF file into a Hugging Face model directory.

The `gguf` package reads the file and dequantizes its tensors with numpy, so no torch is needed.
Output: config.json, generation_config.json, model.safetensors (float32, HF key names) and a fast
tokenizer (tokenizer.json, tokenizer_config.json with the chat template, special_tokens_map.json).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# GGUF metadata key (after "llama.") -> HF config field.
_LLAMA_FIELDS = {
    "vocab_size": "vocab_size",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
}
# Keys that only restate head_dim; they are checked against it, not copied.
_HEAD_DIM_KEYS = ("rope.dimension_count", "attention.key_length", "attention.value_length")
_REQUIRED = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count",
             "attention.layer_norm_rms_epsilon", "context_length")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# llama.cpp's `tokenizer.ggml.pre` names the split regex its converter saw in tokenizer.json.
_PRE_TOKENIZERS = {
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
}
_CONTROL_TOKEN = 3  # llama.cpp token type for special tokens such as <|im_end|>


class GGUFFormatError(ValueError):
    """The GGUF file holds something this converter cannot turn into a HF llama model."""


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All metadata fields as Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _exact(value: Any) -> Any:
    # GGUF stores eps and rope base as float32; 1e-5 would come back as 9.99999974e-06.
    return float(str(np.float32(value))) if isinstance(value, float) else value


def gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A transformers LlamaForCausalLM config.json dict from GGUF metadata and tensor names."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFFormatError(f"general.architecture is {arch!r}; only 'llama' GGUF files can be "
                              "converted (Llama, SmolLM2 and other llama-architecture models)")
    llama = {key[len("llama."):]: value for key, value in meta.items() if key.startswith("llama.")}
    unknown = sorted(set(llama) - set(_LLAMA_FIELDS) - set(_HEAD_DIM_KEYS))
    if unknown:
        raise GGUFFormatError(f"GGUF metadata llama.{unknown[0]} is not supported (it may change the "
                              f"model's math); supported llama.* keys: {sorted(_LLAMA_FIELDS)}")
    missing = [key for key in _REQUIRED if key not in llama]
    if missing:
        raise GGUFFormatError(f"GGUF metadata lacks llama.{missing[0]}, which a llama model needs")
    cfg = {hf: _exact(llama[key]) for key, hf in _LLAMA_FIELDS.items() if key in llama}
    cfg.setdefault("vocab_size", len(meta["tokenizer.ggml.tokens"]))
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("rope_theta", 10000.0)  # llama.cpp's default when the key is absent
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    for key in _HEAD_DIM_KEYS:
        if key in llama and llama[key] != head_dim:
            raise GGUFFormatError(f"GGUF metadata llama.{key} is {llama[key]}, but a llama model "
                                  f"needs it equal to head_dim = {head_dim}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **cfg, "head_dim": head_dim,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rope_scaling": None,
        "torch_dtype": "float32",
    }


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies, with its [out, in] shape."""
    hidden, mlp, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    layer = {
        "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (mlp, hidden), "mlp.up_proj": (mlp, hidden), "mlp.down_proj": (hidden, mlp),
        "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
    }
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}.weight": s for name, s in layer.items()})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    return shapes


def hf_tensor_name(gguf_name: str) -> str:
    """The HF key for a GGUF tensor name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise GGUFFormatError(f"GGUF tensor {gguf_name!r} has no Hugging Face llama equivalent; known: "
                              f"{sorted(_GLOBAL_TENSORS)} and blk.N.{{{','.join(_LAYER_TENSORS)}}}.weight")
    return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp interleaves each head's two rotary halves (rows i and i + head_dim/2 become adjacent)
    because its RoPE rotates neighbouring pairs; HF's rotate_half rotates the two halves.
    """
    rows = weight.shape[0]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(reader: GGUFReader, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 array in HF shape) one tensor at a time."""
    shapes = expected_shapes(cfg)
    seen: set[str] = set()
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name not in shapes or name in seen:
            why = "appears twice" if name in seen else "is not part of the model the config describes"
            raise GGUFFormatError(f"GGUF tensor {tensor.name!r} (HF {name}) {why}")
        seen.add(name)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        if shape != shapes[name]:
            raise GGUFFormatError(f"GGUF tensor {tensor.name!r} has shape {shape}; config implies "
                                  f"{shapes[name]}")
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = unpermute_rows(array, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = unpermute_rows(array, cfg["num_key_value_heads"])
        yield name, np.ascontiguousarray(array)
    missing = sorted(set(shapes) - seen)
    if missing:
        raise GGUFFormatError(f"GGUF file lacks tensors for {missing[:3]} ({len(missing)} missing)")


def gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE fast tokenizer from the GGUF vocabulary and merges."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "gpt-2")
    if kind != "gpt2":
        raise GGUFFormatError(f"tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) "
                              "tokenizers can be converted")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFFormatError(f"tokenizer.ggml.pre is {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}")
    for flag in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
        if meta.get(flag):
            raise GGUFFormatError(f"{flag} is true; only tokenizers that add no BOS/EOS are supported")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise GGUFFormatError(f"tokenizer.ggml.merges entry {' '.join(bad)!r} is not two tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta.get("tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, types) if kind == _CONTROL_TOKEN])
    return tokenizer


def _special_tokens(meta: dict[str, Any]) -> dict[str, str]:
    tokens = meta["tokenizer.ggml.tokens"]
    keys = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    return {name: tokens[meta[f"tokenizer.ggml.{key}"]] for name, key in keys.items()
            if f"tokenizer.ggml.{key}" in meta}


def write_tokenizer(meta: dict[str, Any], out_dir: Path, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    gguf_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    special = _special_tokens(meta)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": max_length}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face model directory for the llama GGUF file at gguf_path."""
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    cfg = gguf_config(meta, {tensor.name for tensor in reader.tensors})
    out_dir.mkdir(parents=True, exist_ok=True)
    # safetensors.numpy writes from one dict; ~540 MB float32 for a 135M model.
    save_file(dict(gguf_tensors(reader, cfg)), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(out_dir / "config.json", cfg)
    generation = {key: cfg[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if cfg[key] is not None}
    _write_json(out_dir / "generation_config.json", generation)
    write_tokenizer(meta, out_dir, cfg["max_position_embeddings"])

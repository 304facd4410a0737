"""Export to Hugging Face formats: a PEFT LoRA adapter directory, or a whole transformers model
with the adapter merged into the dequantized base.

Tensor names come from the tables loading uses: `peft_keys` (jaxrl/hf/peft_io.py) for adapter
tensors and `key_table` (jaxrl/hf/keymap.py) for model tensors. jaxrl keeps A [in, r],
B [r, out] and kernels [in, out]; PEFT and transformers store lora_A [r, in], lora_B [out, r]
and weights [out, in], hence the transposes. Every file is written under a temporary name and
renamed into place, so a reader never sees a half-written one.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxrl.config import QuantConfig
from jaxrl.hf.keymap import key_table
from jaxrl.hf.load import load_host_params
from jaxrl.hf.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_keys
from jaxrl.hf.safetensors_io import write_tensors
from jaxrl.lora.lora import Lora, merged_kernel
from jaxrl.model.families import ModelSpec
from jaxrl.quant.nf4 import QTensor, dequantize_np

EXPORT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
MODEL_WEIGHTS = "model.safetensors"
# Tokenizer, chat template and generation defaults travel with a merged model.
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json",
                   "chat_template*", "vocab.json", "merges.txt", "generation_config.json")
_METADATA = {"format": "pt"}  # what transformers and PEFT write and check for


def _replace_into(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _number(x: float) -> float | int:
    return round(x) if abs(x - round(x)) < 1e-9 else x


def peft_tensors(lora: Lora, spec: ModelSpec) -> dict[str, np.ndarray]:
    """{PEFT key: lora_A [r, in] or lora_B [out, r]} in float32."""
    return {key: np.ascontiguousarray(np.asarray(lora.weights["layers"][name][ab][layer],
                                                 np.float32).T)
            for key, (name, layer, ab) in peft_keys(spec, lora.targets).items()}


def adapter_config(lora: Lora, base_name: str, dropout: float) -> dict[str, Any]:
    """adapter_config.json of a plain LoRA with lora_alpha / r = the adapter's scale."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
            "r": lora.rank, "lora_alpha": _number(lora.scale * lora.rank),
            "lora_dropout": dropout, "target_modules": list(lora.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "inference_mode": True}


def write_peft_adapter(out_dir: str | Path, lora: Lora, spec: ModelSpec, base_name: str,
                       dropout: float = 0.0) -> Path:
    """adapter_config.json + adapter_model.safetensors that PeftModel.from_pretrained loads."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = peft_tensors(lora, spec)
    _replace_into(out_dir / ADAPTER_WEIGHTS, lambda p: write_tensors(p, tensors, _METADATA))
    text = json.dumps(adapter_config(lora, base_name, dropout), indent=2) + "\n"
    _replace_into(out_dir / ADAPTER_CONFIG, lambda p: p.write_text(text, encoding="utf-8"))
    return out_dir


def merged_tensors(model_dir: Path, spec: ModelSpec, quant: QuantConfig | None, lora: Lora,
                   dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """{HF key: weight} of the base as trained (quantized per `quant`, dequantized) with
    scale * A @ B added to every adapted kernel, in `dtype`."""
    host = load_host_params(model_dir, spec, np.float32, quant)
    slots = defaultdict(list)
    for key, slot in key_table(spec).items():
        slots[slot.path].append((key, slot))
    tensors = {}
    for path in list(host):
        value = host.pop(path)  # one dense float32 stack at a time
        dense = dequantize_np(value, np.float32) if isinstance(value, QTensor) else value
        target = path.split("/")[1] if path.startswith("layers/") else None
        if path.endswith("/kernel") and target in lora.targets:
            dense = np.asarray(merged_kernel(dense, lora.weights["layers"][target], lora.scale))
        for key, slot in slots[path]:
            part = dense if slot.layer is None else dense[slot.layer]
            tensors[key] = np.ascontiguousarray((part.T if slot.transpose else part)
                                                .astype(dtype))
    return tensors


def _merged_config(model_dir: Path, dtype_name: str) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]:
        config[key] = dtype_name
    return config


def write_merged_model(out_dir: str | Path, model_dir: str | Path, spec: ModelSpec,
                       quant: QuantConfig | None, lora: Lora, dtype: str = "bfloat16") -> Path:
    """A transformers model directory (config.json, model.safetensors, tokenizer files and
    chat template of the base) of the base with the adapter merged in."""
    out_dir, model_dir = Path(out_dir), Path(model_dir)
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"merged export dtype must be one of {', '.join(EXPORT_DTYPES)}; "
                         f"got {dtype!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = merged_tensors(model_dir, spec, quant, lora, EXPORT_DTYPES[dtype])
    _replace_into(out_dir / MODEL_WEIGHTS, lambda p: write_tensors(p, tensors, _METADATA))
    text = json.dumps(_merged_config(model_dir, dtype), indent=2) + "\n"
    _replace_into(out_dir / "config.json", lambda p: p.write_text(text, encoding="utf-8"))
    for pattern in TOKENIZER_FILES:
        for source in model_dir.glob(pattern):
            _replace_into(out_dir / source.name, lambda p, s=source: shutil.copyfile(s, p))
    return out_dir

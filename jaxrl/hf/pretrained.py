"""A model ready to use: params (optionally NF4), an optional PEFT adapter, tokenizer, EOS ids.

The one loading path for every verb that runs a model outside training (generate, serve, eval,
rationale scoring, agents). NF4 kernels follow `quant.dequantize` (auto: kept 4-bit on
accelerators and dequantized per layer inside the loop; dequantized once on CPU, where XLA's
per-step dequantization costs more than the memory it saves).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxrl.config import QuantConfig, SamplingConfig
from jaxrl.hf.default_model import resolve_model_path
from jaxrl.hf.load import load_params
from jaxrl.hf.tokenizer import (chat_prompt_ids, chat_prompt_text, detokenizer, eos_token_ids,
                                load_tokenizer, text_ids)
from jaxrl.lora.lora import Lora
from jaxrl.lora.peft_io import load_peft_adapter
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import layer_bits
from jaxrl.quant.qparams import dequantize_params, dequantize_strategy
from jaxrl.sampling.sampler import SampleOutput, sample


@dataclasses.dataclass
class Pretrained:
    path: Path
    spec: ModelSpec
    params: dict[str, Any]
    tokenizer: Any
    eos_ids: tuple[int, ...]
    detokenize: Callable[[Sequence[int]], str]
    lora: Lora | None = None

    def chat_text(self, messages: Sequence[Mapping[str, str]]) -> str:
        """`messages` rendered by the chat template, ending with the assistant header."""
        return chat_prompt_text(self.tokenizer, messages)

    def chat_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def ids(self, text: str) -> list[int]:
        """Token ids of text as it stands (no special tokens added)."""
        return text_ids(self.tokenizer, text)

    def sample(self, prompts: Sequence[Sequence[int]], key: jax.Array,
               cfg: SamplingConfig = SamplingConfig(), use_adapter: bool = True
               ) -> SampleOutput:
        """One completion per prompt (token ids), with the loaded adapter unless use_adapter
        is False (the base alone)."""
        return sample(self.params, self.spec, prompts, key, cfg,
                      lora=self.lora if use_adapter else None, eos_ids=self.eos_ids,
                      detokenize=self.detokenize)


def load_pretrained(path: str | Path, adapter: str | Path | None = None,
                    dtype: str = "float32", quant: str | QuantConfig = "none") -> Pretrained:
    """Loads model `path` (a local HF directory, a hub id or `default`) in `dtype`, quantizing
    linear kernels while loading when `quant` is nf4 or int4, plus a PEFT adapter directory."""
    model_dir = resolve_model_path(str(path))
    qcfg = quant if isinstance(quant, QuantConfig) else (
        None if quant == "none" else QuantConfig(mode=quant))
    spec, params = load_params(model_dir, dtype=jnp.dtype(dtype), quant=qcfg)
    if qcfg is not None and dequantize_strategy(qcfg) == "once":
        params = dequantize_params(params, jnp.dtype(dtype))
    params = layer_bits(params)  # bf16 layers as their bits on the CPU, as a run holds them
    tokenizer = load_tokenizer(model_dir)
    lora = None if adapter is None else load_peft_adapter(adapter, spec)
    return Pretrained(path=model_dir, spec=spec, params=params, tokenizer=tokenizer,
                      eos_ids=eos_token_ids(tokenizer, model_dir),
                      detokenize=detokenizer(tokenizer), lora=lora)

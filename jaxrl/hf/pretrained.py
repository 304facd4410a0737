"""A model ready to use: params (optionally NF4), an optional PEFT adapter, tokenizer, EOS ids.

What every verb that runs a model on one device outside training loads (generate, serve, eval,
rationale scoring, agents, sft): the model from the one loader (`jaxrl.hf.loader.load_model`,
for the default device's numerics), so NF4 kernels follow `quant.dequantize` as in a run (auto:
kept 4-bit on accelerators and dequantized per layer inside the loop; dequantized once on the
CPU), plus a PEFT adapter.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import jax

from jaxrl.backends.numerics import numerics_of
from jaxrl.config import QuantConfig, SamplingConfig
from jaxrl.hf.loader import load_model
from jaxrl.hf.peft_io import load_peft_adapter
from jaxrl.hf.tokenizer import (chat_prompt_ids, chat_prompt_text, detokenizer, eos_token_ids,
                                text_ids)
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
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
    """Loads model `path` (a local HF directory, a hub id or `default`) in `dtype` on the
    default device, quantizing linear kernels while loading when `quant` is nf4 or int4 (a mode
    name, or the run's QuantConfig), plus a PEFT adapter directory."""
    qcfg = quant if isinstance(quant, QuantConfig) else (
        None if quant == "none" else QuantConfig(mode=quant))
    model = load_model(path, dtype=dtype, quant=qcfg, numerics=numerics_of(None))
    lora = None if adapter is None else load_peft_adapter(adapter, model.spec)
    return Pretrained(path=model.path, spec=model.spec, params=model.params,
                      tokenizer=model.tokenizer, eos_ids=eos_token_ids(model.tokenizer, model.path),
                      detokenize=detokenizer(model.tokenizer), lora=lora)

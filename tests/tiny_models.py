"""Tiny random Hugging Face models of each family, built in the tests (no hub)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_config(family: str, *, tie: bool = False, rope_scaling: dict | None = None,
              layers: int = 2, hidden: int = 64, **extra):
    import transformers

    config_cls = getattr(transformers, FAMILY_CLASSES[family][0])
    kw = dict(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
              tie_word_embeddings=tie, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3":
        kw["head_dim"] = 32  # differs from hidden / heads, as in real Qwen3 models
    if rope_scaling is not None:
        kw["rope_scaling"] = dict(rope_scaling)  # transformers mutates it
    kw.update(extra)
    return config_cls(**kw)


def make_model(family: str, seed: int = 0, **config_kw):
    """A random fp32 torch model whose weights are large enough that errors would show."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILY_CLASSES[family][1])(hf_config(family, **config_kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    return model.float().eval()


def save_model(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def padded_batch(seed: int = 0, batch: int = 3, length: int = 12, vocab: int = 128):
    """Tokens [B, T] and a mask with row 1 left-padded and row 2 right-padded."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(3, vocab, (batch, length))
    mask = np.ones((batch, length), bool)
    mask[1, :4] = False
    mask[2, length - 3:] = False
    return tokens, mask


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy `generate` of exactly n new tokens (EOS ignored) after prompt."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def tiny_llama_with_lora(rank: int = 4, alpha: float = 8.0):
    """(spec, params, lora) of the tiny llama (random, std 0.2) with a rank-`rank` adapter whose
    weights are all shifted by 0.05, so that B is not zero and the adapter changes the model."""
    import jax

    from jaxrl.lora.lora import init_lora
    from jaxrl.model.families import spec_from_hf_config
    from jaxrl.model.params import init_params

    spec = spec_from_hf_config(hf_config("llama").to_dict())
    params = init_params(spec, jax.random.PRNGKey(0), std=0.2)
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=rank, alpha=alpha)
    return spec, params, lora.replace(
        weights=jax.tree_util.tree_map(lambda x: x + 0.05, lora.weights))

"""The real default model (SmolLM2-135M-Instruct): jaxrl against transformers, and NF4 + LoRA
against full precision."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxrl.config import QuantConfig
from jaxrl.hf.load import load_params
from jaxrl.lora.lora import init_lora
from jaxrl.model.transformer import forward, positions_from_mask

# runs on an accelerator too (tools/accelerator_check.sh)
pytestmark = pytest.mark.accelerator

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "If I have 3 apples and eat one, how many are left? Explain step by step.",
]


@pytest.fixture(scope="module")
def batch(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS]
    enc = tok(texts, padding=True, padding_side="left", return_tensors="np")
    return enc["input_ids"], enc["attention_mask"].astype(bool)


def _jax_logits(params, spec, tokens, mask, lora=None):
    m = jnp.asarray(mask)
    fn = jax.jit(lambda p, l: forward(p, jnp.asarray(tokens), positions_from_mask(m), spec,
                                      attn_mask=m, lora=l)[0])
    return np.asarray(fn(params, lora))


def test_last_token_logits_match_transformers(default_model_dir, batch):
    tokens, mask = batch
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens),
                    attention_mask=torch.tensor(mask.astype(np.int64))).logits[:, -1].numpy()
    spec, params = load_params(default_model_dir)
    got = _jax_logits(params, spec, tokens, mask)[:, -1]
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def _kl(p_logits, q_logits):
    lp, lq = jax.nn.log_softmax(p_logits, -1), jax.nn.log_softmax(q_logits, -1)
    return np.asarray(jnp.sum(jnp.exp(lp) * (lp - lq), -1))


def test_nf4_with_fresh_lora_stays_close_to_full_precision(default_model_dir, batch):
    """Mean KL(full || NF4 + LoRA at B = 0) per token over chat prompts (printed).

    Measured: 1.29 nats mean, 0.58 median (NF4, block 64, double quant); 0.51 mean with block 32.
    The embedded weights were shipped as Q4_1 (a linear 4-bit grid per 32 weights), so NF4's
    normal-shaped levels re-quantize an already quantized grid; real bf16 checkpoints lose less.
    The bounds catch a broken quantizer (a wrong nibble order or scale gives KL > 5)."""
    tokens, mask = batch
    spec, full = load_params(default_model_dir)
    _, nf4 = load_params(default_model_dir, spec, quant=QuantConfig(mode="nf4", double_quant=True))
    lora = init_lora(spec, jax.random.PRNGKey(0), rank=16, alpha=32)
    kl = _kl(_jax_logits(full, spec, tokens, mask), _jax_logits(nf4, spec, tokens, mask, lora))
    mean_kl = float(kl[mask].mean())
    print(f"mean KL per token, fp32 vs NF4 (double quant) + LoRA(B=0): {mean_kl:.4f} nats")
    assert 0 < mean_kl < 1.5
    assert float(np.median(kl[mask])) < 0.8

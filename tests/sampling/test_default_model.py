"""The real default model (SmolLM2-135M-Instruct): greedy chat completions equal transformers'
greedy `generate` token for token, with both layer loops, prompts batched with left padding."""
import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrl.config import SamplingConfig
from jaxrl.hf.load import load_params
from jaxrl.hf.tokenizer import chat_prompt_ids, eos_token_ids, load_tokenizer
from jaxrl.sampling import sample

QUESTIONS = ["What is the capital of France?",
             "Write a haiku about autumn leaves, then explain what a haiku is in one sentence."]
N = 32


@pytest.mark.slow
def test_greedy_chat_equals_transformers_generate(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    eos = eos_token_ids(tok, default_model_dir)
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    want = []
    for ids in prompts:
        with torch.no_grad():
            ids_t = torch.tensor([ids])
            out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=N,
                                 do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0])
        want.append(out[0, len(ids):].numpy())
    assert len(prompts[0]) != len(prompts[1])
    assert any(len(w) < N for w in want) and any(len(w) == N for w in want)  # EOS and length
    spec, params = load_params(default_model_dir)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=N)
    got = sample(params, spec, prompts, jax.random.PRNGKey(0), cfg, eos_ids=eos)
    for row, w in enumerate(want):
        assert got.mask[row].sum() == len(w)
        np.testing.assert_array_equal(got.tokens[row, :len(w)], w)
        assert got.finish_reasons[row] == ("stop" if len(w) < N else "length")

"""The decode engine on tiny random models, float32: greedy requests equal transformers'
generate whatever slot they land in and whatever decodes beside them, seeded requests decode the
same alone or beside others, log-probs equal teacher forcing, each distinct prompt is prefilled
once, slots are refilled as requests finish, tokens stream in order, and changing settings
compiles nothing new."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.hf.load import load_params
from jaxrl.model.transformer import forward
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.sampling import engine as engine_mod
from jaxrl.sampling.engine import row_keys
from tests.tiny_models import make_model

PROMPTS = [[5, 9, 31, 7, 100, 3, 44], [17, 2, 88], list(range(10, 40)), [64], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(torch model, spec, params) of a tiny random qwen2 with tied embeddings."""
    path = tmp_path_factory.mktemp("engine_model")
    model = make_model("qwen2", tie=True)
    model.save_pretrained(path)
    return (model, *load_params(path))


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _teacher_forced(params, spec, prompt, tokens, temperature):
    ids = jnp.asarray([list(prompt) + list(tokens)])
    logits = forward(params, ids, jnp.arange(ids.shape[1])[None], spec)[0][0]
    logp = jax.nn.log_softmax(logits[len(prompt) - 1:-1] / temperature, axis=-1)
    return np.asarray(logp)[np.arange(len(tokens)), tokens]


def _run(params, spec, requests, slots=4, chunk=4, layer_loop="scan", eos_ids=()):
    engine = Engine(params, spec, eos_ids=eos_ids, slots=slots, capacity=64, chunk=chunk,
                    layer_loop=layer_loop)
    for r in requests:
        engine.submit(r)
    engine.run()
    return engine


MIXED = [Decoding(0.0), Decoding(0.8, top_k=5), Decoding(1.0, top_p=0.9), Decoding(0.7, min_p=0.1),
         Decoding(0.0)]


def _mixed_requests(keys):
    """More requests than slots, of mixed settings and budgets (some finish early)."""
    return [Request(PROMPTS[i % 5], MIXED[i % 5], max_new_tokens=[12, 5, 20, 3, 9, 16, 7][i % 7],
                    key=keys[i]) for i in range(9)]


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_requests_decode_as_alone_whatever_slot_and_neighbours(tiny, layer_loop):
    model, spec, params = tiny
    keys = row_keys(jax.random.PRNGKey(0), range(9))
    together = _run(params, spec, _mixed_requests(keys), layer_loop=layer_loop)
    assert together.stats.admitted == 9 and together.stats.chunks > 1
    for i, r in enumerate(_mixed_requests(keys)):
        alone = _run(params, spec, [r], slots=1, chunk=8, layer_loop=layer_loop)
        want = r  # the same request object, now decoded alone
        got = _mixed_requests(keys)[i]
        assert len(want.tokens) == want.max_new_tokens and want.finish_reason == "length"
        assert alone.stats.admitted == 1
        del got
    for r in _collected(params, spec, keys, layer_loop):
        if r.decoding.temperature == 0:
            assert r.tokens == _hf_greedy(model, r.prompt, r.max_new_tokens)


def _collected(params, spec, keys, layer_loop):
    requests = _mixed_requests(keys)
    _run(params, spec, requests, layer_loop=layer_loop)
    return requests

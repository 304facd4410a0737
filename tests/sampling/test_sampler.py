"""`sample` (the decode engine underneath) on tiny random models: greedy parity with
transformers, padding invariance, log-probs against teacher forcing, EOS and
stop handling, NF4 + LoRA, seeds, and a bounded number of compiled programs."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import QuantConfig, SamplingConfig
from jaxrl.hf.load import load_params
from jaxrl.lora.lora import init_lora
from jaxrl.model.transformer import forward, positions_from_mask
from jaxrl.quant.nf4 import QTensor, dequantize
from jaxrl.sampling import programs, sample
from tests.tiny_models import LLAMA3_ROPE, hf_greedy, make_model

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=64)
PROMPTS = [[5, 9, 31, 7, 100, 3, 44], [17, 2, 88], list(range(10, 40))]
CASES = {"llama-rope-scaling": ("llama", dict(rope_scaling=LLAMA3_ROPE)),
         "qwen2-tied": ("qwen2", dict(tie=True)),
         "qwen3": ("qwen3", {})}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{case: (torch model, spec, params)}."""
    out = {}
    for name, (family, kw) in CASES.items():
        path = tmp_path_factory.mktemp(name)
        model = make_model(family, **kw)
        model.save_pretrained(path)
        out[name] = (model, *load_params(path))
    return out


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_transformers_generate(models, case):
    model, spec, params = models[case]
    out = sample(params, spec, PROMPTS[:2], jax.random.PRNGKey(0), GREEDY)
    assert out.tokens.shape == (2, 64) and out.mask.all()
    assert out.finish_reasons == ("length", "length")
    for row, prompt in enumerate(PROMPTS[:2]):
        np.testing.assert_array_equal(out.tokens[row], hf_greedy(model, prompt, 64))


def test_a_prompt_decodes_the_same_alone_and_beside_longer_prompts(models):
    _, spec, params = models["qwen3"]
    short = PROMPTS[1]
    alone = sample(params, spec, [short], jax.random.PRNGKey(0), GREEDY)
    batch = sample(params, spec, PROMPTS, jax.random.PRNGKey(0), GREEDY)
    assert batch.prompt_tokens.shape[1] == 32 and alone.prompt_tokens.shape[1] == 16
    np.testing.assert_array_equal(batch.tokens[1], alone.tokens[0])
    np.testing.assert_allclose(batch.logprobs[1], alone.logprobs[0], atol=1e-5)


def _teacher_forced(params, spec, out, temperature, lora=None):
    """log_softmax(logits / T) of each completion token, by one forward over prompt + completion."""
    tokens = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    logits = forward(params, tokens, positions_from_mask(mask), spec, attn_mask=mask,
                     lora=lora)[0]
    p = out.prompt_tokens.shape[1]
    logp = jax.nn.log_softmax(logits[:, p - 1:-1] / temperature, axis=-1)
    return np.take_along_axis(np.asarray(logp), out.tokens[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=20, top_p=0.9),
                                      dict(temperature=1.0), dict(temperature=0.0)])
def test_logprobs_equal_teacher_forced_logprobs(models, settings):
    _, spec, params = models["qwen2-tied"]
    cfg = SamplingConfig(max_new_tokens=24, **settings)
    out = sample(params, spec, PROMPTS, jax.random.PRNGKey(3), cfg)
    want = _teacher_forced(params, spec, out, settings["temperature"] or 1.0)
    np.testing.assert_allclose(out.logprobs[out.mask], want[out.mask], atol=1e-5, rtol=0)
    assert (out.logprobs[out.mask] < 0).all()


def test_tokens_after_eos_are_masked(models):
    _, spec, params = models["llama-rope-scaling"]
    free = sample(params, spec, PROMPTS, jax.random.PRNGKey(1),
                  SamplingConfig(temperature=1.0, max_new_tokens=40))
    eos = int(free.tokens[0, 5])  # a token row 0 emits at column 5 (maybe earlier too)
    detok = lambda ids: ",".join(map(str, ids))
    out = sample(params, spec, PROMPTS, jax.random.PRNGKey(1),
                 SamplingConfig(temperature=1.0, max_new_tokens=40), eos_ids=(eos, 127),
                 detokenize=detok)
    for row in range(3):
        hits = np.flatnonzero(np.isin(free.tokens[row], [eos, 127]))
        end = hits[0] + 1 if len(hits) else 40
        assert out.mask[row].sum() == end and out.mask[row, :end].all()
        np.testing.assert_array_equal(out.tokens[row, :end], free.tokens[row, :end])
        assert (out.tokens[row, end:] == eos).all()  # the pad id is the first EOS id
        assert (out.logprobs[row, end:] == 0).all()
        assert out.texts[row] == detok(free.tokens[row, :end])  # what rewards see
        assert out.finish_reasons[row] == ("stop" if len(hits) else "length")
    assert out.finish_reasons[0] == "stop"


def test_stop_strings_cut_mask_and_text_on_the_host(models):
    _, spec, params = models["qwen3"]
    detok = lambda ids: " ".join(f"t{i}" for i in ids)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=16)
    plain = sample(params, spec, PROMPTS[:1], jax.random.PRNGKey(0), cfg, detokenize=detok)
    stop = f"t{plain.tokens[0, 3]} t{plain.tokens[0, 4]}"
    first = plain.texts[0].find(stop)
    kept = len(plain.texts[0][:first + len(stop)].split())
    out = sample(params, spec, PROMPTS[:1], jax.random.PRNGKey(0),
                 dataclasses.replace(cfg, stop=(stop, "never")), detokenize=detok)
    assert out.finish_reasons == ("stop",) and plain.finish_reasons == ("length",)
    assert out.mask[0].sum() == kept and out.texts[0].endswith(stop)
    assert out.texts[0] == plain.texts[0][:first + len(stop)]
    assert (out.logprobs[0, kept:] == 0).all()
    with pytest.raises(ValueError, match="detokenize"):
        sample(params, spec, PROMPTS[:1], jax.random.PRNGKey(0),
               dataclasses.replace(cfg, stop=(stop,)))


def test_same_seed_same_output_and_other_seed_other_output(models):
    _, spec, params = models["qwen3"]
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=20)
    a, b = (sample(params, spec, PROMPTS, jax.random.PRNGKey(7), cfg) for _ in range(2))
    c = sample(params, spec, PROMPTS, jax.random.PRNGKey(8), cfg)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.tokens != c.tokens).any()


def _dequantized(params):
    return jax.tree_util.tree_map(lambda x: dequantize(x) if isinstance(x, QTensor) else x,
                                  params, is_leaf=lambda x: isinstance(x, QTensor))


def _random_lora(spec):
    """An adapter whose B is not zero, so it changes the outputs."""
    lora = init_lora(spec, jax.random.PRNGKey(0), rank=4, alpha=8)
    layers = {k: {"a": v["a"], "b": 0.3 * jax.random.normal(jax.random.PRNGKey(1), v["b"].shape)}
              for k, v in lora.weights["layers"].items()}
    return dataclasses.replace(lora, weights={"layers": layers})


def test_nf4_with_lora_decodes_like_its_dequantized_weights(models, tmp_path):
    model, spec, _ = models["qwen3"]
    model.save_pretrained(tmp_path)
    _, nf4 = load_params(tmp_path, spec, quant=QuantConfig(mode="nf4", double_quant=True))
    lora = _random_lora(spec)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=32)
    q = sample(nf4, spec, PROMPTS, jax.random.PRNGKey(0), cfg, lora=lora)
    d = sample(_dequantized(nf4), spec, PROMPTS, jax.random.PRNGKey(0), cfg, lora=lora)
    base = sample(_dequantized(nf4), spec, PROMPTS, jax.random.PRNGKey(0), cfg)
    np.testing.assert_array_equal(q.tokens, d.tokens)
    np.testing.assert_allclose(q.logprobs, d.logprobs, atol=1e-5)
    assert (base.tokens != d.tokens).any()  # the adapter matters
    want = _teacher_forced(_dequantized(nf4), spec, q, 1.0, lora)
    np.testing.assert_allclose(q.logprobs[q.mask], want[q.mask], atol=1e-5)


def test_lora_dropout_never_acts_while_sampling(models):
    # dropout is a training regularizer: the rollout's log-probs must be the adapter's own
    _, spec, params = models["qwen3"]
    lora = _random_lora(spec)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=16)
    plain = sample(params, spec, PROMPTS, jax.random.PRNGKey(4), cfg, lora=lora)
    dropped = sample(params, spec, PROMPTS, jax.random.PRNGKey(4), cfg,
                     lora=dataclasses.replace(lora, dropout=0.5))
    np.testing.assert_array_equal(plain.tokens, dropped.tokens)
    np.testing.assert_array_equal(plain.logprobs, dropped.logprobs)


def test_compiles_one_program_per_bucket(models):
    """sample's engine programs are keyed by shape buckets and the settings' features only:
    new lengths within the buckets and new settings of the same features (here: drawn with
    top-k; greedy) reuse them."""
    _, spec, params = models["qwen2-tied"]
    run = lambda prompt, n, t: sample(params, spec, [prompt, prompt[:2]], jax.random.PRNGKey(0),
                                      SamplingConfig(temperature=t, top_k=7, max_new_tokens=n))
    sizes = lambda: (programs.generate.cache_size(), programs.admit._cache_size())
    run(list(range(3, 6)), 5, 0.5)
    before = sizes()
    for n, length, t in zip([5, 9, 16, 3], [3, 9, 16, 12], [0.5, 0.3, 1.2, 0.8]):
        out = run(list(range(3, 3 + length)), n, t)  # prompt bucket 16, new-token bucket 16
        assert out.tokens.shape == (2, n) and out.mask.all()
    assert sizes() == before
    run(list(range(3, 9)), 9, 0.0)  # greedy: one features value of its own
    greedy = sizes()
    assert greedy[0] <= before[0] + 1 and greedy[1] <= before[1] + 1
    run(list(range(3, 14)), 12, 0.0)
    assert sizes() == greedy
    run(list(range(3, 20)), 5, 0.5)  # prompt bucket 32: a new cache width
    assert sizes()[0] == greedy[0] + 1


def test_decoding_stops_early_once_every_row_has_finished(models):
    """All rows end on the first step, so the loop body never runs past it."""
    _, spec, params = models["qwen3"]
    first = sample(params, spec, PROMPTS, jax.random.PRNGKey(0), GREEDY).tokens[:, 0]
    out = sample(params, spec, PROMPTS, jax.random.PRNGKey(0), GREEDY,
                 eos_ids=tuple(int(t) for t in first))
    assert out.mask.sum(axis=1).tolist() == [1, 1, 1]
    assert out.finish_reasons == ("stop",) * 3


def test_fewer_slots_than_rows_refill_and_decode_the_same(models):
    """sampling.slots below the row count: rows wait for free slots and decode as with a slot
    each (per-row keys), greedy and sampled."""
    _, spec, params = models["qwen3"]
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[2][:5]]
    for t in (0.0, 0.9):
        cfg = SamplingConfig(temperature=t, top_p=0.95, max_new_tokens=20)
        wide = sample(params, spec, prompts, jax.random.PRNGKey(4), cfg)
        narrow = sample(params, spec, prompts, jax.random.PRNGKey(4),
                        dataclasses.replace(cfg, slots=2))
        np.testing.assert_array_equal(narrow.tokens, wide.tokens)
        np.testing.assert_array_equal(narrow.mask, wide.mask)
        np.testing.assert_allclose(narrow.logprobs, wide.logprobs, atol=1e-5)


def test_a_row_at_its_stop_string_frees_its_slot_at_the_next_chunk(models, monkeypatch):
    """Rows cancelled at their stop string: the rollout ends after the chunk that holds every
    row's stop string instead of decoding to max_new_tokens, with the same kept tokens."""
    from jaxrl.sampling import sampler as sampler_module

    _, spec, params = models["qwen3"]
    detok = lambda ids: " ".join(f"t{i}" for i in ids)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=64)
    plain = sample(params, spec, PROMPTS[:1], jax.random.PRNGKey(0), cfg, detokenize=detok)
    stop = f"t{plain.tokens[0, 3]} t{plain.tokens[0, 4]}"
    engines = []

    class Recorded(sampler_module.Engine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            engines.append(self)

    monkeypatch.setattr(sampler_module, "Engine", Recorded)
    out = sample(params, spec, PROMPTS[:1], jax.random.PRNGKey(0),
                 dataclasses.replace(cfg, stop=(stop,)), detokenize=detok)
    kept = out.mask[0].sum()
    np.testing.assert_array_equal(out.tokens[0, :kept], plain.tokens[0, :kept])
    assert out.finish_reasons == ("stop",)
    assert engines[0].stats.tokens == 16 and engines[0].stats.chunks == 1  # not 63 tokens

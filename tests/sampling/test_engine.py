"""The decode engine on tiny random models, float32: requests decode as they do alone whatever
slot they land in and whatever decodes beside them (greedy ones equal transformers' generate),
log-probs equal teacher forcing, each distinct prompt is prefilled once, slots are refilled as
requests finish, tokens stream in order, and settings compile a program only for parts of the
token choice (features) not compiled before."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.backends.numerics import numerics_for
from jaxrl.hf.load import load_params
from jaxrl.model.transformer import forward, lm_logits
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.sampling import engine as engine_module
from jaxrl.sampling import programs as engine_programs
from jaxrl.sampling.requests import row_keys
from jaxrl.sampling.sampling_fns import Features
from tests.tiny_models import hf_greedy, make_model

PROMPTS = [[5, 9, 31, 7, 100, 3, 44], [17, 2, 88], list(range(10, 40)), [64], [3, 1, 4, 1, 5]]
MIXED = [Decoding(0.0), Decoding(0.8, top_k=5), Decoding(1.0, top_p=0.9),
         Decoding(0.7, min_p=0.1), Decoding(1.3)]
BUDGETS = [12, 5, 20, 3, 9, 16, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(torch model, spec, params) of a tiny random qwen2 with tied embeddings."""
    path = tmp_path_factory.mktemp("engine_model")
    model = make_model("qwen2", tie=True)
    model.save_pretrained(path)
    return (model, *load_params(path))


def _teacher_forced(params, spec, prompt, tokens, temperature):
    """log_softmax(logits / T) of each completion token by one forward over prompt + tokens."""
    ids = jnp.asarray([list(prompt) + list(tokens)])
    logits = forward(params, ids, jnp.arange(ids.shape[1])[None], spec)[0][0]
    logp = jax.nn.log_softmax(logits[len(prompt) - 1:-1] / temperature, axis=-1)
    return np.asarray(logp)[np.arange(len(tokens)), tokens]


def _requests(n=9, seed=0):
    """More requests than slots, of mixed settings and budgets, so slots are refilled."""
    keys = row_keys(jax.random.PRNGKey(seed), range(n))
    return [Request(PROMPTS[i % 5], MIXED[i % 5], max_new_tokens=BUDGETS[i % 7], key=keys[i])
            for i in range(n)]


def _run(params, spec, requests, slots=4, chunk=4, eos_ids=()):
    engine = Engine(params, spec, eos_ids=eos_ids, slots=slots, capacity=64, chunk=chunk)
    for r in requests:
        engine.submit(r)
    engine.run()
    return engine


def test_requests_decode_as_alone_whatever_slot_and_neighbours(tiny):
    model, spec, params = tiny
    together = _requests()
    engine = _run(params, spec, together)
    assert engine.stats.admitted == 9 and engine.stats.chunks > 2
    for r, alone in zip(together, _requests()):
        _run(params, spec, [alone], slots=1, chunk=8)
        assert r.tokens == alone.tokens and len(r.tokens) == r.max_new_tokens
        np.testing.assert_allclose(r.logprobs, alone.logprobs, atol=1e-5)
        assert r.finish_reason == alone.finish_reason == "length"
        if r.decoding.temperature == 0:
            assert r.tokens == hf_greedy(model, r.prompt, r.max_new_tokens)


def test_logprobs_equal_teacher_forced_logprobs(tiny):
    _, spec, params = tiny
    requests = _requests(seed=3)
    _run(params, spec, requests)
    for r in requests:
        t = r.decoding.temperature or 1.0
        want = _teacher_forced(params, spec, r.prompt, r.tokens, t)
        np.testing.assert_allclose(r.logprobs, want, atol=1e-5, rtol=0)


def test_a_group_prefills_its_prompt_once_and_its_rows_differ(tiny):
    _, spec, params = tiny
    keys = row_keys(jax.random.PRNGKey(1), range(8))
    group = [Request(PROMPTS[0], Decoding(1.0), 10, keys[i]) for i in range(4)]
    other = [Request(PROMPTS[1], Decoding(1.0), 10, keys[4 + i]) for i in range(4)]
    engine = _run(params, spec, group + other, slots=8)
    assert engine.stats.prefills == 2 and engine.stats.admitted == 8
    assert len({tuple(r.tokens) for r in group}) > 1  # own keys, own draws


def test_eos_ends_a_request_and_frees_its_slot(tiny):
    _, spec, params = tiny
    free = _requests()
    _run(params, spec, free)
    eos = free[2].tokens[4]  # a token request 2 emits at index 4 (maybe earlier too)
    stopped = _requests()
    engine = _run(params, spec, stopped, eos_ids=(eos,))
    for a, b in zip(free, stopped):
        hits = [i for i, t in enumerate(a.tokens) if t == eos]
        end = hits[0] + 1 if hits else len(a.tokens)
        assert b.tokens == a.tokens[:end]
        assert b.finish_reason == ("stop" if hits else "length")
    assert stopped[2].finish_reason == "stop"
    assert engine.stats.tokens + engine.stats.admitted == sum(len(r.tokens) for r in stopped)


def test_tokens_stream_in_order_as_they_are_decoded(tiny):
    _, spec, params = tiny
    seen, done = [], []
    request = Request(PROMPTS[2], Decoding(0.9), 11, row_keys(jax.random.PRNGKey(2), [0])[0],
                      on_token=lambda t, lp: seen.append((t, lp)), on_done=done.append)
    engine = Engine(params, spec, slots=2, capacity=64, chunk=4)
    engine.submit(request)
    counts, more = [], True
    while more:
        more = engine.step()
        counts.append(len(seen))
    assert counts == [1 + 4, 1 + 8, 11]  # the first token from the prefill, then a chunk a step
    assert [t for t, _ in seen] == request.tokens and done == [request]


def test_settings_compile_a_program_per_features_value(tiny, monkeypatch):
    """Requests that share one setting (a rollout) run one features value; other settings that
    use the same parts compile nothing new; mixed settings compile one `generate` for each
    features value the engine passes, and the engine passes a new one only where none it ran
    covers the requests (jaxrl/sampling/engine.py)."""
    _, spec, params = tiny
    passed = []
    real = engine_module.generate

    def spy(*args, **kwargs):
        passed.append(kwargs["features"])
        return real(*args, **kwargs)
    monkeypatch.setattr(engine_module, "generate", spy)
    compiled = lambda: (engine_programs.generate.cache_size(), engine_programs.admit._cache_size())

    def run(decoding, seed, chunk=3):  # chunk 3: a generate no other test compiles
        requests = _requests(seed=seed)
        for r in requests:
            r.decoding = decoding
        _run(params, spec, requests, chunk=chunk)

    rollout = Features(sampled=True, top_k=True)
    run(Decoding(0.3, top_k=2), seed=20)
    assert set(passed) == {rollout}
    before = compiled()
    for seed, decoding in enumerate([Decoding(1.7, top_k=40), Decoding(0.9, top_k=7)]):
        run(decoding, seed=21 + seed)
    assert compiled() == before and set(passed) == {rollout}
    passed.clear()
    _run(params, spec, _requests(seed=5), chunk=3)
    mixed = set(passed)
    passed.clear()  # settings arriving one kind after another, into one engine
    _run(params, spec, sorted(_requests(n=10, seed=6), key=lambda r: MIXED.index(r.decoding)),
         chunk=3)
    new = compiled()[0] - before[0]
    assert new == len((mixed | set(passed)) - {rollout}) > 1
    covers = lambda a, b: a.bits() & b.bits() == b.bits()
    for i, f in enumerate(passed):
        if f not in passed[:i]:
            assert not any(covers(g, f) for g in passed[:i]), (f, passed[:i])
    assert len(set(passed)) < len(MIXED)


def test_a_request_that_does_not_fit_is_refused(tiny):
    _, spec, params = tiny
    engine = Engine(params, spec, slots=2, capacity=32, chunk=4)
    with pytest.raises(ValueError, match="cache columns"):
        engine.submit(Request(list(range(1, 30)), max_new_tokens=8))


def _groups(seed=0, groups=3, share=4):
    """`groups` groups of `share` requests of one prompt each, with mixed settings and
    budgets inside a group."""
    keys = row_keys(jax.random.PRNGKey(seed), range(groups * share))
    return [Request(PROMPTS[(i // share) % 5], MIXED[i % 5], max_new_tokens=BUDGETS[i % 7],
                    key=keys[i]) for i in range(groups * share)]


def test_blocks_sharing_a_prompt_decode_as_alone(tiny):
    """Slots in blocks of 4 that hold their group's prompt once: each request decodes the
    tokens and log-probs it decodes alone in an unshared slot, with 3 groups in 2 blocks (a
    block is refilled once all 4 of its requests have finished), and one prefill per group."""
    _, spec, params = tiny
    together = _groups()
    engine = Engine(params, spec, slots=8, capacity=64, chunk=4, share=4, prompt_capacity=32)
    for i in range(0, len(together), 4):
        engine.submit_group(together[i:i + 4])
    engine.run()
    assert engine.stats.prefills == 3 and engine.stats.admitted == 12
    assert engine.state.prefix.k.shape[1:4] == (2, spec.num_kv_heads, 32)  # [L, S/4, K, P, D]
    assert engine.state.cache.max_len == 32  # each slot's own tokens
    assert sorted({r.slot // 4 for r in together}) == [0, 1]
    for r, alone in zip(together, _groups()):
        _run(params, spec, [alone], slots=1, chunk=8)
        assert r.tokens == alone.tokens and len(r.tokens) == r.max_new_tokens
        np.testing.assert_allclose(r.logprobs, alone.logprobs, atol=1e-5)


def test_shared_blocks_stop_at_eos_and_match_teacher_forcing(tiny):
    _, spec, params = tiny
    free = _groups(seed=7, groups=2, share=2)
    _run(params, spec, free)
    eos = free[1].tokens[2]
    stopped = _groups(seed=7, groups=2, share=2)
    engine = Engine(params, spec, eos_ids=(eos,), slots=2, capacity=64, chunk=4, share=2,
                    prompt_capacity=32)
    for i in range(0, 4, 2):
        engine.submit_group(stopped[i:i + 2])
    engine.run()
    for a, b in zip(free, stopped):
        hits = [i for i, t in enumerate(a.tokens) if t == eos]
        assert b.tokens == a.tokens[:hits[0] + 1 if hits else len(a.tokens)]
        t = b.decoding.temperature or 1.0
        want = _teacher_forced(params, spec, b.prompt, b.tokens, t)
        np.testing.assert_allclose(b.logprobs, want, atol=1e-5, rtol=0)
    assert stopped[1].finish_reason == "stop"


def test_shared_blocks_refuse_what_they_cannot_hold(tiny):
    _, spec, params = tiny
    engine = Engine(params, spec, slots=4, capacity=32, chunk=4, share=2, prompt_capacity=16)
    with pytest.raises(ValueError, match="submit_group"):
        engine.submit(Request([1, 2, 3], max_new_tokens=4))
    with pytest.raises(ValueError, match="one prompt"):
        engine.submit_group([Request([1, 2, 3]), Request([1, 2, 4])])
    with pytest.raises(ValueError, match="one prompt"):
        engine.submit_group([Request([1, 2, 3])])
    with pytest.raises(ValueError, match="cache columns"):  # a prompt past the 16 shared
        engine.submit_group([Request(list(range(1, 20)), max_new_tokens=4)] * 2)
    with pytest.raises(ValueError, match="cache columns"):  # new tokens past the 16 own
        engine.submit_group([Request([1, 2, 3], max_new_tokens=20)] * 2)
    with pytest.raises(ValueError, match="hold"):
        engine.submit_group([Request([1, 2, 3], hold=True)] * 2)
    with pytest.raises(ValueError, match="whole blocks"):
        Engine(params, spec, slots=6, capacity=32, share=4, prompt_capacity=16)


def test_decode_logits_are_the_heads_logits(tiny):
    # on one CPU device with a tied head the decode step's logits come from the vocab-major
    # product [V, E] x [S, E] -> [V, S], transposed: the same numbers as the head's [S, V]
    _, spec, params = tiny
    h = jnp.asarray(np.random.RandomState(0).randn(5, spec.hidden_size), jnp.float32)
    got = jax.jit(engine_programs.decode_logits, static_argnums=(2, 3, 4))(
        params, h, spec, None, numerics_for("cpu"))
    want = lm_logits(params, h, spec)
    assert got.shape == want.shape == (5, spec.vocab_size) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_capacity_that_is_no_power_of_two_holds_a_prompt_whose_bucket_it_does_not(tiny):
    # a 30-token prompt is prefilled 32 columns wide; the slots hold 34 columns (a local
    # judge's engine: judge prompt columns + reply tokens)
    model, spec, params = tiny
    engine = Engine(params, spec, slots=2, capacity=34, chunk=4)
    request = engine.submit(Request(PROMPTS[2], Decoding(0.0), 4))
    engine.run()
    np.testing.assert_array_equal(request.tokens, hf_greedy(model, PROMPTS[2], 4))
    engine = Engine(params, spec, slots=2, capacity=20, chunk=4)  # 16 < 17 tokens < 32
    request = engine.submit(Request(list(range(3, 20)), Decoding(0.0), 2))
    engine.run()
    np.testing.assert_array_equal(request.tokens, hf_greedy(model, list(range(3, 20)), 2))


def test_cancel_frees_the_slot_at_the_next_step_and_hands_out_nothing_after(tiny):
    _, spec, params = tiny
    engine = Engine(params, spec, slots=2, capacity=64, chunk=4)
    got = []
    long = engine.submit(Request(PROMPTS[0], Decoding(0.0), 40,
                                 on_token=lambda t, lp: got.append(t)))
    other = engine.submit(Request(PROMPTS[1], Decoding(0.0), 40))
    queued = engine.submit(Request(PROMPTS[3], Decoding(0.0), 6))
    never = engine.submit(Request(PROMPTS[4], Decoding(0.0), 6))
    engine.step()  # both slots decode; two requests wait
    engine.cancel(long)
    engine.cancel(never)
    before, tokens = list(got), engine.stats.tokens
    engine.step()  # long's slot is freed before this step decodes, queued takes it
    assert long.finish_reason == "cancelled" and got == before == long.tokens
    assert never.finish_reason == "cancelled" and never.tokens == []
    assert queued.slot == long.slot and engine.stats.tokens - tokens == 4 + 4  # other + queued
    engine.run()
    assert queued.finish_reason == "length" and len(queued.tokens) == 6
    assert other.finish_reason == "length" and len(other.tokens) == 40
    # cancelled between steps: nothing more is decoded for it
    mid = engine.submit(Request(PROMPTS[2], Decoding(0.0), 30))
    engine.step()
    first = list(mid.tokens)
    engine.cancel(mid)
    engine.step()
    assert mid.finish_reason == "cancelled" and mid.tokens == first
    assert not engine.busy()


@pytest.mark.parametrize("settings", [Decoding(0.0), Decoding(0.9, top_k=8, presence_penalty=0.5)])
def test_chunked_prefill_decodes_what_one_piece_does_while_others_keep_decoding(tiny, settings):
    model, spec, params = tiny
    keys = row_keys(jax.random.PRNGKey(3), range(2))
    outs = []
    for chunk in (0, 8):
        engine = Engine(params, spec, slots=2, capacity=64, chunk=2, prefill_chunk=chunk)
        running = engine.submit(Request(PROMPTS[1], settings, 20, keys[0]))
        engine.step()
        long = engine.submit(Request(PROMPTS[2], settings, 8, keys[1]))  # 30 tokens: 4 pieces
        paced = []
        while not long.tokens:
            before = len(running.tokens)
            engine.step()
            paced.append(len(running.tokens) - before)
        engine.run()
        outs.append((running.tokens, long.tokens))
        if chunk:  # each step while the long prompt went in also decoded the running one
            assert paced == [2, 2, 2, 2] and engine.stats.prefill_pieces == 3
    assert outs[0] == outs[1]
    if settings.temperature == 0:
        np.testing.assert_array_equal(outs[1][1], hf_greedy(model, PROMPTS[2], 8))


class _Sequence:
    """A constraint that allows exactly one token at a time: `tokens`, then the EOS id."""

    def __init__(self, tokens, eos):
        self.left, self.eos = list(tokens), eos

    def allowed(self, vocab):
        mask = np.zeros(vocab, bool)
        mask[self.left[0] if self.left else self.eos] = True
        return mask

    def advance(self, token):
        assert token == (self.left[0] if self.left else self.eos)
        self.left = self.left[1:]


@pytest.mark.parametrize("prefill_chunk", [0, 4])
def test_a_constrained_request_takes_only_allowed_tokens_beside_a_free_one(tiny, prefill_chunk):
    model, spec, params = tiny
    engine = Engine(params, spec, eos_ids=(2,), slots=2, capacity=64, chunk=8,
                    prefill_chunk=prefill_chunk)
    free = engine.submit(Request(PROMPTS[0], Decoding(0.0), 12))
    bound = engine.submit(Request(PROMPTS[1], Decoding(0.9), 12,
                                  constraint=_Sequence([7, 8, 9, 7], eos=2)))
    engine.run()
    assert bound.tokens == [7, 8, 9, 7, 2] and bound.finish_reason == "stop"
    np.testing.assert_array_equal(free.tokens, hf_greedy(model, PROMPTS[0], 12))

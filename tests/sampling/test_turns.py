"""Conversations continued in their slots: a request that holds its slot is followed by one
that keeps some of its tokens, appends new ones to the slot's KV cache (no second prefill) and
decodes on. The continued conversation's log-probs equal one teacher-forced forward over the
whole conversation, its greedy tokens equal a fresh request's on the whole conversation, and
requests decoding beside it are unaffected."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.hf.load import load_params
from jaxrl.model.transformer import forward
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.sampling.requests import row_keys
from tests.tiny_models import make_model

# per conversation: its prompt, then per later turn (tokens kept of the previous turn, tokens
# the environment appends); None keeps the whole previous turn
CONVERSATIONS = [
    ([5, 9, 31, 7, 100], [(None, [40, 41, 42]), (3, [7, 8])]),
    ([17, 2, 88, 19], [(2, [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71])]),
    ([64, 3], [(5, [9]), (None, [11, 12, 13])]),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("turns_model")
    make_model("llama").save_pretrained(path)
    return load_params(path)


WIDTH = 64  # every engine here has 64 cache columns (one set of programs for all tests)


def _teacher_forced(params, spec, conversations, temperature):
    """Per conversation (tokens, sampled positions, ...): log_softmax(logits / T)[next token] at
    its positions, by one forward over all conversations right-padded to WIDTH (causal: the
    padding after a conversation changes none of its logits)."""
    ids = np.zeros((len(conversations), WIDTH), np.int32)
    for row, (tokens, *_) in enumerate(conversations):
        ids[row, :len(tokens)] = tokens
    logits = forward(params, jnp.asarray(ids), jnp.arange(WIDTH)[None].repeat(len(ids), 0),
                     spec)[0]
    logp = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))
    return [logp[row, np.asarray(p) - 1, ids[row, p]]
            for row, (_, p, *_) in enumerate(conversations)]


def _engine(params, spec):
    return Engine(params, spec, slots=4, capacity=WIDTH, chunk=4)


def _converse(engine, decoding, budget=6, seed=0):
    """Run every conversation turn by turn, all in the engine together, plus one plain request
    decoding beside them. Returns per conversation (its whole token list, the positions the
    engine sampled, their log-probs, where its last turn's tokens start) and the plain request."""
    keys = row_keys(jax.random.PRNGKey(seed), range(10))
    plain = engine.submit(Request([3, 1, 4, 1, 5], decoding, 12, keys[9]))
    turns = [[engine.submit(Request(p, decoding, budget, keys[i], hold=True))]
             for i, (p, _) in enumerate(CONVERSATIONS)]
    for t in range(2):
        engine.run()
        for i, (_, later) in enumerate(CONVERSATIONS):
            if t < len(later):
                keep, appended = later[t]
                turns[i].append(engine.submit(Request(
                    appended, decoding, budget, row_keys(keys[i], [t + 1])[0], hold=True,
                    follows=turns[i][-1], keep=keep)))
    engine.run()
    out = []
    for (prompt, _), requests in zip(CONVERSATIONS, turns):
        tokens, policy, logprobs = list(prompt), [], []
        for r, nxt in zip(requests, requests[1:] + [None]):
            kept = len(r.tokens) if nxt is None else nxt.kept()
            last_start = len(tokens)
            policy += range(len(tokens), len(tokens) + kept)
            tokens += r.tokens[:kept]
            logprobs += r.logprobs[:kept]
            tokens += [] if nxt is None else list(nxt.prompt)
        engine.release(requests[-1])
        out.append((tokens, policy, logprobs, last_start))
    return out, plain


def test_continued_logprobs_equal_one_forward_over_the_conversation(tiny):
    spec, params = tiny
    engine = _engine(params, spec)
    conversations, _ = _converse(engine, Decoding(0.8))
    assert engine.stats.prefills == 4 and engine.stats.continued == 5
    wants = _teacher_forced(params, spec, conversations, 0.8)
    for (_, _, logprobs, _), want in zip(conversations, wants):
        np.testing.assert_allclose(logprobs, want, atol=1e-5, rtol=0)


def test_greedy_continuation_equals_a_fresh_prefill_and_neighbours_are_unaffected(tiny):
    spec, params = tiny
    engine = _engine(params, spec)
    conversations, plain = _converse(engine, Decoding(0.0))
    alone = _engine(params, spec)
    plain_alone = alone.submit(Request([3, 1, 4, 1, 5], Decoding(0.0), 12))
    alone.run()
    assert plain.tokens == plain_alone.tokens
    for tokens, _, _, last_start in conversations:
        fresh = alone.submit(Request(tokens[:last_start], Decoding(0.0),
                                     len(tokens) - last_start))
        alone.run()
        assert fresh.tokens == tokens[last_start:]


def test_continuations_are_checked(tiny):
    spec, params = tiny
    engine = _engine(params, spec)
    free = engine.submit(Request([5, 6, 7], Decoding(0.0), 4))
    held = engine.submit(Request([5, 6, 7], Decoding(0.0), 4, hold=True))
    engine.run()
    with pytest.raises(ValueError, match="holds its slot"):
        engine.submit(Request([1], follows=free))
    with pytest.raises(ValueError, match="keeps between 1 and the 4 tokens"):
        engine.submit(Request([1], follows=held, keep=5))
    with pytest.raises(ValueError, match="would reach column 65"):
        engine.submit(Request([1] * 50, max_new_tokens=8, follows=held))
    engine.release(held)
    with pytest.raises(ValueError, match="not been continued or released"):
        engine.release(held)

"""Repetition, presence and frequency penalties, logit_bias and top log-probs, on numbers worked
out by hand."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.sampling.sampling_fns import (MAX_TOP_LOGPROBS, Decoding, History, RowSettings,
                                         adjust_logits, next_token)

LOGITS = jnp.asarray([[2.0, -1.0, 0.5, 3.0, -2.0]], jnp.float32)


def _history(prompt=(), generated=()):
    """One row over a 5-token vocab: the prompt's tokens, then the generated ones recorded."""
    h = History.of_prompts(jnp.asarray([list(prompt) or [0]], jnp.int32),
                           jnp.asarray([len(prompt)], jnp.int32), 5)
    for t in generated:
        h = h.record(jnp.asarray([t]), jnp.asarray([True]))
    return h


def _adjust(history, **decoding):
    return np.asarray(adjust_logits(LOGITS, RowSettings.of([Decoding(**decoding)]), history))[0]


def test_history_marks_the_prompt_and_counts_generated_tokens():
    h = _history(prompt=[1, 3, 3], generated=[0, 3, 0])
    np.testing.assert_array_equal(h.prompt[0], [False, True, False, True, False])
    np.testing.assert_array_equal(h.counts[0], [2, 0, 0, 1, 0])
    dead = h.record(jnp.asarray([4]), jnp.asarray([False]))  # a finished slot records nothing
    np.testing.assert_array_equal(dead.counts[0], [2, 0, 0, 1, 0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # seen: 1 (prompt, -1.0) and 3 (generated, 3.0); r = 2 -> -2.0 and 1.5; 0, 2, 4 unchanged
    got = _adjust(_history(prompt=[1], generated=[3]), repetition_penalty=2.0)
    np.testing.assert_allclose(got, [2.0, -2.0, 0.5, 1.5, -2.0])


def test_presence_and_frequency_count_generated_tokens_only():
    # counts [2, 0, 0, 1, 0]; token 1 is only in the prompt, so it keeps -1.0
    # token 0: 2.0 - 0.5 * 1 - 0.25 * 2 = 1.0; token 3: 3.0 - 0.5 - 0.25 = 2.25
    got = _adjust(_history(prompt=[1], generated=[0, 3, 0]), presence_penalty=0.5,
                  frequency_penalty=0.25)
    np.testing.assert_allclose(got, [1.0, -1.0, 0.5, 2.25, -2.0])
    # negative penalties encourage repeats: token 0 gains 1.0 + 2 * 1.0
    got = _adjust(_history(generated=[0, 0]), presence_penalty=-1.0, frequency_penalty=-1.0)
    np.testing.assert_allclose(got, [5.0, -1.0, 0.5, 3.0, -2.0])


def test_logit_bias_adds_to_the_named_tokens_after_the_penalties():
    # token 3: 3.0 / 2 (repetition) - 100 = -98.5; token 4: -2.0 + 7.5 = 5.5
    got = _adjust(_history(generated=[3]), repetition_penalty=2.0,
                  logit_bias=((3, -100.0), (4, 7.5)))
    np.testing.assert_allclose(got, [2.0, -1.0, 0.5, -98.5, 5.5])


def test_greedy_follows_the_adjusted_logits_and_the_logprob_stays_raw():
    keys = jax.random.split(jax.random.PRNGKey(0), 1)
    settings = RowSettings.of([Decoding(temperature=0.0, logit_bias=((2, 10.0),))])
    picked = next_token(keys, LOGITS, settings, _history())
    assert int(picked.token[0]) == 2  # 0.5 + 10 beats 3.0
    np.testing.assert_allclose(picked.logprob, jax.nn.log_softmax(LOGITS)[:, 2], atol=1e-6)


def test_rows_keep_their_own_penalties():
    """Two rows, one penalized: the other adjusts nothing."""
    logits = jnp.concatenate([LOGITS, LOGITS])
    history = jax.tree_util.tree_map(lambda a: jnp.concatenate([a, a]), _history(generated=[3]))
    settings = RowSettings.of([Decoding(frequency_penalty=2.0), Decoding()])
    got = np.asarray(adjust_logits(logits, settings, history))
    np.testing.assert_allclose(got, [[2.0, -1.0, 0.5, 1.0, -2.0], LOGITS[0]])


def test_top_logprobs_are_the_best_tokens_of_the_tempered_distribution():
    logits = jnp.asarray(np.random.RandomState(0).randn(2, 64) * 3, jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    settings = RowSettings.of([Decoding(temperature=0.5, top_logprobs=3), Decoding(0.5)])
    picked = next_token(keys, logits, settings, History.empty(2, 64))
    logp = np.asarray(jax.nn.log_softmax(logits / 0.5))
    best = np.argsort(-logp, axis=-1)[:, :MAX_TOP_LOGPROBS]
    np.testing.assert_array_equal(picked.top_ids, best)
    np.testing.assert_allclose(picked.top_logprobs, np.take_along_axis(logp, best, -1),
                               atol=1e-5)


@pytest.mark.parametrize("field,value", [("repetition_penalty", 0.0), ("top_logprobs", 21),
                                         ("logit_bias", ((1, 1.0),) * 301),
                                         ("logit_bias", ((-1, 1.0),))])
def test_decoding_checks_the_new_fields(field, value):
    with pytest.raises(ValueError, match=field):
        Decoding(**{field: value})

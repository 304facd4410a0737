"""The reference pass and the update take only the columns that are not padding in every row
(`Rollout.columns`): prompts padded to a power of two lose their all-padding left columns down
to a quarter bucket, completions lose the columns after every row's end down to a power of two,
and nothing kept changes: the same reference log-probs, loss and gradients as on the full
padded rows."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import GrpoConfig
from jaxrl.lora.lora import init_lora
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import init_params
from jaxrl.model.transformer import positions_from_mask
from jaxrl.rl.loop import make_batch
from jaxrl.rl.losses import token_weights
from jaxrl.rl.rollout import Rollout
from jaxrl.rl.train_step import Batch, StepOptions, accumulate_grads, compile_reference
from jaxrl.sampling.buckets import left_pad
from jaxrl.sampling.sampler import SampleOutput
from tests.tiny_models import hf_config

WIDTH, NEW = 64, 48  # the sampler's prompt bucket and max_new_tokens
PROMPTS, ENDS = (20, 29, 7, 11), (9, 3, 17, 1)  # prompt lengths; each row's completion length


def _rollout() -> Rollout:
    rng = np.random.RandomState(0)
    tokens, mask = left_pad([list(rng.randint(3, 128, n)) for n in PROMPTS], WIDTH)
    done = np.arange(NEW)[None, :] < np.asarray(ENDS)[:, None]
    out = SampleOutput(prompt_tokens=tokens, prompt_mask=mask,
                       tokens=np.where(done, rng.randint(3, 128, (4, NEW)), 0).astype(np.int32),
                       mask=done, logprobs=np.where(done, -1.5, 0.0).astype(np.float32),
                       finish_reasons=("stop",) * 4, texts=("",) * 4)
    return Rollout(0, [{}] * 4, [""] * 4, out)


def test_columns_keep_the_longest_prompt_and_completion_in_their_buckets():
    rollout = _rollout()
    assert rollout.columns == (WIDTH - 32, 32)  # 29 -> 32 (a quarter bucket), 17 -> 32
    short = dataclasses.replace(rollout, out=dataclasses.replace(
        rollout.out, mask=rollout.out.mask & (np.arange(NEW) < 2)))
    assert short.columns == (WIDTH - 32, 16)  # never under 16 columns
    empty = dataclasses.replace(rollout, out=dataclasses.replace(
        rollout.out, mask=np.zeros_like(rollout.out.mask)))
    assert empty.columns[1] == 16


@pytest.fixture(scope="module")
def model():
    spec = spec_from_hf_config(hf_config("llama").to_dict())
    return spec, init_params(spec, jax.random.PRNGKey(0), std=0.2)


def _full_batch(rollout: Rollout, advantages, ref_logp) -> Batch:
    out = rollout.out
    tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = np.concatenate([out.prompt_mask, out.mask], axis=1)
    rows = (tokens, np.asarray(positions_from_mask(mask)), mask, out.mask, out.logprobs,
            advantages)
    return Batch(*map(jnp.asarray, rows), ref_logp=ref_logp)


def test_trimmed_rows_give_the_full_rows_reference_loss_and_gradients(model):
    spec, params = model
    rollout, advantages = _rollout(), np.array([1.0, -0.5, 0.25, -0.75], np.float32)
    first, width = rollout.columns
    opts = StepOptions(GrpoConfig(beta=0.04), temperature=1.0, max_new_tokens=NEW)
    full = _full_batch(rollout, advantages, None)
    full_ref = compile_reference(spec, opts)(params, full.tokens, full.positions, full.attn_mask)
    short = make_batch(rollout, advantages, np.ones(4))
    assert short.tokens.shape == (4, WIDTH - first + width) == (4, 64)  # from 112 columns
    short_ref = compile_reference(spec, opts, width=width)(params, short.tokens,
                                                           short.positions, short.attn_mask)
    assert short_ref.shape == (4, width)
    done = rollout.out.mask[:, :width]
    np.testing.assert_allclose(np.where(done, short_ref, 0), np.where(done, full_ref[:, :width],
                                                                      0), atol=2e-5)
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=4, alpha=8)
    lora = lora.replace(weights=jax.tree_util.tree_map(lambda x: x + 0.05, lora.weights))
    results = []
    for loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        grpo = GrpoConfig(beta=0.04, loss_agg=loss_agg)
        step = dataclasses.replace(opts, grpo=grpo)
        for batch in (dataclasses.replace(full, ref_logp=full_ref),
                      dataclasses.replace(short, ref_logp=short_ref)):
            weights = token_weights(batch.completion_mask, loss_agg, NEW)
            results.append(accumulate_grads(lora, params, spec, batch, weights, step))
    for ((loss_a, m_a), g_a), ((loss_b, m_b), g_b) in (results[0:2], results[2:4]):
        assert np.isclose(loss_a, loss_b, rtol=1e-5, atol=1e-6)
        assert np.isclose(m_a["kl"], m_b["kl"], rtol=1e-4, atol=1e-7)
        assert m_a["tokens"] == m_b["tokens"] == sum(ENDS)
        for a, b in zip(jax.tree_util.tree_leaves(g_a), jax.tree_util.tree_leaves(g_b)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

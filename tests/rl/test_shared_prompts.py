"""A group's G rows hold one prompt: the reference pass and the update run it once per block of
rows that share it (`Batch.share`, `prefix_hidden_states`), and that changes no log-prob,
entropy, loss or gradient; which rows share is found on the host (`Rollout.share`) within the
limits of groups, micro-batches, mesh shards and LoRA dropout (`prompt_share_limit`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import GrpoConfig, load_config
from jaxrl.model.transformer import hidden_states, positions_from_mask, prefix_hidden_states
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.losses import token_weights
from jaxrl.rl.rollout import Rollout
from jaxrl.rl.session import prompt_share_limit
from jaxrl.rl.train_step import Batch, StepOptions, accumulate_grads, compile_reference
from jaxrl.sampling.buckets import left_pad
from jaxrl.sampling.sampler import SampleOutput
from tests.tiny_models import tiny_llama_with_lora

G, P, N = 4, 16, 12
PROMPTS = (5, 16, 9)  # prompt lengths (left-padded to P), each prompt G rows


@pytest.fixture(scope="module")
def model():
    return tiny_llama_with_lora()


def _rows(seed: int = 0):
    """tokens, positions, mask [B, P + N] of G rows per prompt, and the completion mask."""
    rng = np.random.RandomState(seed)
    prompts = [list(rng.randint(3, 128, n)) for n in PROMPTS]
    prompt_tokens, prompt_mask = left_pad([p for p in prompts for _ in range(G)], P)
    done = np.arange(N)[None] < rng.randint(1, N + 1, len(prompt_tokens))[:, None]
    tokens = np.concatenate([prompt_tokens, np.where(done, rng.randint(3, 128, done.shape), 0)], 1)
    mask = np.concatenate([prompt_mask, done], 1)
    return (jnp.asarray(tokens, jnp.int32), positions_from_mask(jnp.asarray(mask)),
            jnp.asarray(mask), done)


def test_prefix_hidden_states_are_the_rows_hidden_states(model):
    spec, params, lora = model
    tokens, positions, mask, _ = _rows()
    whole, _ = hidden_states(params, tokens, positions, spec, attn_mask=mask, lora=lora)
    prefix, rest = prefix_hidden_states(params, tokens, positions, spec, prefix=P, share=G,
                                        attn_mask=mask, lora=lora)
    assert prefix.shape == (len(PROMPTS), P, spec.hidden_size)
    valid = np.asarray(mask[::G, :P])[..., None]  # pad queries attend to nothing: not compared
    np.testing.assert_allclose(np.where(valid, prefix, 0), np.where(valid, whole[::G, :P], 0),
                               atol=2e-5)
    np.testing.assert_allclose(rest, whole[:, P:], atol=2e-5)
    with pytest.raises(ValueError, match="blocks of 5 rows"):
        prefix_hidden_states(params, tokens, positions, spec, prefix=P, share=5)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_shared_prompts_give_the_same_logprobs_entropies_and_gradients(model, remat):
    spec, params, lora = model
    tokens, positions, mask, done = _rows()
    weight = np.where(done, np.arange(1, N + 1), 0)  # each position its own weight

    def objective(lora, share):
        logp, entropy = token_logprobs(params, spec, tokens, positions, mask, lora, start=P,
                                       with_entropy=True, remat=remat, share=share)
        return jnp.sum(logp * weight) + 0.1 * jnp.sum(entropy * done), (logp, entropy)

    results = {share: jax.value_and_grad(objective, has_aux=True)(lora, share)
               for share in (1, 2, G)}
    (value, (logp, entropy)), grads = results[1]
    for share in (2, G):
        (v, (lp, ent)), g = results[share]
        assert np.isclose(v, value, rtol=1e-6)
        np.testing.assert_allclose(np.where(done, lp, 0), np.where(done, logp, 0), atol=2e-5)
        np.testing.assert_allclose(np.where(done, ent, 0), np.where(done, entropy, 0), atol=2e-5)
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(grads)):
            np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()))


def test_shared_update_and_reference_match_micro_batched_rows(model):
    spec, params, lora = model
    tokens, positions, mask, done = _rows(1)
    rows = len(tokens)
    opts = StepOptions(GrpoConfig(beta=0.04), temperature=1.0, max_new_tokens=N, micro_batches=3)
    refs = [compile_reference(spec, opts, share=share)(params, tokens, positions, mask)
            for share in (1, G)]
    np.testing.assert_allclose(np.where(done, refs[1], 0), np.where(done, refs[0], 0), atol=2e-5)
    rng = np.random.RandomState(2)
    batch = Batch(tokens, positions, mask, jnp.asarray(done),
                  jnp.asarray(rng.normal(-3, 0.3, (rows, N)), jnp.float32),
                  jnp.asarray(rng.normal(size=rows), jnp.float32), ref_logp=refs[0])
    weights = token_weights(batch.completion_mask, opts.grpo.loss_agg, N)
    (loss_a, m_a), g_a = accumulate_grads(lora, params, spec, batch, weights, opts)
    (loss_b, m_b), g_b = accumulate_grads(lora, params, spec, batch.replace(share=G), weights,
                                          opts)
    assert np.isclose(loss_a, loss_b, rtol=1e-5) and np.isclose(m_a["kl"], m_b["kl"], rtol=1e-4)
    for a, b in zip(jax.tree_util.tree_leaves(g_a), jax.tree_util.tree_leaves(g_b)):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(a).max()))


def _rollout(prompt_rows: list[list[int]]) -> Rollout:
    tokens, mask = left_pad(prompt_rows, 8)
    b = len(prompt_rows)
    out = SampleOutput(prompt_tokens=tokens, prompt_mask=mask, tokens=np.zeros((b, 4), np.int32),
                       mask=np.ones((b, 4), bool), logprobs=np.zeros((b, 4), np.float32),
                       finish_reasons=("length",) * b, texts=("",) * b)
    return Rollout(0, [{}] * b, [""] * b, out)


def test_rollout_share_finds_the_blocks_of_one_prompt():
    a, b = [5, 6, 7], [5, 6, 8]
    assert _rollout([a] * 4 + [b] * 4).share(4) == 4
    assert _rollout([a] * 4 + [b] * 4).share(2) == 2  # within the limit
    assert _rollout([a] * 2 + [b] * 2 + [a] * 4).share(4) == 2  # largest block that holds
    assert _rollout([a, b] * 4).share(4) == 1  # rows of a prompt not next to each other
    assert _rollout([a] * 3 + [a[1:]] + [b] * 4).share(4) == 1  # a shorter prompt: its own
    assert _rollout([a] * 6).share(4) == 2  # 4 does not divide 6 rows


def test_prompt_share_limit_respects_groups_micro_batches_shards_and_dropout():
    def limit(*overrides, ways=None, local=16):
        cfg = load_config(None, ["data.prompts_per_step=4", "grpo.num_generations=4",
                                 *overrides])
        rules = None if ways is None else type("Rules", (), {"batch_ways": ways})()
        return prompt_share_limit(cfg, rules, local)

    assert limit() == 4
    assert limit("optim.micro_batch_size=2") == 2  # a micro-batch holds half a group
    assert limit(ways=2) == 4 and limit(ways=8) == 2 and limit(ways=32) == 1
    assert limit(local=2) == 2  # a process holds two rows of a group
    assert limit("lora.dropout=0.1") == 1  # masks are drawn per row

"""Multi-turn trajectories: environment tokens are context, not actions. Through the policy mask
(SampleOutput.policy_mask -> the batch's completion mask) they add nothing to the loss, the KL
or the gradient, worked out by hand and checked on a model's whole-trajectory forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import GrpoConfig
from jaxrl.lora.lora import init_lora
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import init_params
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.loop import make_batch
from jaxrl.rl.losses import grpo_loss, token_weights
from jaxrl.rl.rollout import Rollout
from jaxrl.rl.train_step import StepOptions, accumulate_grads
from jaxrl.sampling.sampler import SampleOutput
from tests.tiny_models import hf_config

LN2 = np.log(2.0)
# two trajectories of 5 completion positions: P policy, E environment, - padding
#   row 0: P P E E P     row 1: P E E P -
POLICY = np.array([[1, 1, 0, 0, 1], [1, 0, 0, 1, 0]], bool)
VALID = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], bool)
JUNK = 7.0  # what the sampler's row holds at environment positions must not matter


def _inputs():
    ratio = np.array([[1.0, 1.1, 1.0, 1.0, 0.9], [1.2, 1.0, 1.0, 1.0, 1.0]])
    logp = np.where(POLICY, np.log(ratio), JUNK)
    ref = logp.copy()
    ref[0, 0] = np.log(0.5)  # the one token with a KL: d = ref - logp = ln(1/2)
    return (jnp.asarray(logp, jnp.float32), jnp.zeros((2, 5)), jnp.asarray([1.0, -1.0]),
            jnp.asarray(ref, jnp.float32))


def test_environment_tokens_add_no_loss_kl_or_gradient_by_hand():
    logp, old, adv, ref = _inputs()
    cfg = GrpoConfig(beta=0.5, epsilon_low=0.2, epsilon_high=0.28)
    mask = jnp.asarray(POLICY)

    def loss_fn(lp):
        return grpo_loss(lp, old, adv, mask, cfg, ref_logp=ref,
                         weights=token_weights(mask, "seq-mean-token-mean"))

    # every ratio is inside [0.8, 1.28], so per policy token: -r * A + beta * k3
    # row 0 (A = 1): -1.0 + 0.5 * (0.5 + ln 2 - 1), -1.1, -0.9; mean over its 3 tokens
    # row 1 (A = -1): 1.2, 1.0; mean over its 2 tokens
    row0 = (-1.0 + 0.5 * (0.5 + LN2 - 1) - 1.1 - 0.9) / 3
    loss, metrics = loss_fn(logp)
    assert np.isclose(loss, (row0 + 1.1) / 2, atol=1e-6)  # 0.0660956
    assert np.isclose(metrics["kl"], (0.5 + LN2 - 1) / 5, atol=1e-6)  # over the 5 policy tokens
    # d/d logp: (-r * A + beta * (1 - exp(d))) / len / rows at policy tokens, 0 elsewhere
    grad = jax.grad(lambda lp: loss_fn(lp)[0])(logp)
    want = [[(-1.0 + 0.5 * 0.5) / 6, -1.1 / 6, 0, 0, -0.9 / 6], [1.2 / 4, 0, 0, 1.0 / 4, 0]]
    np.testing.assert_allclose(grad, want, atol=1e-6)
    unmasked, _ = grpo_loss(logp, old, adv, jnp.asarray(VALID), cfg, ref_logp=ref,
                            weights=token_weights(jnp.asarray(VALID), "seq-mean-token-mean"))
    assert not np.isclose(unmasked, loss)  # counted as actions they would change it


@pytest.fixture(scope="module")
def model():
    spec = spec_from_hf_config(hf_config("llama").to_dict())
    return spec, init_params(spec, jax.random.PRNGKey(0), std=0.2)


def _rollout(logprobs, ref_junk: float):
    rng = np.random.RandomState(0)
    out = SampleOutput(prompt_tokens=rng.randint(3, 128, (2, 4)).astype(np.int32),
                       prompt_mask=np.ones((2, 4), bool),
                       tokens=rng.randint(3, 128, (2, 5)).astype(np.int32), mask=VALID,
                       logprobs=np.where(POLICY, logprobs, ref_junk).astype(np.float32),
                       finish_reasons=("stop", "stop"), texts=("", ""), policy_mask=POLICY)
    return Rollout(0, [{}, {}], ["", ""], out,
                   jnp.asarray(np.where(POLICY, logprobs - 0.1, ref_junk), jnp.float32))


def test_a_trajectory_trains_on_its_policy_tokens_in_one_forward(model):
    spec, params = model
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=4, alpha=8)
    lora = lora.replace(weights=jax.tree_util.tree_map(lambda x: x + 0.1, lora.weights))
    opts = StepOptions(GrpoConfig(beta=0.04), temperature=1.0, max_new_tokens=5)
    first = _rollout(np.zeros((2, 5)), 0.0)
    batch = make_batch(first, np.array([1.0, -1.0]), np.ones(2))
    np.testing.assert_array_equal(batch.completion_mask, POLICY)  # the loss mask
    np.testing.assert_array_equal(batch.attn_mask[:, 4:], VALID)  # the context
    logp = token_logprobs(params, spec, batch.tokens, batch.positions, batch.attn_mask, lora,
                          start=4)[0]
    results = []
    for junk in (0.0, -40.0):  # what environment positions hold in pi_old and the reference
        rollout = _rollout(np.asarray(logp), junk)
        batch = make_batch(rollout, np.array([1.0, -1.0]), np.ones(2))
        weights = token_weights(batch.completion_mask, "seq-mean-token-mean")
        results.append(accumulate_grads(lora, params, spec, batch, weights, opts))
    (loss_a, metrics_a), grads_a = results[0]
    (loss_b, metrics_b), grads_b = results[1]
    assert np.isclose(loss_a, loss_b) and np.isclose(metrics_a["kl"], metrics_b["kl"])
    assert metrics_a["tokens"] == POLICY.sum()
    for a, b in zip(jax.tree_util.tree_leaves(grads_a), jax.tree_util.tree_leaves(grads_b)):
        np.testing.assert_array_equal(a, b)

"""GRPO learns: a tiny random model raises a synthetic reward from chance to above 0.8."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import GrpoConfig, OptimConfig, SamplingConfig
from jaxrl.lora.lora import init_lora
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import init_params
from jaxrl.rl.advantages import compute_advantages
from jaxrl.rl.loop import make_batch
from jaxrl.rl.rollout import Rollout
from jaxrl.rl.train_step import StepOptions, compile_train_step, init_train_state, make_optimizer
from jaxrl.sampling.sampler import sample
from tests.tiny_models import hf_config

TARGET, PROMPTS, G, NEW = 7, 4, 8, 8


def test_grpo_raises_reward_from_chance_to_above_0_8():
    """reward = share of completion tokens equal to TARGET; chance is 1/128."""
    spec = spec_from_hf_config(hf_config("llama").to_dict())
    # std 0.2, not 0.02: with a near-zero frozen LM head no adapter can move the logits far
    # enough (RMS-normed hidden states times tiny head rows), and nothing could be learned
    params = init_params(spec, jax.random.PRNGKey(0), std=0.2)
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=8, alpha=16)
    optimizer, _ = make_optimizer(OptimConfig(lr=3e-2, max_grad_norm=1.0), total_steps=60)
    grpo = GrpoConfig(num_generations=G, beta=0.0)
    step_fn = compile_train_step(spec, optimizer, StepOptions(grpo, 1.0, NEW))
    state = init_train_state(lora, optimizer)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW)
    rng = np.random.RandomState(0)
    history = []
    for step in range(60):
        prompts = [list(rng.randint(3, 128, 5)) for _ in range(PROMPTS) for _ in range(G)]
        out = sample(params, spec, prompts, jax.random.PRNGKey(100 + step), sampling,
                     lora=state.lora)
        rewards = ((out.tokens == TARGET) & out.mask).sum(1) / np.maximum(out.mask.sum(1), 1)
        history.append(float(rewards.mean()))
        if np.mean(history[-3:]) > 0.8:
            break
        adv = compute_advantages(jnp.asarray(rewards, jnp.float32), G)
        batch = make_batch(Rollout(step, [], [], out), np.asarray(adv.advantages),
                           np.asarray(adv.keep))
        state, _ = step_fn(state, params, batch)
    assert history[0] < 0.1, history[:3]  # near chance at the start
    assert np.mean(history[-3:]) > 0.8, history

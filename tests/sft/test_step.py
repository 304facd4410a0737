"""The SFT update: only loss tokens reach the gradient, micro-batches equal the whole batch."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.logprobs import token_logprobs
from jaxrl.sft.step import SftBatch, SftOptions, loss_weights, sft_loss, sum_over_micro_batches
from tests.tiny_models import tiny_llama_with_lora

T = 12


@pytest.fixture(scope="module")
def setup():
    spec, params, lora = tiny_llama_with_lora()
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, 128, (4, T)).astype(np.int32)
    attn = np.ones((4, T), bool)
    attn[1, 9:] = False  # right padding
    loss = np.zeros((4, T), bool)
    loss[:, 4:8] = True  # an assistant turn; tokens 8.. (a later user turn) are not trained on
    loss[1, 8:] = False
    return spec, params, lora, SftBatch(*map(jnp.asarray, (tokens, attn, loss)))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _grads(spec, params, lora, batch, micro=1):
    fn = jax.value_and_grad(sft_loss, has_aux=True)
    return sum_over_micro_batches(lambda i, mb, w: fn(lora, params, spec, mb, w, SftOptions()),
                                  (batch, loss_weights(batch)), micro)


def test_masked_tokens_contribute_nothing_to_loss_or_gradient(setup):
    spec, params, lora, batch = setup
    (loss, metrics), grads = _grads(spec, params, lora, batch)
    # rewrite every token after the last loss token: targets the mask excludes, and (causal)
    # context of no loss token
    changed = batch.replace(tokens=batch.tokens.at[:, 8:].set(5))
    (loss2, _), grads2 = _grads(spec, params, lora, changed)
    assert float(loss) == float(loss2) and float(metrics["tokens"]) == 4 * 4
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads2)):
        np.testing.assert_array_equal(a, b)
    # and the loss is the mean negative log-prob of exactly the loss tokens
    logp, _ = jax.jit(token_logprobs, static_argnums=1)(
        params, spec, batch.tokens, jnp.cumsum(batch.attn_mask, 1) - 1, batch.attn_mask, lora)
    np.testing.assert_allclose(float(loss), -float(logp[:, 3:7].mean()), rtol=1e-6)
    assert max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(grads)) > 0


def test_micro_batches_equal_the_whole_batch(setup):
    spec, params, lora, batch = setup
    (loss1, _), g1 = _grads(spec, params, lora, batch)
    (loss2, _), g2 = _grads(spec, params, lora, batch, 2)
    np.testing.assert_allclose(float(loss1), float(loss2), rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-6 * float(jnp.abs(a).max()))


def test_an_nf4_base_trains_as_its_dequantized_weights(setup):
    from jaxrl.model.params import LINEAR_NAMES
    from jaxrl.quant.nf4 import quantize_np
    from jaxrl.quant.qparams import dequantize_params

    spec, params, lora, batch = setup
    layers = {name: dict(p, kernel=quantize_np(np.asarray(p["kernel"]), 64, "nf4"))
              if name in LINEAR_NAMES else p for name, p in params["layers"].items()}
    nf4 = {**params, "layers": layers}
    (loss, _), grads = _grads(spec, nf4, lora, batch)
    (dense_loss, _), dense_grads = _grads(spec, dequantize_params(nf4, jnp.float32), lora, batch)
    np.testing.assert_allclose(float(loss), float(dense_loss), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(dense_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()))


@pytest.mark.slow
def test_lora_dropout_applies_with_a_key_per_update(setup):
    from jaxrl.config import OptimConfig
    from jaxrl.rl.train_step import init_train_state, make_optimizer
    from jaxrl.sft.step import compile_sft_step

    spec, params, lora, batch = setup
    optimizer, _ = make_optimizer(OptimConfig(lr=1e-3), total_steps=4)

    def grad_norm(dropout, updates_before=0):
        fresh = jax.tree_util.tree_map(jnp.copy, lora)  # the step donates its state
        state = init_train_state(fresh.replace(dropout=dropout), optimizer)
        state = state.replace(step=state.step + updates_before)
        step = compile_sft_step(spec, optimizer, SftOptions(seed=3))
        return float(step(state, params, batch)[1]["grad_norm"])

    plain, dropped = grad_norm(0.0), grad_norm(0.5)
    assert not np.isclose(plain, dropped, rtol=1e-3)  # applied, not ignored
    assert grad_norm(0.5) == dropped and not np.isclose(grad_norm(0.5, 1), dropped, rtol=1e-3)

"""On 8 fake CPU devices, each mesh gives the single-device results: forward logits, greedy
samples and one GRPO step (loss, gradients, updated LoRA), float32, 1e-5."""
import functools

import jax
import numpy as np
import optax
import pytest

from jaxrl.config import MeshConfig
from jaxrl.model.transformer import forward, positions_from_mask
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.train_step import Batch, compile_train_step
from jaxrl.sampling.buckets import left_pad
from jaxrl.sampling.sampler import sample
from jaxrl.sharding import (MeshRules, make_mesh, param_shardings, place, row_shardings,
                            step_shardings)
from tests.sharding.common import GREEDY, OPTS, ROWS, SPEC, model, optimizer_state, prompts

MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)]
TOL = dict(rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=4)
def _reference(params, tokens, positions, mask, start):
    return token_logprobs(params, SPEC, tokens, positions, mask, None, start=start)[0]


def _batch(params, lora, out) -> Batch:
    tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = np.concatenate([out.prompt_mask, out.mask], axis=1)
    positions = np.asarray(positions_from_mask(mask))
    ref = _reference(params, tokens, positions, mask, out.prompt_tokens.shape[1])
    rng = np.random.RandomState(3)
    return Batch(tokens=tokens, positions=positions, attn_mask=mask, completion_mask=out.mask,
                 logp_old=np.asarray(ref) + rng.normal(0, 0.05, out.mask.shape).astype(np.float32),
                 advantages=rng.normal(size=ROWS).astype(np.float32), ref_logp=np.asarray(ref))


def _run(rules: MeshRules | None, batch: Batch | None = None):
    """(logits, greedy sample, step metrics, new state, batch) with params and adapter on
    `rules`; the batch is built from the sample unless given (its reference pass is the same
    program on every mesh, so the meshes reuse the single device's)."""
    params, lora = model()
    optimizer, state = optimizer_state(lora)
    tokens, mask = left_pad(prompts(), 16)
    positions = positions_from_mask(mask)
    fwd = jax.jit(functools.partial(forward, spec=SPEC))
    if rules is not None:
        params = place(params, param_shardings(rules, params, SPEC))
        tokens, mask, positions = place((tokens, mask, positions),
                                        row_shardings(rules, (tokens, mask, positions)))
    out = sample(params, SPEC, prompts(), jax.random.PRNGKey(0), GREEDY, lora=lora,
                 eos_ids=(2,), shardings=rules)
    batch = _batch(params, lora, out) if batch is None else batch
    shardings = None
    if rules is not None:
        shardings = step_shardings(rules, state, params, SPEC, optimizer, ROWS)
        state, batch = place((state, batch), (shardings[0][0], row_shardings(rules, batch)))
    logits = fwd(params, tokens, positions, attn_mask=mask, lora=lora)[0]
    step = compile_train_step(SPEC, optimizer, OPTS, shardings)
    new_state, metrics = step(state, params, batch)
    return jax.device_get((logits, out, metrics, new_state, batch))


@pytest.fixture(scope="module")
def single():
    return _run(None)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_mesh_matches_single_device(single, shape):
    rules = MeshRules(make_mesh(MeshConfig(*shape)))
    ref_logits, ref_out, ref_metrics, ref_state, batch = single
    logits, out, metrics, state, _ = _run(rules, batch)
    np.testing.assert_allclose(logits, ref_logits, **TOL)
    np.testing.assert_array_equal(out.tokens, ref_out.tokens)
    np.testing.assert_array_equal(out.mask, ref_out.mask)
    np.testing.assert_allclose(out.logprobs, ref_out.logprobs, **TOL)
    for key in ("loss", "kl", "grad_norm", "entropy"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], **TOL, err_msg=key)
    grads, ref_grads = (optax.tree_utils.tree_get(s.opt_state, "mu") for s in (state, ref_state))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), grads, ref_grads)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **TOL),
                           state.lora.weights, ref_state.lora.weights)
    assert not np.allclose(state.lora.weights["layers"]["q_proj"]["b"],
                           model()[1].weights["layers"]["q_proj"]["b"])

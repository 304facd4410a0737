"""On 8 fake CPU devices, each mesh gives the single-device results: forward logits, greedy
samples and one GRPO step (loss, gradients, updated LoRA), float32, 1e-5; and the GRPO variants
(with LoRA dropout) give on a mesh the step they give on one device."""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxrl.config import GrpoConfig, MeshConfig
from jaxrl.model.transformer import forward, positions_from_mask
from jaxrl.rl.train_step import Batch, compile_train_step
from jaxrl.sampling.buckets import left_pad
from jaxrl.sampling.sampler import sample
from jaxrl.sharding import (MeshRules, make_mesh, param_shardings, place, row_shardings,
                            step_shardings)
from tests.sharding.common import (GREEDY, G, OPTS, ROWS, SPEC, assert_same_step, model,
                                   optimizer_state, prompts, step_batch)

MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)]
TOL = dict(rtol=1e-5, atol=1e-5)


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
    batch = step_batch(params, out) if batch is None else batch
    shardings = None
    if rules is not None:
        shardings = step_shardings(rules, state, params, SPEC, optimizer, ROWS)
        state, batch = place((state, batch), (shardings[0][0], row_shardings(rules, batch)))
    logits = fwd(params, tokens, positions, attn_mask=mask, lora=lora)[0]
    step = compile_train_step(SPEC, optimizer, dataclasses.replace(OPTS, mesh=rules), shardings)
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
    assert_same_step(metrics, state, ref_metrics, ref_state, TOL)


VARIANTS = {
    "gspo-kl-delta-entropy": GrpoConfig(num_generations=G, beta=0.04, epsilon_low=0.1,
                                        epsilon_high=0.1, importance_sampling="sequence",
                                        kl_ratio_weighted=True, delta=1.5,
                                        top_entropy_quantile=0.5),
    "cispo-entropy": GrpoConfig(num_generations=G, beta=0.04, loss="cispo", epsilon_low=1.0,
                                epsilon_high=0.5, loss_agg="token-mean", top_entropy_quantile=0.3),
}


def _variant_step(rules: MeshRules | None, batch: Batch, grpo: GrpoConfig):
    """(metrics, new state) of one micro-batched step with `grpo`, LoRA dropout 0.1."""
    params, lora = model()
    optimizer, state = optimizer_state(lora.replace(dropout=0.1))
    shardings = None
    if rules is not None:
        params = place(params, param_shardings(rules, params, SPEC))
        shardings = step_shardings(rules, state, params, SPEC, optimizer, ROWS)
        state, batch = place((state, batch), (shardings[0][0], row_shardings(rules, batch)))
    opts = dataclasses.replace(OPTS, grpo=grpo, seed=7, mesh=rules)
    new_state, metrics = compile_train_step(SPEC, optimizer, opts, shardings)(state, params, batch)
    return jax.device_get((metrics, new_state))


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_variants_on_a_mesh_match_single_device(single, name):
    batch = single[4]
    ref_metrics, ref_state = _variant_step(None, batch, VARIANTS[name])
    metrics, state = _variant_step(MeshRules(make_mesh(MeshConfig(2, 2, 2))), batch,
                                   VARIANTS[name])
    assert_same_step(metrics, state, ref_metrics, ref_state, TOL)
    for key in ("entropy_selected_frac", "clip_frac", "seq_clip_frac", "kl_weighted"):
        if key in ref_metrics:
            np.testing.assert_allclose(metrics[key], ref_metrics[key], **TOL, err_msg=key)

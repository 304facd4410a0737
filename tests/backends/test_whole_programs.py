"""The accelerator numerics choices as whole programs on the CPU: with the GPU's forms (on one
device its Pallas kernels, in interpret mode) and with the TPU's, a forward, greedy and seeded
decoding through the engine, and one GRPO step, on one device and on the (2, 2, 2) mesh, equal
the CPU choice's logits, tokens, log-probs, loss and LoRA gradients (the NF4 model of the mesh
tests, in float32, at their tolerance)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.backends.numerics import numerics_for
from jaxrl.config import SamplingConfig
from jaxrl.model.transformer import forward
from jaxrl.rl.train_step import compile_train_step
from jaxrl.sampling.sampler import sample
from jaxrl.sharding import place, row_shardings, step_shardings
from tests.sharding.common import (GREEDY, NEW, OPTS, ROWS, SPEC, assert_same_step, mesh_rules,
                                   optimizer_state, placed, prompts, quantized_model,
                                   step_batch)

TOL = dict(rtol=1e-5, atol=1e-5)
SETTINGS = {"greedy": GREEDY, "t0.7": SamplingConfig(temperature=0.7, max_new_tokens=NEW)}


def _run(platform: str, on_mesh: bool, batch=None):
    """(logits, {setting: sample}, step metrics, new state, batch) of the NF4 model under
    `platform`'s numerics; the batch is built from the greedy sample unless given."""
    rules = mesh_rules() if on_mesh else None
    numerics = numerics_for(platform, 8 if on_mesh else 1)
    if numerics.in_place_layers:  # Pallas GPU kernels, run by the CPU in interpret mode
        numerics = dataclasses.replace(numerics, interpret=True)
    params, lora = quantized_model()
    optimizer, state = optimizer_state(lora)
    params = placed(rules, numerics.hold(params))
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 128, (ROWS, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), tokens.shape)
    logits = jax.jit(lambda p, a: forward(p, tokens, positions, SPEC, lora=a,
                                          numerics=numerics)[0])(params, lora)
    outs = {name: sample(params, SPEC, prompts(), jax.random.PRNGKey(0), cfg, lora=lora,
                         eos_ids=(2,), shardings=rules, numerics=numerics)
            for name, cfg in SETTINGS.items()}
    batch = step_batch(params, outs["greedy"]) if batch is None else batch
    shardings = None
    if rules is not None:
        shardings = step_shardings(rules, state, params, SPEC, optimizer, ROWS)
        state, batch = place((state, batch), (shardings[0][0], row_shardings(rules, batch)))
    opts = dataclasses.replace(OPTS, mesh=rules, numerics=numerics)
    new_state, metrics = compile_train_step(SPEC, optimizer, opts, shardings)(state, params,
                                                                             batch)
    return jax.device_get((logits, outs, metrics, new_state, batch))


@pytest.fixture(scope="module")
def cpu_choice():
    return _run("cpu", on_mesh=False)


@pytest.mark.parametrize("on_mesh", [False, True], ids=["one-device", "mesh"])
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_accelerator_choice_equals_the_cpu_choice(cpu_choice, platform, on_mesh):
    logits, outs, metrics, state, _ = _run(platform, on_mesh, batch=cpu_choice[4])
    want_logits, want_outs, want_metrics, want_state, _ = cpu_choice
    np.testing.assert_allclose(logits, want_logits, **TOL)
    for name in SETTINGS:
        got, want = outs[name], want_outs[name]
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=name)
        np.testing.assert_array_equal(got.mask, want.mask, err_msg=name)
        np.testing.assert_allclose(got.logprobs, want.logprobs, **TOL, err_msg=name)
    assert_same_step(metrics, state, want_metrics, want_state, TOL)


def test_the_choices_differ_where_they_should():
    cpu, gpu, tpu = (numerics_for(p) for p in ("cpu", "gpu", "tpu"))
    assert (cpu.nf4_decode, cpu.nf4_many) == (tpu.nf4_decode, tpu.nf4_many) == ("block", "dense")
    assert (gpu.nf4_decode, gpu.nf4_many, gpu.attention) == ("kernel", "split", "pallas_gpu")
    gpu8 = numerics_for("gpu", 8)  # kernels on one device only
    assert (gpu8.nf4_decode, gpu8.attention, gpu8.in_place_layers) == ("split", "xla", False)
    assert cpu.hold_bits and not gpu.hold_bits and not tpu.hold_bits
    assert cpu.cache_dtype(jnp.bfloat16) == jnp.float32
    assert gpu.cache_dtype(jnp.bfloat16) == tpu.cache_dtype(jnp.bfloat16) == jnp.bfloat16
    assert cpu.vocab_major_head and not numerics_for("cpu", 8).vocab_major_head
    assert cpu.compiler_options("decode") and gpu.compiler_options("decode") is None
    with pytest.raises(ValueError, match="rocm"):
        numerics_for("rocm")


def test_a_jax_that_cannot_lower_the_kernels_keeps_the_xla_forms(monkeypatch):
    from jaxrl.backends import numerics

    def fails():
        raise TypeError("pallas_call() got an unexpected keyword argument 'compiler_params'")

    monkeypatch.setattr(numerics, "_lower_gpu_kernels", fails)
    numerics.gpu_kernels_unusable.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="keeps the XLA forms"):
            gpu = numerics_for("gpu")
        assert (gpu.nf4_decode, gpu.attention) == ("split", "xla") and gpu.fixed_chunk
    finally:
        numerics.gpu_kernels_unusable.cache_clear()

"""The path accelerators run, on 8 fake CPU devices: NF4 kernels (double-quantized QTensors, not
dequantized up front) dequantized per layer inside the layer scan. A (2, 2, 2) mesh gives the
single-device results: the dequantized kernels bit for bit, sampled tokens and their log-probs,
and one GRPO step (loss, gradients, updated LoRA), float32, 1e-5; and under that path the
sampler's log-probs equal the learner's teacher-forced ones."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import distributed
from jaxrl.backends.numerics import REFERENCE, numerics_for
from jaxrl.config import SamplingConfig
from jaxrl.model.families import load_spec
from jaxrl.model.params import LINEAR_NAMES, declare, flatten
from jaxrl.model.transformer import positions_from_mask
from jaxrl.quant.nf4 import QTensor, dequantize, dequantize_np
from jaxrl.quant.qparams import quantized_paths
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.train_step import Batch, compile_train_step
from jaxrl.sampling.sampler import sample
from jaxrl.sharding import (MeshRules, place, row_shardings,
                            step_shardings)
from tests.sharding.common import (GREEDY, NEW, NF4, OPTS, ROWS, SPEC, assert_same_step,
                                   mesh_rules, optimizer_state, placed, prompts,
                                   quantized_model, step_batch)
from tests.tiny_models import make_model

TOL = dict(rtol=1e-5, atol=1e-5)
SETTINGS = {"greedy": GREEDY, "t0.7": SamplingConfig(temperature=0.7, max_new_tokens=NEW)}


@jax.jit
def _dequantized_per_layer(kernels):
    """Each layer's kernels dequantized inside a scan over the layers, as the forward does."""
    def layer(_, lk):
        return None, jax.tree_util.tree_map(lambda q: dequantize(q, jnp.float32), lk,
                                            is_leaf=lambda x: isinstance(x, QTensor))
    return jax.lax.scan(layer, None, kernels)[1]


def test_dequantized_kernels_on_the_mesh_equal_one_device_bit_for_bit():
    params, _ = quantized_model()
    kernels = {name: params["layers"][name]["kernel"] for name in LINEAR_NAMES}
    assert all(isinstance(q, QTensor) and q.double_quant for q in kernels.values())
    want = {name: dequantize_np(q, np.float32) for name, q in kernels.items()}
    rules = mesh_rules()
    layers = placed(rules, params)["layers"]
    for name, dense in jax.device_get(_dequantized_per_layer(
            {name: layers[name]["kernel"] for name in LINEAR_NAMES})).items():
        np.testing.assert_array_equal(dense, want[name], err_msg=name)
    for name, dense in jax.device_get(_dequantized_per_layer(kernels)).items():
        np.testing.assert_array_equal(dense, want[name], err_msg=name)


def _span(index: slice, size: int) -> tuple[int, int]:
    return index.start or 0, size if index.stop is None else index.stop


def test_loading_onto_the_mesh_quantizes_whole_tensors(tmp_path):
    """Each process quantizes a tensor whole and places slices of its codes and scales: the
    leaves equal the single-device load; codes split like the dense kernel, so a packed byte
    (input rows 2i and 2i + 1) never straddles shards, and every device holds the scales of
    the blocks its input rows belong to (a block count its axes do not divide stays whole)."""
    make_model("qwen2").save_pretrained(tmp_path)
    spec = load_spec(tmp_path)
    rules = mesh_rules()
    one = flatten(distributed.load_params(tmp_path, spec, jnp.float32, NF4, None))
    mesh = flatten(distributed.load_params(tmp_path, spec, jnp.float32, NF4, rules))
    decls = declare(spec)
    for path in quantized_paths(spec, NF4):
        q, want = mesh[path], one[path]
        for got, leaf in zip(jax.tree_util.tree_leaves(q), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf), err_msg=path)
        assert q.codes.sharding.spec == rules.spec(decls[path].axes, decls[path].shape), path
        codes = q.codes.sharding.devices_indices_map(q.codes.shape)
        scales = q.scales.sharding.devices_indices_map(q.scales.shape)
        for device, (layers, byte_rows, cols) in codes.items():
            first, stop = (2 * i for i in _span(byte_rows, q.codes.shape[1]))
            blocks = _span(scales[device][1], q.scales.shape[1])
            assert blocks[0] * q.block_size <= first and stop <= blocks[1] * q.block_size, path
            assert (layers, cols) == (scales[device][0], scales[device][2]), path


def _run(rules: MeshRules | None, batch: Batch | None = None):
    """({setting: sample}, step metrics, new state, batch) with the NF4 params and the adapter
    on `rules`; the batch is built from the greedy sample unless given."""
    params, lora = quantized_model()
    optimizer, state = optimizer_state(lora)
    params = placed(rules, params)
    outs = {name: sample(params, SPEC, prompts(), jax.random.PRNGKey(0), cfg, lora=lora,
                         eos_ids=(2,), shardings=rules) for name, cfg in SETTINGS.items()}
    batch = step_batch(params, outs["greedy"]) if batch is None else batch
    shardings = None
    if rules is not None:
        shardings = step_shardings(rules, state, params, SPEC, optimizer, ROWS)
        state, batch = place((state, batch), (shardings[0][0], row_shardings(rules, batch)))
    step = compile_train_step(SPEC, optimizer, dataclasses.replace(OPTS, mesh=rules), shardings)
    new_state, metrics = step(state, params, batch)
    return jax.device_get((outs, metrics, new_state, batch))


def test_the_gpu_split_form_on_the_mesh_gives_the_dequantized_logits():
    """The GPU numerics multiply every NF4 kernel in qmatmul's split form (two matmuls, over the
    even and the odd input rows); on the mesh, whose tensor axis splits the inputs of o_proj and
    down_proj, it gives the logits and the adapter's gradients of the dequantized kernels on
    one device."""
    from jaxrl.model import transformer

    gpu = numerics_for("gpu", 8)
    assert gpu.nf4_decode == gpu.nf4_many == "split"
    params, lora = quantized_model()
    dense = jax.tree_util.tree_map(lambda x: dequantize(x, jnp.float32)
                                   if isinstance(x, QTensor) else x, params,
                                   is_leaf=lambda x: isinstance(x, QTensor))
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 128, (ROWS, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), tokens.shape)

    def logits(p, adapter, numerics=REFERENCE):
        return transformer.forward(p, tokens, positions, SPEC, lora=adapter,
                                   numerics=numerics)[0]

    def grads(p, adapter, numerics=REFERENCE):  # of a loss that weighs every logit differently
        weights = jnp.cos(jnp.arange(SPEC.vocab_size, dtype=jnp.float32))
        return jax.grad(lambda a: jnp.mean(logits(p, a, numerics) * weights))(adapter).weights

    want = jax.device_get((jax.jit(logits)(dense, lora), jax.jit(grads)(dense, lora)))
    meshed = placed(mesh_rules(), params)
    on_gpu = functools.partial(logits, numerics=gpu), functools.partial(grads, numerics=gpu)
    got = jax.device_get((jax.jit(on_gpu[0])(meshed, lora), jax.jit(on_gpu[1])(meshed, lora)))
    np.testing.assert_allclose(got[0], want[0], **TOL)
    for path, g in flatten(got[1]).items():
        np.testing.assert_allclose(g, flatten(want[1])[path], **TOL, err_msg=path)


@pytest.fixture(scope="module")
def single():
    return _run(None)


@pytest.fixture(scope="module")
def meshed(single):
    return _run(mesh_rules(), single[3])


def test_mesh_matches_single_device(single, meshed):
    ref_outs, ref_metrics, ref_state, _ = single
    outs, metrics, state, _ = meshed
    for name, ref in ref_outs.items():
        np.testing.assert_array_equal(outs[name].tokens, ref.tokens, err_msg=name)
        np.testing.assert_array_equal(outs[name].mask, ref.mask, err_msg=name)
        np.testing.assert_allclose(outs[name].logprobs, ref.logprobs, **TOL, err_msg=name)
    assert not np.array_equal(ref_outs["greedy"].tokens, ref_outs["t0.7"].tokens)
    assert_same_step(metrics, state, ref_metrics, ref_state, TOL)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _teacher_forced(params, lora, tokens, positions, mask, start, temperature):
    return token_logprobs(params, SPEC, tokens, positions, mask, lora, start=start,
                          temperature=temperature, remat="none")[0]


@pytest.mark.parametrize("where", ["one_device", "mesh_2x2x2"])
def test_sampler_logprobs_equal_teacher_forced_logprobs(request, where):
    rules = None if where == "one_device" else mesh_rules()
    params, lora = quantized_model()
    params = placed(rules, params)
    outs = request.getfixturevalue("single" if rules is None else "meshed")[0]
    for name, cfg in SETTINGS.items():
        out = outs[name]
        tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
        mask = np.concatenate([out.prompt_mask, out.mask], axis=1)
        positions = np.asarray(positions_from_mask(mask))
        want = _teacher_forced(params, lora, tokens, positions, mask, out.prompt_tokens.shape[1],
                               cfg.temperature or 1.0)
        np.testing.assert_allclose(np.where(out.mask, out.logprobs, 0.0),
                                   np.where(out.mask, jax.device_get(want), 0.0), **TOL,
                                   err_msg=name)

"""A tiny Qwen3-style model whose every sharded dim divides 8 (8 query and 8 KV heads, vocab
128), and the pieces of one GRPO step on it; shared by the mesh and the multi-process tests."""
from __future__ import annotations

import functools

import jax
import numpy as np
import optax

from jaxrl.config import GrpoConfig, MeshConfig, OptimConfig, QuantConfig, SamplingConfig
from jaxrl.lora.lora import init_lora
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import flatten, init_params, unflatten
from jaxrl.quant.nf4 import quantize_np
from jaxrl.quant.qparams import quantized_paths
from jaxrl.model.transformer import positions_from_mask
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.train_step import Batch, StepOptions, init_train_state, make_optimizer
from jaxrl.sharding import MeshRules, make_mesh, param_shardings, place

SPEC = spec_from_hf_config({
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "eos_token_id": 2})
ROWS, G, NEW = 8, 2, 8
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=NEW)
# No clipping, so Adam's first moment after one step is 0.1 * grad. Adam divides each gradient by
# its own magnitude, so a rounding difference in a gradient that is ~0 (a KL term of ~1e-8 on one
# layout, exactly 0 on another) would move that weight by up to lr (1e-3) on one side only;
# eps 1e-5 scales such a move below 1e-5 (the tolerance) while gradients of 1e-3 and more, the
# ones training moves, are normalized as usual.
OPTIM = OptimConfig(lr=1e-3, max_grad_norm=0.0, eps=1e-5)
OPTS = StepOptions(grpo=GrpoConfig(num_generations=G, beta=0.04), temperature=1.0,
                   max_new_tokens=NEW, micro_batches=2)


def model():
    """(params, lora) in float32; LoRA B is non-zero so the adapter changes every output."""
    params = init_params(SPEC, jax.random.PRNGKey(0), std=0.2)
    lora = init_lora(SPEC, jax.random.PRNGKey(1), rank=4, alpha=8)
    lora = lora.replace(weights=jax.tree_util.tree_map(
        lambda x: x + 0.05 if x.shape[1] == 4 else x, lora.weights))
    return params, lora


NF4 = QuantConfig(mode="nf4", block_size=64, double_quant=True, dequantize="per_layer")


def quantized_model():
    """(params, lora) of `model()` with every layer kernel an NF4 QTensor, as `jaxrl train`
    holds them with quant.dequantize=per_layer: the forward dequantizes them layer by layer."""
    params, lora = model()
    flat = flatten(params)
    for path in quantized_paths(SPEC, NF4):
        flat[path] = quantize_np(np.asarray(flat[path]), NF4.block_size, NF4.mode,
                                 NF4.double_quant)
    return unflatten(flat), lora


def mesh_rules() -> MeshRules:
    """The (2, 2, 2) mesh of the 8 test devices."""
    return MeshRules(make_mesh(MeshConfig(2, 2, 2)))


def placed(rules: MeshRules | None, tree):
    """params `tree` placed on `rules`' mesh (as they are without one)."""
    return tree if rules is None else place(tree, param_shardings(rules, tree, SPEC))


def prompts(rows: int = ROWS, seed: int = 0) -> list[list[int]]:
    """`rows` prompts of 3 to 9 tokens, each repeated G times in a row (a group per prompt)."""
    rng = np.random.RandomState(seed)
    unique = [rng.randint(3, 128, rng.randint(3, 10)).tolist() for _ in range(rows // G)]
    return [p for p in unique for _ in range(G)]


def optimizer_state(lora):
    optimizer, _ = make_optimizer(OPTIM, total_steps=10)
    return optimizer, init_train_state(lora, optimizer)


def rewards_of(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A reward computed from a row's own tokens only (as a verifier would)."""
    return ((tokens % 7) * mask).sum(axis=1).astype(np.float32) / NEW


@functools.partial(jax.jit, static_argnums=4)
def _reference(params, tokens, positions, mask, start):
    return token_logprobs(params, SPEC, tokens, positions, mask, None, start=start)[0]


def step_batch(params, out) -> Batch:
    """A GRPO batch from sample `out`: reference log-probs under params (the base), old
    log-probs near them and random advantages, both seeded."""
    tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = np.concatenate([out.prompt_mask, out.mask], axis=1)
    positions = np.asarray(positions_from_mask(mask))
    ref = _reference(params, tokens, positions, mask, out.prompt_tokens.shape[1])
    rng = np.random.RandomState(3)
    return Batch(tokens=tokens, positions=positions, attn_mask=mask, completion_mask=out.mask,
                 logp_old=np.asarray(ref) + rng.normal(0, 0.05, out.mask.shape).astype(np.float32),
                 advantages=rng.normal(size=ROWS).astype(np.float32), ref_logp=np.asarray(ref))


def assert_same_step(metrics, state, ref_metrics, ref_state, tol) -> None:
    """One GRPO step's metrics, gradients (Adam's first moment after one step) and updated
    adapter equal the reference's within tol; the adapter moved."""
    for key in ("loss", "kl", "grad_norm", "entropy"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], **tol, err_msg=key)
    grads, ref_grads = (optax.tree_utils.tree_get(s.opt_state, "mu") for s in (state, ref_state))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **tol), grads, ref_grads)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **tol),
                           state.lora.weights, ref_state.lora.weights)
    assert not np.allclose(state.lora.weights["layers"]["q_proj"]["b"],
                           model()[1].weights["layers"]["q_proj"]["b"])

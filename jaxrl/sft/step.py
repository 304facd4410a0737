"""One SFT update: token-mean cross-entropy over the loss tokens of a batch, jitted with the
train state donated, micro-batched, non-finite updates skipped (the GRPO step's machinery in
jaxrl/rl/train_step.py).

Glossary: B rows, T tokens per row (right-padded), M micro-batches of B / M rows.

Each loss token is weighted 1 / (loss tokens of the whole batch) before the batch is split,
so summing the micro-batches' losses and gradients gives the whole batch's exactly (without
LoRA dropout, whose masks are drawn per micro-batch: `dropout_key` in train_step.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxrl.backends.numerics import REFERENCE, Numerics
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import positions_from_mask
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.train_step import (TrainState, apply_gradients, dropout_key, jit_step, micro_key,
                                 sum_over_micro_batches)


@struct.dataclass
class SftBatch:
    tokens: jax.Array  # [B, T] int32, right-padded
    attn_mask: jax.Array  # [B, T] bool, real tokens
    loss_mask: jax.Array  # [B, T] bool, tokens the loss covers (assistant tokens)


@dataclasses.dataclass(frozen=True)
class SftOptions:
    micro_batches: int = 1
    logprob_chunk: int = 128
    seed: int = 0  # of the LoRA dropout keys (run.seed)
    numerics: Numerics = REFERENCE  # the backend forms (`jaxrl.backends.numerics.numerics_of`)


def loss_weights(batch: SftBatch) -> jax.Array:
    """[B, T - 1]: 1 / (loss tokens in the batch) at each target that is a loss token."""
    targets = batch.loss_mask[:, 1:].astype(jnp.float32)  # target j is token j + 1
    return targets / jnp.maximum(targets.sum(), 1.0)


def sft_loss(lora, params, spec: ModelSpec, batch: SftBatch, weights: jax.Array,
             opts: SftOptions, remat: str = "full", rng: jax.Array | None = None):
    """(sum of -log p(target) * weight, {"tokens": loss tokens}) of a (micro-)batch; rng: the
    LoRA dropout key (None: no dropout, as in evaluation)."""
    logp, _ = token_logprobs(params, spec, batch.tokens, positions_from_mask(batch.attn_mask),
                             batch.attn_mask, lora, start=1, chunk=opts.logprob_chunk,
                             remat=remat, rng=rng, numerics=opts.numerics)  # [B, T - 1]
    return -jnp.sum(logp * weights), {"tokens": jnp.sum(weights > 0).astype(jnp.float32)}


def sft_step(state: TrainState, params, batch: SftBatch, *, spec: ModelSpec,
             optimizer: optax.GradientTransformation, opts: SftOptions):
    """(new state, metrics: loss, grad_norm, tokens, skipped)."""
    if batch.tokens.shape[0] % opts.micro_batches:
        raise ValueError(f"batch of {batch.tokens.shape[0]} rows does not split into "
                         f"{opts.micro_batches} micro-batches; set optim.micro_batch_size to a "
                         "divisor of sft.batch_size")
    grad_fn = jax.value_and_grad(sft_loss, has_aux=True)
    rng = dropout_key(state.lora, opts.seed, state)
    (loss, metrics), grads = sum_over_micro_batches(
        lambda index, mb, w: grad_fn(state.lora, params, spec, mb, w, opts,
                                     rng=micro_key(rng, index)),
        (batch, loss_weights(batch)), opts.micro_batches)
    new_state, finite = apply_gradients(state, optimizer, loss, grads)
    return new_state, {"loss": loss, "grad_norm": optax.global_norm(grads),
                       "skipped": (~finite).astype(jnp.int32), **metrics}


def compile_sft_step(spec: ModelSpec, optimizer: optax.GradientTransformation,
                     opts: SftOptions = SftOptions()):
    return jit_step(functools.partial(sft_step, spec=spec, optimizer=optimizer, opts=opts))


def compile_eval_loss(spec: ModelSpec, opts: SftOptions = SftOptions()):
    """jitted (lora, params, batch) -> the batch's token-mean loss, no gradient."""
    return jax.jit(lambda lora, params, batch: sft_loss(
        lora, params, spec, batch, loss_weights(batch), opts, remat="none")[0])

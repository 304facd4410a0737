"""One GRPO policy update: jitted, LoRA and optimizer state donated, micro-batched; and the
reference pass, micro-batched alike.

Glossary: B completions, T = P + N tokens per row (left-padded prompt of width P, completion of
width N), M micro-batches of B / M rows.

Only the LoRA pytree is differentiated; the frozen (possibly NF4) base params are an argument
that is never differentiated. A step whose loss or gradients are not finite leaves the adapter
and optimizer state unchanged and counts itself in `state.skipped`.

LoRA dropout (`lora.dropout` > 0) draws its masks from `dropout_key`: a key per update tried,
so each of `num_iterations` updates on a batch draws fresh masks and a resumed run draws the
same ones; each micro-batch folds in its index. Only the policy's forward in the update drops
out: the sampler and the reference pass run without a key.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxrl.backends.numerics import REFERENCE, Numerics
from jaxrl.config import GrpoConfig, OptimConfig
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.losses import ROW_METRICS, entropy_mask, grpo_loss, token_weights
from jaxrl.sharding import MeshRules


@struct.dataclass
class TrainState:
    lora: Lora
    opt_state: Any
    step: jax.Array  # [] int32, updates applied
    skipped: jax.Array  # [] int32, updates skipped for non-finite loss or gradients


@struct.dataclass
class Batch:
    """A scored rollout batch, all arrays on device."""

    tokens: jax.Array  # [B, T] int32
    positions: jax.Array  # [B, T] int32
    attn_mask: jax.Array  # [B, T] bool, valid tokens
    completion_mask: jax.Array  # [B, N] bool, completion tokens up to and including EOS
    logp_old: jax.Array  # [B, N] float32, the sampler's log-probs (pi_old)
    advantages: jax.Array  # [B] float32
    ref_logp: jax.Array | None = None  # [B, N] float32, None when beta == 0
    # [B, N] bool, completion tokens decoded under an adapter older than the one this update
    # starts from (partial rollouts); None: no token was (the step then reports no carried_*)
    carried: jax.Array | None = None
    # blocks of `share` consecutive rows hold the same prompt columns, which the forward
    # passes then run once per block (`Rollout.share`); 1: every row alone. Static.
    share: int = struct.field(pytree_node=False, default=1)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static settings of the compiled step (hashable: part of the compile key)."""

    grpo: GrpoConfig
    temperature: float  # of the distribution the sampler drew from (1.0 for greedy)
    max_new_tokens: int
    micro_batches: int = 1
    logprob_chunk: int = 128
    remat: str = "full"  # a key of jaxrl.model.transformer.REMAT_POLICIES, or auto
    seed: int = 0  # of the LoRA dropout keys (run.seed)
    mesh: MeshRules | None = None  # the mesh the step runs on: how its weights are gathered
    numerics: Numerics = REFERENCE  # the backend forms (`jaxrl.backends.numerics.numerics_of`)


def make_optimizer(optim: OptimConfig, total_steps: int):
    """(AdamW over LoRA params, its learning-rate schedule): linear warmup, then constant or
    cosine decay to 0; gradients clipped to `optim.max_grad_norm` first."""
    warmup = min(optim.warmup_steps, max(total_steps - 1, 0))
    if optim.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, optim.lr, max(warmup, 1), max(total_steps, warmup + 1))
    elif warmup:
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, optim.lr, warmup), optax.constant_schedule(optim.lr)],
            [warmup])
    else:
        schedule = optax.constant_schedule(optim.lr)
    adamw = optax.adamw(schedule, eps=optim.eps, weight_decay=optim.weight_decay)
    if optim.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(optim.max_grad_norm), adamw), schedule
    return adamw, schedule


def init_train_state(lora: Lora, optimizer: optax.GradientTransformation) -> TrainState:
    # distinct buffers: the state is donated, and one buffer cannot be donated twice
    return TrainState(lora=lora, opt_state=optimizer.init(lora), step=jnp.zeros((), jnp.int32),
                      skipped=jnp.zeros((), jnp.int32))


DROPOUT_STREAM = 0x44524F50  # folded into the seed's key: the dropout masks' own stream


def dropout_key(lora: Lora, seed: int, state: TrainState) -> jax.Array | None:
    """The LoRA dropout key of the update `state` is about to take (None without dropout):
    PRNGKey(seed) on the dropout stream, folded with the updates tried so far (applied and
    skipped), so no two updates of a run share masks."""
    if lora.dropout == 0:
        return None
    key = jax.random.fold_in(jax.random.PRNGKey(seed), DROPOUT_STREAM)
    return jax.random.fold_in(key, state.step + state.skipped)


def micro_key(rng: jax.Array | None, index) -> jax.Array | None:
    """Micro-batch `index`'s dropout key (None without dropout)."""
    return None if rng is None else jax.random.fold_in(rng, index)


def _loss(lora: Lora, params, spec: ModelSpec, mb: Batch, weights: jax.Array,
          selected: jax.Array | None, opts: StepOptions, rng: jax.Array | None):
    width = mb.completion_mask.shape[1]
    logp, entropy = token_logprobs(
        params, spec, mb.tokens, mb.positions, mb.attn_mask, lora,
        start=mb.tokens.shape[1] - width, chunk=opts.logprob_chunk,
        temperature=opts.temperature, with_entropy=True, remat=opts.remat, rng=rng,
        shardings=opts.mesh, share=mb.share, numerics=opts.numerics)
    loss, metrics = grpo_loss(logp, mb.logp_old, mb.advantages, mb.completion_mask, opts.grpo,
                              ref_logp=mb.ref_logp, max_new_tokens=opts.max_new_tokens,
                              weights=weights, entropy=entropy, selected=selected,
                              carried=mb.carried)
    valid = mb.completion_mask.astype(jnp.float32)
    metrics["entropy_sum"] = jnp.sum(jax.lax.stop_gradient(entropy) * valid)
    metrics["tokens"] = valid.sum()
    metrics["rows"] = (valid.sum(axis=1) > 0).sum().astype(jnp.float32)
    return loss, metrics


def _split(tree, m: int):
    """[B, ...] leaves -> [M, B / M, ...]."""
    return jax.tree_util.tree_map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), tree)


def _add(acc, x):
    return jax.tree_util.tree_map(jnp.add, acc, x)


def sum_over_micro_batches(fn, xs, micro_batches: int, combine=_add):
    """fn(index, *xs) summed over the M micro-batches of xs (a tuple of pytrees of [B, ...]
    leaves; None leaves are allowed), one at a time in a `lax.scan`; fn(0, *xs) when M is 1.
    combine(acc, result) -> acc replaces the sum (leaf by leaf addition); acc starts as zeros,
    so combine(zeros, result) must be result (a max of values >= 0, say)."""
    if micro_batches == 1:
        return fn(jnp.zeros((), jnp.int32), *xs)
    split = (jnp.arange(micro_batches), _split(xs, micro_batches))
    first = jax.tree_util.tree_map(lambda x: x[0], split)
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                   jax.eval_shape(lambda i, x: fn(i, *x), *first))

    def body(acc, x):
        return combine(acc, fn(x[0], *x[1])), None
    return jax.lax.scan(body, zeros, split)[0]


_COUNTS = ("tokens", "rows", "entropy_sum", "carried_tokens", "carried_ratio_sum")
_MAXIMA = ("carried_ratio_max",)  # maxima over micro-batches (of values >= 0)


def _combine_step(acc, x):
    """((loss, metrics), grads) of micro-batches so far and of the next: sums, except the
    metrics in _MAXIMA, which keep the larger."""
    (loss, metrics), grads = _add(acc, x)
    metrics.update({k: jnp.maximum(acc[0][1][k], x[0][1][k]) for k in _MAXIMA
                    if k in metrics})
    return (loss, metrics), grads


def accumulate_grads(lora, params, spec, batch: Batch, weights, opts: StepOptions,
                     rng: jax.Array | None = None, selected: jax.Array | None = None):
    """Loss, gradient and metrics summed over micro-batches (each metric weighted by the
    micro-batch's valid tokens, or its rows for ROW_METRICS; the counts of _COUNTS summed, the
    maxima of _MAXIMA the largest); rng: the update's dropout key."""
    grad_fn = jax.value_and_grad(_loss, has_aux=True)
    basis = lambda k: "rows" if k in ROW_METRICS else "tokens"  # noqa: E731
    if opts.micro_batches == 1:
        return grad_fn(lora, params, spec, batch, weights, selected, opts, micro_key(rng, 0))

    def weighted(index, mb, w, sel):
        (loss, metrics), grads = grad_fn(lora, params, spec, mb, w, sel, opts,
                                         micro_key(rng, index))
        metrics = {k: v if k in _COUNTS + _MAXIMA else v * metrics[basis(k)]
                   for k, v in metrics.items()}
        return (loss, metrics), grads

    (loss, metrics), grads = sum_over_micro_batches(weighted, (batch, weights, selected),
                                                    opts.micro_batches, _combine_step)
    metrics = {k: v if k in _COUNTS + _MAXIMA else v / jnp.maximum(metrics[basis(k)], 1.0)
               for k, v in metrics.items()}
    return (loss, metrics), grads


def batch_entropy(lora, params, spec, batch: Batch, opts: StepOptions,
                  rng: jax.Array | None) -> jax.Array:
    """[B, N] entropies of the completion positions under the policy, micro-batch by
    micro-batch with the keys the update's forward uses (no gradient is taken)."""
    def one(index, mb):
        width = mb.completion_mask.shape[1]
        return token_logprobs(params, spec, mb.tokens, mb.positions, mb.attn_mask, lora,
                              start=mb.tokens.shape[1] - width, chunk=opts.logprob_chunk,
                              temperature=opts.temperature, with_entropy=True, remat="none",
                              rng=micro_key(rng, index), shardings=opts.mesh,
                              share=mb.share, numerics=opts.numerics)[1]
    m = opts.micro_batches
    entropy = jax.lax.map(lambda x: one(*x), (jnp.arange(m), _split(batch, m)))
    return entropy.reshape(batch.completion_mask.shape)


def whole_batch_selection(lora, params, spec, batch: Batch, opts: StepOptions,
                          rng: jax.Array | None) -> jax.Array | None:
    """The tokens the policy loss keeps under grpo.top_entropy_quantile, chosen over the whole
    batch before it is split into micro-batches; None when the loss can choose them itself
    (all tokens kept, or one micro-batch that is the whole batch)."""
    quantile = opts.grpo.top_entropy_quantile
    if quantile >= 1.0 or opts.micro_batches == 1:
        return None
    entropy = batch_entropy(lora, params, spec, batch, opts, rng)
    return entropy_mask(entropy, batch.completion_mask.astype(bool), quantile)


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


def apply_gradients(state: TrainState, optimizer: optax.GradientTransformation, loss, grads):
    """(new state, finite): the optimizer update of the adapter, or, when the loss or any
    gradient is not finite, the state unchanged with the skip counted."""
    finite = jnp.isfinite(loss) & _all_finite(grads)
    safe_grads = jax.tree_util.tree_map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, opt_state = optimizer.update(safe_grads, state.opt_state, state.lora)
    lora = optax.apply_updates(state.lora, updates)
    keep = lambda new, old: jax.tree_util.tree_map(  # noqa: E731
        lambda n, o: jnp.where(finite, n, o), new, old)
    return TrainState(lora=keep(lora, state.lora), opt_state=keep(opt_state, state.opt_state),
                      step=state.step + finite.astype(jnp.int32),
                      skipped=state.skipped + (~finite).astype(jnp.int32)), finite


def train_step(state: TrainState, params, batch: Batch, *, spec: ModelSpec,
               optimizer: optax.GradientTransformation, opts: StepOptions):
    """(new state, metrics). Jit with `jax.jit(train_step, static_argnames=("spec",
    "optimizer", "opts"), donate_argnums=0)`; see `compile_train_step`."""
    if batch.tokens.shape[0] % opts.micro_batches:
        raise ValueError(f"batch of {batch.tokens.shape[0]} rows does not split into "
                         f"{opts.micro_batches} micro-batches; set optim.micro_batch_size to a "
                         "divisor of prompts_per_step * num_generations")
    if batch.tokens.shape[0] // opts.micro_batches % batch.share:
        raise ValueError(f"micro-batches of {batch.tokens.shape[0] // opts.micro_batches} rows "
                         f"do not split into blocks of {batch.share} rows sharing a prompt")
    weights = token_weights(batch.completion_mask, opts.grpo.loss_agg, opts.max_new_tokens)
    rng = dropout_key(state.lora, opts.seed, state)
    selected = whole_batch_selection(state.lora, params, spec, batch, opts, rng)
    (loss, metrics), grads = accumulate_grads(state.lora, params, spec, batch, weights, opts,
                                              rng, selected)
    new_state, finite = apply_gradients(state, optimizer, loss, grads)
    metrics.pop("rows")
    entropy = metrics.pop("entropy_sum") / jnp.maximum(metrics.pop("tokens"), 1.0)
    if batch.carried is not None:  # carried_tokens and carried_ratio_max stay as they are
        metrics["carried_ratio_mean"] = metrics.pop("carried_ratio_sum") / jnp.maximum(
            metrics["carried_tokens"], 1.0)
    return new_state, {"loss": loss, "grad_norm": optax.global_norm(grads), "entropy": entropy,
                       "skipped": (~finite).astype(jnp.int32), **metrics}


def reference_logprobs(params, tokens: jax.Array, positions: jax.Array, attn_mask: jax.Array, *,
                       spec: ModelSpec, opts: StepOptions, width: int | None = None,
                       share: int = 1) -> jax.Array:
    """The GRPO reference pass: log-probs [B, N] (N = width, default opts.max_new_tokens) of
    each row's last N tokens under the frozen base (LoRA off, so no dropout either), at the
    learner's temperature, opts.micro_batches micro-batches one at a time as the update takes
    them, so its activations are the size of the update's forward; share as `Batch.share`."""
    n = opts.max_new_tokens if width is None else width

    def score(tok, pos, mask):
        return token_logprobs(params, spec, tok, pos, mask, None,
                              start=tok.shape[1] - n, chunk=opts.logprob_chunk,
                              temperature=opts.temperature, remat="none",
                              shardings=opts.mesh, share=share, numerics=opts.numerics)[0]

    b, m = tokens.shape[0], opts.micro_batches
    if b % m:
        raise ValueError(f"batch of {b} rows does not split into {m} micro-batches; set "
                         "optim.micro_batch_size to a divisor of prompts_per_step * "
                         "num_generations")
    if m == 1:
        return score(tokens, positions, attn_mask)
    out = jax.lax.map(lambda xs: score(*xs), _split((tokens, positions, attn_mask), m))
    return out.reshape(b, -1)  # [M, B / M, N] -> [B, N]


def compile_reference(spec: ModelSpec, opts: StepOptions,
                      shardings: tuple[Any, Any] | None = None, width: int | None = None,
                      share: int = 1):
    """The jitted reference pass `(params, tokens, positions, attn_mask) -> [B, N]` scoring the
    last N = width (default opts.max_new_tokens) columns of rows sharing their prompt in blocks
    of `share` (`Batch.share`). shardings: (in, out) from `jaxrl.sharding.reference_shardings`;
    None for one device."""
    placed = {} if shardings is None else {"in_shardings": shardings[0],
                                           "out_shardings": shardings[1]}
    return jax.jit(functools.partial(reference_logprobs, spec=spec, opts=opts, width=width,
                                     share=share), **placed)


def jit_step(step, shardings: tuple[Any, Any] | None = None):
    """`step(state, params, batch)` jitted with the train state donated (its buffers are
    reused for the new one). shardings: (in, out) from `jaxrl.sharding.step_shardings` to run
    on a mesh; None lets jit follow its arguments (one device)."""
    placed = {} if shardings is None else {"in_shardings": shardings[0],
                                           "out_shardings": shardings[1]}
    return jax.jit(step, donate_argnums=0, **placed)


def compile_train_step(spec: ModelSpec, optimizer: optax.GradientTransformation,
                       opts: StepOptions, shardings: tuple[Any, Any] | None = None):
    """The jitted GRPO step (see `jit_step`) recomputing as opts.remat, a policy of
    `jaxrl.model.transformer.REMAT_POLICIES`, says (auto: `jaxrl.rl.remat.compile_step`)."""
    return jit_step(functools.partial(train_step, spec=spec, optimizer=optimizer, opts=opts),
                    shardings)

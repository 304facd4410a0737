"""Batched generation: one prefill, then decoding in a `lax.while_loop` that stops as soon as
every row has finished, with sampling controls and per-token log-probs.

Glossary: B batch, P prompt width (bucketed), N new-token bucket, S = P + N cache slots, V vocab.

Prompts are left-padded to P, so every row's last prompt token is in column P - 1 and every row
writes its t-th new token to cache slot P + t; positions count each row's own tokens (pads do not
advance them), so a prompt decodes the same alone or beside longer prompts. A row finishes on any
of the EOS ids (chat models have several) or at `max_new_tokens`; its later columns hold the pad
id, are masked out and carry log-prob 0. The completion mask includes the EOS token itself.

Log-probs: of each chosen token under log_softmax(logits / T) for temperature T > 0, before
top-k / top-p / min-p filtering (what `jaxrl.rl.logprobs.token_logprobs(..., temperature=T)`
computes, so the GRPO ratio starts at 1); for T = 0 (greedy) under the untempered
log_softmax(logits).

Layer loops (`layer_loop`, jaxrl/sampling/layer_loops.py): "scan", the model's `lax.scan` over
the stacked layers (NF4 dequantized per layer inside it; the only loop on GPU and TPU), or on
CPU for dense params "unrolled"; "auto" chooses. On CPU the KV cache is float32: XLA:CPU computes
bf16 elementwise ops in float32, so writing a step's keys into a bf16 cache would convert the
whole cache twice per layer, while a float32 cache is updated in place. Timings are in
docs/benchmarks.md.

Buckets: P and N are rounded up to powers of two (jaxrl/sampling/buckets.py) and the requested
`max_new_tokens` is a traced scalar, so the number of compiled programs stays bounded; decoding
settings and EOS ids are static (a new value compiles a new program).

Stop strings are applied on the host after decoding (jaxrl/sampling/stop.py).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl import distributed
from jaxrl.config import SamplingConfig
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.attention import rope_tables
from jaxrl.model.kv_cache import init_cache
from jaxrl.model.transformer import Params, hidden_states, lm_logits, positions_from_mask
from jaxrl.sampling.buckets import bucket, left_pad
from jaxrl.sampling.layer_loops import (choose_layer_loop, init_layer_cache, layer_cache_shardings,
                                        min_rows, unrolled_hidden_states, unstacked)
from jaxrl.sampling.sampling_fns import Decoding, next_token
from jaxrl.sampling.stop import cut_at_stop
from jaxrl.sharding import (MeshRules, cache_shardings, constrain, lora_shardings,
                            param_shardings, row_shardings)

@struct.dataclass
class Generation:
    """Device output of `generate`, columns [0, N) of the new-token bucket."""

    tokens: jax.Array  # [B, N] int32; the pad id after a row's end
    mask: jax.Array  # [B, N] bool: generated tokens, through the EOS token
    logprobs: jax.Array  # [B, N] float32; 0 where masked
    stopped: jax.Array  # [B] bool: the row ended on an EOS id


@struct.dataclass
class _Carry:
    t: jax.Array  # [] tokens generated so far
    cache: object
    last: jax.Array  # [B] the token generated last
    out: Generation  # out.stopped marks the finished rows


def _record(c: _Carry, token: jax.Array, logprob: jax.Array, eos: jax.Array, pad_id: int):
    """The carry after writing token [B] and logprob [B] into column c.t."""
    live = ~c.out.stopped
    token = jnp.where(live, token, pad_id)
    column = lambda a, x: jax.lax.dynamic_update_slice(a, x[:, None], (0, c.t))
    out = Generation(tokens=column(c.out.tokens, token), mask=column(c.out.mask, live),
                     logprobs=column(c.out.logprobs, jnp.where(live, logprob, 0.0)),
                     stopped=c.out.stopped | (live & jnp.isin(token, eos)))
    return c.replace(t=c.t + 1, last=token, out=out)


@functools.partial(jax.jit, static_argnames=(
    "spec", "decoding", "eos_ids", "max_new_bucket", "layer_loop", "shardings"))
def generate(params: Params, prompt: jax.Array, prompt_mask: jax.Array, key: jax.Array,
             max_new_tokens: jax.Array, lora: Lora | None = None, *, spec: ModelSpec,
             decoding: Decoding, eos_ids: tuple[int, ...], max_new_bucket: int,
             layer_loop: str, shardings: MeshRules | None = None) -> Generation:
    """Prefill the left-padded prompt [B, P] (mask [B, P]), then decode up to max_new_tokens
    (a traced int32 <= max_new_bucket) new tokens per row; layer_loop "scan" or "unrolled"
    (`choose_layer_loop`). The KV cache is float32 on CPU (module docstring) and in the
    activations' dtype (the embedding's) elsewhere, which is lossless: keys and values are
    computed in that dtype.
    shardings: the mesh and rules that params, adapter, rows and cache are held in (None: one
    device); the outputs come back split by rows."""
    if shardings is not None:
        params = constrain(params, param_shardings(shardings, params, spec))
        if lora is not None:
            lora = constrain(lora, lora_shardings(shardings, lora, spec))
        prompt, prompt_mask = constrain((prompt, prompt_mask),
                                        row_shardings(shardings, (prompt, prompt_mask)))
    rows = prompt.shape[0]
    extra = max(min_rows(params, layer_loop) - rows, 0)
    prompt, prompt_mask = (jnp.pad(x, ((0, extra), (0, 0)), mode="edge")
                           for x in (prompt, prompt_mask))
    out = _generate(params, prompt, prompt_mask, key, max_new_tokens, lora, spec=spec,
                    decoding=decoding, eos_ids=eos_ids, max_new_bucket=max_new_bucket,
                    layer_loop=layer_loop, shardings=shardings)
    out = jax.tree_util.tree_map(lambda a: a[:rows], out)
    return out if shardings is None else constrain(out, row_shardings(shardings, out))


def _platform(shardings: MeshRules | None) -> str:
    """The platform the program runs on: the mesh's (a TPU topology may be compiled for from a
    CPU host, see `jaxrl plan`), else the default backend's."""
    return jax.default_backend() if shardings is None else shardings.mesh.devices.flat[0].platform


def _generate(params, prompt, prompt_mask, key, max_new_tokens, lora, *, spec, decoding,
              eos_ids, max_new_bucket, layer_loop, shardings) -> Generation:
    """`generate` for a batch the layer loop runs as it is."""
    b, p = prompt.shape
    n = max_new_bucket
    on_cpu = _platform(shardings) == "cpu"
    cache_dtype = jnp.float32 if on_cpu else params["embed_tokens"]["embedding"].dtype
    attn_mask = jnp.concatenate([prompt_mask, jnp.ones((b, n), bool)], axis=1)  # [B, S]
    make_cache, run_layers, cache_rules = init_cache, hidden_states, cache_shardings
    if layer_loop == "unrolled":
        make_cache, cache_rules = init_layer_cache, layer_cache_shardings
        run_layers = functools.partial(
            unrolled_hidden_states,
            rope_table=rope_tables(jnp.arange(p + n, dtype=jnp.int32)[None], spec))
        params, lora = unstacked(params, lora)

    def logits_after(tokens, positions, cache):  # [B, V] at each row's last input token
        h, cache = run_layers(params, tokens, positions, spec, attn_mask=attn_mask, cache=cache,
                              lora=lora)
        return lm_logits(params, h[:, -1], spec), cache

    positions = positions_from_mask(prompt_mask)
    cache = make_cache(spec, b, p + n, cache_dtype)
    if shardings is not None:
        cache = constrain(cache, cache_rules(shardings, cache))
    logits, cache = logits_after(prompt, positions, cache)
    first_position = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)  # [B]
    eos = jnp.asarray(eos_ids, jnp.int32)
    pad_id = eos_ids[0] if eos_ids else 0
    empty = Generation(tokens=jnp.full((b, n), pad_id, jnp.int32), mask=jnp.zeros((b, n), bool),
                       logprobs=jnp.zeros((b, n), jnp.float32), stopped=jnp.zeros((b,), bool))
    start = _Carry(t=jnp.zeros((), jnp.int32), cache=cache, last=jnp.zeros((b,), jnp.int32),
                   out=empty)
    start = _record(start, *next_token(jax.random.fold_in(key, 0), logits, decoding), eos, pad_id)

    def step(c: _Carry) -> _Carry:
        positions = (first_position + c.t - 1)[:, None]  # [B, 1] of the token fed back
        logits, cache = logits_after(c.last[:, None], positions, c.cache)
        token, logprob = next_token(jax.random.fold_in(key, c.t), logits, decoding)
        return _record(c.replace(cache=cache), token, logprob, eos, pad_id)

    limit = jnp.minimum(max_new_tokens, n)
    final = jax.lax.while_loop(lambda c: (c.t < limit) & ~jnp.all(c.out.stopped), step, start)
    return final.out


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Host output of `sample`; the learner scores concat(prompt_tokens, tokens)."""

    prompt_tokens: np.ndarray  # [B, P] int32, left-padded to the prompt bucket
    prompt_mask: np.ndarray  # [B, P] bool
    tokens: np.ndarray  # [B, max_new_tokens] int32
    mask: np.ndarray  # [B, max_new_tokens] bool, cut at stop strings
    logprobs: np.ndarray  # [B, max_new_tokens] float32, 0 where masked
    finish_reasons: tuple[str, ...]  # "stop" (EOS id or stop string) or "length"
    texts: tuple[str, ...] | None  # the masked completions as text, with a detokenizer


def _apply_stop(out: SampleOutput, stop: Sequence[str],
                detokenize: Callable[[Sequence[int]], str]) -> SampleOutput:
    mask, reasons, texts = out.mask.copy(), list(out.finish_reasons), []
    for row in range(mask.shape[0]):
        ids = out.tokens[row, mask[row]].tolist()
        kept, text, stopped = cut_at_stop(ids, stop, detokenize)
        mask[row, kept:] = False
        reasons[row] = "stop" if stopped else reasons[row]
        texts.append(text)
    return dataclasses.replace(out, mask=mask, logprobs=np.where(mask, out.logprobs, 0.0),
                               finish_reasons=tuple(reasons), texts=tuple(texts))


def sample(params: Params, spec: ModelSpec, prompts: Sequence[Sequence[int]], key: jax.Array,
           cfg: SamplingConfig = SamplingConfig(), *, lora: Lora | None = None,
           eos_ids: Sequence[int] = (), detokenize: Callable[[Sequence[int]], str] | None = None,
           layer_loop: str = "auto", shardings: MeshRules | None = None) -> SampleOutput:
    """Sample one completion per prompt (lists of token ids; repeat a prompt for a group).

    cfg supplies temperature, top_k, top_p, min_p, max_new_tokens and stop strings; eos_ids end a
    row (`jaxrl.hf.tokenizer.eos_token_ids` lists a model's); detokenize (ids -> text) is needed
    for stop strings and fills `texts`. The same key, prompts and settings give the same output.
    shardings: sample on a mesh; with several processes `prompts` are this process's rows
    (jaxrl/distributed.py) and so is the output. layer_loop: module docstring.
    """
    if cfg.stop and detokenize is None:
        raise ValueError(f"stop strings {list(cfg.stop)} need a detokenize function (ids -> text)")
    width = bucket(max(len(ids) for ids in prompts) if prompts else 1)
    if shardings is not None:
        width = distributed.host_max(width)  # every process's rows share one global array
    tokens, mask = left_pad(prompts, width)
    rows = (tokens, mask) if shardings is None else distributed.rows_to_global(shardings,
                                                                               (tokens, mask))
    loop = choose_layer_loop(params, layer_loop, _platform(shardings))
    gen = generate(params, *rows, key, jnp.int32(cfg.max_new_tokens), lora, spec=spec,
                   decoding=Decoding.from_config(cfg), eos_ids=tuple(int(i) for i in eos_ids),
                   max_new_bucket=bucket(cfg.max_new_tokens), layer_loop=loop,
                   shardings=shardings)
    gen = jax.device_get(gen) if shardings is None else distributed.rows_to_local(gen)
    n = cfg.max_new_tokens
    out = SampleOutput(prompt_tokens=tokens, prompt_mask=mask, tokens=gen.tokens[:, :n],
                       mask=gen.mask[:, :n], logprobs=gen.logprobs[:, :n],
                       finish_reasons=tuple("stop" if s else "length" for s in gen.stopped),
                       texts=None)
    return out if detokenize is None else _apply_stop(out, cfg.stop, detokenize)

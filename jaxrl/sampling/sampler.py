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

Layer loops (`layer_loop`), chosen per backend and weight format by "auto" (measurements in
docs/benchmarks.md):
  "scan"      `hidden_states`: `lax.scan` over the stacked layers and a [L, B, K, S, D] cache.
              NF4 / int4 kernels are dequantized per layer inside the scan, so one layer is dense
              at a time even inside the decode loop (tests/sampling/test_memory.py checks the
              compiled program). Used for quantized params on every backend and for all params
              off CPU.
  "unrolled"  `unrolled_hidden_states`: the layers unrolled in Python over per-layer weights and
              a per-layer cache with keys stored [B, K, D, S]. Used for dense params on CPU, where
              a scan copies every layer's weights and cache out of their stacks on every step.
              The per-layer weights are sliced once per call, before the decode loop, behind an
              optimization barrier (XLA would sink the slices into the loop body and copy the
              weights every step again); temporary memory: one copy of the dense layer weights.
              Quantized kernels are refused: their dequantization would be hoisted the same way.
Both loops run the same `decoder_layer`; both are tested against transformers' greedy generate.

Kernels (`kernels`): "xla" (XLA's ops only) or "cpu", jaxrl's CPU kernels
(jaxrl/kernels/cpu.py) in the unrolled loop on one CPU device with AMX ("auto" picks them for
bf16 weights wherever they are available; fp32 weights take them only when asked, and then only
the decode attention, over the fp32 cache, with XLA's matmuls): the layer kernels and the LM
head are packed into the matmul kernel's layout by `pack_params`, which `sample` runs once per
params and keeps while they live (one packed copy of the weights, in place of the per-call
slices); every matmul is then a custom call that multiplies at memory speed where XLA's bf16 dot
of a few rows does not (a decode step's matmuls at batch 1 / 8 / 32: ~16 / 18 / 26 ms against
~31 / 32 / 39 ms), and each decode step attends over the filled cache slots only. Both
accumulate bf16 products in float32; both are tested to decode the same tokens
(docs/benchmarks.md has the figures).

On CPU with XLA's ops the KV cache is float32: XLA:CPU computes bf16 elementwise ops in
float32, so writing a step's keys into a bf16 cache converts the whole cache twice per layer,
while a float32 cache is updated in place. With kernels "cpu" the cache is bf16 (the decode
attention kernel writes it in place and reads half the bytes). With XLA's dot, bf16 weights pay
off for two rows and more (every matmul accumulates in float32); XLA:CPU multiplies a single
bf16 row ~5x slower than two, so one bf16 row decodes as two (the AMX kernel has no such cliff).

Buckets: P and N are rounded up to powers of two (jaxrl/sampling/buckets.py) and the requested
`max_new_tokens` is a traced scalar, so the number of compiled programs stays bounded; decoding
settings and EOS ids are static (a new value compiles a new program).

Stop strings are applied on the host after decoding (jaxrl/sampling/stop.py).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl import distributed
from jaxrl.config import SamplingConfig
from jaxrl.kernels import cpu as cpu_kernels
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.attention import rope_tables
from jaxrl.model.kv_cache import init_cache, init_layer_cache
from jaxrl.model.params import LINEAR_NAMES
from jaxrl.model.transformer import (Params, hidden_states, lm_logits, positions_from_mask,
                                     unrolled_hidden_states, unstack_layers)
from jaxrl.quant.nf4 import QTensor
from jaxrl.sampling.buckets import bucket, left_pad
from jaxrl.sampling.sampling_fns import Decoding, next_token
from jaxrl.sampling.stop import cut_at_stop
from jaxrl.sharding import (MeshRules, cache_shardings, constrain, lora_shardings,
                            param_shardings, row_shardings)

LAYER_LOOPS = ("auto", "scan", "unrolled")
KERNELS = ("auto", "xla", "cpu")


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


def is_quantized(params: Params) -> bool:
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QTensor))
    return any(isinstance(leaf, QTensor) for leaf in leaves)


def choose_layer_loop(params: Params, layer_loop: str = "auto") -> str:
    """"scan" or "unrolled" (module docstring); "auto" takes "unrolled" for dense params on CPU."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}; got {layer_loop!r}")
    if layer_loop == "unrolled" and is_quantized(params):
        raise ValueError("layer_loop 'unrolled' needs dense kernels; quantized (NF4/int4) params "
                         "decode with 'scan', which keeps dequantization per layer")
    if layer_loop != "auto":
        return layer_loop
    dense_on_cpu = jax.default_backend() == "cpu" and not is_quantized(params)
    return "unrolled" if dense_on_cpu else "scan"


def _bf16(params: Params) -> bool:
    return params["embed_tokens"]["embedding"].dtype == jnp.bfloat16


def choose_kernels(params: Params, layer_loop: str, kernels: str = "auto",
                   shardings: MeshRules | None = None) -> str:
    """"xla" or "cpu" (module docstring) for the chosen layer loop; "auto" takes "cpu" for bf16
    weights in the unrolled loop on one device when `jaxrl.kernels.cpu.available()`."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}; got {kernels!r}")
    fits = layer_loop == "unrolled" and shardings is None
    if kernels == "cpu":
        if not fits:
            raise ValueError("kernels 'cpu' need the 'unrolled' layer loop and one device")
        if not cpu_kernels.available():
            raise ValueError("kernels 'cpu' are unavailable on this machine (the log says why; "
                             "see jaxrl/kernels/cpu.py)")
        return "cpu"
    if kernels == "xla":
        return "xla"
    return "cpu" if fits and _bf16(params) and cpu_kernels.available() else "xla"


def _record(c: _Carry, token: jax.Array, logprob: jax.Array, eos: jax.Array, pad_id: int):
    """The carry after writing token [B] and logprob [B] into column c.t."""
    live = ~c.out.stopped
    token = jnp.where(live, token, pad_id)
    column = lambda a, x: jax.lax.dynamic_update_slice(a, x[:, None], (0, c.t))
    out = Generation(tokens=column(c.out.tokens, token), mask=column(c.out.mask, live),
                     logprobs=column(c.out.logprobs, jnp.where(live, logprob, 0.0)),
                     stopped=c.out.stopped | (live & jnp.isin(token, eos)))
    return c.replace(t=c.t + 1, last=token, out=out)


def _packed(params: Params) -> Params:
    """params with every layer's linear kernels and the LM head (the embedding, transposed, when
    tied) in the AMX kernel's layout."""
    def pack_layer(lp):
        return {name: ({**sub, "kernel": cpu_kernels.pack_kernel(sub["kernel"])}
                       if name in LINEAR_NAMES else sub) for name, sub in lp.items()}
    head = (params["embed_tokens"]["embedding"].T if "lm_head" not in params
            else params["lm_head"]["kernel"])
    return {**params, "layers": tuple(pack_layer(lp) for lp in params["layers"]),
            "lm_head": {"kernel": cpu_kernels.pack_kernel(head)}}


@jax.jit
def pack_params(params: Params) -> Params:
    """params for kernels "cpu": the layer stack split into per-layer trees, every linear kernel
    and the LM head packed for `jaxrl.kernels.cpu.matmul`; `generate` takes them as they are.
    `sample` packs once per params and keeps the result while they live (`_packed_once`)."""
    return _packed({**params, "layers": unstack_layers(params["layers"])})


_PACKED: dict = {}  # the last params `sample` packed: {"leaves": weakrefs, "packed": params}


def _packed_once(params: Params) -> Params:
    """`pack_params(params)`, reused while the same arrays are passed again (a GRPO run samples
    from one frozen base many times); dropped when they are freed. Holds one packed copy."""
    leaves = jax.tree_util.tree_leaves(params)
    refs = _PACKED.get("leaves", ())
    if len(refs) == len(leaves) and all(r() is x for r, x in zip(refs, leaves)):
        return _PACKED["packed"]
    _PACKED.clear()
    packed, token = pack_params(params), object()
    _PACKED.update(leaves=[weakref.ref(x) for x in leaves], packed=packed, token=token)
    weakref.finalize(leaves[0], _drop_packed, token)
    return packed


def _drop_packed(token: object) -> None:
    if _PACKED.get("token") is token:
        _PACKED.clear()


def _unstacked(params: Params, lora: Lora | None, pack: bool):
    """params and lora with their layer stacks split into per-layer trees (and with pack, the
    kernels packed for the CPU matmul kernel, unless `pack_params` did it already), materialized
    before the decode loop: the optimization barrier keeps XLA from sinking the slices into the
    loop body, where they would copy every layer's weights out of the stacks on every step."""
    if not isinstance(params["layers"], tuple):  # else packed by pack_params
        params = {**params, "layers": unstack_layers(params["layers"])}
        if pack:
            params = _packed(params)
    adapters = None if lora is None else unstack_layers(lora.weights["layers"])
    layers, adapters = jax.lax.optimization_barrier(((params["layers"], params.get("lm_head")),
                                                     adapters))
    params = {**params, "layers": layers[0]} | ({"lm_head": layers[1]} if pack else {})
    return params, (None if lora is None else lora.replace(weights={"layers": adapters}))


def _min_rows(params: Params, layer_loop: str, kernels: str) -> int:
    """XLA:CPU multiplies one bf16 row by a kernel 5-8x slower than two rows (60 [576, 1536]
    kernels: 139 ms against 26 ms), so the unrolled loop decodes a single bf16 row as two unless
    jaxrl's CPU kernels do the matmuls."""
    return 2 if layer_loop == "unrolled" and _bf16(params) and kernels == "xla" else 1


@functools.partial(jax.jit, static_argnames=(
    "spec", "decoding", "eos_ids", "max_new_bucket", "layer_loop", "shardings", "kernels"))
def generate(params: Params, prompt: jax.Array, prompt_mask: jax.Array, key: jax.Array,
             max_new_tokens: jax.Array, lora: Lora | None = None, *, spec: ModelSpec,
             decoding: Decoding, eos_ids: tuple[int, ...], max_new_bucket: int,
             layer_loop: str, shardings: MeshRules | None = None,
             kernels: str = "xla") -> Generation:
    """Prefill the left-padded prompt [B, P] (mask [B, P]), then decode up to max_new_tokens
    (a traced int32 <= max_new_bucket) new tokens per row; layer_loop "scan" or "unrolled",
    kernels "xla" or "cpu" (`choose_layer_loop`, `choose_kernels`).
    The KV cache is float32 on CPU with kernels "xla" (module docstring) and in the
    activations' dtype (the embedding's) otherwise, which is lossless: keys and values are
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
    extra = max(_min_rows(params, layer_loop, kernels) - rows, 0)
    prompt, prompt_mask = (jnp.pad(x, ((0, extra), (0, 0)), mode="edge")
                           for x in (prompt, prompt_mask))
    out = _generate(params, prompt, prompt_mask, key, max_new_tokens, lora, spec=spec,
                    decoding=decoding, eos_ids=eos_ids, max_new_bucket=max_new_bucket,
                    layer_loop=layer_loop, shardings=shardings, kernels=kernels)
    out = jax.tree_util.tree_map(lambda a: a[:rows], out)
    return out if shardings is None else constrain(out, row_shardings(shardings, out))


def _platform(shardings: MeshRules | None) -> str:
    """The platform the program runs on: the mesh's (a TPU topology may be compiled for from a
    CPU host, see `jaxrl plan`), else the default backend's."""
    return jax.default_backend() if shardings is None else shardings.mesh.devices.flat[0].platform


def _generate(params, prompt, prompt_mask, key, max_new_tokens, lora, *, spec, decoding,
              eos_ids, max_new_bucket, layer_loop, shardings, kernels) -> Generation:
    """`generate` for a batch the layer loop runs as it is."""
    b, p = prompt.shape
    n = max_new_bucket
    on_cpu = _platform(shardings) == "cpu"
    dtype = params["embed_tokens"]["embedding"].dtype
    cache_dtype = jnp.float32 if on_cpu and kernels == "xla" else dtype
    attn_mask = jnp.concatenate([prompt_mask, jnp.ones((b, n), bool)], axis=1)  # [B, S]
    make_cache, run_layers = init_cache, hidden_states
    if layer_loop == "unrolled":
        make_cache = init_layer_cache
        run_layers = functools.partial(
            unrolled_hidden_states, cpu_kernel_attention=kernels == "cpu",
            rope_table=rope_tables(jnp.arange(p + n, dtype=jnp.int32)[None], spec))
        params, lora = _unstacked(params, lora, pack=kernels == "cpu" and _bf16(params))

    def logits_after(tokens, positions, cache):  # [B, V] at each row's last input token
        h, cache = run_layers(params, tokens, positions, spec, attn_mask=attn_mask, cache=cache,
                              lora=lora)
        return lm_logits(params, h[:, -1], spec), cache

    positions = positions_from_mask(prompt_mask)
    cache = make_cache(spec, b, p + n, cache_dtype)
    if shardings is not None:
        cache = constrain(cache, cache_shardings(shardings, cache))
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
           layer_loop: str = "auto", shardings: MeshRules | None = None,
           kernels: str = "auto") -> SampleOutput:
    """Sample one completion per prompt (lists of token ids; repeat a prompt for a group).

    cfg supplies temperature, top_k, top_p, min_p, max_new_tokens and stop strings; eos_ids end a
    row (`jaxrl.hf.tokenizer.eos_token_ids` lists a model's); detokenize (ids -> text) is needed
    for stop strings and fills `texts`. The same key, prompts and settings give the same output.
    shardings: sample on a mesh; with several processes `prompts` are this process's rows
    (jaxrl/distributed.py) and so is the output. layer_loop and kernels: module docstring.
    """
    if cfg.stop and detokenize is None:
        raise ValueError(f"stop strings {list(cfg.stop)} need a detokenize function (ids -> text)")
    width = bucket(max(len(ids) for ids in prompts) if prompts else 1)
    if shardings is not None:
        width = distributed.host_max(width)  # every process's rows share one global array
    tokens, mask = left_pad(prompts, width)
    rows = (tokens, mask) if shardings is None else distributed.rows_to_global(shardings,
                                                                               (tokens, mask))
    loop = choose_layer_loop(params, layer_loop)
    kernels = choose_kernels(params, loop, kernels, shardings)
    if kernels == "cpu" and _bf16(params):
        params = _packed_once(params)
    gen = generate(params, *rows, key, jnp.int32(cfg.max_new_tokens), lora, spec=spec,
                   decoding=Decoding.from_config(cfg), eos_ids=tuple(int(i) for i in eos_ids),
                   max_new_bucket=bucket(cfg.max_new_tokens), layer_loop=loop,
                   shardings=shardings, kernels=kernels)
    gen = jax.device_get(gen) if shardings is None else distributed.rows_to_local(gen)
    n = cfg.max_new_tokens
    out = SampleOutput(prompt_tokens=tokens, prompt_mask=mask, tokens=gen.tokens[:, :n],
                       mask=gen.mask[:, :n], logprobs=gen.logprobs[:, :n],
                       finish_reasons=tuple("stop" if s else "length" for s in gen.stopped),
                       texts=None)
    return out if detokenize is None else _apply_stop(out, cfg.stop, detokenize)

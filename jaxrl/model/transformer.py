"""The decoder forward pass: a pure function of params, tokens and positions.

Two ways to run the layers share `decoder_layer`: `hidden_states` scans over the stacked layer
weights (training, log-probs, and decoding wherever weights are quantized or the backend is not
a CPU), and `unrolled_hidden_states` unrolls the layers in Python over a per-layer cache (the
sampler's fast path for dense weights on CPU; see jaxrl/sampling/sampler.py for the measurements).

Glossary: B batch, T tokens in this call, S key slots (T without a cache, the cache length with
one), E hidden size, F MLP size, H/K query/kv heads, D head dim, V vocab, L layers.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.kernels import cpu as cpu_kernels
from jaxrl.lora.lora import Lora, lora_delta
from jaxrl.model.attention import apply_rope, attend, rope_tables
from jaxrl.model.families import ModelSpec
from jaxrl.model.kv_cache import KVCache, LayerKVCache
from jaxrl.model.params import LINEAR_NAMES
from jaxrl.quant.nf4 import QTensor, as_dense

Params = dict[str, Any]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * xf.astype(x.dtype)


def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows of the embedding table [V, E] for tokens [...]. A bf16 table is gathered as its
    uint16 bit patterns: XLA:CPU gathers bf16 through float32 and converts the whole table first
    (113 MB and ~90 ms per call for the default model); the bits, and so the result, are the
    same."""
    if table.dtype != jnp.bfloat16:
        return table[tokens]
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16)[tokens]
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def linear(x: jax.Array, p: Params) -> jax.Array:
    """x [..., in] @ kernel [in, out] (+ bias), accumulated in float32; the kernel may be a
    quantized QTensor or, in the sampler's CPU loop, a `jaxrl.kernels.cpu.PackedKernel`."""
    kernel = p["kernel"]
    if isinstance(kernel, cpu_kernels.PackedKernel):
        y = cpu_kernels.matmul(x, kernel)
    else:
        y = jnp.einsum("...i,io->...o", x, as_dense(kernel, x.dtype),
                       preferred_element_type=jnp.float32)
    if "bias" in p:
        y = y + p["bias"]
    return y.astype(x.dtype)


def projector(lp: Params, ll: Params | None, lora: Lora | None, rng: jax.Array | None):
    """proj(name, x): layer linear `name` applied to x, plus its adapter when it has one."""
    def proj(name: str, x: jax.Array) -> jax.Array:
        y = linear(x, lp[name])
        if ll is not None and name in ll:
            key = None if rng is None else jax.random.fold_in(rng, LINEAR_NAMES.index(name))
            y = y + lora_delta(x, ll[name], lora.scale, lora.dropout, key)
        return y
    return proj


def attention_mask(attn_mask: jax.Array, t: int, start: jax.Array) -> jax.Array:
    """[B, T, S]: query t (at slot start + t) sees valid key slots s <= start + t."""
    s = attn_mask.shape[1]
    causal = jnp.arange(s)[None, :] <= (start + jnp.arange(t))[:, None]  # [T, S]
    return causal[None] & attn_mask[:, None, :]


def _qkv(x, proj, lp, rope, spec: ModelSpec):
    """q [B, T, H, D] and k, v [B, T, K, D] of normed hidden states x [B, T, E], roped."""
    b, t, _ = x.shape
    q = proj("q_proj", x).reshape(b, t, spec.num_heads, spec.head_dim)
    k = proj("k_proj", x).reshape(b, t, spec.num_kv_heads, spec.head_dim)
    v = proj("v_proj", x).reshape(b, t, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm:
        q = rms_norm(q, lp["q_norm"]["scale"], spec.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"]["scale"], spec.rms_norm_eps)
    return apply_rope(q, *rope), apply_rope(k, *rope), v


def decoder_layer(h: jax.Array, lp: Params, proj, rope, spec: ModelSpec, attention):
    """One pre-norm decoder layer on h [B, T, E]: (h', kv). `attention(q, k, v)` takes q
    [B, T, H, D], k and v [B, T, K, D] and returns ([B, T, H*D], whatever it keeps as kv), so
    callers choose the cache layout."""
    x = rms_norm(h, lp["input_layernorm"]["scale"], spec.rms_norm_eps)
    out, kv = attention(*_qkv(x, proj, lp, rope, spec))
    h = h + proj("o_proj", out)
    x = rms_norm(h, lp["post_attention_layernorm"]["scale"], spec.rms_norm_eps)
    return h + proj("down_proj", jax.nn.silu(proj("gate_proj", x)) * proj("up_proj", x)), kv


def _stacked_attention(mask: jax.Array, kv_slots):
    """Attention over this call's keys, or over a [B, K, S, D] cache layer written at slot
    start when kv_slots = (cache_k, cache_v, start)."""
    def attention(q, k, v):
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        if kv_slots is not None:
            cache_k, cache_v, start = kv_slots
            k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, 0, start, 0))
            v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, 0, start, 0))
        return attend(q, k.astype(q.dtype), v.astype(q.dtype), mask), (k, v)
    return attention


def hidden_states(params: Params, tokens: jax.Array, positions: jax.Array, spec: ModelSpec, *,
                  attn_mask: jax.Array | None = None, cache: KVCache | None = None,
                  lora: Lora | None = None, rng: jax.Array | None = None, remat: bool = False):
    """Final-normed hidden states [B, T, E] and the updated cache (None without one).

    lora: adapters added to their target linears (None = the frozen base alone, which is also
    the GRPO reference policy). rng: key for LoRA dropout (None = no dropout, as in eval).
    remat: recompute each layer in the backward pass instead of saving its intermediates; this
    also keeps dequantized NF4 weights from being saved for the backward, one per layer.
    tokens, positions: [B, T] int32. attn_mask marks valid (non-pad) key slots: [B, T] without a
    cache, [B, S] over the cache slots with one (default: all valid). With a cache the T new
    tokens are written at slots [cache.index, cache.index + T).
    """
    b, t = tokens.shape
    start = jnp.zeros((), jnp.int32) if cache is None else cache.index
    if attn_mask is None:
        attn_mask = jnp.ones((b, t if cache is None else cache.max_len), bool)
    mask = attention_mask(attn_mask, t, start)
    rope = rope_tables(positions, spec)
    h = embed(params["embed_tokens"]["embedding"], tokens)  # [B, T, E]

    def layer(h, xs):
        lp, ll, kv, key = xs
        attention = _stacked_attention(mask, None if kv is None else (*kv, start))
        h, new_kv = decoder_layer(h, lp, projector(lp, ll, lora, key), rope, spec, attention)
        return h, (new_kv if kv is not None else None)

    kv_in = None if cache is None else (cache.k, cache.v)
    ll = None if lora is None else lora.weights["layers"]
    use_dropout = lora is not None and lora.dropout > 0 and rng is not None
    keys = jax.random.split(rng, spec.num_layers) if use_dropout else None
    body = jax.checkpoint(layer) if remat else layer
    h, kv_out = jax.lax.scan(body, h, (params["layers"], ll, kv_in, keys))
    h = rms_norm(h, params["norm"]["scale"], spec.rms_norm_eps)
    if cache is None:
        return h, None
    return h, KVCache(k=kv_out[0], v=kv_out[1], index=start + t)


def _transposed_key_attention(mask: jax.Array, cache_kt: jax.Array, cache_v: jax.Array,
                              start: jax.Array, kernel: bool):
    """Attention over one `LayerKVCache` layer, this call's keys written at slot start; computed
    in the cache dtype. kernel: one-token calls write the cache and attend in
    `jaxrl.kernels.cpu.decode_attention` where it takes the shapes, and other calls attend in
    float32 (the kernel's precision) whatever the cache dtype."""
    def attention(q, k, v):
        b, t, h, d = q.shape
        if kernel and t == 1 and cpu_kernels.attention_supported(cache_kt):
            out, kt, cv = cpu_kernels.decode_attention(q[:, 0], k[:, 0], v[:, 0], cache_kt,
                                                       cache_v, mask[:, 0], start)
            return out.reshape(b, 1, h * d).astype(q.dtype), (kt, cv)
        kt = k.transpose(0, 2, 3, 1).astype(cache_kt.dtype)  # [B, K, D, T]
        v = v.transpose(0, 2, 1, 3).astype(cache_v.dtype)  # [B, K, T, D]
        kt = jax.lax.dynamic_update_slice(cache_kt, kt, (0, 0, 0, start))
        v = jax.lax.dynamic_update_slice(cache_v, v, (0, 0, start, 0))
        dtype = jnp.float32 if kernel else kt.dtype
        out = attend(q.astype(dtype), kt.astype(dtype), v.astype(dtype), mask,
                     keys_transposed=True)
        return out.astype(q.dtype), (kt, v)
    return attention


def unstack_layers(tree: Params) -> tuple[Params, ...]:
    """Per-layer trees of a tree whose leaves are stacked over layers (QTensors included)."""
    n = jax.tree_util.tree_leaves(tree)[0].shape[0]
    return tuple(jax.tree_util.tree_map(lambda a: a[i], tree) for i in range(n))


def unrolled_hidden_states(params: Params, tokens: jax.Array, positions: jax.Array,
                           spec: ModelSpec, *, attn_mask: jax.Array, cache: LayerKVCache,
                           lora: Lora | None = None, cpu_kernel_attention: bool = False,
                           rope_table: tuple[jax.Array, jax.Array] | None = None):
    """`hidden_states` with a `LayerKVCache` and the layers unrolled in Python, for decoding
    (no dropout, no remat). params["layers"] and lora.weights["layers"] hold one tree per layer
    (`unstack_layers`); their kernels may be `jaxrl.kernels.cpu.PackedKernel`s.
    cpu_kernel_attention: one-token calls attend with `jaxrl.kernels.cpu.decode_attention`.
    rope_table: `rope_tables` of positions [1, S] = 0..S-1, computed once before a decode loop;
    each call then looks its positions up instead of evaluating cos and sin, which XLA:CPU fuses
    into every layer's consumers and evaluates per head and layer (~1.5M per step at batch 32).
    Returns final-normed hidden states [B, T, E] and the cache.

    Dense kernels only. Inside a decode loop each layer's weights are loop-invariant, and so
    would be the dequantization of an NF4 kernel: XLA hoists it out of the loop and holds every
    layer dense at once. In the scan of `hidden_states` the layer index varies, which keeps
    dequantization per layer, so quantized params must decode through `hidden_states`.
    """
    quantized = [leaf for leaf in jax.tree_util.tree_leaves(
        params["layers"], is_leaf=lambda x: isinstance(x, QTensor)) if isinstance(leaf, QTensor)]
    if quantized:
        raise ValueError("unrolled_hidden_states takes dense kernels only; NF4/int4 kernels "
                         "must run through hidden_states, whose layer scan keeps dequantization "
                         "per layer inside a decode loop")
    b, t = tokens.shape
    start = cache.index
    mask = attention_mask(attn_mask, t, start)
    rope = (rope_tables(positions, spec) if rope_table is None
            else tuple(table[0][positions] for table in rope_table))
    h = embed(params["embed_tokens"]["embedding"], tokens)  # [B, T, E]
    kts, vs = [], []
    adapters = [None] * spec.num_layers if lora is None else lora.weights["layers"]
    for lp, ll, cache_kt, cache_v in zip(params["layers"], adapters, cache.kt, cache.v):
        attention = _transposed_key_attention(mask, cache_kt, cache_v, start,
                                              cpu_kernel_attention)
        h, (kt, v) = decoder_layer(h, lp, projector(lp, ll, lora, None), rope, spec, attention)
        kts.append(kt)
        vs.append(v)
    h = rms_norm(h, params["norm"]["scale"], spec.rms_norm_eps)
    return h, LayerKVCache(kt=tuple(kts), v=tuple(vs), index=start + t)


def lm_logits(params: Params, h: jax.Array, spec: ModelSpec) -> jax.Array:
    """Logits [..., V] in float32 from hidden states [..., E]. A packed head
    (`jaxrl.kernels.cpu.PackedKernel` in params["lm_head"], which the sampler's CPU loop puts
    there for tied embeddings too) takes precedence."""
    head = params.get("lm_head", {}).get("kernel")
    if isinstance(head, cpu_kernels.PackedKernel):
        return cpu_kernels.matmul(h, head)
    if spec.tie_word_embeddings:
        w = params["embed_tokens"]["embedding"]  # [V, E]
        return jnp.einsum("...e,ve->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    w = as_dense(params["lm_head"]["kernel"], h.dtype)  # [E, V]
    return jnp.einsum("...e,ev->...v", h, w, preferred_element_type=jnp.float32)


def forward(params: Params, tokens: jax.Array, positions: jax.Array, spec: ModelSpec, *,
            attn_mask: jax.Array | None = None, cache: KVCache | None = None,
            lora: Lora | None = None, rng: jax.Array | None = None, remat: bool = False):
    """Logits [B, T, V] (float32) and the updated cache. See `hidden_states` for the inputs."""
    h, cache = hidden_states(params, tokens, positions, spec, attn_mask=attn_mask, cache=cache,
                             lora=lora, rng=rng, remat=remat)
    return lm_logits(params, h, spec), cache


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Positions [B, T] for a padded batch (left or right): the count of valid tokens before
    each token; pads get the position of the previous valid token (they are masked anyway)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)

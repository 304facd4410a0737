"""The decoder forward pass: a pure function of params, tokens and positions.

`hidden_states` scans over the stacked layer weights with `lax.scan`: training, log-probs and
decoding (jaxrl/sampling/engine.py) all run this one loop, on every backend, with NF4 kernels
dequantized one layer at a time inside it.

Glossary: B batch, T tokens in this call, S key slots (T without a cache, the cache length with
one), E hidden size, F MLP size, H/K query/kv heads, D head dim, V vocab, L layers.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.lora.lora import Lora, lora_delta
from jaxrl.model.attention import apply_rope, attend, rope_tables
from jaxrl.model.families import ModelSpec
from jaxrl.model.kv_cache import KVCache
from jaxrl.model.params import LINEAR_NAMES
from jaxrl.quant.nf4 import QTensor, as_dense

Params = dict[str, Any]

# What each layer of the scan keeps for the backward pass (`remat`), least recomputation first:
# none saves every intermediate; dots saves the outputs of matmuls without batch dims (the
# linears and LoRA products) and recomputes attention and elementwise ops; full saves only the
# layer's input and recomputes the whole layer. Dequantized NF4 kernels are saved under none.
REMAT_POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "full": jax.checkpoint_policies.nothing_saveable}


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
    quantized QTensor, dequantized here (so inside the layer scan, one layer at a time)."""
    y = jnp.einsum("...i,io->...o", x, as_dense(p["kernel"], x.dtype),
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
    """[B, T, S]: query t of row b (at slot start[b] + t; start [B] or a scalar) sees valid key
    slots s <= start[b] + t."""
    b, s = attn_mask.shape
    query = jnp.broadcast_to(start, (b,))[:, None] + jnp.arange(t)  # [B, T]
    return (jnp.arange(s) <= query[..., None]) & attn_mask[:, None, :]


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


def _attention(mask: jax.Array):
    """Attention over this call's keys alone (no cache)."""
    def attention(q, k, v):
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        return attend(q, k, v, mask), None
    return attention


def _cached_attention(mask: jax.Array, cache: KVCache, layer: jax.Array):
    """Attention over layer `layer` of the stacked cache, this call's keys and values [B, T, K, D]
    written first at each row's slots [cache.index[b], cache.index[b] + T). Only the new slots
    are written (a scatter into the whole stack), so a decode step moves T tokens per row, not
    the layer's cache; slots past the cache's end are dropped. Returns the stack too."""
    def attention(q, k, v):
        b, t = q.shape[:2]
        rows = jnp.arange(b)[:, None]  # [B, 1]
        slots = cache.index[:, None] + jnp.arange(t)  # [B, T]
        ck = cache.k.at[layer, rows, :, slots].set(k.astype(cache.k.dtype), mode="drop")
        cv = cache.v.at[layer, rows, :, slots].set(v.astype(cache.v.dtype), mode="drop")
        out = attend(q, ck[layer].astype(q.dtype), cv[layer].astype(q.dtype), mask)
        return out, (ck, cv)
    return attention


def hidden_states(params: Params, tokens: jax.Array, positions: jax.Array, spec: ModelSpec, *,
                  attn_mask: jax.Array | None = None, cache: KVCache | None = None,
                  lora: Lora | None = None, rng: jax.Array | None = None, remat: str = "none"):
    """Final-normed hidden states [B, T, E] and the updated cache (None without one).

    lora: adapters added to their target linears (None = the frozen base alone, which is also
    the GRPO reference policy). rng: key for LoRA dropout (None = no dropout, as in eval).
    remat: what each layer saves for the backward pass, a key of REMAT_POLICIES; dots and full
    also keep dequantized NF4 weights from being saved for the backward, one per layer.
    tokens, positions: [B, T] int32. attn_mask marks valid (non-pad) key slots: [B, T] without a
    cache, [B, S] over the cache slots with one (default: all valid). With a cache, row b's T
    new tokens are written at slots [cache.index[b], cache.index[b] + T) and attend causally to
    the slots before them; the stacked cache rides in the scan's carry.
    """
    b, t = tokens.shape
    start = jnp.zeros((b,), jnp.int32) if cache is None else cache.index
    if attn_mask is None:
        attn_mask = jnp.ones((b, t if cache is None else cache.max_len), bool)
    mask = attention_mask(attn_mask, t, start)
    rope = rope_tables(positions, spec)
    h = embed(params["embed_tokens"]["embedding"], tokens)  # [B, T, E]

    def layer(carry, xs):
        h, kv = carry
        lp, ll, i, key = xs
        attention = (_attention(mask) if kv is None
                     else _cached_attention(mask, cache.replace(k=kv[0], v=kv[1]), i))
        h, kv = decoder_layer(h, lp, projector(lp, ll, lora, key), rope, spec, attention)
        return (h, kv), None

    kv = None if cache is None else (cache.k, cache.v)
    ll = None if lora is None else lora.weights["layers"]
    use_dropout = lora is not None and lora.dropout > 0 and rng is not None
    keys = jax.random.split(rng, spec.num_layers) if use_dropout else None
    policy = REMAT_POLICIES[remat]
    body = layer if policy is None else jax.checkpoint(layer, policy=policy)
    layers = jnp.arange(spec.num_layers)
    (h, kv), _ = jax.lax.scan(body, (h, kv), (params["layers"], ll, layers, keys))
    h = rms_norm(h, params["norm"]["scale"], spec.rms_norm_eps)
    if cache is None:
        return h, None
    return h, KVCache(k=kv[0], v=kv[1], index=start + t)


def lm_logits(params: Params, h: jax.Array, spec: ModelSpec) -> jax.Array:
    """Logits [..., V] in float32 from hidden states [..., E]."""
    if spec.tie_word_embeddings:
        w = params["embed_tokens"]["embedding"]  # [V, E]
        return jnp.einsum("...e,ve->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    w = as_dense(params["lm_head"]["kernel"], h.dtype)  # [E, V]
    return jnp.einsum("...e,ev->...v", h, w, preferred_element_type=jnp.float32)


def forward(params: Params, tokens: jax.Array, positions: jax.Array, spec: ModelSpec, *,
            attn_mask: jax.Array | None = None, cache: KVCache | None = None,
            lora: Lora | None = None, rng: jax.Array | None = None, remat: str = "none"):
    """Logits [B, T, V] (float32) and the updated cache. See `hidden_states` for the inputs."""
    h, cache = hidden_states(params, tokens, positions, spec, attn_mask=attn_mask, cache=cache,
                             lora=lora, rng=rng, remat=remat)
    return lm_logits(params, h, spec), cache


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Positions [B, T] for a padded batch (left or right): the count of valid tokens before
    each token; pads get the position of the previous valid token (they are masked anyway)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)

"""The sampler's two layer loops, both running the model's `decoder_layer`.

  "scan"      `jaxrl.model.transformer.hidden_states`: `lax.scan` over the stacked layers and a
              stacked [L, B, K, S, D] cache, the loop training and log-probs run too. NF4 / int4
              kernels are dequantized per layer inside the scan, so one layer is dense at a time
              even inside the decode loop (tests/sampling/test_memory.py checks the compiled
              program). The only loop on GPU and TPU, and for quantized params everywhere.
  "unrolled"  `unrolled_hidden_states` below: the layers unrolled in Python over per-layer
              weights and a per-layer cache (`LayerKVCache`, keys stored [B, K, D, S]); dense
              params on CPU only, where a decode step in the scan copies every layer's weights
              and cache out of their stacks and back (docs/benchmarks.md has the figures).
              The per-layer weights are sliced once per call, before the decode loop, behind an
              optimization barrier (XLA would sink the slices into the loop body and copy the
              weights every step again); temporary memory: one copy of the dense layer weights.
              Quantized kernels are refused: inside a decode loop their dequantization is
              loop-invariant, and XLA would hoist it and hold every layer dense at once.

`choose_layer_loop("auto")` takes "unrolled" for dense params on a CPU backend, "scan" otherwise.

Glossary: B batch, T tokens in this call, S cache slots, E hidden size, H/K query/kv heads,
D head dim, L layers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.lora.lora import Lora
from jaxrl.model.attention import attend, rope_tables
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import (Params, attention_mask, decoder_layer, embed, projector,
                                     rms_norm)
from jaxrl.quant.nf4 import QTensor
from jaxrl.sharding import MeshRules

LAYER_LOOPS = ("auto", "scan", "unrolled")


def is_quantized(params: Params) -> bool:
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QTensor))
    return any(isinstance(leaf, QTensor) for leaf in leaves)


def choose_layer_loop(params: Params, layer_loop: str = "auto",
                      platform: str | None = None) -> str:
    """"scan" or "unrolled" (module docstring) for params on `platform` (default: the default
    backend's)."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}; got {layer_loop!r}")
    if layer_loop == "unrolled" and is_quantized(params):
        raise ValueError("layer_loop 'unrolled' needs dense kernels; quantized (NF4/int4) params "
                         "decode with 'scan', which keeps dequantization per layer")
    if layer_loop != "auto":
        return layer_loop
    on_cpu = (platform or jax.default_backend()) == "cpu"
    return "unrolled" if on_cpu and not is_quantized(params) else "scan"


def min_rows(params: Params, layer_loop: str) -> int:
    """XLA:CPU multiplies one bf16 row by a kernel 5-8x slower than two rows (60 [576, 1536]
    kernels: 139 ms against 26 ms), so the unrolled loop decodes a single bf16 row as two."""
    bf16 = params["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    return 2 if layer_loop == "unrolled" and bf16 else 1


@struct.dataclass
class LayerKVCache:
    kt: tuple[jax.Array, ...]  # L x [B, K, D, S]: keys, transposed
    v: tuple[jax.Array, ...]  # L x [B, K, S, D]
    index: jax.Array  # [B] int32: row b's slots [0, index[b]) are filled

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2]


def init_layer_cache(spec: ModelSpec, batch: int, max_len: int,
                     dtype=jnp.float32) -> LayerKVCache:
    """Per layer one array each for keys and values, so a decode step updates every layer's
    slot in place; keys transposed, so the q.k product reads them as a plain [D, S] matrix."""
    kt = (batch, spec.num_kv_heads, spec.head_dim, max_len)
    v = (batch, spec.num_kv_heads, max_len, spec.head_dim)
    layers = range(spec.num_layers)
    return LayerKVCache(kt=tuple(jnp.zeros(kt, dtype) for _ in layers),
                        v=tuple(jnp.zeros(v, dtype) for _ in layers),
                        index=jnp.zeros((batch,), jnp.int32))


def layer_cache_shardings(rules: MeshRules, cache: LayerKVCache) -> LayerKVCache:
    kt = ("batch", "kv_heads", "head_dim", "seq")
    v = ("batch", "kv_heads", "seq", "head_dim")
    return cache.replace(kt=tuple(rules.named(kt, a.shape) for a in cache.kt),
                         v=tuple(rules.named(v, a.shape) for a in cache.v),
                         index=rules.rows(cache.index.shape))


def unstack_layers(tree: Params) -> tuple[Params, ...]:
    """Per-layer trees of a tree whose leaves are stacked over layers."""
    n = jax.tree_util.tree_leaves(tree)[0].shape[0]
    return tuple(jax.tree_util.tree_map(lambda a: a[i], tree) for i in range(n))


def unstacked(params: Params, lora: Lora | None) -> tuple[Params, Lora | None]:
    """params and lora with their layer stacks split into per-layer trees, materialized before
    the decode loop: the optimization barrier keeps XLA from sinking the slices into the loop
    body, where they would copy every layer's weights out of the stacks on every step."""
    layers = unstack_layers(params["layers"])
    adapters = None if lora is None else unstack_layers(lora.weights["layers"])
    layers, adapters = jax.lax.optimization_barrier((layers, adapters))
    return ({**params, "layers": layers},
            None if lora is None else lora.replace(weights={"layers": adapters}))


def _transposed_key_attention(mask: jax.Array, cache_kt: jax.Array, cache_v: jax.Array,
                              start: jax.Array):
    """Attention over one `LayerKVCache` layer, this call's keys and values [B, T, K, D] written
    at each row's slots [start[b], start[b] + T) (past the end: dropped); computed in the cache
    dtype."""
    def attention(q, k, v):
        rows = jnp.arange(q.shape[0])[:, None]  # [B, 1]
        slots = start[:, None] + jnp.arange(q.shape[1])  # [B, T]
        kt = cache_kt.at[rows, :, :, slots].set(k.astype(cache_kt.dtype), mode="drop")
        v = cache_v.at[rows, :, slots].set(v.astype(cache_v.dtype), mode="drop")
        out = attend(q.astype(kt.dtype), kt, v, mask, keys_transposed=True)
        return out.astype(q.dtype), (kt, v)
    return attention


def unrolled_hidden_states(params: Params, tokens: jax.Array, positions: jax.Array,
                           spec: ModelSpec, *, attn_mask: jax.Array, cache: LayerKVCache,
                           lora: Lora | None = None,
                           rope_table: tuple[jax.Array, jax.Array] | None = None):
    """`hidden_states` with a `LayerKVCache` and the layers unrolled in Python, for decoding
    (no dropout, no remat). params["layers"] and lora.weights["layers"] hold one tree per layer
    (`unstacked`), with dense kernels.
    rope_table: `rope_tables` of positions [1, S] = 0..S-1, computed once before a decode loop;
    each call then looks its positions up instead of evaluating cos and sin, which XLA:CPU fuses
    into every layer's consumers and evaluates per head and layer (~1.5M per step at batch 32).
    Returns final-normed hidden states [B, T, E] and the cache."""
    if is_quantized(params["layers"]):
        raise ValueError("unrolled_hidden_states takes dense kernels only; NF4/int4 kernels "
                         "must run through hidden_states, whose layer scan keeps dequantization "
                         "per layer inside a decode loop")
    start = cache.index
    mask = attention_mask(attn_mask, tokens.shape[1], start)
    rope = (rope_tables(positions, spec) if rope_table is None
            else tuple(table[0][positions] for table in rope_table))
    h = embed(params["embed_tokens"]["embedding"], tokens)  # [B, T, E]
    kts, vs = [], []
    adapters = [None] * spec.num_layers if lora is None else lora.weights["layers"]
    for lp, ll, cache_kt, cache_v in zip(params["layers"], adapters, cache.kt, cache.v):
        attention = _transposed_key_attention(mask, cache_kt, cache_v, start)
        h, (kt, v) = decoder_layer(h, lp, projector(lp, ll, lora, None), rope, spec, attention)
        kts.append(kt)
        vs.append(v)
    h = rms_norm(h, params["norm"]["scale"], spec.rms_norm_eps)
    return h, LayerKVCache(kt=tuple(kts), v=tuple(vs), index=start + tokens.shape[1])

"""The decoder forward pass: a pure function of params, tokens and positions.

`hidden_states` scans over the stacked layer weights with `lax.scan` (`_scan_layers`, the one
layer loop): training, log-probs and decoding (jaxrl/sampling/programs.py) all run it, with NF4
kernels dequantized one layer at a time inside it, and `prefix_hidden_states` runs the same loop
over rows that share a prompt. Every backend form (products, NF4 matmul form, how weights are
held, what remat saves, the embedding gather, the decode head) comes from the static `numerics`
argument (`jaxrl.backends.numerics`); the default is the XLA reference forms.

Glossary: B batch, T tokens in this call, C cache columns (key slots before this call's tokens;
T without a cache), P prefix (shared prompt) columns, E hidden size, F MLP size, H/K query/kv
heads, D head dim, V vocab, L layers.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.backends.numerics import REFERENCE, AtLayer, Numerics, dense_tree, joined_name
from jaxrl.lora.lora import Lora, lora_delta, scaled_xa
from jaxrl.model.attention import apply_rope, attend, attend_filled, rope_tables
from jaxrl.model.families import ModelSpec
from jaxrl.model.kv_cache import KVCache, write_tokens
from jaxrl.model.params import LINEAR_NAMES
from jaxrl.quant.nf4 import QTensor, as_dense

Params = dict[str, Any]


class Layout(Protocol):
    """Where a mesh puts the forward's arrays (`jaxrl.sharding.MeshRules` is one); None in the
    functions below means one device, or the partitioner's choice."""

    def constrain_rows(self, x: jax.Array) -> jax.Array:
        """x [B, ...] with its rows split over the batch axes, every other dim whole."""

    def constrain_layer(self, lp: Params, ll: Params | None, spec: ModelSpec):
        """(lp, ll): one layer's weights and adapter laid out for a call with many tokens."""


# What each layer of the scan keeps for the backward pass (`remat`), least recomputation first:
# none saves every intermediate; dots saves each projection's output (`projector`: the linear's
# matmul plus its LoRA delta, one [B, T, out] array however the matmul is split, as the NF4
# matmul splits it in two) and recomputes attention, norms, activations and the LoRA products;
# full saves only the layer's input and recomputes the whole layer. Dequantized NF4 kernels are
# saved under none.
REMAT_POLICIES = {"none": None,
                  "dots": jax.checkpoint_policies.save_only_these_names("projection"),
                  "full": jax.checkpoint_policies.nothing_saveable}


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * xf.astype(x.dtype)


def linear(x: jax.Array, p: Params, numerics: Numerics = REFERENCE) -> jax.Array:
    """x [B, T, in] @ kernel [in, out] (+ bias), accumulated in float32 and rounded once to
    x's dtype; the kernel may be a quantized QTensor, dequantized with the matmul
    (`Numerics.matmul`), so inside the layer scan, one layer at a time. Without a bias the
    matmul itself yields x's dtype, so where a mesh splits `in` (o_proj and down_proj over the
    tensor axis, and in the backward pass the column-parallel layers' input gradients) the
    partial sums are reduced across devices in the model's dtype, except where the numerics'
    form sums in float32 first (the NF4 block and split forms, the CPU's bfloat16 product)."""
    dtype = jnp.float32 if "bias" in p else x.dtype  # a bias is added before the rounding
    y = numerics.matmul(x, p["kernel"], dtype=dtype)
    if "bias" in p:
        y = y + p["bias"]
    return y.astype(x.dtype)


class projector:
    """proj(name, x): layer linear `name` applied to x, plus its adapter when it has one; the
    result is named "projection" (the one array remat dots saves of it, as `Numerics.save`
    saves it). proj.swiglu(x): swiglu of the gate and up projections of x. Where the numerics
    runs a linear as one kernel with its LoRA term in the epilogue (`Numerics.fuses`: NF4
    layers read in place), the projection and, for gate and up, SwiGLU are that kernel's."""

    def __init__(self, lp: Params, ll: Params | None, lora: Lora | None,
                 rng: jax.Array | None, numerics: Numerics = REFERENCE):
        self.lp, self.ll, self.lora, self.rng, self.numerics = lp, ll, lora, rng, numerics

    def _adapter(self, name: str):
        return None if self.ll is None else self.ll.get(name)

    def _fused(self, name: str, x: jax.Array) -> bool:
        dropout = self.lora is not None and self.lora.dropout > 0 and self.rng is not None
        return (not dropout and "bias" not in self.lp[name]
                and self.numerics.fuses(self.lp[name]["kernel"], x.shape[-2]))

    def _scale(self, x: jax.Array):
        """The low-rank term's scale for x [B, T, in]: a number, or per row (`Lora.rows`)."""
        return 1.0 if self.lora is None else self.lora.scale_for(x)

    def _for_kernel(self, ad, x: jax.Array):
        """An adapter as the kernels take it: in the rows form with its x @ A term computed
        here (the kernels scale by one number)."""
        if ad is None or self.lora.rows is None or "xa" in ad:
            return ad
        return {"xa": scaled_xa(x, ad["a"], self._scale(x)), "b": ad["b"]}

    def __call__(self, name: str, x: jax.Array) -> jax.Array:
        numerics, ad = self.numerics, self._adapter(name)
        if self._fused(name, x):
            y = numerics.nf4_linear(x, self.lp[name]["kernel"], self._for_kernel(ad, x),
                                    scale=self._scale(x))
        else:
            y = linear(x, self.lp[name], numerics)
            if ad is not None:
                key = (None if self.rng is None
                       else jax.random.fold_in(self.rng, LINEAR_NAMES.index(name)))
                y = y + lora_delta(x, ad, self._scale(x), self.lora.dropout, key)
        return numerics.save(y, "projection")

    def _kernel_adapters(self, names, x: jax.Array):
        """The adapters of the linears `names` for the kernels: with their x @ A terms from
        one product where the sampling program joined their A matrices
        (`Numerics.hold_adapters`), else as they are."""
        adapters = [self._adapter(n) for n in names]
        joined = self._adapter(joined_name(names))
        if joined is None:
            return [self._for_kernel(ad, x) for ad in adapters]
        scale = self._scale(x)
        if self.lora.rows is not None:  # each member's columns, side by side
            scale = jnp.tile(scale, (1, 1, len(names)))
        xa = scaled_xa(x, joined["a"], scale)
        ends = np.cumsum([ad["a"].shape[-1] for ad in adapters])[:-1]
        return [{"xa": part, "b": ad["b"]}
                for part, ad in zip(jnp.split(xa, ends, axis=-1), adapters)]

    def many(self, names, x: jax.Array) -> list[jax.Array]:
        """[proj(name, x) for name in names], the kernels' x @ A terms in one product where
        their A matrices are joined."""
        if not all(self._fused(n, x) for n in names):
            return [self(n, x) for n in names]
        return [self.numerics.save(self.numerics.nf4_linear(
            x, self.lp[n]["kernel"], ad, scale=self._scale(x)), "projection")
            for n, ad in zip(names, self._kernel_adapters(tuple(names), x))]

    def swiglu(self, x: jax.Array) -> jax.Array:
        names = ("gate_proj", "up_proj")
        if all(self._fused(n, x) for n in names):
            gate, up = self._kernel_adapters(names, x)
            return self.numerics.nf4_linear(
                x, self.lp["gate_proj"]["kernel"], gate, scale=self._scale(x),
                up=self.lp["up_proj"]["kernel"], up_adapter=up)
        return swiglu(self("gate_proj", x), self("up_proj", x))


def attention_mask(attn_mask: jax.Array, t: int, start: jax.Array) -> jax.Array:
    """[B, T, S]: query t of row b (at slot start[b] + t; start [B] or a scalar) sees valid key
    slots s <= start[b] + t."""
    b, s = attn_mask.shape
    query = jnp.broadcast_to(start, (b,))[:, None] + jnp.arange(t)  # [B, T]
    return (jnp.arange(s) <= query[..., None]) & attn_mask[:, None, :]


def _qkv(x, proj, lp, rope, spec: ModelSpec):
    """q [B, T, H, D] and k, v [B, T, K, D] of normed hidden states x [B, T, E], roped."""
    b, t, _ = x.shape
    q, k, v = proj.many(("q_proj", "k_proj", "v_proj"), x)
    q = q.reshape(b, t, spec.num_heads, spec.head_dim)
    k = k.reshape(b, t, spec.num_kv_heads, spec.head_dim)
    v = v.reshape(b, t, spec.num_kv_heads, spec.head_dim)
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
    return h + proj("down_proj", proj.swiglu(x)), kv


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, silu computed in float32 and rounded once to gate's dtype (as torch's
    silu kernel rounds a bfloat16 input), then multiplied in the inputs' dtype. jax.nn.silu in
    bfloat16 rounds each of its steps (negate, exp, add, divide, multiply), in the backward
    pass too, which XLA:CPU does element by element."""
    return jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up


def _attention(mask: jax.Array, keep: bool = False):
    """Attention over this call's keys alone (no cache); keep: also return its keys and values
    [B, K, T, D] as the layer's kv (for the rows that attend to them next)."""
    def attention(q, k, v):
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        return attend(q, k, v, mask), ((k, v) if keep else None)
    return attention


def _cached_attention(mask: jax.Array, cache: tuple[jax.Array, jax.Array] | None,
                      prefix: tuple[jax.Array, jax.Array] | None = None):
    """Attention over one layer's cache slots [B, K, S, D] (keys, values), read in place, then
    this call's own keys and values [B, T, K, D]; mask [B, T, S + T]. prefix: keys and values
    [B / R, K, P, D] that blocks of R rows share, before the cache (mask [B, T, P + S + T]).
    The caches are only read here: the new keys and values are returned, and `hidden_states`
    writes all layers' into the cache after the scan, so the layer loop neither carries nor
    rewrites the cache."""
    def attention(q, k, v):
        new_k, new_v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        return attend(q, new_k, new_v, mask, cache=cache, prefix=prefix), (k, v)
    return attention


def _filled_attention(kernel, kv: AtLayer, index: jax.Array, prefix_index: jax.Array | None):
    """`_cached_attention` of a decode step (one token per row, every cache column valid)
    through `kernel`, which reads only the filled columns of the layer kv.layer of the stacked
    caches kv.stack (keys, values[, the prefix's keys, values]): row b's [0, index[b]), and its
    block's prefix columns [0, prefix_index[b / R])."""
    def attention(q, k, v):
        stack, layer = kv.stack, kv.layer
        prefix = None if prefix_index is None else (stack[2], stack[3], layer, prefix_index)
        out = attend_filled(q, k, v, kernel, (stack[0], stack[1], layer, index), prefix)
        return out, (k, v)
    return attention


def _read_lengths(cache: KVCache, prefix: KVCache | None, reading: jax.Array | None):
    """The columns a decode step's filled-columns attention reads: of each row's cache [B]
    and of each block's prompt [B / R] (None without a prefix); none for rows not `reading`
    (a block's prompt: none once none of its rows reads)."""
    own = jnp.minimum(cache.index, cache.max_len)
    shared = None if prefix is None else prefix.index
    if reading is not None:
        own = jnp.where(reading, own, 0)
        if prefix is not None:
            blocks = jnp.any(reading.reshape(prefix.index.shape[0], -1), axis=1)
            shared = jnp.where(blocks, shared, 0)
    return own, shared


def cached_mask(attn_mask: jax.Array, t: int, start: jax.Array) -> jax.Array:
    """[B, T, S + T]: query t of row b (start [B]: the slots its row has filled) sees the valid
    cache slots s < start[b] and its call's tokens up to itself; attn_mask [B, S] marks valid
    slots, and a new token is valid where its slot start[b] + t is (past the end: valid)."""
    b, s = attn_mask.shape
    slots = start[:, None] + jnp.arange(t)  # [B, T]
    old = (jnp.arange(s) < start[:, None]) & attn_mask  # [B, S]
    new_valid = jnp.take_along_axis(attn_mask, jnp.minimum(slots, s - 1), axis=1) | (slots >= s)
    causal = jnp.arange(t)[None, :, None] >= jnp.arange(t)[None, None, :]  # [1, T, T]
    new = causal & new_valid[:, None, :]  # [B, T, T]
    return jnp.concatenate([jnp.broadcast_to(old[:, None, :], (b, t, s)), new], axis=2)


def _rows(layout: Layout | None, x: jax.Array) -> jax.Array:
    return x if layout is None else layout.constrain_rows(x)


def _scan_layers(params: Params, lora: Lora | None, carry, xs, layer_fn, *, spec: ModelSpec,
                 numerics: Numerics, layout: Layout | None, remat: str,
                 rng: jax.Array | None = None):
    """The layer loop: `lax.scan` over the stacked layers (as `numerics` holds them), running
    layer_fn(carry, lp, proj, x) -> (carry, out) with the layer's dense weights lp, its
    projector proj (`projector`: linears plus adapters, LoRA dropout keyed by rng) and its
    slice x of xs (a pytree with a leading [L] axis, or None); each layer's weights are laid
    out by `layout` (None: left as they are). remat: a key of REMAT_POLICIES. Returns (carry,
    the outs stacked [L, ...]).

    Where the numerics' kernels read layers in place (`Numerics.in_place_layers`), the loop
    runs over the layer index instead: lp's NF4 kernels and x are `AtLayer`s of the whole
    stacks (the kernels index them; an XLA form slices them), the other weights are sliced."""
    use_dropout = lora is not None and lora.dropout > 0 and rng is not None
    keys = jax.random.split(rng, spec.num_layers) if use_dropout else None
    layers = numerics.hold(params)["layers"]
    in_place = numerics.in_place_layers

    def layer(carry, scanned):
        lp, ll, key, x = scanned
        if in_place:  # lp is the layer index
            lp, x = _at_layer(layers, lp), None if xs is None else AtLayer(xs, lp)
        lp, ll = dense_tree(lp), dense_tree(ll)
        if layout is not None and not in_place:  # in place: kernels run on one device
            lp, ll = layout.constrain_layer(lp, ll, spec)
        return layer_fn(carry, lp, projector(lp, ll, lora, key, numerics), x)

    policy = REMAT_POLICIES[remat]
    body = layer if policy is None else jax.checkpoint(layer, policy=policy)
    ll = None if lora is None else lora.weights["layers"]
    if in_place:
        return jax.lax.scan(body, carry, (jnp.arange(spec.num_layers), ll, keys, None))
    return jax.lax.scan(body, carry, (layers, ll, keys, xs))


def _at_layer(layers: Params, i: jax.Array) -> Params:
    """Layer i of the stacked weights: NF4 kernels as `AtLayer`s of their stacks, every other
    leaf sliced."""
    def pick(a):
        return AtLayer(a, i) if isinstance(a, QTensor) else AtLayer(a, i).get()
    return jax.tree_util.tree_map(pick, layers, is_leaf=lambda a: isinstance(a, QTensor))


def hidden_states(params: Params, tokens: jax.Array, positions: jax.Array, spec: ModelSpec, *,
                  attn_mask: jax.Array | None = None, cache: KVCache | None = None,
                  prefix: KVCache | None = None, lora: Lora | None = None,
                  rng: jax.Array | None = None, remat: str = "none",
                  shardings: Layout | None = None, numerics: Numerics = REFERENCE,
                  reading: jax.Array | None = None):
    """Final-normed hidden states [B, T, E] and the updated cache (None without one).

    lora: adapters added to their target linears (None = the frozen base alone, which is also
    the GRPO reference policy). rng: key for LoRA dropout (None = no dropout, as in eval).
    remat: what each layer saves for the backward pass, a key of REMAT_POLICIES; dots and full
    also keep dequantized NF4 weights from being saved for the backward, one per layer.
    tokens, positions: [B, T] int32. attn_mask marks valid (non-pad) key slots: [B, T] without a
    cache, [B, C] over the cache columns with one (default: all valid). With a cache, row b's T
    new tokens attend causally to its filled columns [0, cache.index[b]) and to each other, then
    are written at columns [cache.index[b], cache.index[b] + T) (`write_tokens`): the layer scan
    reads each layer's cache as a scanned input and never carries the cache.
    prefix (only with a cache): keys and values [L, B / R, K, P, D] before every row's cache,
    each shared by a block of R consecutive rows (their prompt, filled to prefix.index), read
    once per block; it is only read, and positions are the caller's (after the prefix).
    shardings: the mesh layout of the arrays (`jaxrl.sharding.MeshRules`; None: one device, or
    let the partitioner choose). A call with more than one token per row gathers each layer's
    weights over the FSDP axes inside the loop; a decode step (one token per row) leaves them
    split and moves its few activations instead. numerics: the backend forms
    (`jaxrl.backends.numerics`). reading [B] bool (a decode step's live rows, or None: all):
    where the numerics' decode attention reads only filled columns, the other rows read
    none (their outputs are garbage for the caller to drop), so a finished slot's stale fill
    costs nothing; their new keys and values are still written at their index.
    """
    b, t = tokens.shape
    kernel = None  # attention over each row's filled columns, read in place
    if cache is not None and t == 1 and attn_mask is None:
        kernel = numerics.filled_attention()
    if attn_mask is None:
        attn_mask = jnp.ones((b, t if cache is None else cache.max_len), bool)
    if cache is None:
        mask = attention_mask(attn_mask, t, jnp.zeros((b,), jnp.int32))
    else:
        mask = cached_mask(attn_mask, t, cache.index)
    if prefix is not None:  # the block's prompt columns, before the row's own
        filled = jnp.repeat(prefix.index, b // prefix.index.shape[0])  # [B]
        seen = jnp.arange(prefix.max_len) < filled[:, None]  # [B, P]
        mask = jnp.concatenate([jnp.broadcast_to(seen[:, None], (b, t, prefix.max_len)), mask],
                               axis=2)
    rope = rope_tables(positions, spec)
    many = shardings if t > 1 else None  # the layout of a call with many tokens per row
    h = _rows(many, numerics.embed(params["embed_tokens"]["embedding"], tokens))  # [B, T, E]

    kv = None if cache is None else (cache.k, cache.v)
    if prefix is not None:
        kv += (prefix.k, prefix.v)
    stacks = None  # the caches a kernel indexes itself where the loop would slice them
    if kernel is not None:
        read = _read_lengths(cache, prefix, reading)
        if not numerics.in_place_layers:
            stacks, kv = kv, jnp.arange(spec.num_layers, dtype=jnp.int32)

    def layer(h, lp, proj, kv):
        if kernel is not None:
            kv = kv if stacks is None else AtLayer(stacks, kv)
            attention = _filled_attention(kernel, kv, *read)
        else:
            kv = kv.get() if isinstance(kv, AtLayer) else kv
            attention = (_attention(mask) if kv is None
                         else _cached_attention(mask, kv[:2], prefix=kv[2:] or None))
        return decoder_layer(_rows(many, h), lp, proj, rope, spec, attention)

    h, new = _scan_layers(params, lora, h, kv, layer, spec=spec, numerics=numerics,
                          layout=many, remat=remat, rng=rng)
    h = rms_norm(h, params["norm"]["scale"], spec.rms_norm_eps)
    return h, (None if cache is None else write_tokens(cache, *new))


def prefix_hidden_states(params: Params, tokens: jax.Array, positions: jax.Array,
                         spec: ModelSpec, *, prefix: int, share: int,
                         attn_mask: jax.Array | None = None, lora: Lora | None = None,
                         remat: str = "none", shardings: Layout | None = None,
                         numerics: Numerics = REFERENCE):
    """`hidden_states` of rows whose first `prefix` columns (tokens, positions and mask) are
    the same in each block of `share` consecutive rows, as a GRPO group's rows share their
    prompt: the prefix runs once per block, and the rows' later columns attend to their block's
    keys and values. Returns the final-normed (prefix [B / share, P, E], rest [B, T - P, E]):
    the same values as hidden_states(...)[:, :P] of each block's first row and [:, P:], with
    P / T of the rows' work done once per block instead of once per row. Differentiable: a
    block's prefix gathers the gradients of all its rows.

    No LoRA dropout (no rng): masks drawn once per block would tie the rows' prompt masks."""
    b, t = tokens.shape
    if b % share or not 1 <= prefix < t:
        raise ValueError(f"{b} rows of {t} columns do not split into blocks of {share} rows "
                         f"sharing a prefix of {prefix} columns")
    if attn_mask is None:
        attn_mask = jnp.ones((b, t), bool)
    first = lambda x: x[:, :prefix].reshape(b // share, share, prefix)[:, 0]  # noqa: E731
    n = t - prefix
    mask_p = attention_mask(first(attn_mask), prefix, jnp.zeros((b // share,), jnp.int32))
    causal = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]  # [N, N]
    mask_c = jnp.concatenate([jnp.broadcast_to(attn_mask[:, None, :prefix], (b, n, prefix)),
                              causal & attn_mask[:, None, prefix:]], axis=2)  # [B, N, P + N]
    rope_p, rope_c = rope_tables(first(positions), spec), rope_tables(positions[:, prefix:], spec)
    table = params["embed_tokens"]["embedding"]
    hp = _rows(shardings, numerics.embed(table, first(tokens)))  # [B / share, P, E]
    hc = _rows(shardings, numerics.embed(table, tokens[:, prefix:]))  # [B, N, E]

    def layer(carry, lp, proj, _):
        hp, (k, v) = decoder_layer(_rows(shardings, carry[0]), lp, proj, rope_p, spec,
                                   _attention(mask_p, keep=True))
        hc, _ = decoder_layer(_rows(shardings, carry[1]), lp, proj, rope_c, spec,
                              _cached_attention(mask_c, None, prefix=(k, v)))  # the block's
        return (hp, hc), None

    (hp, hc), _ = _scan_layers(params, lora, (hp, hc), None, layer, spec=spec,
                               numerics=numerics, layout=shardings, remat=remat)
    scale, eps = params["norm"]["scale"], spec.rms_norm_eps
    return rms_norm(hp, scale, eps), rms_norm(hc, scale, eps)


def lm_logits(params: Params, h: jax.Array, spec: ModelSpec,
              numerics: Numerics = REFERENCE) -> jax.Array:
    """Logits [..., V] in float32 from hidden states [..., E]."""
    if spec.tie_word_embeddings:
        w = params["embed_tokens"]["embedding"]  # [V, E]
        return numerics.product(h, w, transposed=True)
    return numerics.product(h, as_dense(params["lm_head"]["kernel"], h.dtype))


def logits_at(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """logits[..., ids] of logits [..., V] and ids [...], as a sum over V of the one entry
    that matches: exactly that entry, and where a mesh splits the vocab each device sums its
    own part and only [...] crosses between them (a gather would collect the logits whole)."""
    hit = jnp.arange(logits.shape[-1]) == ids[..., None]
    return jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)


def forward(params: Params, tokens: jax.Array, positions: jax.Array, spec: ModelSpec, *,
            attn_mask: jax.Array | None = None, cache: KVCache | None = None,
            lora: Lora | None = None, rng: jax.Array | None = None, remat: str = "none",
            numerics: Numerics = REFERENCE):
    """Logits [B, T, V] (float32) and the updated cache. See `hidden_states` for the inputs."""
    h, cache = hidden_states(params, tokens, positions, spec, attn_mask=attn_mask, cache=cache,
                             lora=lora, rng=rng, remat=remat, numerics=numerics)
    return lm_logits(params, h, spec, numerics), cache


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Positions [B, T] for a padded batch (left or right): the count of valid tokens before
    each token; pads get the position of the previous valid token (they are masked anyway)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)

"""The decode engine's device side: S decode slots over one KV cache and the jitted programs
that fill and advance them; the host loop that drives them is `Engine`
(jaxrl/sampling/engine.py).

Glossary: S decode slots, C cache columns per slot (its capacity), U distinct prompts prefilled
together, P their width (bucketed), M slots filled together, N steps per `generate` call (the
chunk), R slots continued together, A the tokens appended to each (bucketed), V vocab.

Slots. Each slot holds one request's row of the KV cache, left-aligned: its prompt in columns
[0, len), its t-th new token in column len + t, so a token's cache column is its position and
no slot carries padding. Beside the cache every slot holds, as arrays [S] on the device: the
token to feed next, whether it is live, how many tokens it has generated, its token budget, its
PRNG key and its decoding settings (`RowSettings`), and for the penalties which tokens its
prompt holds and how often it generated each (`History`, [S, V] each). A slot's t-th token is
drawn with fold_in(key, t) under its own settings, so a request decodes the same tokens
whatever slot it lands in and whatever decodes beside it.

Shared prompts. An engine made with share R > 1 groups its slots in blocks of R consecutive
slots that decode R requests of one prompt (a GRPO group, `Engine.submit_group`). The block
holds the prompt's keys and values once, in a prefix cache [L, S / R, K, P, D] beside the
slots' own caches [L, S, K, C - P, D] (a slot's t-th new token in its own column t), and each
decode step's attention reads it once for the block: the R rows' queries form one product
against it. Requests in blocks are admitted and freed a block at a time and cannot be held
for continuations.

Programs (jitted; static: the model spec, EOS ids, mesh, numerics, the sampling features and
the shapes):
  admit     prefill U distinct prompts once (right-padded to P), copy row src[m]'s P cache
            columns into slot dst[m] for each of M new slots (the G completions of a prompt
            share one prefill; with blocks, into the block's prefix cache once), and draw each
            new slot's first token. Padding entries name slot S and are dropped.
  generate  advance every live slot by up to N tokens and return the new tokens, their
            log-probs and which were emitted [S, N]. With `Numerics.fixed_chunk` (GPU, TPU)
            the chunk is N steps, always: a slot that is not live changes nothing and emits
            nothing, so no step waits on the host to learn whether to go on; otherwise (CPU)
            it stops early once no slot is live, or (an interruptible engine's, a server's)
            after a step once the host has asked it to
            (`jaxrl.backends.numerics.interrupt_chunks`: a cancel or a new request).
  extend    continue R slots: conversations held in their slots (jaxrl/sampling/requests.py)
            and prompts prefilled in pieces. Rewind each such slot's cache to its kept tokens,
            append up to A tokens [R, A] there in one pass over those R rows alone (the other
            slots are left as they were), and draw each row's first new token under its new
            key, settings and budget.
Adapters: with an `AdapterSet` as the programs' lora, each slot decodes with its own adapter
(`Slots.adapter`, its index; `admit` takes each prefilled prompt's), through the set's rows form
(`AdapterSet.for_rows`): the indices are data, so a new mix of adapters compiles nothing.
Settings, keys, budgets and prompt lengths are data; which parts of the token choice a program
holds (greedy choice, draws, each filter, the penalties, top log-probs) is static, the
`Features` the host computes from the settings of the slots it fills and holds
(`jaxrl.sampling.sampling_fns.Features`), so new settings compile a program only where they
need a part the programs compiled so far leave out. S, C and N are fixed per engine, and U, M,
P, R and A are rounded up to powers of two, so the programs number at most one `generate` per
features value, one `admit` per (U, M, P) bucket and features value and one `extend` per (R, A)
bucket and features value; a run whose rows share one setting (a GRPO rollout) compiles one
features value.

Both programs run the model's `lax.scan` over the stacked layers (`hidden_states`), the loop
training runs, with NF4 kernels dequantized one layer at a time inside it; the scan reads each
layer's cache in place and each step writes only its new token per slot, once, after the scan
(`kv_cache.write_tokens`), into the donated state. The backend forms, the cache's dtype and the
decode program's compiler options come from the static `numerics` (`jaxrl.backends.numerics`;
default: the XLA reference forms).

"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.backends.numerics import REFERENCE, Numerics, Program
from jaxrl.lora.adapters import AdapterSet
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.kv_cache import KVCache, init_cache
from jaxrl.model.transformer import Params, hidden_states, lm_logits
from jaxrl.sampling.sampling_fns import (ALL, MAX_TOP_LOGPROBS, Decoding, Features, History,
                                         RowSettings, next_token)
from jaxrl.sharding import (MeshRules, cache_shardings, constrain, head_logits, head_rules,
                            lora_shardings, param_shardings, row_shardings,
                            vocab_top_k)


@struct.dataclass
class Slots:
    """Device state of the S slots (module docstring)."""

    cache: KVCache  # [L, S, K, C, D]; cache.index [S]: tokens in each slot's cache
    last: jax.Array  # [S] int32: the token to feed next
    live: jax.Array  # [S] bool
    count: jax.Array  # [S] int32: tokens generated
    budget: jax.Array  # [S] int32: max new tokens
    keys: jax.Array  # [S, 2] uint32
    settings: RowSettings  # [S] each
    history: History  # [S, V] each: what the penalties read
    adapter: jax.Array  # [S] int32: the slot's adapter index (an `AdapterSet`'s; 0: the base)
    # With blocks of R slots sharing a prompt (module docstring): the prompts' cache
    # [L, S / R, K, P, D], index [S / R] their lengths; `cache` then holds each slot's own
    # tokens only, its column t the slot's t-th generated token. None: no sharing.
    prefix: KVCache | None = None


@struct.dataclass
class Chunk:
    """What one `generate` call decoded, [S, N]."""

    tokens: jax.Array  # int32
    logprobs: jax.Array  # float32
    emitted: jax.Array  # bool: the slot was live and produced this token
    top_ids: jax.Array  # [S, N, MAX_TOP_LOGPROBS] int32, for slots that ask (RowSettings)
    top_logprobs: jax.Array  # [S, N, MAX_TOP_LOGPROBS] float32


def _cache_dtype(params: Params, numerics: Numerics):
    return numerics.cache_dtype(params["embed_tokens"]["embedding"].dtype)


def decode_logits(params: Params, h: jax.Array, spec: ModelSpec, shardings: MeshRules | None,
                  numerics: Numerics = REFERENCE) -> jax.Array:
    """Logits [S, V] float32 of a decode step's hidden states h [S, E]: the numerics' own form
    of a tied head on one device where it has one (`Numerics.tied_decode_logits`), else the
    model's head laid out as `head_logits` lays it."""
    if shardings is None and spec.tie_word_embeddings:
        own = numerics.tied_decode_logits(params["embed_tokens"]["embedding"], h)
        if own is not None:
            return own
    return head_logits(shardings, lm_logits(params, h, spec, numerics))


def _place(params, lora, spec, shardings, numerics: Numerics, rows: jax.Array | None = None):
    """params and lora laid out on the mesh, lora in the compute dtype as the numerics holds
    it (`Numerics.hold_adapters`). An `AdapterSet` becomes the one `Lora` of the rows whose
    adapter indices are rows [B] (`AdapterSet.for_rows`)."""
    if shardings is not None:
        params = constrain(params, param_shardings(shardings, params, spec))
        if isinstance(lora, AdapterSet):
            lora = lora.replace(loras=tuple(constrain(m, lora_shardings(shardings, m, spec))
                                            for m in lora.loras))
        elif lora is not None:
            lora = constrain(lora, lora_shardings(shardings, lora, spec))
    if isinstance(lora, AdapterSet):
        lora = lora.for_rows(rows)
    dtype = params["embed_tokens"]["embedding"].dtype
    return params, numerics.hold_adapters(lora, dtype)


@functools.partial(jax.jit, static_argnames=("spec", "slots", "capacity", "share",
                                             "prompt_capacity", "shardings", "numerics"))
def init_slots(params: Params, *, spec: ModelSpec, slots: int, capacity: int, share: int = 1,
               prompt_capacity: int = 0, shardings: MeshRules | None = None,
               numerics: Numerics = REFERENCE) -> Slots:
    """S empty slots of `capacity` cache columns each; with share R > 1, in blocks of R slots
    that share the first prompt_capacity of those columns (one prompt per block)."""
    dtype = _cache_dtype(params, numerics)
    prefix = None
    if share > 1:
        prefix = init_cache(spec, slots // share, prompt_capacity, dtype)
        capacity -= prompt_capacity
    cache = init_cache(spec, slots, capacity, dtype)
    zeros = lambda dtype: jnp.zeros((slots,), dtype)
    state = Slots(cache=cache, last=zeros(jnp.int32), live=zeros(bool), count=zeros(jnp.int32),
                  budget=zeros(jnp.int32), keys=jnp.zeros((slots, 2), jnp.uint32),
                  settings=jax.tree_util.tree_map(jnp.asarray,
                                                  RowSettings.of([Decoding()] * slots)),
                  history=History.empty(slots, spec.vocab_size), adapter=zeros(jnp.int32),
                  prefix=prefix)
    return state if shardings is None else constrain(state, _slot_shardings(shardings, state))


def _slot_shardings(shardings: MeshRules, state: Slots) -> Slots:
    """The cache as `cache_shardings` lays it out, the history [S, V] as the logits it
    adjusts (`head_logits`), every other field split by slots."""
    rest = row_shardings(shardings, state.replace(cache=None, history=None, prefix=None))
    vocab = head_rules(shardings)
    history = jax.tree_util.tree_map(lambda a: vocab.named(("batch", "vocab"), a.shape),
                                     state.history)
    prefix = None if state.prefix is None else cache_shardings(shardings, state.prefix)
    return rest.replace(cache=cache_shardings(shardings, state.cache), history=history,
                        prefix=prefix)


def abstract_slots(params: Params, spec: ModelSpec, slots: int, capacity: int,
                   shardings: MeshRules, share: int = 1, prompt_capacity: int = 0,
                   numerics: Numerics = REFERENCE) -> Slots:
    """ShapeDtypeStructs of `init_slots` with their shardings, for compiling the engine's
    programs without data (`jaxrl plan`)."""
    make = functools.partial(init_slots, spec=spec, slots=slots, capacity=capacity,
                             share=share, prompt_capacity=prompt_capacity, shardings=shardings,
                             numerics=numerics)
    shapes = jax.eval_shape(make, params)
    return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  shapes, _slot_shardings(shardings, shapes))


def _insert_rows(cache: KVCache, pre: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """cache with prefill rows pre[src[m]] (columns [0, P)) copied into slots dst[m]; an entry
    naming a slot past the end is dropped."""
    p = pre.k.shape[3]
    k = cache.k.at[:, dst, :, :p].set(pre.k[:, src].astype(cache.k.dtype), mode="drop")
    v = cache.v.at[:, dst, :, :p].set(pre.v[:, src].astype(cache.v.dtype), mode="drop")
    return cache.replace(k=k, v=v)


def _fold(keys: jax.Array, t: jax.Array) -> jax.Array:
    """keys [R, 2] each folded with t [R] (or a scalar): the key of each row's t-th token."""
    t = jnp.broadcast_to(t, keys.shape[:1])
    return jax.vmap(jax.random.fold_in)(keys, t)


@functools.partial(jax.jit, donate_argnums=0,
                   static_argnames=("spec", "eos_ids", "shardings", "numerics", "features"))
def admit(state: Slots, params: Params, lora: Lora | AdapterSet | None, prompts: jax.Array,
          lengths: jax.Array, adapter: jax.Array, src: jax.Array, dst: jax.Array,
          keys: jax.Array, settings: RowSettings, budget: jax.Array, *, spec: ModelSpec,
          eos_ids: tuple[int, ...], shardings: MeshRules | None = None,
          numerics: Numerics = REFERENCE, features: Features = ALL,
          allowed: jax.Array | None = None, first: jax.Array | None = None):
    """Prefill prompts [U, P] (right-padded; lengths [U]) under adapters adapter [U] (indices
    of an `AdapterSet` lora; ignored otherwise) and fill slots dst [M] from rows src [M] with
    keys [M, 2], settings [M] and budgets [M] (module docstring). With blocks of
    R slots sharing a prompt (state.prefix), M is a multiple of R and each R consecutive
    entries fill one block's slots in order from one row. features must cover the settings of
    the slots filled (`Features.covers`). Returns the new state and, per new slot [M], its
    first token with its log-probs (`Picked`) and whether the slot is already done. allowed
    [M, V]: the tokens each new slot's first token may be (`next_token`; None: all). first
    [M]: how many of the completion's tokens each new slot's prompt already ends with (a
    completion resumed after its slot was lost, `Request.drawn`; None: 0 each): the slot's
    first token is then the completion's token first[m], drawn with fold_in(key, first[m]),
    and its budget counts them."""
    params, lora = _place(params, lora, spec, shardings, numerics, adapter)
    first = jnp.zeros_like(budget) if first is None else first
    u, p = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (u, p))
    pre = init_cache(spec, u, p, _cache_dtype(params, numerics))
    h, pre = hidden_states(params, prompts, positions, spec, cache=pre, lora=lora,
                           shardings=shardings, numerics=numerics)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [U, E]
    head = lm_logits(params, last, spec, numerics)
    logits = head_logits(shardings, head[src])  # [M, V]
    seen = jax.tree_util.tree_map(lambda a: a[src],
                                  History.of_prompts(prompts, lengths, spec.vocab_size))
    picked = next_token(_fold(keys, first), logits, settings, seen,
                        vocab_top_k(shardings, *logits.shape), features, allowed)
    token = picked.token
    done = jnp.isin(token, jnp.asarray(eos_ids, jnp.int32)) | (budget <= first + 1)
    put = lambda a, x: a.at[dst].set(x, mode="drop")
    prefix = state.prefix
    if prefix is None:
        cache = _insert_rows(state.cache, pre, src, dst)
        cache = cache.replace(index=put(cache.index, lengths[src]))
    else:  # the block's prompt once; its slots' own caches start empty
        share = state.last.shape[0] // prefix.index.shape[0]
        rows, blocks = src[::share], dst[::share] // share  # padding: block S / R, dropped
        prefix = _insert_rows(prefix, pre, rows, blocks)
        prefix = prefix.replace(index=prefix.index.at[blocks].set(lengths[rows], mode="drop"))
        cache = state.cache.replace(index=put(state.cache.index, jnp.zeros_like(dst)))
    state = state.replace(cache=cache, prefix=prefix, last=put(state.last, token),
                          live=put(state.live, ~done),
                          count=put(state.count, first + 1),
                          budget=put(state.budget, budget), keys=put(state.keys, keys),
                          adapter=put(state.adapter, adapter[src]),
                          settings=jax.tree_util.tree_map(put, state.settings, settings),
                          history=jax.tree_util.tree_map(put, state.history,
                                                         seen.record(token, budget > 0)))
    return state, picked, done


# the decode program, jitted with the numerics' compiler options for it
@functools.partial(Program, program="decode", donate_argnums=0,
                   static_argnames=("spec", "eos_ids", "steps", "shardings", "numerics",
                                    "features", "interruptible"))
def generate(state: Slots, params: Params, lora: Lora | AdapterSet | None, *, spec: ModelSpec,
             eos_ids: tuple[int, ...], steps: int, shardings: MeshRules | None = None,
             numerics: Numerics = REFERENCE, features: Features = ALL,
             allowed: jax.Array | None = None,
             refill: jax.Array | None = None,
             interruptible: bool = False) -> tuple[Slots, Chunk]:
    """Advance every live slot by up to `steps` tokens (module docstring); features must cover
    the settings of the live slots (`Features.covers`). The columns of a slot that is not live
    at a step hold emitted False and zeros; with `numerics.fixed_chunk` the chunk runs all
    `steps` steps with no data-dependent branch or loop and gives what the early-stopping
    chunk gives (cache columns past a slot's filled ones aside, which nothing reads). An
    `AdapterSet` lora gives each slot its own adapter (`Slots.adapter`). allowed [S, V]: the
    tokens each slot may take next (a grammar's mask, `next_token`), with steps 1. refill (a
    scalar, early-stopping chunk only): the chunk also ends after a step once at least this
    many slots are not live, so the host can fill them (a partial rollout's next group).
    interruptible (early-stopping chunk only): the chunk also polls the host at each step and
    ends once it asks (`jaxrl.backends.numerics.interrupt_chunks`; a server's engine)."""
    if allowed is not None and steps != 1:
        raise ValueError(f"a token mask holds for one step; got steps={steps}")
    params, lora = _place(params, lora, spec, shardings, numerics, state.adapter)
    s = state.last.shape[0]
    eos = jnp.asarray(eos_ids, jnp.int32)

    top_k = vocab_top_k(shardings, s, spec.vocab_size)
    prompt = state.prefix  # a slot's own columns follow its block's prompt
    offset = 0 if prompt is None else jnp.repeat(prompt.index, s // prompt.index.shape[0])

    def step(st: Slots) -> tuple[Slots, Chunk]:
        """One decode step of every slot: the new state and the step's column [S] of each
        Chunk field; a slot that is not live keeps its state and emits nothing."""
        index = st.cache.index
        h, cache = hidden_states(params, st.last[:, None], (index + offset)[:, None], spec,
                                 cache=st.cache, prefix=st.prefix, lora=lora,
                                 shardings=shardings, numerics=numerics, reading=st.live)
        logits = decode_logits(params, h[:, -1], spec, shardings, numerics)  # [S, V]
        picked = next_token(_fold(st.keys, st.count), logits, st.settings, st.history, top_k,
                            features, allowed)
        token, live = picked.token, st.live
        done = jnp.isin(token, eos) | (st.count + 1 >= st.budget)
        column = Chunk(tokens=jnp.where(live, token, 0),
                       logprobs=jnp.where(live, picked.logprob, 0.0), emitted=live,
                       top_ids=jnp.where(live[:, None], picked.top_ids, 0),
                       top_logprobs=jnp.where(live[:, None], picked.top_logprobs, 0.0))
        st = st.replace(cache=cache.replace(index=jnp.where(live, index + 1, index)),
                        last=jnp.where(live, token, st.last), live=live & ~done,
                        count=st.count + live, history=st.history.record(token, live))
        return st, column

    if numerics.fixed_chunk:  # N steps, each over live masks: nothing for the host to decide
        state, columns = jax.lax.scan(lambda st, _: step(st), state, length=steps)
        return state, jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 0, 1), columns)

    def body(carry):
        i, st, out = carry
        st, column = step(st)
        out = jax.tree_util.tree_map(lambda a, x: a.at[:, i].set(x), out, column)
        return i + 1, st, out

    k = min(MAX_TOP_LOGPROBS, spec.vocab_size)
    empty = Chunk(tokens=jnp.zeros((s, steps), jnp.int32),
                  logprobs=jnp.zeros((s, steps), jnp.float32),
                  emitted=jnp.zeros((s, steps), bool),
                  top_ids=jnp.zeros((s, steps, k), jnp.int32),
                  top_logprobs=jnp.zeros((s, steps, k), jnp.float32))
    def more(c):  # steps left, a live slot, and (after the first) neither has the host asked
        go_on = ~numerics.chunk_interrupted() if interruptible else jnp.bool_(True)
        if refill is not None:  # nor are enough slots free
            go_on = go_on & (jnp.sum(~c[1].live) < refill)
        return (c[0] < steps) & jnp.any(c[1].live) & ((c[0] == 0) | go_on)

    _, state, out = jax.lax.while_loop(more, body, (jnp.zeros((), jnp.int32), state, empty))
    return state, out


@functools.partial(jax.jit, donate_argnums=0)
def retire(state: Slots, stop: jax.Array) -> Slots:
    """state with the slots where stop [S] is True no longer live (cancelled: the next
    `generate` leaves them as they are and they emit nothing)."""
    return state.replace(live=state.live & ~stop)


def _appended_history(history: History, tokens: jax.Array, count: jax.Array,
                      vocab: int) -> History:
    """history with each row's first count[r] tokens [R, A] added to its prompt tokens (the
    penalties treat appended tokens as prompt)."""
    r, a = tokens.shape
    real = jnp.arange(a)[None, :] < count[:, None]
    rows = jnp.broadcast_to(jnp.arange(r)[:, None], (r, a))
    return history.replace(prompt=history.prompt.at[rows, jnp.where(real, tokens, vocab)].set(
        True, mode="drop"))


def _write_windows(stack: jax.Array, window: jax.Array, rows: jax.Array,
                   start: jax.Array) -> jax.Array:
    """stack [L, S, K, C, D] with window [L, R, K, A, D] written at slots rows [R], columns
    [start[r], start[r] + A); rows past S and columns past C are dropped."""
    n_layers, r, n_kv, a = window.shape[:4]
    layers = jnp.arange(n_layers)[:, None, None, None]
    heads = jnp.arange(n_kv)[None, None, :, None]
    columns = (start[:, None] + jnp.arange(a))[None, :, None, :]  # [1, R, 1, A]
    return stack.at[layers, rows[None, :, None, None], heads, columns].set(
        window.astype(stack.dtype), mode="drop")


@functools.partial(jax.jit, donate_argnums=0,
                   static_argnames=("spec", "eos_ids", "shardings", "numerics", "features"))
def extend(state: Slots, params: Params, lora: Lora | AdapterSet | None, rows: jax.Array,
           tokens: jax.Array, start: jax.Array, count: jax.Array, keys: jax.Array,
           settings: RowSettings, budget: jax.Array, *, spec: ModelSpec,
           eos_ids: tuple[int, ...], shardings: MeshRules | None = None,
           numerics: Numerics = REFERENCE, features: Features = ALL,
           allowed: jax.Array | None = None):
    """Continue slots rows [R] (module docstring; an entry naming slot S is padding, dropped):
    slot rows[r]'s cache keeps columns [0, start[r]) and gains the first count[r] tokens of
    tokens [R, A] (right-padded) behind them; then it draws a first token with keys [R, 2],
    settings [R] (which features must cover, `Features.covers`) and budget [R] (0: a piece of
    a prompt prefilled in chunks, whose draw is only a placeholder: the slot is done and the
    token not recorded). Only those R rows pass through the model, each reading its own
    slot's cache, so a piece costs what its rows hold whatever decodes beside it; every other
    slot keeps its state. Returns the new state and, per row [R], the first token with its
    log-probs (`Picked`) and whether the slot is already done. allowed [R, V]: the tokens each
    row's first token may be (None: all)."""
    if state.prefix is not None:
        raise ValueError("slots that share a prompt cannot be continued")
    take = lambda a: jnp.take(a, rows, axis=0, mode="clip")  # padding reads some slot
    params, lora = _place(params, lora, spec, shardings, numerics, take(state.adapter))
    r, a = tokens.shape
    cache = state.cache
    own = KVCache(k=jnp.take(cache.k, rows, axis=1, mode="clip"),
                  v=jnp.take(cache.v, rows, axis=1, mode="clip"), index=start)
    positions = start[:, None] + jnp.arange(a, dtype=jnp.int32)  # [R, A]
    h, own = hidden_states(params, tokens, positions, spec,
                           attn_mask=jnp.ones((r, cache.max_len), bool), cache=own,
                           lora=lora, shardings=shardings, numerics=numerics)
    last = jnp.take_along_axis(h, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = head_logits(shardings, lm_logits(params, last, spec, numerics))  # [R, V]
    seen = _appended_history(jax.tree_util.tree_map(take, state.history), tokens, count,
                             spec.vocab_size)
    picked = next_token(_fold(keys, 0), logits, settings, seen,
                        vocab_top_k(shardings, *logits.shape), features, allowed)
    token = picked.token
    done = jnp.isin(token, jnp.asarray(eos_ids, jnp.int32)) | (budget <= 1)
    columns = (start[:, None] + jnp.arange(a))[None, :, None, :, None]  # the new tokens'
    window = lambda stack: jnp.take_along_axis(stack, columns, axis=3, mode="clip")
    cache = cache.replace(k=_write_windows(cache.k, window(own.k), rows, start),
                          v=_write_windows(cache.v, window(own.v), rows, start))
    put = lambda old, new: old.at[rows].set(new, mode="drop")
    state = state.replace(
        cache=cache.replace(index=put(cache.index, start + count)), last=put(state.last, token),
        live=put(state.live, ~done), count=put(state.count, jnp.ones_like(count)),
        budget=put(state.budget, budget), keys=put(state.keys, keys),
        settings=jax.tree_util.tree_map(put, state.settings, settings),
        history=jax.tree_util.tree_map(put, state.history,
                                       seen.record(token, budget > 0)))
    return state, picked, done

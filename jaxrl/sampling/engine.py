"""The decode engine: S decode slots over one KV cache, continuous batching, per-slot settings.

Glossary: S decode slots, C cache columns per slot (its capacity), U distinct prompts prefilled
together, P their width (bucketed), M slots filled together, N steps per `generate` call (the
chunk), V vocab.

Slots. Each slot holds one request's row of the KV cache, left-aligned: its prompt in columns
[0, len), its t-th new token in column len + t, so a token's cache column is its position and
no slot carries padding. Beside the cache every slot holds, as arrays [S] on the device: the
token to feed next, whether it is live, how many tokens it has generated, its token budget, its
PRNG key and its decoding settings (`RowSettings`), and for the penalties which tokens its
prompt holds and how often it generated each (`History`, [S, V] each). A slot's t-th token is
drawn with fold_in(key, t) under its own settings, so a request decodes the same tokens
whatever slot it lands in and whatever decodes beside it.

Programs (jitted; static: the model spec, EOS ids, mesh and the shapes):
  admit     prefill U distinct prompts once (right-padded to P), copy row src[m]'s P cache
            columns into slot dst[m] for each of M new slots (the G completions of a prompt
            share one prefill), and draw each new slot's first token. Padding entries name
            slot S and are dropped.
  generate  advance every live slot by up to N tokens (stopping early once no slot is live)
            and return the new tokens, their log-probs and which were emitted [S, N].
Settings, keys, budgets and prompt lengths are data, so changing them never compiles a
program; S, C and N are fixed per engine, and U, M and P are rounded up to powers of two, so
the programs number at most one `generate` plus one `admit` per (U, M, P) bucket.

Host loop (`Engine.step`): fill free slots from the queue (FIFO), run one `generate` chunk,
hand each request its new tokens (`Request.on_token`, which serving streams), and free the
slots whose request finished (an EOS id, or its max_new_tokens). `Engine.run` steps until the
queue is empty and no slot is live.

Both programs run the model's `lax.scan` over the stacked layers (`hidden_states`), the loop
training runs, with NF4 kernels dequantized one layer at a time inside it; the scan reads each
layer's cache in place and each step writes only its new token per slot, once, after the scan
(`kv_cache.write_tokens`), into the donated state. The cache is float32 on CPU (XLA:CPU
converts a bf16 cache whole to float32 for that write) and in the activations' dtype
elsewhere, which is lossless: keys and values are computed in that dtype.

Several processes: each process queues its own requests and fills its own slots (the rows of
the slot axis that its devices hold; processes whose devices share a batch shard hold the same
slots and queue the same requests); the bucket sizes and whether to admit are agreed with
`distributed.host_max`, so every process runs the same programs in the same order.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl import distributed
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.kv_cache import KVCache, init_cache
from jaxrl.model.transformer import Params, hidden_states, lm_logits
from jaxrl.sampling.buckets import bucket
from jaxrl.sampling.sampling_fns import (MAX_TOP_LOGPROBS, Decoding, History, RowSettings,
                                         next_token)
from jaxrl.sharding import (MeshRules, cache_shardings, constrain, lora_shardings,
                            param_shardings, row_shardings)


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


@struct.dataclass
class Chunk:
    """What one `generate` call decoded, [S, N]."""

    tokens: jax.Array  # int32
    logprobs: jax.Array  # float32
    emitted: jax.Array  # bool: the slot was live and produced this token
    top_ids: jax.Array  # [S, N, MAX_TOP_LOGPROBS] int32, for slots that ask (RowSettings)
    top_logprobs: jax.Array  # [S, N, MAX_TOP_LOGPROBS] float32


def _platform(shardings: MeshRules | None) -> str:
    return jax.default_backend() if shardings is None else shardings.mesh.devices.flat[0].platform


def _cache_dtype(params: Params, shardings: MeshRules | None):
    return (jnp.float32 if _platform(shardings) == "cpu"
            else params["embed_tokens"]["embedding"].dtype)


def _place(params, lora, spec, shardings):
    if shardings is None:
        return params, lora
    params = constrain(params, param_shardings(shardings, params, spec))
    if lora is not None:
        lora = constrain(lora, lora_shardings(shardings, lora, spec))
    return params, lora


@functools.partial(jax.jit, static_argnames=("spec", "slots", "capacity", "shardings"))
def init_slots(params: Params, *, spec: ModelSpec, slots: int, capacity: int,
               shardings: MeshRules | None = None) -> Slots:
    """S empty slots of `capacity` cache columns each."""
    cache = init_cache(spec, slots, capacity, _cache_dtype(params, shardings))
    zeros = lambda dtype: jnp.zeros((slots,), dtype)
    state = Slots(cache=cache, last=zeros(jnp.int32), live=zeros(bool), count=zeros(jnp.int32),
                  budget=zeros(jnp.int32), keys=jnp.zeros((slots, 2), jnp.uint32),
                  settings=jax.tree_util.tree_map(jnp.asarray,
                                                  RowSettings.of([Decoding()] * slots)),
                  history=History.empty(slots, spec.vocab_size))
    return state if shardings is None else constrain(state, _slot_shardings(shardings, state))


def _slot_shardings(shardings: MeshRules, state: Slots) -> Slots:
    """The cache as `cache_shardings` lays it out, every other field split by slots."""
    rest = row_shardings(shardings, state.replace(cache=None))
    return rest.replace(cache=cache_shardings(shardings, state.cache))


def abstract_slots(params: Params, spec: ModelSpec, slots: int, capacity: int,
                   shardings: MeshRules) -> Slots:
    """ShapeDtypeStructs of `init_slots` with their shardings, for compiling the engine's
    programs without data (`jaxrl plan`)."""
    make = functools.partial(init_slots, spec=spec, slots=slots, capacity=capacity,
                             shardings=shardings)
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


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("spec", "eos_ids", "shardings"))
def admit(state: Slots, params: Params, lora: Lora | None, prompts: jax.Array,
          lengths: jax.Array, src: jax.Array, dst: jax.Array, keys: jax.Array,
          settings: RowSettings, budget: jax.Array, *, spec: ModelSpec,
          eos_ids: tuple[int, ...], shardings: MeshRules | None = None):
    """Prefill prompts [U, P] (right-padded; lengths [U]) and fill slots dst [M] from rows
    src [M] with keys [M, 2], settings [M] and budgets [M] (module docstring). Returns the new
    state and, per new slot [M], its first token with its log-probs (`Picked`) and whether the
    slot is already done."""
    params, lora = _place(params, lora, spec, shardings)
    u, p = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (u, p))
    pre = init_cache(spec, u, p, _cache_dtype(params, shardings))
    h, pre = hidden_states(params, prompts, positions, spec, cache=pre, lora=lora)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [U, E]
    logits = lm_logits(params, last, spec)[src]  # [M, V]
    seen = jax.tree_util.tree_map(lambda a: a[src],
                                  History.of_prompts(prompts, lengths, spec.vocab_size))
    picked = next_token(_fold(keys, 0), logits, settings, seen)
    token = picked.token
    done = jnp.isin(token, jnp.asarray(eos_ids, jnp.int32)) | (budget <= 1)
    put = lambda a, x: a.at[dst].set(x, mode="drop")
    cache = _insert_rows(state.cache, pre, src, dst)
    cache = cache.replace(index=put(cache.index, lengths[src]))
    state = state.replace(cache=cache, last=put(state.last, token), live=put(state.live, ~done),
                          count=put(state.count, jnp.ones_like(budget)),
                          budget=put(state.budget, budget), keys=put(state.keys, keys),
                          settings=jax.tree_util.tree_map(put, state.settings, settings),
                          history=jax.tree_util.tree_map(put, state.history,
                                                         seen.record(token, budget > 0)))
    return state, picked, done


@functools.partial(jax.jit, donate_argnums=0,
                   static_argnames=("spec", "eos_ids", "steps", "shardings"))
def generate(state: Slots, params: Params, lora: Lora | None, *, spec: ModelSpec,
             eos_ids: tuple[int, ...], steps: int,
             shardings: MeshRules | None = None) -> tuple[Slots, Chunk]:
    """Advance every live slot by up to `steps` tokens (module docstring)."""
    params, lora = _place(params, lora, spec, shardings)
    s, c = state.last.shape[0], state.cache.max_len
    eos = jnp.asarray(eos_ids, jnp.int32)
    ones = jnp.ones((s, c), bool)

    def step(carry):
        i, st, out = carry
        index = st.cache.index
        h, cache = hidden_states(params, st.last[:, None], index[:, None], spec,
                                 attn_mask=ones, cache=st.cache, lora=lora)
        picked = next_token(_fold(st.keys, st.count), lm_logits(params, h[:, -1], spec),
                            st.settings, st.history)
        token, live = picked.token, st.live
        done = jnp.isin(token, eos) | (st.count + 1 >= st.budget)
        column = lambda a, x: a.at[:, i].set(x)
        out = Chunk(tokens=column(out.tokens, jnp.where(live, token, 0)),
                    logprobs=column(out.logprobs, jnp.where(live, picked.logprob, 0.0)),
                    emitted=column(out.emitted, live),
                    top_ids=column(out.top_ids, picked.top_ids),
                    top_logprobs=column(out.top_logprobs, picked.top_logprobs))
        st = st.replace(cache=cache.replace(index=jnp.where(live, index + 1, index)),
                        last=jnp.where(live, token, st.last), live=live & ~done,
                        count=st.count + live, history=st.history.record(token, live))
        return i + 1, st, out

    k = min(MAX_TOP_LOGPROBS, spec.vocab_size)
    empty = Chunk(tokens=jnp.zeros((s, steps), jnp.int32),
                  logprobs=jnp.zeros((s, steps), jnp.float32),
                  emitted=jnp.zeros((s, steps), bool),
                  top_ids=jnp.zeros((s, steps, k), jnp.int32),
                  top_logprobs=jnp.zeros((s, steps, k), jnp.float32))
    _, state, out = jax.lax.while_loop(lambda c: (c[0] < steps) & jnp.any(c[1].live), step,
                                       (jnp.zeros((), jnp.int32), state, empty))
    return state, out


@dataclasses.dataclass
class Request:
    """One completion to decode: prompt token ids, settings, a budget and a key (the same key,
    prompt and settings always give the same tokens). on_token(token, logprob) is called with
    each new token as it is decoded (after `top_logprobs` got that token's alternatives, when
    decoding.top_logprobs asks for them); on_done(request) once it has finished."""

    prompt: Sequence[int]
    decoding: Decoding = Decoding()
    max_new_tokens: int = 16
    key: jax.Array | np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(2, np.uint32))
    on_token: Callable[[int, float], None] | None = None
    on_done: Callable[["Request"], None] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # per token: the decoding.top_logprobs most likely (token id, log-prob), best first
    top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" (an EOS id) or "length"

    def _emit(self, token: int, logprob: float, top_ids: np.ndarray,
              top_logprobs: np.ndarray) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        k = self.decoding.top_logprobs
        if k:
            self.top_logprobs.append(tuple(zip(top_ids[:k].tolist(), top_logprobs[:k].tolist())))
        if self.on_token is not None:
            self.on_token(token, logprob)

    def _finish(self, stopped: bool) -> None:
        self.finish_reason = "stop" if stopped else "length"
        if self.on_done is not None:
            self.on_done(self)


def row_keys(key: jax.Array, rows: Sequence[int]) -> np.ndarray:
    """[R, 2] the key of each row: fold_in(key, row), for requests numbered by row."""
    return np.asarray(jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.asarray(rows, jnp.uint32)))


@dataclasses.dataclass
class EngineStats:
    """Counters of this process's work: prompts prefilled, requests admitted, `generate` calls,
    decode steps run and tokens they emitted (a first token comes from the prefill and is not
    counted here)."""

    prefills: int = 0
    admitted: int = 0
    chunks: int = 0
    steps: int = 0
    tokens: int = 0

    def utilization(self, slots: int) -> float:
        """Emitted tokens per slot-step of the decode steps run (1 = every slot always live)."""
        return self.tokens / (self.steps * slots) if self.steps else 0.0


class Engine:
    """The host side of the decode engine (module docstring): a queue of `Request`s decoded in
    `slots` slots of `capacity` cache columns, `chunk` steps per `generate` call.

    eos_ids end a request (a chat model has several); shardings: the mesh and rules that
    params, adapter and slots are held in (None: one device; slots split over the data axes)."""

    def __init__(self, params: Params, spec: ModelSpec, *, eos_ids: Sequence[int] = (),
                 slots: int = 16, capacity: int = 2048, chunk: int = 16,
                 lora: Lora | None = None, shardings: MeshRules | None = None):
        if slots < 1 or capacity < 2 or chunk < 1:
            raise ValueError(f"an engine needs slots >= 1, capacity >= 2 and chunk >= 1; got "
                             f"{slots}, {capacity}, {chunk}")
        self.spec, self.shardings = spec, shardings
        self.slots, self.capacity, self.chunk = slots, capacity, chunk
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.params, self.lora = params, lora
        self.state = init_slots(params, spec=spec, slots=slots, capacity=capacity,
                                shardings=shardings)
        start, stop = distributed.local_rows(shardings, slots)
        self._first = start  # this process's slots are [start, stop)
        self._free = deque(range(start, stop))
        self._queue: deque[Request] = deque()
        self._active: dict[int, Request] = {}
        self.stats = EngineStats()

    def submit(self, request: Request) -> Request:
        """Queue a request; it is decoded by later `step`s (its callbacks fire then)."""
        n = len(request.prompt)
        if n < 1 or request.max_new_tokens < 1 or n + request.max_new_tokens > self.capacity:
            raise ValueError(f"a request needs a prompt of >= 1 token and max_new_tokens >= 1 "
                             f"within the engine's {self.capacity} cache columns; got a "
                             f"{n}-token prompt and max_new_tokens {request.max_new_tokens}")
        self._queue.append(request)
        return request

    def busy(self) -> bool:
        """Requests wait or decode in this process."""
        return bool(self._queue or self._active)

    def step(self) -> bool:
        """Fill free slots, decode one chunk, hand out tokens; whether any process has work
        left (every process calls it the same number of times)."""
        self._admit()
        if distributed.host_max(len(self._active)):
            self.state, chunk = generate(self.state, self.params, self.lora, spec=self.spec,
                                         eos_ids=self.eos_ids, steps=self.chunk,
                                         shardings=self.shardings)
            chunk, live = self._local((chunk, self.state.live))
            self.stats.chunks += 1
            self.stats.steps += int(chunk.emitted.any(axis=0).sum())
            self.stats.tokens += int(chunk.emitted.sum())
            self._dispatch(chunk, live)
        return bool(distributed.host_max(int(self.busy())))

    def run(self) -> None:
        """Step until every queued request has finished."""
        while self.step():
            pass

    def _local(self, tree):
        """This process's rows of device outputs split by rows, as numpy."""
        return jax.device_get(tree) if self.shardings is None else distributed.rows_to_local(tree)

    def _rows(self, n: int) -> int:
        """n rounded up to a power of two that, with several processes, splits over the batch
        shards this process holds."""
        per_process = 1
        if self.shardings is not None and jax.process_count() > 1:
            per_process = len(distributed.batch_shards(self.shardings)[jax.process_index()])
        return bucket(n, minimum=per_process)

    def _admit(self) -> None:
        n = min(len(self._queue), len(self._free))
        take = [self._queue.popleft() for _ in range(n)]
        dst = [self._free.popleft() for _ in range(n)]
        distinct: dict[tuple[int, ...], int] = {}
        src = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in take]
        m = distributed.host_max(n)
        if m == 0:
            return
        u = self._rows(distributed.host_max(len(distinct)))
        width = bucket(distributed.host_max(max((len(p) for p in distinct), default=1)))
        m = self._rows(m)
        prompts, lengths = np.zeros((u, width), np.int32), np.ones((u,), np.int32)
        for row, ids in enumerate(distinct):
            prompts[row, :len(ids)], lengths[row] = ids, len(ids)
        pad = m - n
        offset = distributed.local_rows(self.shardings,
                                        distributed.global_rows(self.shardings, u))[0]
        rows = dict(
            src=np.asarray(src + [0] * pad, np.int32) + offset,
            dst=np.asarray(dst + [self.slots] * pad, np.int32),
            keys=np.stack([np.asarray(r.key, np.uint32) for r in take]
                          + [np.zeros(2, np.uint32)] * pad),
            settings=RowSettings.of([r.decoding for r in take] + [Decoding()] * pad),
            budget=np.asarray([r.max_new_tokens for r in take] + [1] * pad, np.int32))
        data = (prompts, lengths, rows)
        if self.shardings is not None:
            data = distributed.rows_to_global(self.shardings, data)
        prompts, lengths, rows = data
        self.state, picked, done = admit(
            self.state, self.params, self.lora, prompts, lengths, rows["src"], rows["dst"],
            rows["keys"], rows["settings"], rows["budget"], spec=self.spec,
            eos_ids=self.eos_ids, shardings=self.shardings)
        p, done = self._local((picked, done))
        self.stats.prefills += len(distinct)
        self.stats.admitted += n
        for i, (request, slot) in enumerate(zip(take, dst)):
            request._emit(int(p.token[i]), float(p.logprob[i]), p.top_ids[i], p.top_logprobs[i])
            if done[i]:
                self._free.append(slot)
                request._finish(int(p.token[i]) in self.eos_ids)
            else:
                self._active[slot] = request

    def _dispatch(self, chunk: Chunk, live) -> None:
        for slot, request in list(self._active.items()):
            row = slot - self._first
            for j in np.flatnonzero(chunk.emitted[row]):
                request._emit(int(chunk.tokens[row, j]), float(chunk.logprobs[row, j]),
                              chunk.top_ids[row, j], chunk.top_logprobs[row, j])
            if not live[row]:
                del self._active[slot]
                self._free.append(slot)
                request._finish(request.tokens[-1] in self.eos_ids)

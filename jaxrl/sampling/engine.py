"""The decode engine: a queue of requests decoded in S slots over one KV cache, with continuous
batching and per-slot settings. The slots and the jitted programs that fill and advance them
(`admit`, `generate`, `extend`) are jaxrl/sampling/programs.py; this is the host side.

Host loop (`Engine.step`): fill free slots from the queue (FIFO), append the queued
continuations to their held slots, run one `generate` chunk, hand each request its new tokens
(`Request.on_token`, which serving streams), and free the slots whose request finished (an EOS
id, or its max_new_tokens) unless it holds its slot for a continuation. `Engine.run` steps
until the queues are empty and no slot is live.

Several processes: each process queues its own requests and fills its own slots (the rows of
the slot axis that its devices hold; processes whose devices share a batch shard hold the same
slots and queue the same requests); the bucket sizes and whether to admit are agreed with
`distributed.host_max`, so every process runs the same programs in the same order.

Features: each program call takes static `Features` (jaxrl/sampling/sampling_fns.py) that
cover the requests decoding in the slots and those the call fills or continues, united over
the processes, so the device decides nothing the host knows. Where features the engine already
ran that program with cover them, it takes the fewest of those; otherwise the exact ones. So a
run whose requests share one setting (a GRPO rollout) runs one features value, and a server
with mixed settings a new one only when none it ran covers the requests in its slots, rather
than one for every combination of settings its slots pass through.

Adapters: an engine whose `lora` is an `AdapterSet` decodes each request with its own adapter
(`Request.adapter`, 0: the base alone) in one batch: the slots carry their adapter indices as
data, so any mix compiles nothing, and requests of any adapter fill any free slot. Prompts are
prefilled once per (adapter, prompt). `lora` may be replaced between steps (a new policy
adapter after an update) by one of the same structure; rows already decoding go on under it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.backends.numerics import Numerics, chunk_begins, interrupt_chunks, numerics_of
from jaxrl.lora.adapters import AdapterSet
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import Params
from jaxrl.sampling.buckets import bucket
from jaxrl.sampling.programs import Chunk, admit, extend, generate, init_slots, retire
from jaxrl.sampling.requests import EngineStats, Request
from jaxrl.sampling.sampling_fns import Decoding, Features, RowSettings
from jaxrl.sharding import MeshRules


class Engine:
    """The host side of the decode engine (module docstring): a queue of `Request`s decoded in
    `slots` slots of `capacity` cache columns, `chunk` steps per `generate` call.

    eos_ids end a request (a chat model has several); shardings: the mesh and rules that
    params, adapter and slots are held in (None: one device; slots split over the data axes).
    share R > 1: the slots form blocks of R that decode R requests of one prompt (a GRPO
    group), submitted together (`submit_group`); the block holds the prompt's keys and values
    once, in the first prompt_capacity of each slot's capacity columns, and every step reads
    them once for the R slots. Such slots are freed a block at a time and cannot be held for
    continuations. numerics: the backend forms its programs take (`jaxrl.backends.numerics`;
    None: the choice for the mesh's devices, or the default device's). prefill_chunk (share
    1): a prompt longer than this many tokens is prefilled this many tokens a step (its first
    piece when admitted, then one piece a step of the prompt admitted first, in the step's
    `extend` pass over that slot alone), so the requests decoding meanwhile keep their pace
    (0: a prompt in one piece); it draws its first token once its last piece is in."""

    def __init__(self, params: Params, spec: ModelSpec, *, eos_ids: Sequence[int] = (),
                 slots: int = 16, capacity: int = 2048, chunk: int = 16,
                 lora: Lora | AdapterSet | None = None, shardings: MeshRules | None = None,
                 share: int = 1,
                 prompt_capacity: int = 0, numerics: Numerics | None = None,
                 prefill_chunk: int = 0):
        if prefill_chunk and (share > 1 or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk ({prefill_chunk}) takes a positive number of tokens "
                             "and an engine without shared prompts (share 1)")
        if slots < 1 or capacity < 2 or chunk < 1:
            raise ValueError(f"an engine needs slots >= 1, capacity >= 2 and chunk >= 1; got "
                             f"{slots}, {capacity}, {chunk}")
        start, stop = distributed.local_rows(shardings, slots)
        if share > 1 and (start % share or stop % share or not 1 <= prompt_capacity < capacity):
            raise ValueError(f"blocks of {share} slots need this process's slots [{start}, "
                             f"{stop}) to split into whole blocks and a prompt capacity "
                             f"between 1 and the {capacity - 1} columns left for new tokens; "
                             f"got prompt_capacity {prompt_capacity}")
        self.spec, self.shardings = spec, shardings
        self.numerics = numerics_of(shardings) if numerics is None else numerics
        self.slots, self.capacity, self.chunk = slots, capacity, chunk
        self.share, self.prompt_capacity = share, (prompt_capacity if share > 1 else 0)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.params, self.lora = params, lora
        self.state = init_slots(params, spec=spec, slots=slots, capacity=capacity, share=share,
                                prompt_capacity=self.prompt_capacity, shardings=shardings,
                                numerics=self.numerics)
        self._first, self._local_slots = start, stop - start  # this process's: [start, stop)
        self._free = deque(range(start // share, stop // share))  # free blocks of share slots
        self._busy: dict[int, int] = {}  # block -> its slots not yet freed
        self._queue: deque[list[Request]] = deque()  # groups of `share` requests
        self._continuations: deque[Request] = deque()
        self._active: dict[int, Request] = {}
        self._held: dict[int, Request] = {}  # slot -> the finished request holding it
        self.prefill_chunk = prefill_chunk
        # slot -> [request, prompt tokens cached, admitted this step (its next piece waits)]
        self._prefilling: dict[int, list] = {}
        self._used: dict[str, set[Features]] = {}  # program -> the features it ran with
        self.stats = EngineStats()
        # >0: an early-stopping chunk (the CPU's) also ends once this many slots are free, for
        # a caller that fills them a group at a time (jaxrl/rl/partial.py)
        self.refill = 0
        # an early-stopping chunk (the CPU's) polls the host each step (`interrupt`): a host
        # callback per step, so only a server's engine, where requests come mid-chunk
        self.interruptible = False
        # called as every step starts: submits requests waiting outside (a local judge's)
        self.feed: Callable[[], None] | None = None

    def submit(self, request: Request) -> Request:
        """Queue a request; it is decoded by later `step`s (its callbacks fire then). A request
        that follows a held one is appended to that one's slot (jaxrl/sampling/requests.py)."""
        if request.follows is not None:
            return self._submit_continuation(request)
        if self.share > 1:
            raise ValueError(f"this engine decodes groups of {self.share} requests of one "
                             "prompt: submit them with submit_group")
        self.submit_group([request])
        return request

    def submit_group(self, requests: Sequence[Request]) -> list[Request]:
        """Queue `share` requests of one prompt to decode in one block of slots (with share 1:
        one request, as `submit`)."""
        requests = list(requests)
        prompts = len({(r.adapter, tuple(r.prompt)) for r in requests})
        if len(requests) != self.share or prompts != 1:
            raise ValueError(f"a group is {self.share} requests of one prompt; got "
                             f"{len(requests)} requests of {prompts} prompts")
        n = len(requests[0].prompt)
        prompt_room = self.prompt_capacity or self.capacity
        new_room = self.capacity - (self.prompt_capacity or n)
        for request in requests:
            if request.drawn and (self.prefill_chunk or self.share > 1
                                  or not 0 < request.drawn < min(n, request.max_new_tokens)):
                raise ValueError(f"a request resumed after {request.drawn} drawn tokens needs "
                                 "them at the end of its prompt, max_new_tokens above them, "
                                 "and an engine of single slots without prefill_chunk")
            if (n < 1 or not 1 <= request.max_new_tokens - request.drawn <= new_room
                    or n > prompt_room):
                raise ValueError(
                    f"a request needs a prompt of >= 1 token and max_new_tokens >= 1 within the "
                    f"engine's {self.capacity} cache columns (of which {self.prompt_capacity} "
                    f"hold a shared prompt); got a {n}-token prompt and max_new_tokens "
                    f"{request.max_new_tokens}")
            self._check_adapter(request)
            if request.follows is not None or (request.hold and self.share > 1):
                raise ValueError("requests decoded in blocks sharing a prompt cannot hold their "
                                 "slots or continue a conversation")
        self._queue.append(requests)
        return requests

    def _check_adapter(self, request: Request) -> None:
        n = len(self.lora) if isinstance(self.lora, AdapterSet) else 0
        if not 0 <= request.adapter <= n:
            raise ValueError(f"request adapter {request.adapter} is not one of this engine's: "
                             + (f"0 (the base) to {n}" if n else "it holds one adapter (or "
                                "none) that every request decodes with, adapter 0"))

    def _submit_continuation(self, request: Request) -> Request:
        held = request.follows
        if self._held.get(held.slot) is not held:
            raise ValueError("a continuation must follow a finished request that holds its slot "
                             "(Request.hold = True) and has no other continuation or release")
        if not 1 <= request.kept() <= len(held.tokens):
            raise ValueError(f"a continuation keeps between 1 and the {len(held.tokens)} tokens "
                             f"its request generated; got keep={request.keep}")
        end = request.start() + len(request.appended()) + request.max_new_tokens
        if request.max_new_tokens < 1 or end > self.capacity:
            raise ValueError(f"a continuation needs max_new_tokens >= 1 within the engine's "
                             f"{self.capacity} cache columns; its conversation would reach "
                             f"column {end} (max_new_tokens {request.max_new_tokens})")
        request.adapter = held.adapter
        self._continuations.append(request)
        return request

    def release(self, request: Request) -> None:
        """Give back the slot a finished request holds (its conversation is over)."""
        if self._held.get(request.slot) is not request:
            raise ValueError("release takes a finished request that holds its slot "
                             "(Request.hold = True) and has not been continued or released")
        del self._held[request.slot]
        self._free_slot(request.slot)

    def _free_slot(self, slot: int) -> None:
        """A slot is free again; its block is free once all its slots are."""
        block = slot // self.share
        self._busy[block] -= 1
        if not self._busy[block]:
            del self._busy[block]
            self._free.append(block)

    def cancel(self, request: Request) -> None:
        """Stop `request` (callable from any thread, at any time): one still queued never
        starts; one decoding is dropped before the next step decodes, its slot freed; no token
        decoded for it after this call is handed to it or counted. It then finishes with
        finish_reason "cancelled" (on_done is called on the engine's thread). A request that
        has finished already is left as it is. The chunk in flight ends early (`interrupt`)."""
        request.cancelled = True
        self.interrupt()

    @staticmethod
    def interrupt() -> None:
        """End the decode chunk in flight after its step where it can (an `interruptible`
        engine's early-stopping chunk, the CPU's), so what changed meanwhile is served a step
        later, not a chunk later; callable from any thread."""
        interrupt_chunks()

    def _drop_cancelled(self) -> None:
        """Finish the cancelled requests: drop queued ones and continuations, and retire the
        slots of decoding ones (every process calls it)."""
        for group in list(self._queue):
            if all(r.cancelled for r in group):  # a block's group goes in unless all are
                self._queue.remove(group)
                for request in group:
                    request._end("cancelled")
        for request in [r for r in self._continuations if r.cancelled]:
            self._continuations.remove(request)
            request._end("cancelled")
        for slot, (request, *_) in list(self._prefilling.items()):
            if request.cancelled:  # not live: its pieces so far are left, unread
                del self._prefilling[slot]
                self._free_slot(slot)
                request._end("cancelled")
        gone = [slot for slot, r in self._active.items() if r.cancelled]
        if not distributed.host_max(len(gone)):
            return
        stop = np.zeros(self._local_slots, bool)
        stop[[slot - self._first for slot in gone]] = True
        if self.shardings is not None:
            stop = distributed.rows_to_global(self.shardings, stop)
        self.state = retire(self.state, stop)
        for slot in gone:
            request = self._active.pop(slot)
            self._free_slot(slot)
            request._end("cancelled")

    def free_slots(self) -> int:
        """This process's slots that no request holds (a block's count once all of it is)."""
        return len(self._free) * self.share

    def queued(self) -> int:
        """Requests of this process waiting for a slot (groups of `share`, one each)."""
        return len(self._queue)

    def busy(self) -> bool:
        """Requests wait or decode in this process."""
        return bool(self._queue or self._continuations or self._active or self._prefilling)

    def step(self) -> bool:
        """Fill free slots, decode one chunk, hand out tokens, then append continuations and
        the next prompt piece (`_extend`, after the chunk, so a request admitted now gets its
        chunk before a piece delays it); whether any process has work left (every process
        calls it the same number of times)."""
        chunk_begins()
        if self.feed is not None:
            self.feed()
        self._drop_cancelled()
        self._admit()
        if distributed.host_max(len(self._active)):
            features, masked = self._features("generate", masked=list(self._active.values()))
            allowed = self._allowed({s - self._first: r for s, r in self._active.items()},
                                    self._local_slots, masked)
            self.state, chunk = generate(self.state, self.params, self.lora, spec=self.spec,
                                         eos_ids=self.eos_ids,
                                         steps=self.chunk if allowed is None else 1,
                                         shardings=self.shardings, numerics=self.numerics,
                                         features=features, allowed=allowed,
                                         refill=np.int32(self.refill) if self.refill else None,
                                         interruptible=self.interruptible)
            chunk, live = self._local((chunk, self.state.live))
            adapters = np.zeros(self._local_slots, np.int64)
            counted = np.zeros(self._local_slots, bool)
            for slot, request in self._active.items():
                adapters[slot - self._first] = request.adapter
                counted[slot - self._first] = not request.cancelled
            self.stats.count_chunk(chunk.emitted & counted[:, None], adapters)
            self._dispatch(chunk, live)
        self._extend()
        return bool(distributed.host_max(int(self.busy())))

    def run(self) -> None:
        """Step until every queued request has finished."""
        while self.step():
            pass

    def run_until(self, done: Callable[[], bool]) -> None:
        """Step until done() (one process: other requests may still decode, and go on at the
        next step), or until no request is left."""
        while not done() and self.step():
            pass

    def _features(self, program: str, new: Sequence[Request] = (),
                  masked: Sequence[Request] = ()) -> tuple[Features, bool]:
        """(features, masked) for `program`: the features that cover the requests decoding
        in the slots and `new`, united over the processes (every process calls it), or, where
        this engine already ran `program` with features that cover those, the fewest of them,
        so that settings coming and going compile no program for each combination; and
        whether any process has a constrained request among the rows `masked` whose next
        token the program draws (it then takes their masks, `_allowed`)."""
        local = Features.of([r.decoding for r in (*self._active.values(), *new)])
        constrained = any(r.constraint is not None for r in masked)
        bits, any_masked = 0, False
        for b, c in distributed.gather_json([local.bits(), constrained]):
            bits, any_masked = bits | int(b), any_masked or bool(c)
        need = Features.from_bits(bits)
        used = self._used.setdefault(program, set())
        covering = [f for f in used if f.bits() & bits == bits]
        chosen = min(covering, key=lambda f: (bin(f.bits()).count("1"), f.bits()),
                     default=need)
        used.add(chosen)
        return chosen, any_masked

    def _allowed(self, rows: dict[int, Request], n: int, masked: bool):
        """[n, V] the tokens each of n rows may take next, row i's from rows[i]'s constraint
        (all where it has none, or no request), laid out as the programs take it; None unless
        `masked` (`_features`: some process has a constrained request among its rows)."""
        if not masked:
            return None
        v = self.spec.vocab_size
        allowed = np.ones((n, v), bool)
        for row, request in rows.items():
            if request.constraint is not None:
                mask = np.asarray(request.constraint.allowed(v), bool)[:v]
                allowed[row] = False
                allowed[row, :len(mask)] = mask
        if self.shardings is not None:
            allowed = distributed.rows_to_global(self.shardings, allowed)
        return allowed

    def _local(self, tree):
        """This process's rows of device outputs split by rows, as numpy."""
        return jax.device_get(tree) if self.shardings is None else distributed.rows_to_local(tree)

    def _rows(self, n: int) -> int:
        """n rounded up to a power of two that, with several processes, splits over the batch
        shards this process holds (for blocks: a count of blocks)."""
        per_process = 1
        if self.shardings is not None and jax.process_count() > 1:
            per_process = len(distributed.batch_shards(self.shardings)[jax.process_index()])
        return bucket(n, minimum=per_process)

    def _admit(self) -> None:
        n = min(len(self._queue), len(self._free))  # groups into free blocks
        share = self.share
        take = [request for _ in range(n) for request in self._queue.popleft()]
        blocks = [self._free.popleft() for _ in range(n)]
        self._busy.update((block, share) for block in blocks)
        dst = [block * share + i for block in blocks for i in range(share)]
        c = self.prefill_chunk
        chunked = [bool(c) and len(q.prompt) > c for q in take]  # the first piece now
        parts = [tuple(q.prompt[:c] if cut else q.prompt) for q, cut in zip(take, chunked)]
        distinct: dict[tuple[int, tuple[int, ...]], int] = {}  # (adapter, prompt) -> row
        src = [distinct.setdefault((q.adapter, part), len(distinct))
               for q, part in zip(take, parts)]
        m = distributed.host_max(n)
        if m == 0:
            return
        u = self._rows(distributed.host_max(len(distinct)))
        width = bucket(distributed.host_max(max((len(p) for _, p in distinct), default=1)))
        # the prefill's columns fit the slot's (a block's: its prompt columns); a prompt fits
        # them, its bucket may not where the capacity is no power of two
        width = min(width, self.prompt_capacity if share > 1 else self.capacity)
        # slots filled: every slot of this process's for single slots (so how many requests
        # arrive together, or a request's n, never makes a new program), whole blocks else
        m, n = (self._local_slots if share == 1 else self._rows(m) * share), n * share
        prompts, lengths = np.zeros((u, width), np.int32), np.ones((u,), np.int32)
        adapter = np.zeros((u,), np.int32)
        for row, (index, ids) in enumerate(distinct):
            prompts[row, :len(ids)], lengths[row], adapter[row] = ids, len(ids), index
        pad = m - n
        offset = distributed.local_rows(self.shardings,
                                        distributed.global_rows(self.shardings, u))[0]
        rows = dict(
            src=np.asarray(src + [0] * pad, np.int32) + offset,
            dst=np.asarray(dst + [self.slots] * pad, np.int32),
            keys=np.stack([np.asarray(r.key, np.uint32) for r in take]
                          + [np.zeros(2, np.uint32)] * pad),
            settings=RowSettings.of([r.decoding for r in take] + [Decoding()] * pad),
            budget=np.asarray([0 if cut else r.max_new_tokens for r, cut in zip(take, chunked)]
                              + [1] * pad, np.int32),
            first=np.asarray([r.drawn for r in take] + [0] * pad, np.int32))
        data = (prompts, lengths, adapter, rows)
        if self.shardings is not None:
            data = distributed.rows_to_global(self.shardings, data)
        prompts, lengths, adapter, rows = data
        features, masked = self._features("admit", take, take)
        self.state, picked, done = admit(
            self.state, self.params, self.lora, prompts, lengths, adapter, rows["src"],
            rows["dst"],
            rows["keys"], rows["settings"], rows["budget"], spec=self.spec,
            eos_ids=self.eos_ids, shardings=self.shardings, numerics=self.numerics,
            features=features, allowed=self._allowed(dict(enumerate(take)), m, masked),
            first=rows["first"])
        p, done = self._local((picked, done))
        self.stats.prefills += len(distinct)
        self.stats.admitted += n
        for i, (request, slot, cut) in enumerate(zip(take, dst, chunked)):
            request.slot, request.column = slot, len(request.prompt)
            if cut:
                self._prefilling[slot] = [request, c, True]
            else:
                self._start(request, i, p, done)

    def _start(self, request: Request, i: int, picked, done) -> None:
        """Hand a request its first token (row i of picked and done) and mark it live or
        finished (a cancelled one gets no token; its slot is freed at the next step)."""
        if request.cancelled:
            self._active[request.slot] = request
            return
        request._emit(int(picked.token[i]), float(picked.logprob[i]), picked.top_ids[i],
                      picked.top_logprobs[i])
        if done[i]:
            self._finish(request)
        else:
            self._active[request.slot] = request

    def _finish(self, request: Request) -> None:
        """Free the request's slot, or keep it held, and tell the request it finished."""
        if request.hold:
            self._held[request.slot] = request
        else:
            self._free_slot(request.slot)
        request._finish(request.tokens[-1] in self.eos_ids)

    def _extend(self) -> None:
        """Append every queued continuation to its slot, and the next piece of every prompt
        prefilled in chunks to its own, in one `extend` pass."""
        take = list(self._continuations)
        self._continuations.clear()
        pieces = []  # (slot, tokens, first column, budget: 0 until the last piece)
        for request in take:
            pieces.append((request.follows.slot, request.appended(), request.start(),
                           request.max_new_tokens))
            request.slot = request.follows.slot
            request.column = request.start() + len(request.appended())
            del self._held[request.slot]
        # one piece a step, of the prompt admitted first (a step's budget of prompt tokens
        # beside the decoding rows: prefill_chunk, and one shape, warmed by serving)
        filling = [(slot, entry) for slot, entry in self._prefilling.items()
                   if not entry[2]][:1]
        for entry in self._prefilling.values():
            entry[2] = False  # admitted this step: its next piece from the next step on
        for slot, (request, cached, _) in filling:
            piece = list(request.prompt[cached:cached + self.prefill_chunk])
            last = cached + len(piece) == len(request.prompt)
            pieces.append((slot, piece, cached, request.max_new_tokens if last else 0))
        if distributed.host_max(len(pieces)) == 0:
            return
        width = bucket(distributed.host_max(max((len(p[1]) for p in pieces), default=1)))
        n = self._rows(distributed.host_max(len(pieces)))  # only the rows continued
        rows = np.full((n,), self.slots, np.int32)  # padding: slot S, dropped
        tokens, start = np.zeros((n, width), np.int32), np.zeros((n,), np.int32)
        count, budget = np.zeros((n,), np.int32), np.ones((n,), np.int32)
        keys, decodings = np.zeros((n, 2), np.uint32), [Decoding()] * n
        owners = take + [entry[0] for _, entry in filling]
        for i, (request, (slot, ids, first, room)) in enumerate(zip(owners, pieces)):
            rows[i], tokens[i, :len(ids)], start[i], count[i] = slot, ids, first, len(ids)
            keys[i], decodings[i] = np.asarray(request.key, np.uint32), request.decoding
            budget[i] = room
        data = (rows, tokens, start, count, keys, RowSettings.of(decodings), budget)
        if self.shardings is not None:
            data = distributed.rows_to_global(self.shardings, data)
        features, masked = self._features("extend", owners, owners)
        self.state, picked, done = extend(self.state, self.params, self.lora, *data,
                                          spec=self.spec, eos_ids=self.eos_ids,
                                          shardings=self.shardings, numerics=self.numerics,
                                          features=features,
                                          allowed=self._allowed(dict(enumerate(owners)), n,
                                                                masked))
        picked, done = self._local((picked, done))
        self.stats.continued += len(take)
        self.stats.prefill_pieces += len(filling)
        for i, request in enumerate(take):
            self._start(request, i, picked, done)
        for i, (slot, entry) in enumerate(filling, len(take)):
            request, cached, _ = entry
            entry[1] = min(cached + self.prefill_chunk, len(request.prompt))
            if entry[1] == len(request.prompt):
                del self._prefilling[slot]
                self._start(request, i, picked, done)

    def _dispatch(self, chunk: Chunk, live) -> None:
        for slot, request in list(self._active.items()):
            row = slot - self._first
            if request.cancelled:  # its tokens are dropped; `_drop_cancelled` frees the slot
                continue
            for j in np.flatnonzero(chunk.emitted[row]):
                if request.cancelled:  # by its own token's callback (a stop string)
                    break
                request._emit(int(chunk.tokens[row, j]), float(chunk.logprobs[row, j]),
                              chunk.top_ids[row, j], chunk.top_logprobs[row, j])
            if not live[row]:
                del self._active[slot]
                self._finish(request)

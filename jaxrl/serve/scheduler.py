"""The one thread that owns the decode engine (jaxrl/sampling/engine.py) for the server.

Handlers `submit` a request's jobs (one per completion) and get their tokens through each
job's `Sink`, called on this thread; the sink hands them to the handler's event loop. The
thread admits waiting jobs into the engine whenever it has free slots, so requests join the
decoding batch between chunks instead of waiting for a round to finish.

Adapters: every served model decodes in the same batch. The engine holds them all at once
(`engine_lora`): no adapter when every model is the base alone, the one adapter when all
models share one, else an `AdapterSet` of the distinct adapters, and each job's request
carries its model's index in it (0: the base alone). Waiting requests of any model are
admitted first come, first served into free slots; rows of different models decode side by
side in one step, and nothing recompiles for a new mix.

A job still waiting can be cancelled (its client went away); a job in the engine decodes to
its end, as the engine has no way to free a slot early. A failing engine step fails the jobs
it held and the engine is built anew; waiting jobs are kept. More than `max_queue` waiting
requests are refused with `Overloaded`; after `close`, new ones with `Closed`.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from jaxrl.lora.adapters import AdapterSet
from jaxrl.lora.lora import Lora
from jaxrl.sampling.engine import Engine
from jaxrl.sampling.requests import Request
from jaxrl.sampling.sampling_fns import Decoding

log = logging.getLogger("jaxrl.serve")


class Overloaded(Exception):
    """Too many requests are waiting."""


class Closed(Exception):
    """The server is shutting down."""


class Sink(Protocol):
    """Where a job's results go; called on the engine thread."""

    def token(self, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> None: ...

    def done(self, finish_reason: str) -> None: ...

    def fail(self, error: Exception) -> None: ...


@dataclasses.dataclass(eq=False)
class Job:
    """One completion to decode for a served model."""

    prompt: Sequence[int]
    decoding: Decoding
    max_tokens: int
    key: np.ndarray  # [2] uint32
    sink: Sink


@dataclasses.dataclass
class Counts:
    """What the scheduler has done, for /health and /metrics. The per-model counts are keyed by
    served model id (models sharing one adapter share a key: their ids joined by commas)."""

    waiting: int = 0  # jobs waiting for a slot
    running: int = 0  # jobs in the engine
    utilization: float = 0.0  # share of slot-steps that emitted a token in the last chunk
    # since the start, over engine rebuilds: the decode steps in which the model's rows
    # emitted, the tokens they emitted, and the steps whose rows used more than one adapter
    model_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    model_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    mixed_steps: int = 0


def engine_lora(models: Mapping[str, Lora | None]) -> tuple[Lora | AdapterSet | None,
                                                             dict[str, int]]:
    """The engine's `lora` for the served `models` (id -> adapter, None: the base alone) and
    each model's adapter index in it: None when every model is the base alone, the one
    adapter when all models share it, else an `AdapterSet` of the distinct adapters (a model
    without one gets index 0, the base)."""
    distinct: list[Lora] = []
    for lora in models.values():
        if lora is not None and all(lora is not d for d in distinct):
            distinct.append(lora)
    if not distinct:
        return None, dict.fromkeys(models, 0)
    if len(distinct) == 1 and all(lora is not None for lora in models.values()):
        return distinct[0], dict.fromkeys(models, 0)
    index = {id(lora): i for i, lora in enumerate(distinct, 1)}
    return AdapterSet.of(distinct), {m: 0 if lora is None else index[id(lora)]
                                     for m, lora in models.items()}


class Scheduler:
    """Runs `make_engine()`'s engine on its own thread for the models in `adapters` (served
    model id -> LoRA or None for the base), admitting jobs continuously (module docstring)."""

    def __init__(self, make_engine: Callable[[], Engine], adapters: Mapping[str, Lora | None],
                 max_queue: int, on_step: Callable[[Counts, Engine], None] | None = None):
        self._make_engine, self._adapters = make_engine, dict(adapters)
        self.max_queue, self._on_step = max_queue, on_step
        self._lora, self._index = engine_lora(self._adapters)
        names: dict[int, list[str]] = {}
        for model, i in self._index.items():
            names.setdefault(i, []).append(model)
        self._labels = {i: ",".join(ms) for i, ms in names.items()}  # index -> Counts key
        self.engine = self._new_engine()
        self._cond = threading.Condition()
        self._waiting: deque[tuple[int, list[Job]]] = deque()  # (adapter index, jobs)
        self._running: dict[int, Job] = {}  # id(request) -> job
        self._closed = False
        self.counts = Counts(model_steps=dict.fromkeys(self._labels.values(), 0),
                             model_tokens=dict.fromkeys(self._labels.values(), 0))
        self._thread = threading.Thread(target=self._loop, name="jaxrl-serve-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def models(self) -> list[str]:
        return list(self._adapters)

    def _new_engine(self) -> Engine:
        engine = self._make_engine()
        engine.lora = self._lora
        return engine

    def submit(self, model: str, jobs: list[Job]) -> None:
        """Queue one request's jobs for `model`; Overloaded when max_queue requests wait."""
        index = self._index[model]
        with self._cond:
            if self._closed:
                raise Closed("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(f"{len(self._waiting)} requests are already waiting (the "
                                 "limit)")
            self._waiting.append((index, list(jobs)))
            self._count()
            self._cond.notify()

    def cancel(self, jobs: Sequence[Job]) -> None:
        """Drop those of `jobs` that still wait (their client is gone)."""
        drop = {id(j) for j in jobs}
        with self._cond:
            kept = [(i, [j for j in req if id(j) not in drop]) for i, req in self._waiting]
            self._waiting = deque((i, req) for i, req in kept if req)
            self._count()

    def _count(self) -> None:
        self.counts.waiting = sum(len(req) for _, req in self._waiting)
        self.counts.running = len(self._running)

    def _feed(self) -> None:
        """Move waiting jobs of any model into the engine, first come first served, while it
        has free slots (under the lock). A request's jobs go in together; one with more jobs
        than slots goes in alone and waits in the engine's own queue for slots."""
        queue = self._waiting
        while queue and (not self._running
                         or len(self._running) + len(queue[0][1]) <= self.engine.slots):
            index, jobs = queue.popleft()
            for job in jobs:
                self._start(job, index)

    def _start(self, job: Job, adapter: int) -> None:
        def token(t: int, logprob: float, request: Request) -> None:
            job.sink.token(t, logprob, request.top_logprobs[-1] if request.top_logprobs else ())

        request = Request(list(job.prompt), job.decoding, job.max_tokens, job.key,
                          adapter=adapter)
        request.on_token = lambda t, lp: token(t, lp, request)
        request.on_done = self._finished
        self._running[id(request)] = job
        self.engine.submit(request)

    def _finished(self, request: Request) -> None:
        with self._cond:
            job = self._running.pop(id(request))
        job.sink.done(request.finish_reason)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._running and not self._waiting:
                    self._count()
                    self._cond.wait()
                if self._closed:
                    return
                self._feed()
                self._count()
            self._step()

    def _step(self) -> None:
        engine = self.engine
        stats = engine.stats
        before = (stats.steps, stats.tokens, dict(stats.adapter_steps),
                  dict(stats.adapter_tokens), stats.mixed_steps)
        try:
            engine.step()
        except Exception as error:  # noqa: BLE001 -- the jobs get it; the server lives on
            log.exception("the decode engine failed; its %d jobs fail and it is rebuilt",
                          len(self._running))
            with self._cond:
                failed, self._running = list(self._running.values()), {}
            for job in failed:
                job.sink.fail(error)
            self.engine = self._new_engine()
            return
        stats = engine.stats
        steps = stats.steps - before[0]
        if steps:
            self.counts.utilization = (stats.tokens - before[1]) / (steps * engine.slots)
        with self._cond:
            # deltas of this step: a rebuilt engine's stats restart from 0
            for count, now, then in ((self.counts.model_steps, stats.adapter_steps, before[2]),
                                     (self.counts.model_tokens, stats.adapter_tokens,
                                      before[3])):
                for index, n in now.items():
                    label = self._labels.get(index, str(index))
                    count[label] = count.get(label, 0) + n - then.get(index, 0)
            self.counts.mixed_steps += stats.mixed_steps - before[4]
            self._count()
        if self._on_step is not None:
            self._on_step(self.counts, engine)

    def close(self) -> None:
        """Stop after the current step; waiting and running jobs fail with Closed."""
        with self._cond:
            self._closed = True
            waiting = [j for _, req in self._waiting for j in req]
            running = list(self._running.values())
            self._waiting = deque()
            self._cond.notify_all()
        self._thread.join()
        for job in waiting + running:
            job.sink.fail(Closed("the server shut down before this request finished"))

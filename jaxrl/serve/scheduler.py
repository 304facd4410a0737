"""The one thread that owns the decode engine (jaxrl/sampling/engine.py) for the server.

Handlers `submit` a request's jobs (one per completion) and get their tokens through each
job's `Sink`, called on this thread; the sink hands them to the handler's event loop. The
thread admits waiting jobs into the engine whenever it has free slots, so requests join the
decoding batch between chunks instead of waiting for a round to finish.

Adapters: the engine decodes with one LoRA adapter (or the base) at a time, since one batch
cannot mix adapters, so requests for different served models decode in turn. While the
current model has jobs waiting and no other model does, they keep joining the batch; once
another model has jobs waiting, the current one's waiting jobs are held back, the batch
drains, and the engine switches to the next model (round robin) that has jobs waiting.

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
    """What the scheduler has done, for /health and /metrics."""

    waiting: int = 0  # jobs waiting for a slot
    running: int = 0  # jobs in the engine
    switches: int = 0  # adapter changes
    utilization: float = 0.0  # share of slot-steps that emitted a token in the last chunk


class Scheduler:
    """Runs `make_engine()`'s engine on its own thread for the models in `adapters` (served
    model id -> LoRA or None for the base), admitting jobs continuously (module docstring)."""

    def __init__(self, make_engine: Callable[[], Engine], adapters: Mapping[str, Lora | None],
                 max_queue: int, on_step: Callable[[Counts, Engine], None] | None = None):
        self._make_engine, self._adapters = make_engine, dict(adapters)
        self.max_queue, self._on_step = max_queue, on_step
        self.engine = make_engine()
        self._current = next(iter(self._adapters))
        self.engine.lora = self._adapters[self._current]
        self._cond = threading.Condition()
        self._waiting: dict[str, deque[list[Job]]] = {m: deque() for m in self._adapters}
        self._running: dict[int, Job] = {}  # id(request) -> job
        self._closed = False
        self.counts = Counts()
        self._thread = threading.Thread(target=self._loop, name="jaxrl-serve-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def models(self) -> list[str]:
        return list(self._adapters)

    def submit(self, model: str, jobs: list[Job]) -> None:
        """Queue one request's jobs for `model`; Overloaded when max_queue requests wait."""
        with self._cond:
            if self._closed:
                raise Closed("the server is shutting down")
            queued = sum(len(q) for q in self._waiting.values())
            if queued >= self.max_queue:
                raise Overloaded(f"{queued} requests are already waiting (the limit)")
            self._waiting[model].append(list(jobs))
            self._cond.notify()

    def cancel(self, jobs: Sequence[Job]) -> None:
        """Drop those of `jobs` that still wait (their client is gone)."""
        drop = {id(j) for j in jobs}
        with self._cond:
            for model, queue in self._waiting.items():
                kept = [[j for j in req if id(j) not in drop] for req in queue]
                self._waiting[model] = deque(req for req in kept if req)

    def _count(self) -> None:
        self.counts.waiting = sum(len(j) for q in self._waiting.values() for j in q)
        self.counts.running = len(self._running)

    def _next_model(self) -> str | None:
        """The model whose jobs the engine should take now (module docstring)."""
        others = [m for m in self.models if m != self._current and self._waiting[m]]
        if not others:
            return self._current if self._waiting[self._current] else None
        if self._running:
            return None  # drain the current model's batch first
        order = self.models[self.models.index(self._current) + 1:] + self.models
        return next(m for m in order if m in others)

    def _feed(self) -> None:
        """Move waiting jobs into the engine while it has free slots (under the lock)."""
        model = self._next_model()
        if model is None:
            return
        if model != self._current:
            self._current = model
            self.engine.lora = self._adapters[model]
            self.counts.switches += 1
        queue = self._waiting[model]
        # a request's jobs go in together; one with more jobs than slots goes in alone and
        # waits in the engine's own queue for slots
        while queue and (not self._running
                         or len(self._running) + len(queue[0]) <= self.engine.slots):
            for job in queue.popleft():
                self._start(job)

    def _start(self, job: Job) -> None:
        def token(t: int, logprob: float, request: Request) -> None:
            job.sink.token(t, logprob, request.top_logprobs[-1] if request.top_logprobs else ())

        request = Request(list(job.prompt), job.decoding, job.max_tokens, job.key)
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
                while not self._closed and not self._running and not any(
                        self._waiting.values()):
                    self._count()
                    self._cond.wait()
                if self._closed:
                    return
                self._feed()
                self._count()
            self._step()

    def _step(self) -> None:
        before = (self.engine.stats.steps, self.engine.stats.tokens)
        try:
            self.engine.step()
        except Exception as error:  # noqa: BLE001 -- the jobs get it; the server lives on
            log.exception("the decode engine failed; its %d jobs fail and it is rebuilt",
                          len(self._running))
            with self._cond:
                failed, self._running = list(self._running.values()), {}
            for job in failed:
                job.sink.fail(error)
            self.engine = self._make_engine()
            self.engine.lora = self._adapters[self._current]
            return
        steps = self.engine.stats.steps - before[0]
        if steps:
            self.counts.utilization = ((self.engine.stats.tokens - before[1])
                                       / (steps * self.engine.slots))
        if self._on_step is not None:
            with self._cond:
                self._count()
            self._on_step(self.counts, self.engine)

    def close(self) -> None:
        """Stop after the current step; waiting and running jobs fail with Closed."""
        with self._cond:
            self._closed = True
            waiting = [j for q in self._waiting.values() for req in q for j in req]
            running = list(self._running.values())
            self._waiting = {m: deque() for m in self._adapters}
            self._cond.notify_all()
        self._thread.join()
        for job in waiting + running:
            job.sink.fail(Closed("the server shut down before this request finished"))

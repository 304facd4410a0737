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

Prompt log-probs (`echo` with `logprobs` on /v1/completions) are `Score` jobs: the thread
runs one teacher-forced forward of the request's model (`scorer`, jaxrl/serve/scoring.py)
between engine steps, so the device is only ever driven from this thread.

A job can be cancelled at any time (its client went away, or a stop string ended its reply):
one still waiting is dropped, one in the engine is cancelled there (`Engine.cancel`: its slot
is freed before the next step and nothing decoded after reaches its client). A failing engine step fails the jobs
it held and the engine is built anew; waiting jobs are kept. Admission control: a request is
refused with `Overloaded` when more than `max_queue` requests would be left waiting after the
next admission (requests that the free slots take at once never count as queued; so do at
most `max_queue` pending score jobs); after `close`, new ones with `Closed`. `on_change`
gets the counts whenever they change: on submit, cancel, admission, completion and after
each engine step (the gauges of /metrics).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

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
    constraint: Any = None  # structured output's grammar (jaxrl/serve/structured.py)


@dataclasses.dataclass(eq=False)
class Score:
    """The prompt log-probs of one prompt under a served model; `done(PromptLogprobs)` or
    `fail(error)` is called on the engine thread."""

    prompt: Sequence[int]
    done: Callable[[object], None]
    fail: Callable[[Exception], None]


@dataclasses.dataclass
class Counts:
    """What the scheduler has done, for /health and /metrics. The per-model counts are keyed by
    served model id (models sharing one adapter share a key: their ids joined by commas)."""

    waiting: int = 0  # jobs waiting for a slot
    running: int = 0  # jobs in the engine
    utilization: float = 0.0  # share of slot-steps that emitted a token in the last chunk
    # (0 while no job is in the engine)
    scoring: int = 0  # prompt log-prob jobs waiting for the engine thread
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
    model id -> LoRA or None for the base), admitting jobs continuously (module docstring).
    scorer(prompt, lora): the prompt log-probs of `score` jobs (None: no scoring)."""

    def __init__(self, make_engine: Callable[[], Engine], adapters: Mapping[str, Lora | None],
                 max_queue: int, on_change: Callable[[Counts], None] | None = None,
                 scorer: Callable[[Sequence[int], Lora | None], object] | None = None,
                 warmup: Callable[[Engine], None] | None = None):
        self._make_engine, self._adapters = make_engine, dict(adapters)
        self.max_queue, self._on_change, self._scorer = max_queue, on_change, scorer
        self._lora, self._index = engine_lora(self._adapters)
        names: dict[int, list[str]] = {}
        for model, i in self._index.items():
            names.setdefault(i, []).append(model)
        self._labels = {i: ",".join(ms) for i, ms in names.items()}  # index -> Counts key
        self.engine = self._new_engine()
        self._cond = threading.Condition()
        self._waiting: deque[tuple[int, list[Job]]] = deque()  # (adapter index, jobs)
        self._running: dict[int, Job] = {}  # id(request) -> job
        self._requests: dict[int, Request] = {}  # id(job) -> its request in the engine
        self._scores: deque[tuple[str, Score]] = deque()  # (model, job)
        self._closed = False
        self._warmup = warmup
        self.warming = warmup is not None  # the engine thread compiles first
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
        engine.feed = self._feed_step  # waiting jobs go in as each step begins
        engine.interruptible = True  # arrivals and cancels end a CPU chunk after its step
        return engine

    def submit(self, model: str, jobs: list[Job]) -> None:
        """Queue one request's jobs for `model`; Overloaded when more than max_queue requests
        would be left waiting after the next admission (module docstring)."""
        index = self._index[model]
        with self._cond:
            if self._closed:
                raise Closed("the server is shutting down")
            queued = self._queued([len(req) for _, req in self._waiting] + [len(jobs)])
            if queued > self.max_queue:
                raise Overloaded(f"every slot is taken and {queued - 1} requests already wait "
                                 f"for one (--max-queue {self.max_queue})")
            self._waiting.append((index, list(jobs)))
            self._changed()
            self._cond.notify()
        Engine.interrupt()  # admitted after the step in flight, not after its chunk

    def _queued(self, sizes: Sequence[int]) -> int:
        """How many of the waiting requests (their job counts, in order) the next admission
        leaves waiting (the rule of `_feed`)."""
        running = len(self._running)
        for i, n in enumerate(sizes):
            if running and running + n > self.engine.slots:
                return len(sizes) - i
            running += n
        return 0

    def score(self, model: str, job: Score) -> None:
        """Queue the prompt log-probs of `job.prompt` under `model` (module docstring)."""
        if self._scorer is None:
            raise RuntimeError("this scheduler has no scorer")
        self._index[model]  # a served model
        with self._cond:
            if self._closed:
                raise Closed("the server is shutting down")
            if len(self._scores) >= self.max_queue:
                raise Overloaded(f"{len(self._scores)} prompt log-prob jobs already wait "
                                 f"(--max-queue {self.max_queue})")
            self._scores.append((model, job))
            self._changed()
            self._cond.notify()

    def cancel(self, jobs: Sequence[Job | Score]) -> None:
        """Drop those of `jobs` that still wait, and cancel those in the engine, whose slots
        are freed before its next step (their client is gone, or a stop string ended them)."""
        drop = {id(j) for j in jobs}
        with self._cond:
            for job_id in drop:
                request = self._requests.get(job_id)
                if request is not None:
                    self.engine.cancel(request)
            kept = [(i, [j for j in req if id(j) not in drop]) for i, req in self._waiting]
            self._waiting = deque((i, req) for i, req in kept if req)
            self._scores = deque((m, j) for m, j in self._scores if id(j) not in drop)
            self._changed()

    def _count(self) -> None:
        self.counts.waiting = sum(len(req) for _, req in self._waiting)
        self.counts.running = len(self._running)
        self.counts.scoring = len(self._scores)
        if not self._running:
            self.counts.utilization = 0.0

    def _changed(self) -> None:
        """Recount and tell `on_change` (under the lock, so the gauges see changes in order)."""
        self._count()
        if self._on_change is not None:
            self._on_change(self.counts)

    def _feed_step(self) -> None:
        """`Engine.feed`: at the start of each engine step, after the engine has begun noting
        arrivals that should end its next chunk early, so a job that arrives after this waits
        a decode step, not a chunk."""
        with self._cond:
            self._feed()
            self._changed()

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
                          adapter=adapter, constraint=job.constraint)
        request.on_token = lambda t, lp: token(t, lp, request)
        request.on_done = self._finished
        self._running[id(request)] = job
        self._requests[id(job)] = request
        self.engine.submit(request)

    def _finished(self, request: Request) -> None:
        with self._cond:
            job = self._running.pop(id(request))
            self._requests.pop(id(job), None)
            self._changed()
        job.sink.done(request.finish_reason)

    def _loop(self) -> None:
        if self._warmup is not None:
            try:
                self._warmup(self.engine)
            except Exception:  # noqa: BLE001 -- a failed warm-up leaves compiling to requests
                log.exception("warming the engine up failed; requests compile as they come")
            self.warming = False
        while True:
            with self._cond:
                while (not self._closed and not self._running and not self._waiting
                       and not self._scores):
                    self._changed()
                    self._cond.wait()
                if self._closed:
                    return
                score = self._scores.popleft() if self._scores else None
                self._feed()  # and again as the engine step begins (`_feed_step`)
                self._changed()
            if score is not None:
                self._score(*score)
            if self._running:
                self._step()

    def _score(self, model: str, job: Score) -> None:
        try:
            result = self._scorer(job.prompt, self._adapters[model])
        except Exception as error:  # noqa: BLE001 -- the request gets it; the server lives on
            log.exception("scoring a prompt of %d tokens failed", len(job.prompt))
            job.fail(error)
            return
        job.done(result)

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
                self._requests = {}
                self._changed()
            for job in failed:
                job.sink.fail(error)
            self.engine = self._new_engine()
            return
        stats = engine.stats
        steps = stats.steps - before[0]
        with self._cond:
            if steps:
                self.counts.utilization = (stats.tokens - before[1]) / (steps * engine.slots)
            # deltas of this step: a rebuilt engine's stats restart from 0
            for count, now, then in ((self.counts.model_steps, stats.adapter_steps, before[2]),
                                     (self.counts.model_tokens, stats.adapter_tokens,
                                      before[3])):
                for index, n in now.items():
                    label = self._labels.get(index, str(index))
                    count[label] = count.get(label, 0) + n - then.get(index, 0)
            self.counts.mixed_steps += stats.mixed_steps - before[4]
            self._changed()

    def close(self) -> None:
        """Stop after the current step; waiting and running jobs fail with Closed."""
        with self._cond:
            self._closed = True
            waiting = [j for _, req in self._waiting for j in req]
            running = list(self._running.values())
            scores = [j for _, j in self._scores]
            self._waiting, self._scores = deque(), deque()
            self._cond.notify_all()
        self._thread.join()
        closed = Closed("the server shut down before this request finished")
        for job in waiting + running:
            job.sink.fail(closed)
        for score in scores:
            score.fail(closed)

"""The batching queue between HTTP handler threads and the one thread that runs the sampler.

Handlers submit a request's jobs (one per prompt) and wait on their futures. The worker takes
everything queued at once, groups it (`plan_groups`) and runs the groups one after another;
requests that arrive meanwhile wait for the next round. A group is one sampler call, so its jobs
share what the compiled program fixes: temperature and top-p (greedy ignores top-p), the prompt
bucket and the new-token bucket. A seeded sampled job runs alone, so its completions are exactly
the sampler's for that seed whatever else is queued (batch-mates would change the random draws
of its rows); greedy jobs need no such care. When more than `max_queue` requests are waiting,
`submit` raises `Overloaded` (the server answers 503) instead of letting latency grow unbounded.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from jaxrl.sampling.buckets import bucket


class Overloaded(Exception):
    """Too many requests are queued."""


class Closed(Exception):
    """The server is shutting down."""


@dataclasses.dataclass(eq=False)
class Job:
    """One prompt's n completions; `future` receives the engine's result for it."""
    prompt: tuple[int, ...]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    logprobs: bool = False  # the engine then also returns each token's text and offset
    future: Future = dataclasses.field(default_factory=Future)

    @property
    def solo(self) -> bool:
        """A seeded sampled job: its rows must be the whole batch (module doc)."""
        return self.seed is not None and self.temperature > 0


def group_key(job: Job) -> tuple:
    """Jobs with equal keys can share one sampler call."""
    top_p = 1.0 if job.temperature == 0 else job.top_p
    return (job.temperature, top_p, bucket(len(job.prompt)), bucket(job.max_tokens),
            id(job) if job.solo else None)


def plan_groups(jobs: Sequence[Job], max_rows: int) -> list[list[Job]]:
    """Jobs grouped by key in arrival order, each group split to at most max_rows rows (a job is
    never split; one larger than max_rows forms its own group)."""
    groups: dict[tuple, list[list[Job]]] = {}
    for job in jobs:
        chunks = groups.setdefault(group_key(job), [[]])
        if chunks[-1] and sum(j.n for j in chunks[-1]) + job.n > max_rows:
            chunks.append([])
        chunks[-1].append(job)
    return [chunk for chunks in groups.values() for chunk in chunks]


class Batcher:
    """Runs `run_group(jobs) -> results` (one per job) on a worker thread (module doc)."""

    def __init__(self, run_group: Callable[[list[Job]], list], max_rows: int, max_queue: int):
        self._run_group, self.max_rows, self.max_queue = run_group, max_rows, max_queue
        self._cond = threading.Condition()
        self._waiting: list[list[Job]] = []  # one entry per request
        self._running = 0  # requests' jobs in the round being run
        self._closed = False
        self.batches = self.rows = 0
        self._thread = threading.Thread(target=self._loop, name="jaxrl-serve-batcher",
                                        daemon=True)
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue one request's jobs; Overloaded when max_queue requests already wait."""
        with self._cond:
            if self._closed:
                raise Closed("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(f"{len(self._waiting)} requests are already queued (the limit)")
            self._waiting.append(jobs)
            self._cond.notify()

    def stats(self) -> dict[str, int]:
        """Requests waiting, jobs running, and sampler calls and rows run so far."""
        with self._cond:
            return {"queued": len(self._waiting), "running": self._running,
                    "batches": self.batches, "rows": self.rows}

    def _take(self) -> list[Job] | None:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            jobs = [job for request in self._waiting for job in request]
            self._waiting, self._running = [], len(jobs)
            return jobs

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            for group in plan_groups(jobs, self.max_rows):
                self._run(group)
            with self._cond:
                self._running = 0

    def _run(self, group: list[Job]) -> None:
        try:
            results = self._run_group(group)
        except Exception as error:  # noqa: BLE001 -- the requests get it; the server lives on
            for job in group:
                job.future.set_exception(error)
            return
        with self._cond:
            self.batches += 1
            self.rows += sum(job.n for job in group)
        for job, result in zip(group, results):
            job.future.set_result(result)

    def close(self) -> None:
        """Stop the worker after its current group; waiting requests fail with Closed."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._cond.notify_all()
        for request in waiting:
            for job in request:
                job.future.set_exception(Closed("the server shut down before this request ran"))
        self._thread.join()

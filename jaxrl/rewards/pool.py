"""The reward pool: score a batch on the host while the devices keep working.

`submit(samples)` checks the samples (a record no verifier can read raises RewardConfigError
here: a data error) and returns a ticket at once; `collect(ticket)` blocks until every sample is
scored and returns a `ScoredBatch` in submission order. Scoring never raises into the caller:
a timeout, a crashed worker, an unreachable judge or a bug in a reward function scores that
function's default (0.0 for every built-in) and is counted under `rewards/failures/<kind>`.

CPU-bound functions run in worker processes (`workers.ProcessWorkers`, per-sample timeout
`rewards.timeout_s`, a hung or dead worker replaced); I/O-bound ones (judges) run as coroutines on
the pool's asyncio loop thread, each sample under the function's own `timeout_s` and the judge's
concurrency limit. The summed reward of a sample is sum(weight * value) over
`rewards.functions`; each function's values and components are also reported on their own.

Batch metrics: rewards/mean (of the summed reward), rewards/time_s (submit to last result),
rewards/wait_s (how long `collect` blocked: the device waited for rewards), rewards/overlap
(1 - wait / time: the share of scoring hidden behind device work), rewards/per_s,
rewards/<name>/mean, rewards/<name>/<component>/mean, rewards/failures and
rewards/failures/<kind>.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from jaxrl.config import Config, RewardEntry
from jaxrl.rewards import REWARDS, load_target
from jaxrl.rewards.base import (
    RewardConfigError,
    RewardFunction,
    RewardResult,
    Sample,
    failed,
    failures_of,
)
from jaxrl.rewards.workers import ProcessWorkers

log = logging.getLogger(__name__)
B = TypeVar("B")


def build_reward(name: str, cfg: Config) -> RewardFunction:
    """The registered reward function `name`, built for `cfg`."""
    if name not in REWARDS:
        raise RewardConfigError(f"unknown reward {name!r}; registered rewards: "
                                f"{', '.join(sorted(REWARDS))}")
    return load_target(REWARDS[name])(cfg)


@dataclass(frozen=True)
class Ticket:
    """A submitted batch; pass it to `collect`."""
    future: Future
    size: int
    submitted: float


@dataclass(frozen=True)
class ScoredBatch:
    """`rewards[i]`: the weighted sum for sample i; `results[name][i]`: function `name`'s
    result for it; `metrics`: the batch's timing, per-function means and failure counts."""
    rewards: tuple[float, ...]
    results: dict[str, tuple[RewardResult, ...]]
    metrics: dict[str, float]


class RewardPool:
    """Scores batches with the functions of `rewards.functions` (or `functions`)."""

    def __init__(self, cfg: Config, functions: Sequence[RewardEntry] | None = None,
                 start_method: str = "spawn"):
        entries = tuple(functions or cfg.rewards.functions)
        self._functions = [(entry.weight, build_reward(entry.name, cfg)) for entry in entries]
        self.failures: collections.Counter[str] = collections.Counter()
        cpu = {fn.name: fn for _, fn in self._functions if fn.kind == "cpu"}
        for _, fn in self._functions:
            cpu.update(fn.cpu_functions() if fn.kind == "io" else {})
        self._workers = ProcessWorkers(
            {name: REWARDS[name] for name in cpu}, cfg, cfg.rewards.workers,
            cfg.rewards.timeout_s, {name: fn.default for name, fn in cpu.items()},
            start_method) if cpu else None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-loop",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        # while_waiting(done): run by `collect` until done(), on the caller's thread: work the
        # scores need from it (a local judge's engine steps, jaxrl/rewards/local_judge.py)
        self.while_waiting: Callable[[Callable[[], bool]], None] | None = None

    @property
    def restarts(self) -> int:
        """How many workers were replaced (hung or dead) so far."""
        return self._workers.restarts if self._workers else 0

    def submit(self, samples: Sequence[Sample]) -> Ticket:
        """Start scoring `samples`; returns at once."""
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        samples = list(samples)
        for _, fn in self._functions:
            for sample in samples:
                fn.check(sample)
        future = asyncio.run_coroutine_threadsafe(self._score(samples), self._loop)
        return Ticket(future, len(samples), time.monotonic())

    def collect(self, ticket: Ticket) -> ScoredBatch:
        """Wait for a submitted batch; its results in submission order."""
        start = time.monotonic()
        if self.while_waiting is not None:
            self.while_waiting(ticket.future.done)
        per_function, finished = ticket.future.result()
        waited = time.monotonic() - start
        results = {fn.name: tuple(rs) for (_, fn), rs in zip(self._functions, per_function)}
        rewards = tuple(sum(w * rs[i].value for (w, _), rs in zip(self._functions, per_function))
                        for i in range(ticket.size))
        metrics = self._metrics(rewards, results, finished - ticket.submitted, waited, ticket.size)
        return ScoredBatch(rewards, results, metrics)

    def score(self, samples: Sequence[Sample]) -> ScoredBatch:
        """submit + collect."""
        return self.collect(self.submit(samples))

    async def _score(self, samples: list[Sample]):
        per_function = await asyncio.gather(*(
            asyncio.gather(*(self._one(fn, sample) for sample in samples))
            for _, fn in self._functions))
        return per_function, time.monotonic()

    async def _one(self, fn: RewardFunction, sample: Sample) -> RewardResult:
        try:
            if fn.kind == "cpu":
                return await self._run_cpu(fn.name, sample)
            return await asyncio.wait_for(fn.ascore(sample, self._run_cpu), fn.timeout_s)
        except TimeoutError:
            return failed("timeout", fn.default, detail=f"no result within {fn.timeout_s:g} s")
        except Exception as error:  # a bug in a reward must not stop training
            log.warning("reward %s failed: %s: %s", fn.name, type(error).__name__, error)
            return failed("reward_error", fn.default,
                          error=f"{type(error).__name__}: {error}"[:300])

    async def _run_cpu(self, name: str, sample: Sample) -> RewardResult:
        return await asyncio.wrap_future(self._workers.submit(name, sample))

    def _metrics(self, rewards: tuple[float, ...], results: dict[str, tuple[RewardResult, ...]],
                 seconds: float, waited: float, size: int) -> dict[str, float]:
        overlap = min(1.0, max(0.0, 1.0 - waited / seconds)) if seconds else 1.0
        self.failures.update(failure_counts(results))
        return {"rewards/time_s": seconds, "rewards/wait_s": waited, "rewards/overlap": overlap,
                "rewards/per_s": size / seconds if seconds else 0.0,
                **reward_metrics(rewards, results)}

    def close(self) -> None:
        """Stop the loop and the workers; unfinished batches are abandoned."""
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        if self._workers is not None:
            self._workers.close()

    async def _shutdown(self) -> None:
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        for _, fn in self._functions:
            if fn.kind == "io":
                await fn.aclose()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def failure_counts(results: dict[str, Sequence[RewardResult]]) -> collections.Counter[str]:
    """How many results of each failure kind `results` hold."""
    return collections.Counter(kind for rs in results.values() for r in rs
                               for kind in failures_of(r))


def reward_metrics(rewards: Sequence[float], results: dict[str, Sequence[RewardResult]],
                   ) -> dict[str, float]:
    """The batch metrics that depend on the scores alone (module docstring): rewards/mean,
    per-function and per-component means, failure counts."""
    metrics = {"rewards/mean": sum(rewards) / max(1, len(rewards))}
    for name, rs in results.items():
        metrics[f"rewards/{name}/mean"] = sum(r.value for r in rs) / max(1, len(rs))
        for key in sorted({k for r in rs for k in r.components}):
            values = [r.components[key] for r in rs if key in r.components]
            metrics[f"rewards/{name}/{key}/mean"] = sum(values) / len(values)
    failures = failure_counts(results)
    metrics["rewards/failures"] = float(sum(failures.values()))
    metrics.update({f"rewards/failures/{k}": float(n) for k, n in sorted(failures.items())})
    return metrics


def pipelined(pool: RewardPool, batches: Iterable[B], samples_of: Callable[[B], Sequence[Sample]],
              max_staleness: int, overlap: Callable[[B], None] | None = None,
              ) -> Iterator[tuple[B, ScoredBatch, B | None]]:
    """Yield (batch, scores, ahead) with scoring overlapped with device work.

    `batches` is pulled lazily: pulling one runs its rollout. Each batch is submitted at once,
    then `overlap(batch)` runs (the reference log-prob pass). With max_staleness 0 the batch is
    collected next; with 1 the next batch's rollout runs first, while this one is scored, so
    the update of step t follows the rollout of step t+1 and must use the sampler's log-probs
    as pi_old. `ahead` is that next batch (submitted, its `overlap` done), None when there is
    none: a checkpoint taken after the update of `batch` saves it.
    """
    if max_staleness not in (0, 1):
        raise ValueError(f"max_staleness must be 0 or 1; got {max_staleness!r}")
    pending: collections.deque = collections.deque()

    def collect(keep: int):
        while len(pending) > keep:
            done, ticket = pending.popleft()
            yield done, pool.collect(ticket), pending[0][0] if pending else None

    for batch in batches:
        pending.append((batch, pool.submit(samples_of(batch))))
        if overlap is not None:
            overlap(batch)
        yield from collect(max_staleness)
    yield from collect(0)

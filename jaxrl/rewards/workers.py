"""CPU-bound rewards in worker processes, one sample at a time, each under a deadline.

Workers start with `spawn` (or `forkserver`; never `fork`: forking a process in which JAX runs
threads can deadlock) and build their reward functions once from registry targets. A worker
that passes a sample's deadline is killed and replaced, and so is one that dies; the sample
then scores its function's default with info failure "timeout" or "worker_crashed". Each
worker's temporary files (sandbox directories included) live in a scratch directory that is
removed when the worker goes, however it went. Results come back as futures that never raise.
"""
from __future__ import annotations

import collections
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from jaxrl.config import Config
from jaxrl.rewards import load_target
from jaxrl.rewards.base import RewardResult, Sample, failed

log = logging.getLogger(__name__)
START_METHODS = ("spawn", "forkserver")


def _worker_main(conn, targets: Mapping[str, str], cfg: Config, scratch: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    tempfile.tempdir = scratch
    try:
        functions = {name: load_target(target)(cfg) for name, target in targets.items()}
    except Exception as error:
        conn.send(("error", f"cannot build reward functions: {type(error).__name__}: {error}"))
        return
    conn.send(("ready", None))
    while (message := _receive(conn)) is not None:
        name, sample = message
        try:
            result = functions[name].score_one(sample)
        except Exception as error:
            result = failed("reward_error", functions[name].default,
                            error=f"{type(error).__name__}: {error}"[:300])
        conn.send(("result", result))


def _receive(conn):
    try:
        return conn.recv()
    except EOFError:  # the pool went away
        return None


@dataclass
class _Job:
    name: str
    sample: Sample
    future: Future
    deadline: float = float("inf")


@dataclass
class _Slot:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    scratch: str
    ready: bool = False
    job: _Job | None = None


class ProcessWorkers:
    """`submit(name, sample)` returns a Future of the RewardResult of CPU reward `name`."""

    def __init__(self, targets: Mapping[str, str], cfg: Config, workers: int, timeout_s: float,
                 defaults: Mapping[str, float], start_method: str = "spawn"):
        if start_method not in START_METHODS:
            raise ValueError(f"reward workers start with one of {', '.join(START_METHODS)} "
                             f"(fork can deadlock under JAX); got {start_method!r}")
        self._context = multiprocessing.get_context(start_method)
        self._targets, self._cfg, self._defaults = dict(targets), cfg, dict(defaults)
        self.timeout_s = timeout_s
        self.restarts = 0
        self._queue: collections.deque[_Job] = collections.deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._broken = ""
        self._closed = False
        self._slots = [self._start() for _ in range(workers)]
        self._thread = threading.Thread(target=self._run, name="reward-workers", daemon=True)
        self._thread.start()

    def submit(self, name: str, sample: Sample) -> Future:
        future: Future = Future()
        with self._lock:
            self._queue.append(_Job(name, sample, future))
        os.write(self._wake_w, b"x")
        return future

    def _start(self) -> _Slot:
        scratch = tempfile.mkdtemp(prefix="jaxrl-reward-worker-")
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_worker_main, name="jaxrl-reward-worker",
                                        args=(child, self._targets, self._cfg, scratch),
                                        daemon=True)
        process.start()
        child.close()  # so the parent sees EOF when the worker dies
        return _Slot(process, parent, scratch)

    def _run(self) -> None:
        while not self._closed:
            try:
                self._step()
            except Exception as error:  # a bug here must not leave every collect() waiting
                log.exception("reward workers: the dispatcher failed")
                self._broken = f"the reward worker dispatcher failed: {error}"
                for slot in self._slots:
                    if slot.job is not None:
                        self._settle(slot.job, failed("reward_error", self._defaults[
                            slot.job.name], detail=self._broken))
                        slot.job = None

    def _step(self) -> None:
        """Assign work, wait for results, deaths or a deadline, and handle them."""
        self._assign()
        waitables = [self._wake_r]
        for slot in self._slots:
            waitables += [slot.conn, slot.process.sentinel]
        ready = set(multiprocessing.connection.wait(waitables, self._wait_s()))
        if self._wake_r in ready:
            self._drain_wake()
        for slot in list(self._slots):
            if slot.conn in ready or slot.process.sentinel in ready:
                self._service(slot, died=slot.process.sentinel in ready)
        self._expire()

    def _wait_s(self) -> float | None:
        deadlines = [slot.job.deadline for slot in self._slots if slot.job is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _assign(self) -> None:
        """Hand queued jobs to idle ready workers (or fail them all once workers cannot start)."""
        assigned, refused = [], []
        with self._lock:
            if self._broken:
                refused, self._queue = list(self._queue), collections.deque()
            for slot in self._slots:
                while slot.ready and slot.job is None and self._queue:
                    job = self._queue.popleft()
                    if job.future.set_running_or_notify_cancel():  # False: cancelled meanwhile
                        job.deadline = time.monotonic() + self.timeout_s
                        slot.job = job
                        assigned.append(slot)
        for job in refused:
            self._settle(job, failed("worker_start_failed", self._defaults[job.name],
                                     detail=self._broken))
        for slot in assigned:
            try:
                slot.conn.send((slot.job.name, slot.job.sample))
            except (OSError, ValueError):
                self._replace(slot, "worker_crashed", "the worker's pipe closed")

    def _service(self, slot: _Slot, died: bool) -> None:
        try:
            while slot.conn.poll():
                kind, payload = slot.conn.recv()
                if kind == "ready":
                    slot.ready = True
                elif kind == "result" and slot.job is not None:
                    self._settle(slot.job, payload)
                    slot.job = None
                elif kind == "error":
                    self._broken = payload
        except (EOFError, OSError):
            died = True
        if died or not slot.process.is_alive():
            self._replace(slot, "worker_crashed", f"exit code {slot.process.exitcode}")

    def _expire(self) -> None:
        now = time.monotonic()
        for slot in list(self._slots):
            if slot.job is not None and now >= slot.job.deadline:
                self._replace(slot, "timeout", f"no result within {self.timeout_s:g} s")

    def _replace(self, slot: _Slot, kind: str, detail: str) -> None:
        """Kill the slot's worker (its job scores the default as `kind`) and start another."""
        if slot.job is not None:
            self._settle(slot.job, failed(kind, self._defaults[slot.job.name], detail=detail))
        elif not slot.ready and not self._broken:
            self._broken = f"a reward worker died while starting ({detail})"
        self._stop(slot)
        index = self._slots.index(slot)
        if self._closed or self._broken:
            self._slots.pop(index)
        else:
            self._slots[index] = self._start()
            self.restarts += 1

    @staticmethod
    def _settle(job: _Job, result: RewardResult) -> None:
        if not job.future.done():
            job.future.set_result(result)

    @staticmethod
    def _stop(slot: _Slot) -> None:
        if slot.process.is_alive():
            slot.process.kill()
        slot.process.join()
        slot.conn.close()
        shutil.rmtree(slot.scratch, ignore_errors=True)

    def close(self) -> None:
        """Stop the workers; jobs not yet scored get failure "pool_closed"."""
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join()
        for slot in self._slots:
            if slot.job is not None:
                self._settle(slot.job, failed("pool_closed", self._defaults[slot.job.name]))
            try:
                slot.conn.send(None)
            except OSError:
                pass
            slot.process.join(timeout=1.0)
            self._stop(slot)
        for job in self._queue:
            self._settle(job, failed("pool_closed", self._defaults[job.name]))
        os.close(self._wake_r)
        os.close(self._wake_w)

"""Reward functions that misbehave on purpose, for the pool tests (built in worker processes from
their `tests.rewards.helpers:NAME` targets)."""
import asyncio
import multiprocessing
import os
import time

from jaxrl.rewards.base import CpuReward, IoReward, RewardResult


class Misbehave(CpuReward):
    """The completion says what to do: hang, crash, raise; anything else scores its length."""
    name = "misbehave"

    def __init__(self, cfg=None):
        del cfg

    def score_one(self, sample):
        if sample.completion == "hang":
            time.sleep(60)
        if sample.completion == "crash":
            os._exit(3)
        if sample.completion == "raise":
            raise ValueError("boom")
        return RewardResult(float(len(sample.completion)), {"length": len(sample.completion)})


class Sleepy(IoReward):
    """Sleeps the seconds a "sleep:X" completion names (else none); "raise" raises."""
    name = "sleepy"

    def __init__(self, cfg=None):
        del cfg
        self.timeout_s = 1.0

    async def ascore(self, sample, run_cpu):
        if sample.completion == "raise":
            raise RuntimeError("judge bug")
        seconds = sample.completion.partition("sleep:")[2]
        await asyncio.sleep(float(seconds or 0))
        return RewardResult(1.0)


class AwaitsRollout(IoReward):
    """Scores 1.0 once `started` (the rollouts begun so far, counted by the test) reaches the
    number its completion names: a sample can then score only if that rollout runs while it is
    being scored; otherwise it times out."""
    name = "awaits_rollout"
    started = 0

    def __init__(self, cfg=None):
        del cfg
        self.timeout_s = 1.0

    async def ascore(self, sample, run_cpu):
        while AwaitsRollout.started < int(sample.completion):
            await asyncio.sleep(0.005)
        return RewardResult(1.0)


class FailsInWorker(Misbehave):
    """Builds in the trainer, fails to build in a worker process."""
    name = "fails_in_worker"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("no GPU driver in the worker")

"""The reward protocol: samples in, one result (value, named components, info) per sample out.

A reward function is CPU-bound (`CpuReward`: scored one sample at a time in worker processes) or
I/O-bound (`IoReward`: a coroutine per sample on the pool's asyncio loop, e.g. an LLM judge).
Both also offer the synchronous batch call `score(samples)` for scripts and tests.

`info` says why a sample scored what it did. Two keys have fixed meanings:
  "error"    a scoring reason that is the completion's fault (no <answer> span, not a number,
             a failing test); the value is the honest score, nothing is counted.
  "failure"  an infrastructure failure (timeout, crashed worker, judge unreachable or invalid
             reply); the value is the function's documented `default` and the pool counts it
             by kind. A composite lists its parts' failures under "failures".
"""
from __future__ import annotations

import asyncio
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from jaxrl.config import ConfigError


class RewardConfigError(ConfigError):
    """A reward set up wrongly or fed a record it cannot verify (unknown verifier kind, a judge
    without a server): a config or data error that stops the run, never a per-sample failure."""


@dataclass(frozen=True)
class Sample:
    """One completion to score: the prompt text the policy saw, its completion, the task record."""
    prompt: str
    completion: str
    record: Mapping = field(default_factory=dict)


@dataclass(frozen=True)
class RewardResult:
    """One sample's reward: `value`, its named `components` and `info` (see the module doc)."""
    value: float
    components: Mapping[str, float] = field(default_factory=dict)
    info: Mapping[str, Any] = field(default_factory=dict)


def failed(kind: str, default: float = 0.0, **info) -> RewardResult:
    """The result of an infrastructure failure of `kind`, scoring `default`."""
    return RewardResult(float(default), {}, {"failure": kind, **info})


def failures_of(result: RewardResult) -> list[str]:
    """The failure kinds a result records (none, one, or a composite's several)."""
    kinds = list(result.info.get("failures", ()))
    if "failure" in result.info:
        kinds.append(result.info["failure"])
    return kinds


def sample_from_record(record: Mapping, completion: str | None = None) -> Sample:
    """A Sample from a task record: the prompt is the record's `prompt` field when present, else
    its system and user messages joined by blank lines; the completion is `completion` or the
    record's `completion` field."""
    prompt = record.get("prompt")
    if not isinstance(prompt, str):
        prompt = "\n\n".join(str(m.get("content", "")) for m in record.get("messages", ())
                             if isinstance(m, Mapping) and m.get("role") in ("system", "user"))
    text = record.get("completion", "") if completion is None else completion
    return Sample(prompt, str(text), record)


_THINK_OPEN = re.compile(r"<think>\s*$")


def completion_text(sample: Sample) -> str:
    """The completion as the model produced it, with the opening <think> restored when the chat
    template put it at the end of the prompt (Qwen3, DeepSeek-R1 distills)."""
    if _THINK_OPEN.search(sample.prompt) and "<think>" not in sample.completion:
        return "<think>" + sample.completion
    return sample.completion


def answer_span(text: str) -> str | None:
    """The text inside the LAST complete <answer>...</answer> span (None when there is none)."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return None if start < 0 else text[start + len("<answer>"):end]


def think_span(text: str) -> str | None:
    """The text inside the first complete <think>...</think> span (None when there is none)."""
    match = re.search(r"<think>(.*?)</think>", text, re.DOTALL)
    return None if match is None else match.group(1)


CpuRunner = Callable[[str, Sample], Awaitable[RewardResult]]
"""`run_cpu(name, sample)`: score one sample with the CPU-bound reward `name` (in the pool: on a
worker process; standalone: on a thread)."""


class RewardFunction(ABC):
    """Base of every reward function; `default` is the value of a failed sample."""
    name: ClassVar[str]
    kind: ClassVar[str]
    default: float = 0.0

    def check(self, sample: Sample) -> None:
        """Raise RewardConfigError when this function cannot score `sample` at all (a data or
        config error); called for every sample when it is submitted."""

    @abstractmethod
    def score(self, samples: Sequence[Sample]) -> list[RewardResult]:
        """One result per sample, in order."""


class CpuReward(RewardFunction):
    """A CPU-bound reward, scored one sample at a time (in the pool: in a worker process, under
    the per-sample limit `rewards.timeout_s`)."""
    kind = "cpu"

    @abstractmethod
    def score_one(self, sample: Sample) -> RewardResult:
        """The result for one sample."""

    def score(self, samples: Sequence[Sample]) -> list[RewardResult]:
        return [self.score_one(sample) for sample in samples]


class IoReward(RewardFunction):
    """An I/O-bound reward: a coroutine per sample (in the pool: on its asyncio loop), given up
    after `timeout_s`."""
    kind = "io"
    timeout_s: float = 60.0

    @abstractmethod
    async def ascore(self, sample: Sample, run_cpu: CpuRunner) -> RewardResult:
        """The result for one sample; CPU-bound parts go through `run_cpu`."""

    def cpu_functions(self) -> Mapping[str, CpuReward]:
        """The registered CPU-bound rewards this one calls through `run_cpu`, by name (the pool
        runs them on its workers; `score` on threads)."""
        return {}

    async def aclose(self) -> None:
        """Release connections; the pool calls it on its loop when it closes."""

    def score(self, samples: Sequence[Sample]) -> list[RewardResult]:
        return asyncio.run(self._score_all(samples))

    async def _score_all(self, samples: Sequence[Sample]) -> list[RewardResult]:
        parts = self.cpu_functions()

        async def run_cpu(name: str, sample: Sample) -> RewardResult:
            return await asyncio.to_thread(parts[name].score_one, sample)

        try:
            return list(await asyncio.gather(*(self.ascore(s, run_cpu) for s in samples)))
        finally:
            await self.aclose()

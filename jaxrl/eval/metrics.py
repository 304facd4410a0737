"""The metrics of one set of completions (a "variant": the base model, an adapter, a file's
outputs), overall ("all") and per task:

    n, correct, accuracy     the task's verifier (the `correctness` reward) on the <answer> span
    accuracy_ci95_low/high   the Wilson score interval at 95%
    spring/...               Spring's table (jaxrl/eval/spring_metrics.py) for formal tasks
                             (verifier kind knk or zebra)
    cedar/...                CEDAR's process metrics (jaxrl/eval/cedar_metrics.py) through the
                             judge, with how many traces were judged and how many failed
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence

from jaxrl.config import Config
from jaxrl.eval import cedar_metrics
from jaxrl.eval.spring_metrics import spring_metrics
from jaxrl.rewards.base import Sample, sample_from_record
from jaxrl.rewards.correctness import Correctness
from jaxrl.rewards.judge import Judge

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
FORMAL_KINDS = ("knk", "zebra")


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion correct / n (nan, nan when n = 0)."""
    if n == 0:
        return math.nan, math.nan
    p, z2 = correct / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, center - half), min(1.0, center + half)


def accuracy(values: Sequence[float]) -> dict[str, float]:
    """n, correct, accuracy and its Wilson 95% interval; a sample is correct when it scores 1."""
    n, correct = len(values), sum(v == 1.0 for v in values)
    low, high = wilson(correct, n)
    return {"n": float(n), "correct": float(correct),
            "accuracy": correct / n if n else math.nan,
            "accuracy_ci95_low": low, "accuracy_ci95_high": high}


def _formal(record: Mapping) -> bool:
    verifier = record.get("verifier")
    return isinstance(verifier, Mapping) and verifier.get("kind") in FORMAL_KINDS


def _spring(cfg: Config, samples: Sequence[Sample]) -> dict[str, float]:
    from jaxrl.rewards.spring import Spring  # imports z3, needed for formal tasks only

    results = Spring(cfg).score(samples)
    rows = [{"components": dict(r.components), "info": dict(r.info)} for r in results]
    return {f"spring/{k}": v for k, v in spring_metrics(rows).items()}


def _part(cfg: Config, samples: Sequence[Sample], correct: Sequence[float],
          judged: Sequence[dict] | None) -> dict[str, float | None]:
    metrics: dict[str, float | None] = dict(accuracy(correct))
    formal = [s for s in samples if _formal(s.record)]
    if formal and len(formal) == len(samples):
        metrics.update(_spring(cfg, formal))
    if judged is not None:
        metrics.update(cedar_metrics.summarize(judged)[0])
    return metrics


def evaluate(cfg: Config, records: Sequence[Mapping], judge: Judge | None = None,
             judged: Callable[[], None] = lambda: None) -> dict:
    """{"all": metrics, "tasks": {task: metrics}, "judge_failures": {metric: {kind: n}},
    "correctness": [value per record]} of records that carry a `completion`; the CEDAR metrics
    only with a judge (`judged` is called as each record's judgements arrive)."""
    samples = [sample_from_record(r) for r in records]
    correct = [r.value for r in Correctness(cfg).score(samples)]
    outcomes = (None if judge is None
                else asyncio.run(cedar_metrics.judge_samples(judge, samples, judged)))
    tasks = sorted({str(r.get("task", "unknown")) for r in records})
    by_task = {}
    for task in tasks:
        rows = [i for i, r in enumerate(records) if str(r.get("task", "unknown")) == task]
        by_task[task] = _part(cfg, [samples[i] for i in rows], [correct[i] for i in rows],
                              None if outcomes is None else [outcomes[i] for i in rows])
    everything = _part(cfg, samples, correct, outcomes) if len(tasks) > 1 else by_task[tasks[0]]
    failures = {} if outcomes is None else cedar_metrics.summarize(outcomes)[1]
    return {"all": everything, "tasks": by_task, "judge_failures": failures,
            "correctness": correct}


def difference(first: Mapping, second: Mapping) -> dict:
    """second - first for every metric both have a number for ("all" and each shared task)."""
    def diff(a: Mapping, b: Mapping) -> dict[str, float]:
        return {k: b[k] - a[k] for k in a if k in b and isinstance(a[k], float)
                and isinstance(b[k], float) and "_ci95_" not in k}

    shared = [t for t in first["tasks"] if t in second["tasks"]]
    return {"all": diff(first["all"], second["all"]),
            "tasks": {t: diff(first["tasks"][t], second["tasks"][t]) for t in shared}}

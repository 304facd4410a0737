"""The `correctness` reward: the LAST complete <answer> span checked against the record's gold
answer by the record's verifier kind. 1.0 correct, 0.0 otherwise (no span: info error
"no_answer_span"). Components: {"correctness": value} plus the verifier's own (python:
"pass_fraction").

Kinds (a record's `verifier` = {"kind": ..., ...}; the registry in jaxrl.rewards maps kinds to
`Verifier`s, so new kinds need no change here):
  exact    normalized exact match (lowercase, whitespace collapsed, surrounding quotes and
           trailing periods stripped)
  label    {"labels": [...]}: like exact; an answer outside the label set scores 0
  set      "1, 3, 4": sets of normalized items split on commas, whitespace and "and"
  numeric  {"tolerance": relative, default 1e-6}: ints, decimals, thousands separators, a/b,
           a sign, an exponent
  mcq      {"choices": ["A", ...]}: "B", "(B)", "B)", "B." or "B. text"
  python   {"entry_point": "transform", "tests": [{"input", "output"}]}: the span holds the
           function's source (Markdown fences stripped); it runs in the sandbox once for all
           tests (5 s by default), outputs compared as JSON values; 1.0 only if all pass.
A record whose kind is unknown or whose gold answer its kind cannot read is a data error
(RewardConfigError), raised when the sample is submitted, not scored as 0.
"""
from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from jaxrl.config import Config
from jaxrl.rewards import VERIFIERS, load_target
from jaxrl.rewards.base import (
    CpuReward,
    RewardConfigError,
    RewardResult,
    Sample,
    answer_span,
)
from jaxrl.rewards.sandbox import SandboxLimits, SandboxResult, run_python


@dataclass(frozen=True)
class VerifySettings:
    """What verifiers may need beyond the record: the sandbox's limits and isolation."""
    sandbox: SandboxLimits = SandboxLimits()
    isolation: str = "auto"


def _no_check(record: Mapping) -> None:
    del record


@dataclass(frozen=True)
class Verifier:
    """`verify(answer, record, settings)` scores a stripped answer span; `check(record)` raises
    RewardConfigError when the record's gold answer or verifier fields are unusable."""
    verify: Callable[[str, Mapping, VerifySettings], RewardResult]
    check: Callable[[Mapping], None] = _no_check


def _data_error(record: Mapping, problem: str) -> RewardConfigError:
    return RewardConfigError(f"task record {record.get('id', '?')!r} ({record.get('task', '?')}): "
                             f"{problem}")


def _result(correct: bool, error: str) -> RewardResult:
    """1.0, or 0.0 with info {"error": error}."""
    return RewardResult(float(correct), {}, {} if correct else {"error": error})


_QUOTES = "\"'`\u201c\u201d\u2018\u2019"


def normalize(text: str) -> str:
    """Lowercase, collapse whitespace, strip surrounding quotes and trailing periods."""
    text, previous = " ".join(str(text).lower().split()), None
    while text != previous:
        previous = text
        text = text.rstrip(".").strip()
        if len(text) >= 2 and text[0] in _QUOTES and text[-1] in _QUOTES:
            text = text[1:-1].strip()
    return text


def _verify_exact(answer: str, record: Mapping, settings: VerifySettings) -> RewardResult:
    return _result(normalize(answer) == normalize(record["answer"]), "wrong_answer")


def _labels(record: Mapping) -> set[str]:
    labels = record.get("verifier", {}).get("labels")
    if not isinstance(labels, list) or not labels:
        raise _data_error(record, "a 'label' verifier needs a non-empty list 'labels'")
    return {normalize(label) for label in labels}


def _check_label(record: Mapping) -> None:
    if normalize(record.get("answer", "")) not in _labels(record):
        raise _data_error(record, f"gold answer {record.get('answer')!r} is not one of the labels")


def _verify_label(answer: str, record: Mapping, settings: VerifySettings) -> RewardResult:
    if normalize(answer) not in _labels(record):
        return _result(False, "not_a_label")
    return _verify_exact(answer, record, settings)


def items(text: str) -> frozenset[str]:
    """The normalized items of a list like "1, 3 and 4"."""
    parts = re.split(r"[,;\s]+|\band\b", normalize(text))
    return frozenset(p.strip("[](){}.") for p in parts if p.strip("[](){}."))


def _verify_set(answer: str, record: Mapping, settings: VerifySettings) -> RewardResult:
    return _result(items(answer) == items(record["answer"]), "wrong_answer")


_DECIMAL = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+"
_NUMBER = re.compile(rf"([+-]?)\s*({_DECIMAL})(?:[eE]([+-]?\d+))?")
_FRACTION = re.compile(r"([+-]?)\s*(\d+)\s*/\s*(\d+)")


def parse_number(text: str) -> float | None:
    """A number written as an int, a decimal (thousands separators allowed), a fraction a/b,
    with an optional sign and exponent; None when `text` is none of these."""
    text = str(text).strip().rstrip(".").strip()
    if match := _FRACTION.fullmatch(text):
        sign, num, den = match.groups()
        value = int(num) / int(den) if int(den) else None
    elif match := _NUMBER.fullmatch(text):
        sign, digits, exponent = match.groups()
        value = float(digits.replace(",", "") + (f"e{exponent}" if exponent else ""))
    else:
        return None
    return None if value is None else -value if sign == "-" else value


def _tolerance(record: Mapping) -> float:
    tolerance = record.get("verifier", {}).get("tolerance", 1e-6)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0:
        raise _data_error(record, f"numeric tolerance must be a number >= 0; got {tolerance!r}")
    return float(tolerance)


def _check_numeric(record: Mapping) -> None:
    _tolerance(record)
    if parse_number(record.get("answer", "")) is None:
        raise _data_error(record, f"gold answer {record.get('answer')!r} is not a number")


def _verify_numeric(answer: str, record: Mapping, settings: VerifySettings) -> RewardResult:
    value, gold = parse_number(answer), parse_number(record["answer"])
    if value is None:
        return _result(False, "not_a_number")
    tol = _tolerance(record)
    return _result(math.isclose(value, gold, rel_tol=tol, abs_tol=0.0 if gold else tol),
                   "wrong_answer")


def _choices(record: Mapping) -> list[str]:
    choices = record.get("verifier", {}).get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c.strip()
                                                              for c in choices):
        raise _data_error(record, "an 'mcq' verifier needs a non-empty list of strings 'choices'")
    return choices


def choice_of(text: str, choices: list[str]) -> str | None:
    """The choice `text` names ("B", "(B)", "B)", "B." or "B. text"), or None."""
    names = "|".join(sorted(map(re.escape, choices), key=len, reverse=True))
    pattern = rf"\(\s*({names})\s*\)(?:\s.*)?|({names})(?:[.):](?:\s.*)?)?"
    match = re.fullmatch(pattern, str(text).strip(), re.DOTALL | re.IGNORECASE)
    if match is None:
        return None
    picked = (match.group(1) or match.group(2)).upper()
    return next(c for c in choices if c.upper() == picked)


def _check_mcq(record: Mapping) -> None:
    if choice_of(record.get("answer", ""), _choices(record)) is None:
        raise _data_error(record, f"gold answer {record.get('answer')!r} is not one of the choices")


def _verify_mcq(answer: str, record: Mapping, settings: VerifySettings) -> RewardResult:
    choices = _choices(record)
    picked = choice_of(answer, choices)
    if picked is None:
        return _result(False, "not_a_choice")
    return _result(picked == choice_of(record["answer"], choices), "wrong_answer")


EXACT = Verifier(_verify_exact)
LABEL = Verifier(_verify_label, _check_label)
SET = Verifier(_verify_set)
NUMERIC = Verifier(_verify_numeric, _check_numeric)
MCQ = Verifier(_verify_mcq, _check_mcq)


def strip_fences(text: str) -> str:
    """The code inside the first Markdown fence of `text` (the text itself when unfenced)."""
    match = re.search(r"```[^\n`]*\n(.*?)(?:```|\Z)", text, re.DOTALL)
    return (match.group(1) if match else text).strip("\n")


def json_equal(a, b) -> bool:
    """Equality of JSON values: numbers by value, but true is not 1 and "1" is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(json_equal, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _tests(record: Mapping) -> tuple[str, list[dict]]:
    spec = record.get("verifier", {})
    entry, tests = spec.get("entry_point", "transform"), spec.get("tests")
    if not isinstance(entry, str) or not entry.isidentifier():
        raise _data_error(record, f"python entry_point must be an identifier; got {entry!r}")
    if (not isinstance(tests, list) or not tests
            or not all(isinstance(t, dict) and {"input", "output"} <= t.keys() for t in tests)):
        raise _data_error(record, "a 'python' verifier needs a non-empty list 'tests' of "
                          "{\"input\": ..., \"output\": ...}")
    return entry, tests


def _passed(output: dict, expected) -> bool:
    try:
        return "ok" in output and json_equal(json.loads(output["ok"]), expected)
    except (TypeError, ValueError):
        return False


def passed_tests(run: SandboxResult, tests: list[dict]) -> list[bool]:
    """Whether each test passed in a sandbox run of the answer (all False unless it ran)."""
    return [run.status == "ok" and i < len(run.outputs) and _passed(run.outputs[i], t["output"])
            for i, t in enumerate(tests)]


def _verify_python(answer: str, record: Mapping, settings: VerifySettings) -> RewardResult:
    entry, tests = _tests(record)
    run = run_python(strip_fences(answer), entry, tuple(t["input"] for t in tests),
                     settings.sandbox, settings.isolation)
    passed = passed_tests(run, tests)
    info = {"sandbox": run.status, "seconds": round(run.duration_s, 3)}
    if run.status == "sandbox_error":
        info["failure"] = "sandbox_error"
    if not all(passed):
        first = passed.index(False)
        detail = run.outputs[first].get("error", "") if first < len(run.outputs) else run.error
        info.update(error="tests_failed" if run.status == "ok" else f"code_{run.status}",
                    first_failed=first, detail=str(detail)[:300])
    return RewardResult(float(all(passed)), {"pass_fraction": sum(passed) / len(tests)}, info)


def _check_python(record: Mapping) -> None:
    _tests(record)


PYTHON = Verifier(_verify_python, _check_python)


@functools.cache
def _load(target: str) -> Verifier:
    return load_target(target)


def verifier_for(record: Mapping) -> Verifier:
    """The record's verifier; RewardConfigError when the kind is missing or unknown."""
    spec = record.get("verifier")
    kind = spec.get("kind") if isinstance(spec, Mapping) else None
    if kind not in VERIFIERS:
        raise _data_error(record, f"unknown verifier kind {kind!r}; known kinds: "
                          f"{', '.join(sorted(VERIFIERS))}")
    return _load(VERIFIERS[kind])


class Correctness(CpuReward):
    """The correctness reward (see the module doc); scores 0.0..1.0."""
    name = "correctness"

    def __init__(self, cfg: Config | None = None, isolation: str = "auto"):
        cfg = cfg or Config()
        seconds = cfg.rewards.sandbox_timeout_s
        self.settings = VerifySettings(SandboxLimits(wall_s=seconds, cpu_s=seconds), isolation)

    def check(self, sample: Sample) -> None:
        verifier = verifier_for(sample.record)
        if "answer" not in sample.record:
            raise _data_error(sample.record, "has no gold 'answer'")
        verifier.check(sample.record)

    def score_one(self, sample: Sample) -> RewardResult:
        self.check(sample)
        answer = answer_span(sample.completion)
        if answer is None:
            return RewardResult(0.0, {"correctness": 0.0}, {"error": "no_answer_span"})
        result = verifier_for(sample.record).verify(answer.strip(), sample.record, self.settings)
        return RewardResult(result.value, {"correctness": result.value, **result.components},
                            result.info)

"""The `spring` reward: Spring's solver-guided process reward (arXiv 2609.34660, Sec. 3).

    R = r_base                                            when s_sat = 0
    R = r_base + (0.5 + 0.5 r_accuracy) r_proc            when s_sat = 1
    r_base = 0.15 r_parsed + 0.10 r_format + 0.60 r_accuracy
    r_proc = 0.40 r_novel + 0.30 r_consistency - 0.15 r_contra

Range [-0.075, 1.55]. The completion writes premises and steps in the block format of
jaxrl.logic.sexpr inside <think>, then the answer in <answer>; the record's verifier (kind knk
or zebra, jaxrl.rewards.puzzles) carries the task theory (vocabulary and Gamma_dom).

Components (all logged, all written by `jaxrl score`):
  parsed       parsed forms / forms found (premises and steps; a step whose solver check came
               back unknown counts as unparsed); 0 when there is no form
  format       1 when the completion is <think>...</think><answer>...</answer> and its answer
               reads in the task's answer format
  accuracy     puzzle accuracy from the task's verifier (1 only when every person / cell is
               right; person / cell accuracy goes to info["answer"])
  s_sat        1 when Gamma_dom + parsed premises has exactly one solution
  novel        novel steps / parsed steps                     (0 when s_sat = 0)
  contra       contradictory steps / parsed steps             (0 when s_sat = 0)
  consistency  1 when Gamma_dom + parsed steps + answer is satisfiable (0 when s_sat = 0)
Per parsed step, novel and contra lie in [0, 1] whatever the trace length, so a long trace of
restatements cannot collect more than a short one of real deductions (the paper rewards the
density of novel deductions and its Spring traces are the shortest), and unparsed steps are
charged once, through `parsed`, not again in the step ratios.
info: base (why s_sat), steps (count of each verdict), verdicts (in order), errors (why forms did
not parse), answer (the verifier's components), error (no_answer_span / no_formal_forms).
"""
from __future__ import annotations

from collections.abc import Mapping

from jaxrl.config import Config
from jaxrl.logic.sexpr import Limits, extract
from jaxrl.logic.step_checker import VERDICTS, CheckResult, StepChecker
from jaxrl.logic.z3_theory import TheoryError, theory_for
from jaxrl.rewards.base import (
    CpuReward,
    RewardConfigError,
    RewardResult,
    Sample,
    answer_span,
    completion_text,
    think_span,
)
from jaxrl.rewards.correctness import VerifySettings, verifier_for
from jaxrl.rewards.format import well_formed
from jaxrl.rewards.puzzles import ANSWER_EXPRS

COMPONENTS = ("parsed", "format", "accuracy", "s_sat", "novel", "consistency", "contra")


def spring_reward(c: Mapping[str, float]) -> float:
    """R from the components (see the module doc)."""
    base = 0.15 * c["parsed"] + 0.10 * c["format"] + 0.60 * c["accuracy"]
    if not c["s_sat"]:
        return base
    process = 0.40 * c["novel"] + 0.30 * c["consistency"] - 0.15 * c["contra"]
    return base + (0.5 + 0.5 * c["accuracy"]) * process


def reasoning_text(text: str) -> str:
    """Where formal forms are read: the <think> span, else everything before the last
    <answer> (the answer itself never counts as reasoning)."""
    think = think_span(text)
    if think is not None:
        return think
    end = text.rfind("<answer>")
    return text if end < 0 else text[:end]


def components_of(check: CheckResult, forms: int, formatted: bool,
                  accuracy: float) -> dict[str, float]:
    """The seven components (module doc); `forms` counts every form found, read or not."""
    counts = check.counts
    parsed = check.premises_parsed + check.steps_parsed
    per_step = max(1, check.steps_parsed)
    sat = check.s_sat
    return {"parsed": parsed / forms if forms else 0.0, "format": float(formatted),
            "accuracy": accuracy, "s_sat": float(sat),
            "novel": counts["novel"] / per_step if sat else 0.0,
            "consistency": float(sat and check.consistent),
            "contra": counts["contradictory"] / per_step if sat else 0.0}


class Spring(CpuReward):
    """Spring's process reward (see the module doc)."""
    name = "spring"

    def __init__(self, cfg: Config | None = None, limits: Limits = Limits()):
        cfg = cfg or Config()
        # leave the pool's per-sample limit headroom: a trace out of budget scores, never hangs
        self.budget_s = 0.6 * cfg.rewards.timeout_s
        self.check_ms = int(min(1000.0, 1000 * self.budget_s))
        self.limits = limits
        self.settings = VerifySettings()

    def check(self, sample: Sample) -> None:
        record = sample.record
        spec = record.get("verifier")
        kind = spec.get("kind") if isinstance(spec, Mapping) else None
        if kind not in ANSWER_EXPRS:
            raise RewardConfigError(
                f"task record {record.get('id', '?')!r}: the spring reward needs a puzzle "
                f"record with a formal theory (verifier kind {' or '.join(ANSWER_EXPRS)}); got "
                f"kind {kind!r}")
        verifier_for(record).check(record)
        try:
            theory_for(spec.get("theory"))
        except TheoryError as error:
            raise RewardConfigError(f"task record {record.get('id', '?')!r}: verifier "
                                    f"'theory' is unusable: {error}") from None

    def score_one(self, sample: Sample) -> RewardResult:
        self.check(sample)
        record, text = sample.record, completion_text(sample)
        theory = theory_for(record["verifier"]["theory"])
        trace = extract(reasoning_text(text), self.limits)
        answer = answer_span(text)
        info: dict = {}
        accuracy, exprs, formatted = 0.0, None, False
        if answer is None:
            info["error"] = "no_answer_span"
        else:
            verdict = verifier_for(record).verify(answer.strip(), record, self.settings)
            accuracy, info["answer"] = verdict.value, dict(verdict.components)
            exprs = ANSWER_EXPRS[record["verifier"]["kind"]](answer, record)
            formatted = well_formed(text) and bool(exprs)
        if not trace.forms:
            info.setdefault("error", "no_formal_forms")
        check = StepChecker(theory, self.check_ms, self.budget_s).check(trace, exprs)
        components = components_of(check, trace.forms, formatted, accuracy)
        counts = check.counts
        info.update(base=check.base, steps={v: counts[v] for v in VERDICTS},
                    verdicts=[s.verdict for s in check.steps], errors=list(check.errors))
        return RewardResult(spring_reward(components), components, info)

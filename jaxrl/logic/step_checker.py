"""Spring's step checker (arXiv 2609.34660, Sec. "Key designs" 1 and 2): the base theory gate
and the classification of every formal step by what Z3 says about it.

Gate. Gamma_base = Gamma_dom + the parsed premises. s_sat = 1 when Gamma_base is satisfiable and
its solution is unique over the task's symbols (every constant and ground predicate atom); else
0, with `base` saying why: "no_premises", "unsat", "multiple" or "unknown" (solver gave up).

Steps (judged only when s_sat = 1), in order, with P the accepted steps so far:
  contradictory  Gamma_base + P + {z} is unsatisfiable; z is rejected (never joins P)
  tautological   valid and Gamma_dom + {not z} is unsatisfiable (true by the rules alone);
                 removed (never joins P)
  novel          valid, not tautological, Gamma_dom + P + {not z} satisfiable (not entailed
                 by the earlier accepted steps), and not equivalent under Gamma_dom to any
                 single parsed premise
  redundant      valid but entailed by P, or a restated premise (joins P)
  unparsed       no meaning in the theory, or a solver check ran out of time ("unknown")
  unchecked      parsed, but s_sat = 0: there is nothing to judge it against
Valid means Gamma_base + {z} satisfiable and Gamma_base + {not z} unsatisfiable. With a unique
solution s, every accepted step is true in s, so Gamma_base + P has exactly the models of s and
both "valid" and "not contradictory" reduce to "z is true in s": one model evaluation, no
solver call. The other checks run incrementally (push / pop) on two solvers, Gamma_dom and
Gamma_dom + P, each check under `check_ms`, the whole trace under `budget_s`; steps left when
the budget runs out are unparsed ("budget").

Consistency (r_consistency): Gamma_dom + every parsed step + the formalized final answer F is
satisfiable; False when there is no parsed step or no F.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import z3

from jaxrl.logic.sexpr import Form, FormalTrace
from jaxrl.logic.z3_theory import FormalError, Theory

VERDICTS = ("novel", "redundant", "tautological", "contradictory", "unparsed", "unchecked")
VALID = ("novel", "redundant", "tautological")


class _Unknown(Exception):
    """A solver check that returned unknown (timeout) or ran past the trace's budget."""


@dataclass(frozen=True)
class StepResult:
    label: str
    verdict: str  # one of VERDICTS; "unchecked": parsed, but s_sat = 0 so not judged
    detail: str = ""


@dataclass(frozen=True)
class CheckResult:
    premises_total: int
    premises_parsed: int
    base: str  # "unique", "no_premises", "unsat", "multiple" or "unknown"
    steps: tuple[StepResult, ...]
    consistent: bool
    errors: tuple[str, ...]  # why forms did not parse (the first few)

    @property
    def s_sat(self) -> bool:
        return self.base == "unique"

    @property
    def counts(self) -> Counter:
        return Counter(step.verdict for step in self.steps)

    @property
    def steps_parsed(self) -> int:
        return sum(step.verdict != "unparsed" for step in self.steps)


def unique_model(solver: z3.Solver, symbols: Sequence) -> tuple[str, z3.ModelRef | None]:
    """("unique", model), ("unsat" | "multiple" | "unknown", None) for what `solver` holds.
    The solver is left as it was."""
    first = solver.check()
    if first != z3.sat:
        return ("unsat" if first == z3.unsat else "unknown"), None
    model = solver.model()
    solver.push()
    solver.add(z3.Or([sym != model.eval(sym, model_completion=True) for sym in symbols]))
    second = solver.check()
    solver.pop()
    if second == z3.unsat:
        return "unique", model
    return ("multiple" if second == z3.sat else "unknown"), None


class _Clock:
    def __init__(self, check_ms: int, budget_s: float):
        self.check_ms = check_ms
        self.deadline = time.monotonic() + budget_s

    def ms(self) -> int:
        """The time one check may take now; _Unknown once the budget is spent."""
        left = int((self.deadline - time.monotonic()) * 1000)
        if left <= 0:
            raise _Unknown("budget")
        return min(self.check_ms, left)

    def solver(self, theory: Theory, *formulas) -> z3.Solver:
        solver = z3.Solver(ctx=theory.ctx)
        solver.set("timeout", self.check_ms)
        solver.add(*theory.domain, *formulas)
        return solver

    def entails(self, solver: z3.Solver, formula) -> bool:
        """Whether what `solver` holds entails `formula` (an unsat check of its negation)."""
        solver.set("timeout", self.ms())
        solver.push()
        solver.add(z3.Not(formula))
        result = solver.check()
        solver.pop()
        if result == z3.unknown:
            raise _Unknown("solver unknown")
        return result == z3.unsat


def _build(theory: Theory, forms: Sequence[Form], errors: list[str]) -> list:
    """The z3 formula of each form (None for one that has no meaning; its reason in errors)."""
    built = []
    for form in forms:
        formula, reason = None, form.error
        if form.expr is not None:
            try:
                formula = theory.formula(form.expr)
            except FormalError as error:
                reason = str(error)
        if formula is None and len(errors) < 5:
            errors.append(f"{form.kind} {form.label}: {reason}"[:200])
        built.append(formula)
    return built


class StepChecker:
    """Checks traces against one task theory; `check_ms` bounds one solver check and
    `budget_s` one whole trace."""

    def __init__(self, theory: Theory, check_ms: int = 1000, budget_s: float = 5.0):
        self.theory = theory
        self.check_ms = check_ms
        self.budget_s = budget_s

    def check(self, trace: FormalTrace, answer: Sequence | None = None) -> CheckResult:
        """Gate, classify and check consistency (see the module doc); `answer` is the final
        answer as read formal expressions (None when the answer span did not read)."""
        clock = _Clock(self.check_ms, self.budget_s)
        errors: list[str] = []
        premises = [(form.label, p) for form, p in zip(
            trace.premises, _build(self.theory, trace.premises, errors)) if p is not None]
        steps = _build(self.theory, trace.steps, errors)
        base, model = self._gate(clock, premises)
        if model is None:
            results = tuple(StepResult(f.label, "unparsed" if z is None else "unchecked")
                            for f, z in zip(trace.steps, steps))
            return CheckResult(len(trace.premises), len(premises), base, results, False,
                               tuple(errors))
        results = self._classify(clock, model, premises, trace.steps, steps)
        parsed = [z for z, r in zip(steps, results) if r.verdict != "unparsed"]
        consistent = self._consistent(clock, parsed, answer)
        return CheckResult(len(trace.premises), len(premises), base, results, consistent,
                           tuple(errors))

    def _gate(self, clock: _Clock, premises: list[tuple]) -> tuple[str, z3.ModelRef | None]:
        """(base status, the unique model or None); premises are (label, formula) pairs."""
        if not premises:
            return "no_premises", None
        solver = clock.solver(self.theory, *(p for _, p in premises))
        try:
            solver.set("timeout", clock.ms())
        except _Unknown:
            return "unknown", None
        return unique_model(solver, self.theory.symbols)

    def _classify(self, clock: _Clock, model: z3.ModelRef, premises: list[tuple],
                  forms: Sequence[Form], steps: list) -> tuple[StepResult, ...]:
        dom, accepted = clock.solver(self.theory), clock.solver(self.theory)
        results = []
        for form, step in zip(forms, steps):
            if step is None:
                results.append(StepResult(form.label, "unparsed", "no meaning in the theory"))
                continue
            try:
                verdict, detail = self._verdict(clock, model, premises, dom, accepted, step)
            except _Unknown as why:
                verdict, detail = "unparsed", str(why)
            if verdict in ("novel", "redundant"):
                accepted.add(step)
            results.append(StepResult(form.label, verdict, detail))
        return tuple(results)

    @staticmethod
    def _verdict(clock: _Clock, model: z3.ModelRef, premises: list[tuple], dom: z3.Solver,
                 accepted: z3.Solver, step) -> tuple[str, str]:
        if not z3.is_true(model.eval(step, model_completion=True)):
            return "contradictory", "false in the unique solution"
        if clock.entails(dom, step):
            return "tautological", "follows from the domain rules alone"
        if clock.entails(accepted, step):
            return "redundant", "entailed by earlier accepted steps"
        for label, premise in premises:
            if clock.entails(dom, step == premise):
                return "redundant", f"equivalent to premise {label}"
        return "novel", ""

    def _consistent(self, clock: _Clock, steps: list, answer: Sequence | None) -> bool:
        if not steps or not answer:
            return False
        try:
            formulas = [self.theory.formula(expr) for expr in answer]
            solver = clock.solver(self.theory, *steps, *formulas)
            solver.set("timeout", clock.ms())
        except (FormalError, _Unknown):
            return False
        return solver.check() == z3.sat

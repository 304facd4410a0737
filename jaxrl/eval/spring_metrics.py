"""Spring's evaluation metrics (arXiv 2609.34660, main table and ablation) over completions
scored by the `spring` reward, e.g. the lines `jaxrl score --reward spring` writes:

    puzzle_accuracy              share of completions whose answer is entirely right
    cell_accuracy                mean share of right cells (Zebra records)
    person_accuracy              mean share of right roles (Knights and Knaves records)
    sat_rate                     share with s_sat = 1 (premises SAT with a unique solution)
    parse_rate                   mean share of a completion's formal forms that parsed (the
                                 `parsed` component; 0 for a completion with no form)
    steps                        mean parsed steps per completion
    novel_steps                  mean novel steps per completion
    valid_per_parsed             valid steps (novel, redundant, tautological) / classified steps
    contradictions_per_100_steps 100 x contradictory steps / classified steps
Classified steps are the parsed steps of completions with s_sat = 1 (only those are judged).
Every metric is also given for solved (puzzle right) and failed completions, prefixed
"solved/" and "failed/", as in the paper's ablation table. AR-LSAT is scored by `correctness`;
its accuracy is the puzzle accuracy of that reward.

    python -m jaxrl.eval.spring_metrics scored.jsonl
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from jaxrl.logic.step_checker import VALID


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _ratio(num: float, den: float, scale: float = 1.0) -> float:
    return scale * num / den if den else float("nan")


def summarize(results: Iterable[Mapping]) -> dict[str, float]:
    """The metrics (module doc) of results shaped {"components": {...}, "info": {...}}."""
    rows = list(results)
    metrics = {"n": float(len(rows)),
               "puzzle_accuracy": _mean([r["components"]["accuracy"] for r in rows]),
               "sat_rate": _mean([r["components"]["s_sat"] for r in rows]),
               "parse_rate": _mean([r["components"]["parsed"] for r in rows])}
    for name in ("cell_accuracy", "person_accuracy"):
        values = [r["info"]["answer"][name] for r in rows if name in r["info"].get("answer", {})]
        if values:
            metrics[name] = _mean(values)
    verdicts = [r["info"].get("verdicts", []) for r in rows]
    metrics["steps"] = _mean([sum(v != "unparsed" for v in vs) for vs in verdicts])
    metrics["novel_steps"] = _mean([sum(v == "novel" for v in vs) for vs in verdicts])
    judged = [v for r, vs in zip(rows, verdicts) if r["components"]["s_sat"] for v in vs
              if v != "unparsed"]
    metrics["valid_per_parsed"] = _ratio(sum(v in VALID for v in judged), len(judged))
    metrics["contradictions_per_100_steps"] = _ratio(
        sum(v == "contradictory" for v in judged), len(judged), 100.0)
    return metrics


def spring_metrics(results: Iterable[Mapping]) -> dict[str, float]:
    """summarize() over all results, and over the solved and the failed ones."""
    rows = list(results)
    metrics = summarize(rows)
    for label, keep in (("solved", 1.0), ("failed", 0.0)):
        part = [r for r in rows if (r["components"]["accuracy"] == 1.0) == bool(keep)]
        if part:
            metrics.update({f"{label}/{k}": v for k, v in summarize(part).items()})
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m jaxrl.eval.spring_metrics SCORED.jsonl", file=sys.stderr)
        return 2
    lines = Path(args[0]).read_text(encoding="utf-8").splitlines()
    metrics = spring_metrics(json.loads(line) for line in lines if line.strip())
    for name, value in metrics.items():
        print(f"{name:<40} {value:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

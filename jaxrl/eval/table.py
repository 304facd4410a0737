"""The results of `jaxrl eval` as a plain-text table: one block per scope (all tasks, then each
task), one row per metric, one column per variant, and the difference when there are two."""
from __future__ import annotations

import math
from collections.abc import Mapping

_HIDDEN = ("correct", "calls", "valid_calls")  # and every interval bound (shown beside its metric)


def _number(value, count: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.0f}" if count else f"{value:.3f}"


def _is_count(key: str) -> bool:
    return key == "n" or key.endswith("/n")


def _cell(metrics: Mapping, key: str) -> str:
    if key not in metrics:
        return ""
    text = _number(metrics[key], _is_count(key))
    if f"{key}_ci95_low" in metrics:
        low, high = metrics[f"{key}_ci95_low"], metrics[f"{key}_ci95_high"]
        text += f" [{_number(low)}, {_number(high)}]"
    failed = metrics.get(f"{key}/failed") or 0
    return text + (f" ({failed:.0f} failed)" if failed else "")


def _keys(blocks: list[Mapping]) -> list[str]:
    keys: list[str] = []
    for metrics in blocks:
        keys += [k for k in metrics if k not in keys and k not in _HIDDEN
                 and not k.endswith(("/judged", "/failed", "_ci95_low", "_ci95_high"))]
    return keys


def _scope_rows(variants: list[Mapping], diff: Mapping | None) -> list[list[str]]:
    rows = []
    for key in _keys(variants):
        row = [key] + [_cell(m, key) for m in variants]
        if diff is not None:
            row.append(f"{diff[key]:+.3f}" if key in diff and not _is_count(key) else "")
        rows.append(row)
    return rows


def format_table(doc: Mapping) -> str:
    names = list(doc["variants"])
    diff = doc.get("difference")
    header = ["metric", *names] + (["difference"] if diff else [])
    tasks = sorted({t for v in doc["variants"].values() for t in v["tasks"]})
    scopes = [("all", "all tasks")] if len(tasks) > 1 else []
    blocks = []
    for scope, title in scopes + [(t, f"task {t}") for t in tasks]:
        variants = [doc["variants"][n]["all"] if scope == "all"
                    else doc["variants"][n]["tasks"].get(scope, {}) for n in names]
        scope_diff = None if diff is None else (
            diff["all"] if scope == "all" else diff["tasks"].get(scope, {}))
        blocks.append((title, _scope_rows(variants, scope_diff)))
    rows = [header] + [r for _, block in blocks for r in block]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    out = [line(header)]
    for title, block in blocks:
        out += [f"-- {title}"] + [line(r) for r in block]
    return "\n".join(out)

"""A picture of the causal graph: columns of signals, hypotheses by level, and evidence.

The layout is computed here (columns by kind and level, nodes spread evenly in each column), so
no graph-layout library is needed. Pruned hypotheses are drawn faded; the belief path (the
report's chain of hypotheses) has a thick outline.
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

_COLORS = {"signal": "#f4d35e", "evidence": "#9bc1bc", "hypothesis": "#ee964b"}
_EDGE_COLORS = {"support": "#2a9d8f", "refute": "#d62828", "refines": "#555555",
                "causal": "#457b9d"}


def _column(node: dict[str, Any], depth: int) -> int:
    if node["kind"] == "signal":
        return 0
    return 1 + node["level"] if node["kind"] == "hypothesis" else depth + 1


def layout(graph: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """(x, y) of each node: x by column, y spread over [0, 1] within the column."""
    depth = 1 + max((n["level"] for n in graph["nodes"] if n["kind"] == "hypothesis"),
                    default=0)
    columns: dict[int, list[str]] = {}
    for node in graph["nodes"]:
        columns.setdefault(_column(node, depth), []).append(node["id"])
    return {node_id: (float(x), 1.0 - (i + 0.5) / len(ids))
            for x, ids in columns.items() for i, node_id in enumerate(ids)}


def render(graph: dict[str, Any], path: list[str], out: str | Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = layout(graph)
    rows = max([sum(1 for p in pos.values() if p[0] == x) for x, _ in pos.values()] or [1])
    fig, ax = plt.subplots(figsize=(4 * (1 + max((p[0] for p in pos.values()), default=0)),
                                    max(4.0, 1.4 * rows)))
    for edge in graph["edges"]:
        (x0, y0), (x1, y1) = pos[edge["src"]], pos[edge["dst"]]
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops={
            "arrowstyle": "->", "color": _EDGE_COLORS[edge["kind"]], "lw": 1.2, "shrinkA": 18,
            "shrinkB": 18, "connectionstyle": "arc3,rad=0.08"})
    for node in graph["nodes"]:
        x, y = pos[node["id"]]
        text = textwrap.fill(f"{node['id']}: " + textwrap.shorten(node["label"], 60,
                                                                   placeholder="..."), 28)
        if node["kind"] == "hypothesis":
            support = sum(1 for e in graph["edges"]
                          if e["kind"] == "support" and e["dst"] == node["id"])
            text += f"\nconfidence {node['confidence']:.2f}, support {support}"
        ax.text(x, y, text, ha="center", va="center", fontsize=7,
                alpha=0.35 if node["status"] == "pruned" else 1.0,
                bbox={"boxstyle": "round", "fc": _COLORS[node["kind"]],
                      "lw": 2.5 if node["id"] in path else 0.5})
    for kind, color in _EDGE_COLORS.items():
        ax.plot([], [], color=color, label=kind)
    ax.legend(loc="lower right", fontsize=7, frameon=False)
    ax.set_xlim(-0.6, max((p[0] for p in pos.values()), default=0) + 0.6)
    ax.set_ylim(-0.05, 1.05)
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)

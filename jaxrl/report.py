"""report.png: reward, completion length, KL and timing curves from metrics.jsonl, and the
held-out accuracy with its Wilson 95% interval where the run evaluated (eval.every)."""
from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    ("reward", ("reward/mean",), "reward/std"),
    ("completion length (tokens)", ("completion/length_mean", "completion/length_max"), None),
    ("KL to reference", ("loss/kl",), None),
    ("seconds per step", ("time/rollout", "time/reward_wait", "time/update", "time/step"), None),
)
EVAL_PANEL = ("held-out accuracy (95% interval)", ("eval/accuracy",),
              ("eval/accuracy_ci95_low", "eval/accuracy_ci95_high"))


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl; a torn last line (a run killed mid-write) is skipped."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _panel(ax, rows, title, keys, band):
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if not pts:
            continue
        steps, values = zip(*pts)
        ax.plot(steps, values, label=key.split("/")[-1], marker="o" if len(pts) < 20 else None)
        if isinstance(band, tuple):  # (low, high) keys
            low = [r.get(band[0], v) for r, v in zip([r for r in rows if key in r], values)]
            high = [r.get(band[1], v) for r, v in zip([r for r in rows if key in r], values)]
            ax.fill_between(steps, low, high, alpha=0.2)
        elif band and band in rows[0]:
            spread = [r.get(band, 0.0) for r in rows if key in r]
            ax.fill_between(steps, [v - s for v, s in zip(values, spread)],
                            [v + s for v, s in zip(values, spread)], alpha=0.2)
    ax.set_title(title)
    ax.set_xlabel("step")
    if len(keys) > 1 and ax.get_lines():
        ax.legend(fontsize="small")


def write_report(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Plots the curves of metrics.jsonl into a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    panels = PANELS + ((EVAL_PANEL,) if any("eval/accuracy" in r for r in rows) else ())
    fig, axes = plt.subplots(2, 3 if len(panels) > 4 else 2,
                             figsize=(16 if len(panels) > 4 else 11, 7))
    for ax, (title, keys, band) in zip(axes.flat, panels):
        _panel(ax, rows, title, keys, band)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{Path(metrics_path).parent.name}: {len(rows)} steps")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return Path(out_path)

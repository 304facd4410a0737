"""report.png: reward, completion length, KL and timing curves from metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    ("reward", ("reward/mean",), "reward/std"),
    ("completion length (tokens)", ("completion/length_mean", "completion/length_max"), None),
    ("KL to reference", ("loss/kl",), None),
    ("seconds per step", ("time/rollout", "time/reward_wait", "time/update", "time/step"), None),
)


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
        ax.plot(steps, values, label=key.split("/")[-1])
        if band and band in rows[0]:
            spread = [r.get(band, 0.0) for r in rows if key in r]
            ax.fill_between(steps, [v - s for v, s in zip(values, spread)],
                            [v + s for v, s in zip(values, spread)], alpha=0.2)
    ax.set_title(title)
    ax.set_xlabel("step")
    if len(keys) > 1:
        ax.legend(fontsize="small")


def write_report(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Plots the curves of metrics.jsonl into a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, keys, band) in zip(axes.flat, PANELS):
        _panel(ax, rows, title, keys, band)
    fig.suptitle(f"{Path(metrics_path).parent.name}: {len(rows)} steps")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return Path(out_path)

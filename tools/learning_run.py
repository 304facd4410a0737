"""Does GRPO improve the model? Train with `jaxrl train`, then evaluate base and adapter on the
held-out split with `jaxrl eval --compare`, and draw the results.

Each run NAME trains into OUT/NAME (config.yaml, metrics.jsonl, adapter/, report.png), evaluates
at temperature 0 on the validation split of the same tasks (records never trained on) into
OUT/NAME/eval.json, and writes OUT/NAME/summary.md (per-task held-out accuracy of base and adapter
with Wilson 95% intervals) plus two plots: accuracy.png (before / after per task) and
rewards.png (training reward per step, total and per reward function). A multi-turn run
(data.env) is evaluated as greedy episodes; its summary adds tool-call validity, replies and
calls per episode, and episodes.png draws them with the training curves. Dotted overrides after
the options change the run (an ablation is the same config with other overrides and a name).

    python tools/learning_run.py                                   # docs/results.md, main run
    python tools/learning_run.py --name correctness_only 'rewards.functions=[correctness]'
    python tools/learning_run.py --name smoke run.steps=2 'data.tasks=[arithmetic:40]'
    python tools/learning_run.py --config configs/calculator_cpu.yaml --out runs/calculator
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/learning_run.yaml")
    parser.add_argument("--out", default="runs/learning", help="parent of the run directories")
    parser.add_argument("--name", default="main", help="this run's directory name under --out")
    parser.add_argument("--skip-train", action="store_true",
                        help="evaluate and plot an existing run directory")
    parser.add_argument("--skip-eval", action="store_true",
                        help="with --skip-train: only redraw from metrics.jsonl and eval.json")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args()


def _jaxrl(*argv: str) -> float:
    """Runs a jaxrl verb in this interpreter's environment; its wall seconds."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "jaxrl.cli", *argv]
    print("$ jaxrl " + " ".join(argv[:]), flush=True)
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def _read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def plot_accuracy(doc: dict, out: Path) -> Path:
    names = list(doc["variants"])
    tasks = sorted(doc["variants"][names[0]]["tasks"])
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(tasks), 3.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rows = [doc["variants"][name]["tasks"][t] for t in tasks]
        acc = [r["accuracy"] for r in rows]
        err = [[max(a - r["accuracy_ci95_low"], 0.0) for a, r in zip(acc, rows)],
               [max(r["accuracy_ci95_high"] - a, 0.0) for a, r in zip(acc, rows)]]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(tasks))]
        ax.bar(xs, acc, width, yerr=err, capsize=3, label=name)
    ax.set_xticks(range(len(tasks)), [f"{t}\n(n={int(doc['variants'][names[0]]['tasks'][t]['n'])})"
                                      for t in tasks])
    ax.set_ylabel("held-out accuracy (T = 0)")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("before / after GRPO, Wilson 95% intervals")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_rewards(metrics: list[dict], out: Path) -> Path:
    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.plot(steps, [m["reward/mean"] for m in metrics], label="reward (weighted sum)", lw=2)
    functions = sorted(k.split("/")[1] for k in metrics[0]
                       if k.startswith("reward/") and k.count("/") == 2 and k.endswith("/mean"))
    for name in functions:
        ax.plot(steps, [m.get(f"reward/{name}/mean") for m in metrics], label=name, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("mean training reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _bars(ax, doc: dict, keys: list[str], labels: list[str], ylabel: str) -> None:
    """Base and adapter side by side for each held-out metric of `keys` (all tasks), with
    Wilson 95% intervals where the metric has one."""
    names = list(doc["variants"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        row = doc["variants"][name]["all"]
        values = [row[k] for k in keys]
        err = [[max(v - row.get(f"{k}_ci95_low", v), 0.0) for k, v in zip(keys, values)],
               [max(row.get(f"{k}_ci95_high", v) - v, 0.0) for k, v in zip(keys, values)]]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, values, width, yerr=err, capsize=3, label=name)
    ax.set_xticks(range(len(keys)), labels)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def plot_episodes(doc: dict, metrics: list[dict], out: Path) -> Path:
    """Multi-turn runs (data.env): held-out accuracy and tool-call validity with Wilson 95%
    intervals, replies and calls per episode, and the training curves of both rates."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    _bars(axes[0], doc, ["accuracy", "valid_call_frac"], ["accuracy", "valid calls"],
          "held-out rate (T = 0)")
    axes[0].set_ylim(0, 1)
    _bars(axes[1], doc, ["turns_mean", "calls_mean"], ["replies", "tool calls"],
          "per held-out episode")
    steps = [m["step"] for m in metrics]
    for key, label in (("episode/valid_call_frac", "valid calls"),
                       ("reward/episode/correct/mean", "correct answers"),
                       ("episode/concluded_frac", "concluded")):
        if key in metrics[0]:
            axes[2].plot(steps, [m.get(key) for m in metrics], label=label)
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("training rate (T = sampling)")
    axes[2].set_ylim(0, 1)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _acc(row: dict, key: str = "accuracy") -> str:
    return f"{row[key]:.3f} [{row[f'{key}_ci95_low']:.3f}, {row[f'{key}_ci95_high']:.3f}]"


def _episode_lines(base: dict, adapter: dict) -> list[str]:
    """Rows of the held-out episode metrics (multi-turn runs)."""
    rows = [("valid tool calls / calls [95% CI]", _acc(base, "valid_call_frac"),
             _acc(adapter, "valid_call_frac"))]
    rows += [(label, f"{base[k]:.3f}", f"{adapter[k]:.3f}") for k, label in
             (("turns_mean", "replies per episode"), ("calls_mean", "tool calls per episode"),
              ("concluded_frac", "episodes ending in an answer"),
              ("truncated_frac", "episodes cut at env.max_tokens"),
              ("reward_mean", "episode reward"))]
    return ["", "| held-out episodes | base | adapter |", "| --- | ---: | ---: |",
            *(f"| {label} | {b} | {a} |" for label, b, a in rows)]


def summary(doc: dict, metrics: list[dict], seconds: dict[str, float]) -> str:
    base, adapter = doc["variants"]["base"], doc["variants"]["adapter"]
    lines = ["| task | held-out records | base accuracy [95% CI] | adapter accuracy [95% CI] | "
             "difference |", "| --- | ---: | ---: | ---: | ---: |"]
    scopes = [(t, base["tasks"][t], adapter["tasks"][t]) for t in sorted(base["tasks"])]
    for name, b, a in scopes + [("all", base["all"], adapter["all"])]:
        lines.append(f"| {name} | {int(b['n'])} | {_acc(b)} | {_acc(a)} | "
                     f"{a['accuracy'] - b['accuracy']:+.3f} |")
    if "env" in doc:
        lines += _episode_lines(base["all"], adapter["all"])
    first, last = metrics[0], metrics[-1]
    lines += ["", f"training: {len(metrics)} steps, mean reward {first['reward/mean']:.3f} at "
              f"step {first['step']} and {last['reward/mean']:.3f} at step {last['step']} "
              f"(mean of the last 10 steps "
              f"{sum(m['reward/mean'] for m in metrics[-10:]) / len(metrics[-10:]):.3f}); "
              + f"steps {sum(m['time/step'] for m in metrics) / 60:.1f} min in all"
              + "".join(f", {k} {v / 60:.1f} min" for k, v in seconds.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = _args()
    run_dir = Path(args.out) / args.name
    common = ["--config", args.config, f"run.output_dir={run_dir}", *args.overrides]
    seconds = {}
    if not args.skip_train:
        seconds["train"] = _jaxrl("train", *common)
    if not args.skip_eval:
        seconds["eval"] = _jaxrl("eval", "--adapter", str(run_dir / "adapter"), "--compare",
                                 "--out", str(run_dir / "eval.json"), *common)
    doc = json.loads((run_dir / "eval.json").read_text())
    metrics = _read_metrics(run_dir)
    plot_accuracy(doc, run_dir / "accuracy.png")
    plot_rewards(metrics, run_dir / "rewards.png")
    if "env" in doc:
        plot_episodes(doc, metrics, run_dir / "episodes.png")
    text = summary(doc, metrics, seconds)
    (run_dir / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

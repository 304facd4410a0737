"""Spring in miniature: does the solver-checked process reward beat the outcome reward at equal
budget? Gold formal traces, an SFT warm start, two GRPO runs from the same SFT adapter (the
`spring` reward and the outcome reward), and a held-out evaluation of base, SFT and both GRPO
adapters at temperature 0 on the same records, with Spring's table and plots.

Stages (each skips what its output directory already holds, so a stopped run goes on where it
stopped; `jaxrl train` and `jaxrl sft` also resume from their own checkpoints):

    data    jaxrl data --gold-traces: the training split of knk-brief:400 as SFT chat records
    sft     jaxrl sft --config configs/spring_mini_sft.yaml
    grpo    jaxrl train --config configs/spring_mini.yaml, once per reward (same seed)
    eval    jaxrl eval (--compare base / sft), then each GRPO adapter
    report  OUT/summary.md, OUT/accuracy.png, OUT/rewards.png

    python tools/spring_mini.py                       # everything, into runs/spring_mini
    python tools/spring_mini.py --stages eval,report  # after the runs
    python tools/spring_mini.py --seed 1 --out runs/spring_mini_seed1   # another GRPO seed
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_run import plot_accuracy  # noqa: E402

STAGES = ("data", "sft", "grpo", "eval", "report")
OUTCOME = "rewards.functions=[{name: correctness, weight: 0.6}, {name: format, weight: 0.1}]"
REWARDS = {"spring": [], "outcome": [OUTCOME]}
SPRING_ROWS = ("puzzle_accuracy", "person_accuracy", "parse_rate", "sat_rate",
               "valid_per_parsed", "steps", "novel_steps", "contradictions_per_100_steps")


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/spring_mini")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of both GRPO runs")
    parser.add_argument("--sft-adapter", default=None,
                        help="start GRPO from this adapter (default: OUT/sft/adapter)")
    parser.add_argument("--batch-size", type=int, default=32, help="jaxrl eval rows per call")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides for both GRPO runs and the evaluation")
    return parser.parse_args()


def _jaxrl(*argv: str, seconds: dict, label: str) -> None:
    start = time.perf_counter()
    print("$ jaxrl " + " ".join(argv), flush=True)
    subprocess.run([sys.executable, "-m", "jaxrl.cli", *argv], check=True)
    seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start


def run_stages(args, out: Path, seconds: dict) -> None:
    stages = args.stages.split(",")
    traces, sft = out / "sft_train.jsonl", out / "sft"
    adapter = Path(args.sft_adapter) if args.sft_adapter else sft / "adapter"
    common = ["--config", "configs/spring_mini.yaml", f"lora.init_from={adapter}",
              *args.overrides]
    if "data" in stages and not traces.exists():
        _jaxrl("data", "--task", "knk-brief", "--n", "400", "--seed", "42", "--split", "train",
               "--validation-fraction", "0.25", "--gold-traces", "--out", str(traces),
               seconds=seconds, label="data")
    if "sft" in stages and not (sft / "adapter").exists() and not args.sft_adapter:
        _jaxrl("sft", "--config", "configs/spring_mini_sft.yaml", f"run.output_dir={sft}",
               f"data.train_file={traces}", seconds=seconds, label="sft")
    for name, extra in REWARDS.items():
        run = out / name
        if "grpo" in stages and not (run / "adapter").exists():
            _jaxrl("train", *common, f"run.output_dir={run}", f"run.seed={args.seed}", *extra,
                   seconds=seconds, label=f"grpo {name}")
    if "eval" not in stages:
        return
    if not (out / "eval_sft.json").exists():
        _jaxrl("eval", "--adapter", str(adapter), "--compare", "--out",
               str(out / "eval_sft.json"), "--batch-size", str(args.batch_size), *common,
               seconds=seconds, label="eval")
    for name in REWARDS:
        target = out / f"eval_{name}.json"
        if not target.exists():
            _jaxrl("eval", "--adapter", str(out / name / "adapter"), "--out", str(target),
                   "--batch-size", str(args.batch_size), *common, seconds=seconds,
                   label="eval")


def merged(out: Path) -> dict:
    """One document with the variants base, sft, outcome and spring."""
    first = json.loads((out / "eval_sft.json").read_text())
    variants = {"base": first["variants"]["base"], "sft": first["variants"]["adapter"]}
    for name in REWARDS:
        doc = json.loads((out / f"eval_{name}.json").read_text())
        variants[f"grpo {name}"] = doc["variants"]["adapter"]
    return {"variants": variants}


def _metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def plot_components(out: Path) -> Path:
    """Per run: the summed reward and the spring components over steps."""
    fig, axes = plt.subplots(1, len(REWARDS), figsize=(11, 3.4), sharey=True)
    runs = {name: _metrics(out / name) for name in REWARDS}
    last = min(max(m["step"] for m in rows) for rows in runs.values())  # the steps both ran
    for ax, name in zip(axes, REWARDS):
        rows = [m for m in runs[name] if m["step"] <= last]
        steps = [m["step"] for m in rows]
        keys = sorted(k for k in rows[0] if k.startswith("reward/") and k.endswith("/mean"))
        for key in keys:
            ax.plot(steps, [m.get(key) for m in rows], label=key[len("reward/"):-len("/mean")]
                    or "sum", lw=2 if key == "reward/mean" else 1)
        ax.set_title(f"GRPO with the {name} reward")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("mean training reward")
    fig.tight_layout()
    path = out / "rewards.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cell(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def summary(doc: dict, seconds: dict) -> str:
    names = list(doc["variants"])
    rows = ["| variant | puzzles | accuracy [95% CI] | " + " | ".join(SPRING_ROWS[1:]) + " |",
            "| --- | ---: | ---: |" + " ---: |" * (len(SPRING_ROWS) - 1)]
    for name in names:
        every = doc["variants"][name]["all"]
        spring = [every.get(f"spring/{k}") for k in SPRING_ROWS[1:]]
        rows.append(f"| {name} | {int(every['n'])} | {every['accuracy']:.3f} "
                    f"[{every['accuracy_ci95_low']:.3f}, {every['accuracy_ci95_high']:.3f}] | "
                    + " | ".join(_cell(v) for v in spring) + " |")
    timing = ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
    return "\n".join(rows) + (f"\n\nwall time of this invocation: {timing}\n" if timing else "\n")


def main() -> None:
    args = _args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    run_stages(args, out, seconds)
    if "report" not in args.stages.split(","):
        return
    doc = merged(out)
    plot_accuracy(doc, out / "accuracy.png")
    plot_components(out)
    text = summary(doc, seconds)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

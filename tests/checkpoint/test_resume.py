"""A `jaxrl train` run killed with SIGKILL during step K and resumed ends exactly as the same run
uninterrupted: the same metrics for every step (timings aside) and the same final LoRA; also
with partial rollouts (sampling.partial), whose checkpoints hold the rows carried across
steps."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxrl.checkpoint import checkpoint_steps, read_checkpoint
from jaxrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
STEPS, KILL_IN = 5, 3
TIMING = ("time/", "tokens_per_s", "reward/time_s", "reward/wait_s", "reward/overlap",
          "reward/per_s")


def _config(tmp_path: Path, model_dir: Path, partial: bool = False) -> Path:
    config = {
        "run": {"steps": STEPS, "seed": 3},
        "model": {"path": str(model_dir), "dtype": "float32"},
        "quant": {"mode": "nf4"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
        "data": {"tasks": ["arithmetic:40"], "prompts_per_step": 2, "response_prefix": "<think>"},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "grpo": {"num_generations": 2, "beta": 0.04},
        "optim": {"lr": 0.01, "warmup_steps": 1},
        "rewards": {"workers": 1, "max_staleness": 1},
        "logging": {"samples_every": 1},
        "checkpoint": {"every": 1, "keep": 2},
    }
    if partial:  # slots for two steps' rows; a stop string often met ends rows unevenly, so
        # groups finish apart and unfinished ones are carried
        config["sampling"].update(partial=True, max_new_tokens=24, slots=8, stop=["w"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _kill_during_step(config: Path, run_dir: Path, step: int) -> None:
    """Run `python -m jaxrl.cli train` and SIGKILL it as soon as step - 1 is reported."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "train", "--config", str(config),
                             f"run.output_dir={run_dir}"], cwd=ROOT, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith(f"step {step - 1}/{STEPS}"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(lines)[-3000:]


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


@pytest.mark.parametrize("partial", [False, True])
def test_killed_and_resumed_run_matches_the_uninterrupted_run(tiny_chat, tmp_path, capsys,
                                                              partial):
    config = _config(tmp_path, tiny_chat[0], partial)
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    _kill_during_step(config, killed, KILL_IN)
    assert len(_metrics(killed)) < STEPS
    assert 1 <= max(checkpoint_steps(killed / "checkpoints")) < STEPS
    if partial:  # the checkpoint resumed from holds rows decoding when it was saved
        _, meta = read_checkpoint(killed / "checkpoints",
                                  max(checkpoint_steps(killed / "checkpoints")))
        assert any(row["tokens"] and row["finish_reason"] is None
                   for group in meta["carry"]["groups"] for row in group["rows"])

    assert main(["train", "--config", str(config), f"run.output_dir={killed}"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert main(["train", "--config", str(config), f"run.output_dir={whole}"]) == 0
    assert "resuming from" not in capsys.readouterr().err

    assert [row["step"] for row in _metrics(killed)] == list(range(1, STEPS + 1))
    assert _metrics(killed) == _metrics(whole)
    resumed_state, _ = read_checkpoint(killed / "checkpoints", STEPS)
    whole_state, _ = read_checkpoint(whole / "checkpoints", STEPS)
    assert resumed_state.keys() == whole_state.keys()
    for name, value in whole_state.items():
        np.testing.assert_array_equal(resumed_state[name], value, err_msg=name)
    assert np.abs(whole_state["train/lora/weights/layers/q_proj/b"]).max() > 0  # it learned
    if partial:  # rows were carried
        assert sum(row["partial/carried_rows"] for row in _metrics(whole)) > 0
    adapter = "adapter/adapter_model.safetensors"
    assert (killed / adapter).read_bytes() == (whole / adapter).read_bytes()

    assert main(["train", "--config", str(config), f"run.output_dir={killed}",
                 "lora.rank=2"]) == 2
    assert "written with lora.rank=4; this config has lora.rank=2" in capsys.readouterr().err

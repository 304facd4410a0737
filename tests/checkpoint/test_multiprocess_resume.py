"""A `jaxrl train` run of two processes (one CPU device each, mesh data 2, so each
process samples and scores its own rows) killed with SIGKILL after its second checkpoint and
started again ends exactly as the same run uninterrupted: the same metrics for every step, the
same samples, the same final checkpoint and adapter; process 0 alone wrote the run log."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jaxrl.checkpoint import checkpoint_steps, read_checkpoint
from jaxrl.hf.export import write_peft_adapter
from jaxrl.lora.lora import init_lora
from jaxrl.model.families import load_spec
from tests.checkpoint.test_resume import _metrics
from tests.xla_flags import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
STEPS, ROWS = 4, 4
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _start_adapter(model_dir: Path, out: Path) -> np.ndarray:
    """A PEFT adapter with B nonzero, so that the KL term moves the adapter even where the tiny
    model earns no reward; its q_proj B as the run holds it."""
    spec = load_spec(model_dir)
    lora = init_lora(spec, jax.random.PRNGKey(0), rank=4, alpha=8, targets=TARGETS)
    lora = lora.replace(weights=jax.tree_util.tree_map(lambda x: x + 0.05, lora.weights))
    write_peft_adapter(out, lora, spec, str(model_dir))
    return np.asarray(lora.weights["layers"]["q_proj"]["b"])


def _config(tmp_path: Path, model_dir: Path) -> Path:
    config = {
        "run": {"steps": STEPS, "seed": 3},
        "model": {"path": str(model_dir), "dtype": "float32"},
        "quant": {"mode": "nf4"},
        "lora": {"rank": 4, "alpha": 8, "targets": TARGETS,
                 "init_from": str(tmp_path / "start")},
        "mesh": {"data": 2},  # one device per process
        "data": {"tasks": ["arithmetic:40"], "prompts_per_step": 2, "response_prefix": "<think>"},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "grpo": {"num_generations": 2, "beta": 0.04},
        "optim": {"lr": 0.01, "warmup_steps": 1},
        "rewards": {"workers": 1, "max_staleness": 1},
        "logging": {"samples_every": 1},
        "checkpoint": {"every": 1, "keep": 3},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(config: Path, run_dir: Path, logs: Path) -> list[subprocess.Popen]:
    """Both processes of `jaxrl train`; process 0's stderr is piped, process 1's in a file."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        env = {**os.environ, "XLA_FLAGS": cpu_flags(1),
               "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
        err = subprocess.PIPE if i == 0 else open(logs / f"{run_dir.name}-1.log", "a")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxrl.cli", "train", "--config", str(config),
             f"run.output_dir={run_dir}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
            stderr=err, text=True))
    return procs


def _run(config: Path, run_dir: Path, logs: Path, kill_after: int | None = None) -> str:
    """Run both processes to the end, or SIGKILL both once process 0 reports step
    `kill_after`; process 0's stderr."""
    procs = _start(config, run_dir, logs)
    lines = []
    for line in procs[0].stderr:
        lines.append(line)
        if kill_after is not None and line.startswith(f"step {kill_after}/{STEPS}"):
            for p in procs:
                p.send_signal(signal.SIGKILL)
            break
    for p in procs:
        p.wait(timeout=300)
    text = "".join(lines) + procs[0].stderr.read()
    (logs / f"{run_dir.name}-0.log").open("a").write(text)
    other = (logs / f"{run_dir.name}-1.log").read_text()[-3000:]
    want = [-signal.SIGKILL] * 2 if kill_after is not None else [0, 0]
    assert [p.returncode for p in procs] == want, text[:3000] + "\n...\n" + text[-3000:] + (
        "\nprocess 1:\n" + other)
    return text


@pytest.mark.slow
def test_two_process_run_killed_and_resumed_matches_the_uninterrupted_run(tiny_chat, tmp_path):
    config = _config(tmp_path, tiny_chat[0])
    start_b = _start_adapter(tiny_chat[0], tmp_path / "start")
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    _run(config, killed, tmp_path, kill_after=3)  # the second checkpoint is complete by then
    assert 2 <= max(checkpoint_steps(killed / "checkpoints")) < STEPS
    assert "resuming from" in _run(config, killed, tmp_path)
    assert "resuming from" not in _run(config, whole, tmp_path)

    assert [row["step"] for row in _metrics(killed)] == list(range(1, STEPS + 1))
    assert _metrics(killed) == _metrics(whole)
    samples = [(killed / "samples.jsonl").read_text().splitlines(),
               (whole / "samples.jsonl").read_text().splitlines()]
    assert samples[0] == samples[1]
    assert len(samples[1]) == STEPS * ROWS  # every process's rows, written once
    assert [json.loads(line)["step"] for line in samples[1]] == [
        s for s in range(1, STEPS + 1) for _ in range(ROWS)]
    resumed_state, _ = read_checkpoint(killed / "checkpoints", STEPS)
    whole_state, _ = read_checkpoint(whole / "checkpoints", STEPS)
    assert resumed_state.keys() == whole_state.keys()
    for name, value in whole_state.items():
        np.testing.assert_array_equal(resumed_state[name], value, err_msg=name)
    assert np.abs(whole_state["train/lora/weights/layers/q_proj/b"] - start_b).max() > 0
    adapter = "adapter/adapter_model.safetensors"
    assert (killed / adapter).read_bytes() == (whole / adapter).read_bytes()
    assert (whole / "report.png").is_file()

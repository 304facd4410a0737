"""`jaxrl train` on an environment (data.env) with a tiny random chat model: episodes are
rolled out, scored by the episode reward on the host workers and trained on; metrics, samples,
checkpoints (the pending rollout with its policy mask), resume and the adapter export work as
for single-turn GRPO; `jaxrl eval` plays the held-out records as greedy episodes."""
import json

import pytest

from jaxrl.cli import main
from jaxrl.config import from_dict
from jaxrl.rl.loop import train


def _cfg(tiny_chat, tmp_path, env: str, tasks: str, steps: int, **extra):
    return from_dict({
        "run": {"steps": steps, "output_dir": str(tmp_path / "run")},
        "model": {"path": str(tiny_chat[0]), "dtype": "float32"}, "quant": {"mode": "none"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        "data": {"tasks": [tasks], "prompts_per_step": 2, "env": env,
                 "max_prompt_tokens": 512},
        # the rollout shapes of tests/rl/test_episodes.py: one set of engine programs
        "sampling": {"max_new_tokens": 20}, "grpo": {"num_generations": 2, "beta": 0.04},
        # first_tool_choice required: random replies open a call they never close, so each
        # episode has an unreadable call answered by the environment and a second reply
        "env": {"max_turns": 3, "max_tokens": 128, "first_tool_choice": "required",
                "turn_cost": 0.01},
        "rewards": {"functions": ["episode"], "workers": 1, "max_staleness": 1},
        "checkpoint": {"every": 1}, "logging": {"samples_every": 1}, **extra})


def _rows(run, name):
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


@pytest.mark.slow
def test_calculator_training_logs_checkpoints_resumes_and_exports(tiny_chat, tmp_path):
    run = train(_cfg(tiny_chat, tmp_path, "calculator", "calculator:20", 2), log=lambda m: None)
    rows = _rows(run, "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["episode/turns_mean"] == 2 and row["episode/valid_call_frac"] == 0
        assert row["reward/mean"] == -0.02  # no answer is right; two replies at 0.01
        assert row["loss/kl"] >= 0 and row["train/grad_norm"] > 0
    sample = _rows(run, "samples.jsonl")[0]
    assert sample["episode"]["turns"] == 2 and "[tool] the tool call could not be read" in \
        sample["completion"]
    assert (run / "checkpoints" / "2").is_dir()
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    resumed = train(_cfg(tiny_chat, tmp_path, "calculator", "calculator:20", 3),
                    log=lambda m: None)
    assert [r["step"] for r in _rows(resumed, "metrics.jsonl")] == [1, 2, 3]
    out = tmp_path / "eval.json"
    assert main(["eval", "--config", str(run / "config.yaml"), "--adapter", str(run / "adapter"),
                 "--compare", "--out", str(out), "--batch-size", "4"]) == 0
    doc = json.loads(out.read_text())
    for variant in ("base", "adapter"):  # the 4 held-out problems, one greedy episode each
        metrics = doc["variants"][variant]["tasks"]["calculator"]
        assert metrics["n"] == 4 and metrics["turns_mean"] == 2
        assert metrics["valid_call_frac"] == 0 and metrics["accuracy"] == 0
    assert doc["env"]["name"] == "calculator"


@pytest.mark.slow
def test_diagnosis_runs_a_step(tiny_chat, tmp_path):
    cfg = _cfg(tiny_chat, tmp_path, "diagnosis", "diagnosis:8", 1,
               checkpoint={"every": 0})
    rows = _rows(train(cfg, log=lambda m: None), "metrics.jsonl")
    assert rows[0]["episode/turns_mean"] == 2 and "reward/episode/match/mean" in rows[0]

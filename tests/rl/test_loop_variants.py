"""`jaxrl train` with every GRPO variant on: dynamic sampling, truncation masking and the
overlong penalty act on the rows the logs show, and metrics.jsonl reports each variant."""
import json

import numpy as np
import pytest

from jaxrl.config import from_dict
from jaxrl.rewards import REWARDS, register_reward
from jaxrl.rl.loop import train

G = 2


@pytest.fixture
def parity_reward():
    register_reward("length_parity", "tests.rl.length_parity:LengthParity")
    yield
    REWARDS.pop("length_parity")


@pytest.mark.slow
def test_variants_in_a_run(tiny_chat, tmp_path, parity_reward):
    cfg = from_dict({
        "run": {"steps": 2, "output_dir": str(tmp_path / "run")},
        "model": {"path": str(tiny_chat[0]), "dtype": "float32"}, "quant": {"mode": "none"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], "dropout": 0.1},
        "data": {"tasks": ["arithmetic:20"], "prompts_per_step": 2},
        # a stop string ends some random completions early, the others are cut at 8 tokens
        "sampling": {"max_new_tokens": 8, "stop": ["m"]},
        "grpo": {"num_generations": G, "beta": 0.04, "num_iterations": 2,
                 "importance_sampling": "sequence", "kl_ratio_weighted": True, "delta": 2.0,
                 "top_entropy_quantile": 0.5, "mask_truncated": True,
                 "dynamic_sampling": True, "max_sampling_rounds": 3},
        "optim": {"micro_batch_size": 2},
        "rewards": {"functions": ["length_parity"], "overlong_buffer": 4, "workers": 1},
        "checkpoint": {"every": 0}, "logging": {"samples_every": 1}})
    run = train(cfg, log=lambda m: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        step = [s for s in samples if s["step"] == row["step"]]
        finish = np.array([s["finish_reason"] == "length" for s in step])
        penalty = np.array([s["components"]["overlong_penalty"]["value"] for s in step])
        parity = np.array([s["components"]["length_parity"]["value"] for s in step])
        rewards = np.array([s["reward"] for s in step])
        np.testing.assert_allclose(rewards, parity + penalty)  # the penalty is in the reward
        assert np.isclose(row["reward/overlong_penalty/mean"], penalty.mean())
        assert (penalty[finish] == -1).all()  # cut at max_new_tokens: the whole penalty
        assert row["grpo/truncated_masked_frac"] == finish.mean()
        assert 1 <= row["dynamic/rounds"] <= 3
        spread = np.ptp(rewards.reshape(-1, G), axis=1) > 0
        assert spread.sum() == 2 - row["dynamic/short_groups"]
        for key in ("train/seq_clip_frac", "train/delta_clip_frac", "loss/kl_weighted",
                    "dynamic/discarded_groups", "dynamic/unused_groups"):
            assert np.isfinite(row[key]), key
        assert 0 <= row["train/entropy_selected_frac"] <= 1 and row["train/skipped"] == 0
    reasons = {s["finish_reason"] for s in samples}
    assert reasons == {"stop", "length"}  # both kinds of rows were there to mask or keep

"""`jaxrl train` with the CEDAR reward judged by judge.local: base: the judge's requests decode
in the training process's engine, beside the next step's rollout rows (the engine's own
counters), and stay out of the policy's rows and completion metrics."""
import json

from jaxrl.config import from_dict
from jaxrl.rl.loop import train

NEW, JUDGE_TOKENS = 8, 24


def test_cedar_judged_in_the_training_engine(tiny_chat, tmp_path):
    cfg = from_dict({
        "run": {"steps": 2, "output_dir": str(tmp_path / "run")},
        "model": {"path": str(tiny_chat[0]), "dtype": "float32"}, "quant": {"mode": "none"},
        "lora": {"rank": 4, "alpha": 8},
        "data": {"tasks": ["abduction_rules:16"], "prompts_per_step": 2,
                 "max_prompt_tokens": 384},
        "sampling": {"max_new_tokens": NEW},
        "grpo": {"num_generations": 2},
        "rewards": {"functions": ["cedar"], "max_staleness": 1, "workers": 1},
        "judge": {"local": "base", "slots": 2, "max_prompt_tokens": 1024,
                  "max_tokens": JUDGE_TOKENS, "max_retries": 0},
        "checkpoint": {"every": 0}, "logging": {"samples_every": 1}})
    run = train(cfg, log=lambda m: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and len(samples) == 2 * 4  # the policy's rows only
    # 4 rows a step, two judge requests (coverage, directionality) each
    assert sum(r["judge/requests"] for r in rows) == 2 * 4 * 2
    # step 1 is scored while step 2's rollout decodes: judge rows beside rollout rows
    assert rows[0]["judge/beside_rollout_steps"] > 0
    assert all(0 < r["judge/step_share"] <= 1 for r in rows)
    assert all(r["judge/tokens"] > 0 and r["time/judge"] >= 0 for r in rows)
    # judge replies (up to 24 tokens) never count as completions (at most 8)
    assert all(r["completion/length_max"] <= NEW for r in rows)
    for s in samples:  # every part scored: a verdict or its documented default
        for part in ("coverage", "directionality"):
            assert 0 <= s["components"]["cedar"][part] <= 1

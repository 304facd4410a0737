"""`jaxrl pilot`: the statistics of scored groups against hand-computed values, and one run on a
tiny random model that cannot solve its task (zero spread everywhere: "will not learn")."""
import json

import pytest

from jaxrl.cli import main
from jaxrl.eval.pilot import Group, analyze, eta, format_report


def _sets(doc):
    return [r["set"] for r in doc["recommendations"] if r.get("set")]


def test_three_tasks_by_hand():
    groups = [Group("mid", [0, 1, 0, 0]), Group("mid", [1, 1, 0, 0]), Group("mid", [0, 0, 0, 0]),
              Group("hard", [0, 0, 0, 0]), Group("hard", [0, 0, 0, 0]),
              Group("easy", [1.5] * 4)]
    doc = analyze(groups, num_generations=4, prompts_per_step=8)
    overall, mid = doc["overall"], doc["tasks"]["mid"]
    # 2 of 6 groups have spread: zero spread 4/6, useful groups 8 x 2/6
    assert overall["zero_spread"] == pytest.approx(2 / 3)
    assert overall["useful_groups_per_step"] == pytest.approx(8 / 3)
    assert overall["zero_spread_none_solved"] == 3  # mid's third group and hard's two
    assert overall["zero_spread_all_solved"] == 1  # easy: 1.5 everywhere, above the floor 0
    # mid: rewards mean 3/12; within-group stds (n - 1): 0.5, sqrt(1/3), 0
    assert mid["reward_mean"] == pytest.approx(0.25)
    assert mid["reward_std"] == pytest.approx((0.5 + (1 / 3) ** 0.5) / 3)
    assert mid["zero_spread"] == pytest.approx(1 / 3)
    # successes 1, 2, 0 of 4 above mid's minimum 0: rate 3/12; per prompt (s + 0.25) / 5 =
    # 0.25, 0.45, 0.05; at G = 4, 1 - p^4 - (1-p)^4 = 0.6796875, 0.8674875, 0.1854875
    assert mid["success_rate"] == pytest.approx(0.25)
    assert mid["spread_at_G"] == pytest.approx((0.6796875 + 0.8674875 + 0.1854875) / 3)
    # at G = 3 (3p(1-p)): 0.5625, 0.7425, 0.1425 -> 0.4825 < 0.5, so G = 4 is the smallest
    assert mid["needed_G"] == 4 and overall["needed_G"] == 4
    hard, easy = doc["tasks"]["hard"], doc["tasks"]["easy"]
    assert hard["success_rate"] == 0 and hard["needed_G"] is None
    assert easy["success_rate"] == 1 and easy["zero_spread_all_solved"] == 1
    flagged = {r["task"]: r["direction"] for r in doc["recommendations"] if r.get("task")}
    assert flagged == {"hard": "too hard", "easy": "too easy"}  # mid: 1/3 zero spread
    # 2/3 zero spread with some spread: dynamic sampling; 8/3 < 4 useful groups: 4 / (1/3) = 12
    # prompts per step; mid needs no larger G
    assert _sets(doc) == ["grpo.dynamic_sampling=true", "data.prompts_per_step=12"]
    assert doc["verdict"].startswith("will learn: 2 of 6 groups (33%)")


def test_low_success_rate_asks_for_a_larger_group():
    groups = [Group("a", [0, 1, 0, 0], lengths=[10, 64, 64, 20], truncated=[0, 1, 1, 0]),
              Group("a", [0, 0, 0, 0], lengths=[64, 64, 5, 7], truncated=[1, 1, 0, 0])]
    doc = analyze(groups, num_generations=4, prompts_per_step=2, max_new_tokens=64)
    a = doc["tasks"]["a"]
    # rate 1/8; p = (1 + 1/8) / 5 = 0.225 and (1/8) / 5 = 0.025; at G = 4: 1 - p^4 - (1-p)^4 =
    # 0.6366867 and 0.0963117. At G = 7: 1 - 0.225^7 - 0.775^7 = 0.83200 and 1 - 0.975^7 =
    # 0.16241, mean 0.49720 < 0.5; at G = 8: 0.86984 and 0.18335, mean 0.52660
    assert a["spread_at_G"] == pytest.approx((0.6366867 + 0.0963117) / 2, abs=1e-6)
    assert a["needed_G"] == 8
    assert a["length_mean"] == pytest.approx(298 / 8) and a["length_max"] == 64
    assert a["truncated"] == pytest.approx(0.5)
    # zero spread 1/2: dynamic sampling; G = 8; half the rows cut: max_new_tokens doubled;
    # 1 useful group of 2 < 4: 4 / 0.5 = 8 prompts per step
    assert _sets(doc) == ["grpo.dynamic_sampling=true", "grpo.num_generations=8",
                          "sampling.max_new_tokens=128", "data.prompts_per_step=8"]
    # with dynamic sampling on, up to 3 rounds fill the step: min(2, 2 x 0.5 x 3) = 2 useful
    on = analyze(groups, num_generations=4, prompts_per_step=2, dynamic_sampling=True)
    assert on["overall"]["useful_groups_per_step"] == 2
    # but a step of 2 prompts holds at most 2 useful groups: 4 needs 4 prompts
    assert _sets(on) == ["grpo.num_generations=8", "data.prompts_per_step=4"]


def test_no_spread_anywhere_will_not_learn():
    groups = [Group("t", [0.0, 0.0]), Group("t", [0.0, 0.0]), Group("u", [0.5, 0.5])]
    doc = analyze(groups, num_generations=2, prompts_per_step=4)
    assert doc["overall"]["zero_spread"] == 1 and doc["overall"]["useful_groups_per_step"] == 0
    assert doc["verdict"].startswith("will not learn: none of the 3 groups has reward spread")
    assert _sets(doc) == []  # neither dynamic sampling, G nor prompts per step can help
    assert {r["task"] for r in doc["recommendations"]} == {"t", "u"}


def test_eta():
    # staleness 1: scoring (3 s) hides behind the next rollout and reference (2 + 0.5 s)
    t = eta(2.0, 3.0, 0.5, 1.5, steps_left=10, max_staleness=1)
    assert t["reward_wait_s"] == pytest.approx(0.5) and t["step_s"] == pytest.approx(4.5)
    assert t["eta_s"] == pytest.approx(45)
    assert eta(2.0, 3.0, 0.5, 1.5, 10, 0)["step_s"] == pytest.approx(7.0)
    assert eta(2.0, 3.0, None, None, 10, 1)["eta_s"] is None


def test_pilot_on_a_tiny_model_that_cannot_solve_its_task(tiny_chat, tmp_path, capsys):
    config = {
        "run": {"steps": 5, "output_dir": str(tmp_path / "run")},
        "model": {"path": str(tiny_chat[0]), "dtype": "float32"}, "quant": {"mode": "none"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        "data": {"tasks": ["arithmetic:20"], "prompts_per_step": 2},
        "sampling": {"max_new_tokens": 8}, "grpo": {"num_generations": 2},
        "rewards": {"workers": 1, "functions": [{"name": "correctness", "weight": 1.0}]},
        "checkpoint": {"every": 0}, "logging": {"samples_every": 0}}
    path = tmp_path / "pilot.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    out = tmp_path / "pilot.json"
    assert main(["pilot", "--config", str(path), "--prompts", "4", "--no-step-timing",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["prompts"] == 4 and doc["num_generations"] == 2 and doc["prompts_per_step"] == 2
    assert doc["adapter"].startswith("base model (no checkpoint in")
    task = doc["tasks"]["arithmetic"]
    assert task["groups"] == 4 and task["rows"] == 8
    assert task["zero_spread"] == 1 and task["success_rate"] == 0 and task["needed_G"] is None
    assert task["reward_mean"] == 0 and task["functions"] == {"correctness": 0}
    assert 1 <= task["length_max"] <= 8 and 0 <= task["truncated"] <= 1
    assert doc["overall"]["useful_groups_per_step"] == 0
    assert doc["verdict"].startswith("will not learn")
    (advice,) = [r for r in doc["recommendations"] if r.get("task")]
    assert advice["task"] == "arithmetic" and advice["direction"] == "too hard"
    timing = doc["timing"]
    assert timing["rollout_s"] > 0 and timing["step_s"] is None and timing["eta_s"] is None
    assert timing["steps_left"] == 5 and len(timing["rollout_calls_s"]) == 2
    printed = capsys.readouterr().out
    assert printed == format_report(doc) + "\n" and "will not learn" in printed
    assert not (tmp_path / "run").exists()  # the pilot writes nothing into the run directory


@pytest.mark.slow
def test_pilot_resumes_the_runs_adapter_and_times_a_step(tiny_chat, tmp_path, capsys):
    from jaxrl.config import from_dict
    from jaxrl.rl.loop import train

    config = {
        "run": {"steps": 1, "output_dir": str(tmp_path / "run")},
        "model": {"path": str(tiny_chat[0]), "dtype": "float32"}, "quant": {"mode": "none"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        "data": {"tasks": ["arithmetic:20"], "prompts_per_step": 2},
        "sampling": {"max_new_tokens": 8}, "grpo": {"num_generations": 2},
        "rewards": {"workers": 1, "functions": [{"name": "correctness", "weight": 1.0}]},
        "checkpoint": {"every": 1}, "logging": {"samples_every": 0}}
    train(from_dict(config), log=lambda m: None)
    path = tmp_path / "pilot.yaml"
    path.write_text(json.dumps(config))
    out = tmp_path / "pilot.json"
    assert main(["pilot", "--config", str(path), "--prompts", "2", "--out", str(out),
                 "run.steps=4"]) == 0
    doc = json.loads(out.read_text())
    assert doc["adapter"].endswith("(step 1)") and doc["timing"]["start_step"] == 1
    t = doc["timing"]
    assert t["steps_left"] == 3 and t["update_s"] > 0 and t["reference_s"] > 0
    assert t["step_s"] >= t["rollout_s"] + t["reference_s"] + t["update_s"]
    assert t["eta_s"] == pytest.approx(3 * t["step_s"])
    assert "ETA" in capsys.readouterr().out

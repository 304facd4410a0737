"""The `episode` reward on the host workers: each sample's environment scores its episode with
the process terms of `env.*`; a sample without an episode is a config error."""
import pytest

from jaxrl.config import from_dict
from jaxrl.data.generators import generate
from jaxrl.envs.base import case_from_json
from jaxrl.rewards.base import RewardConfigError, Sample
from jaxrl.rewards.pool import RewardPool


def _calculator_sample(answer: str) -> Sample:
    record = {**generate("calculator", 1, seed=2)[0]}
    record["episode"] = {
        "env": "calculator", "turns": 2, "finish": "answer",
        "calls": [{"name": "calculator", "arguments": {}, "valid": True, "output": "x"}],
        "conclusion": {"text": "", "answer": answer}, "tokens": {"policy": 9, "environment": 5}}
    return Sample("prompt", "transcript", record), record["answer"]


def _diagnosis_sample() -> Sample:
    record = {**generate("diagnosis", 1, seed=2)[0]}
    gold = case_from_json(record["metadata"]["case"]).gold
    record["episode"] = {
        "env": "diagnosis", "turns": 1, "finish": "answer", "calls": [],
        "conclusion": {"text": "", "category": gold.coarse, "root_cause": gold.fine,
                       "quotes": ["never retrieved: disk on fire"]},
        "tokens": {"policy": 20, "environment": 0}}
    return Sample("prompt", "transcript", record)


def test_episodes_are_scored_by_their_environments_on_the_workers():
    cfg = from_dict({"data": {"env": "calculator"}, "rewards": {"functions": ["episode"],
                                                                "workers": 1},
                     "env": {"evidence_bonus": 0.2, "turn_cost": 0.05,
                             "fabrication_penalty": 0.5}})
    right, gold = _calculator_sample("")
    right = Sample(right.prompt, right.completion,
                   {**right.record, "episode": {**right.record["episode"],
                                                "conclusion": {"text": "", "answer": gold}}})
    wrong, _ = _calculator_sample("7")
    with RewardPool(cfg) as pool:
        scored = pool.score([right, wrong, _diagnosis_sample()])
    assert scored.rewards[0] == pytest.approx(1 + 0.2 - 0.1)
    assert scored.rewards[1] == pytest.approx(0.2 - 0.1)
    # the gold cause named without its component: Relevant (0.5), not Match; one fabricated
    # quote; no evidence retrieved; one reply
    assert scored.rewards[2] == pytest.approx(0.5 - 0.5 - 0.05)
    results = scored.results["episode"]
    assert results[2].components["fabricated"] == 1.0 and results[2].components["match"] == 0.0
    assert scored.metrics["rewards/episode/correct/mean"] == pytest.approx(1 / 2)


def test_a_sample_without_an_episode_is_a_config_error():
    cfg = from_dict({"data": {"env": "calculator"}, "rewards": {"functions": ["episode"],
                                                                "workers": 1}})
    with RewardPool(cfg) as pool, pytest.raises(RewardConfigError, match="train with data.env"):
        pool.submit([Sample("p", "c", {"id": "x"})])


def test_the_config_pairs_the_reward_with_an_environment():
    from jaxrl.config import ConfigError

    with pytest.raises(ConfigError, match="set config key 'data.env' to one of calculator"):
        from_dict({"rewards": {"functions": ["episode"]}})
    with pytest.raises(ConfigError, match="rewards.overlong_buffer=0"):
        from_dict({"data": {"env": "diagnosis"}, "rewards": {"overlong_buffer": 4}})

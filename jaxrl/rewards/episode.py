"""`episode`: the reward of a multi-turn episode, as its environment scores it.

A sample of a multi-turn rollout (jaxrl/rl/episodes.py) carries the episode in
record["episode"] (its environment, turns, tool calls with their outputs, conclusion and how it
ended); the environment's `score` (jaxrl/envs/calculator.py, diagnosis.py) turns that into the
value: the outcome plus the process terms configured under `env.*`. An episode cut at the token
budget (finish "token_budget") is scored as it stands: without a conclusion there is no outcome.
"""
from __future__ import annotations

from jaxrl.config import Config
from jaxrl.envs import ENVIRONMENTS, environment
from jaxrl.rewards.base import CpuReward, RewardConfigError, RewardResult, Sample


class EpisodeReward(CpuReward):
    name = "episode"

    def __init__(self, cfg: Config | None = None):
        self.cfg = (cfg or Config()).env

    def check(self, sample: Sample) -> None:
        episode = sample.record.get("episode")
        if not isinstance(episode, dict) or episode.get("env") not in ENVIRONMENTS:
            raise RewardConfigError(
                f"reward 'episode' scores multi-turn episodes, whose record holds 'episode' "
                f"with an environment of {', '.join(ENVIRONMENTS)}; record "
                f"{sample.record.get('id')!r} has none (train with data.env set)")

    def score_one(self, sample: Sample) -> RewardResult:
        episode = sample.record["episode"]
        value, components, info = environment(episode["env"]).score(sample.record, episode,
                                                                     self.cfg)
        return RewardResult(value, components, info)

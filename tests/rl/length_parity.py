"""A reward for loop tests that needs no task: 1.0 when the completion's length in characters
is odd, else 0.0 (random completions of a tiny model then differ within a group)."""
from jaxrl.rewards.base import CpuReward, RewardResult, Sample


class LengthParity(CpuReward):
    name = "length_parity"

    def __init__(self, cfg=None):
        del cfg  # nothing to configure

    def score_one(self, sample: Sample) -> RewardResult:
        return RewardResult(float(len(sample.completion) % 2))

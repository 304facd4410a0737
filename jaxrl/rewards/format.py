"""The `format` reward: 1.0 for exactly `<think>...</think>` then `<answer>...</answer>`, else 0.

Whitespace is allowed before, between and after the two spans; anything else outside them, a
second span, or a tag nested inside one scores 0. There is no partial credit: a half-formatted
completion is as useless to the correctness reward as an unformatted one, and a graded format
reward is easy to farm (emit the tags, skip the reasoning). When the chat template opens
<think> at the end of the prompt, the completion is scored with that tag restored.
"""
from __future__ import annotations

import re

from jaxrl.config import Config
from jaxrl.rewards.base import CpuReward, RewardResult, Sample, completion_text

_SHAPE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAG = re.compile(r"</?(think|answer)>")


def well_formed(text: str) -> bool:
    """Whether `text` has exactly the <think>…</think><answer>…</answer> shape."""
    match = _SHAPE.fullmatch(text)
    return match is not None and not any(_TAG.search(span) for span in match.groups())


class FormatReward(CpuReward):
    """1.0 when the completion is well formed, else 0.0 (components: {"format": value})."""
    name = "format"

    def __init__(self, cfg: Config | None = None):
        del cfg  # nothing to configure

    def score_one(self, sample: Sample) -> RewardResult:
        value = float(well_formed(completion_text(sample)))
        info = {} if value else {"error": "bad_format"}
        return RewardResult(value, {"format": value}, info)

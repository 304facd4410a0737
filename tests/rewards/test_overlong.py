"""DAPO's soft overlong punishment, by hand (the numbers of DAPO eq. 13 and TRL's example)."""
import numpy as np
import pytest

from jaxrl.rewards.base import RewardResult
from jaxrl.rewards.overlong import overlong_penalties, with_overlong_penalty
from jaxrl.rewards.pool import ScoredBatch


def test_penalty_is_zero_then_linear_over_the_buffer():
    # L = 100, buffer 20: none up to 80 tokens, (80 - n) / 20 beyond: 90 -> -0.5, 100 -> -1
    got = overlong_penalties([10, 80, 81, 90, 100], 100, 20, 1.0)
    np.testing.assert_allclose(got, [0, 0, -0.05, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalties([90, 100], 100, 20, 0.5), [-0.25, -0.5])
    np.testing.assert_array_equal(overlong_penalties([100], 100, 0, 1.0), [0.0])
    with pytest.raises(ValueError, match="overlong buffer must be in"):
        overlong_penalties([1], 10, 11, 1.0)


def test_penalty_is_added_to_the_reward_and_reported_on_its_own():
    scored = ScoredBatch(rewards=(1.0, 0.5),
                         results={"correctness": (RewardResult(1.0), RewardResult(0.5))},
                         metrics={"rewards/time_s": 2.0, "rewards/mean": 0.75})
    shaped = with_overlong_penalty(scored, [90, 10], 100, 20, 1.0)
    assert shaped.rewards == (0.5, 0.5)
    assert [r.value for r in shaped.results["overlong_penalty"]] == [-0.5, 0.0]
    assert shaped.metrics["rewards/overlong_penalty/mean"] == -0.25
    assert shaped.metrics["rewards/overlong_penalty/frac"] == 0.5
    assert shaped.metrics["rewards/mean"] == 0.5 and shaped.metrics["rewards/time_s"] == 2.0
    assert shaped.metrics["rewards/correctness/mean"] == 0.75  # the functions' own scores

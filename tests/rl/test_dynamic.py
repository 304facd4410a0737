"""Dynamic sampling: which groups a step keeps, how many rounds it samples, and the rollout it
assembles from them (host side, no model)."""
import numpy as np

from jaxrl.rewards.base import RewardResult
from jaxrl.rewards.pool import ScoredBatch
from jaxrl.rl.dynamic import fill_groups, has_spread
from jaxrl.rl.rollout import Rollout
from jaxrl.sampling.sampler import SampleOutput

G = 2


def _part(tag: str, rewards, width: int):
    """A scored rollout whose rows say where they come from: prompt tokens all `width` wide,
    completion tokens and texts carry the part's tag and row."""
    rows = len(rewards)
    out = SampleOutput(
        prompt_tokens=np.full((rows, width), 7, np.int32), prompt_mask=np.ones((rows, width), bool),
        tokens=np.arange(rows * 3, dtype=np.int32).reshape(rows, 3) + 100 * ord(tag[0]),
        mask=np.ones((rows, 3), bool), logprobs=np.full((rows, 3), -1.0, np.float32),
        finish_reasons=("stop",) * rows, texts=tuple(f"{tag}{i}" for i in range(rows)))
    rollout = Rollout(0, [{"id": f"{tag}{i // G}"} for i in range(rows)],
                      [f"p{tag}{i}" for i in range(rows)], out)
    results = {"correctness": tuple(RewardResult(float(r)) for r in rewards)}
    return rollout, ScoredBatch(tuple(map(float, rewards)), results, {"rewards/time_s": 1.0})


def _draws(*parts):
    calls = []

    def draw(k):
        calls.append(k)
        return parts[k - 1]
    return draw, calls


def test_has_spread():
    np.testing.assert_array_equal(has_spread([1, 1, 0, 1, 0.5, 0.5], G), [False, True, False])


def test_extra_rounds_fill_the_step_with_groups_that_have_spread():
    # share 3 groups. round 1: only group 1 has spread; round 2: groups 0 and 2 do
    first = _part("a", [1, 1, 0, 1, 0, 0], width=5)
    draw, calls = _draws(_part("b", [1, 0, 1, 1, 0, 1], width=7))
    rollout, scored, m = fill_groups(first, draw, G, max_rounds=3)
    assert calls == [1]
    assert rollout.out.texts == ("a2", "a3", "b0", "b1", "b4", "b5")
    assert scored.rewards == (0.0, 1.0, 1.0, 0.0, 0.0, 1.0) and has_spread(scored.rewards, G).all()
    assert [r.value for r in scored.results["correctness"]] == list(scored.rewards)
    assert scored.metrics["rewards/mean"] == 0.5 and scored.metrics["rewards/time_s"] == 1.0
    # the first round's rows gain two masked columns on the left to the second round's width
    assert rollout.out.prompt_tokens.shape == (6, 7)
    np.testing.assert_array_equal(rollout.out.prompt_mask[:2, :2], False)
    assert rollout.out.prompt_mask[2:].all() and rollout.records[2] == {"id": "b0"}
    assert m == {"dynamic/rounds": 2, "dynamic/sampled_groups": 6, "dynamic/discarded_groups": 3,
                 "dynamic/unused_groups": 0, "dynamic/short_groups": 0,
                 "dynamic/first_reward_mean": 0.5}
    assert rollout.ref_logp is None  # assembled: the reference pass must run on it


def test_a_full_first_round_is_kept_as_it_is():
    first = _part("a", [1, 0, 0, 1, 1, 0.5], width=5)
    draw, calls = _draws()
    rollout, scored, m = fill_groups(first, draw, G, max_rounds=3)
    assert calls == [] and rollout is first[0] and scored is first[1]
    assert m["dynamic/rounds"] == 1 and m["dynamic/discarded_groups"] == 0


def test_rounds_run_out_and_zero_spread_groups_fill_the_places_left():
    first = _part("a", [1, 1, 0, 1, 0, 0], width=5)
    draw, calls = _draws(_part("b", [1, 1, 0, 0, 1, 1], 5), _part("c", [0, 0, 1, 1, 0, 0], 5))
    rollout, scored, m = fill_groups(first, draw, G, max_rounds=3)
    assert calls == [1, 2]
    assert rollout.out.texts == ("a0", "a1", "a2", "a3", "a4", "a5")  # round 1, in order
    assert m["dynamic/short_groups"] == 2 and m["dynamic/discarded_groups"] == 8


def test_surplus_spread_is_unused_and_other_processes_decide_the_rounds():
    first = _part("a", [1, 1, 0, 1, 0, 0], width=5)
    draw, calls = _draws(_part("b", [1, 0, 1, 0, 0, 1], 5))
    rollout, _, m = fill_groups(first, draw, G, max_rounds=2)
    assert rollout.out.texts == ("a2", "a3", "b0", "b1", "b2", "b3")
    assert m["dynamic/unused_groups"] == 1
    # this process has all it needs, but another one is short: it samples the round as well
    full = _part("a", [1, 0, 1, 0, 1, 0], width=5)
    draw, calls = _draws(_part("b", [1, 0, 1, 0, 0, 1], 5))
    rollout, _, m = fill_groups(full, draw, G, max_rounds=2, agree=lambda short: 1)
    assert calls == [1] and rollout.out.texts == full[0].out.texts
    assert m["dynamic/rounds"] == 2 and m["dynamic/unused_groups"] == 3

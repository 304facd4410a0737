"""Dynamic sampling (DAPO; verl's `filter_groups`): a step trains on groups whose rewards differ.

A group whose G rewards are all equal has advantage 0 on every row: it adds nothing to the
policy gradient and only dilutes the batch. With `grpo.dynamic_sampling`, once a step's rollout
is scored (overlong penalty included), each process keeps its groups with reward spread, in
order; while any process holds fewer than its share of the step's `data.prompts_per_step`
groups, every process samples another round, the next data item's prompts (its share of them:
the same number of rows, so the same slot count and compiled programs as the first round) and
takes groups with spread from it, until `grpo.max_sampling_rounds` rollouts (the first
included) were sampled. Spread groups beyond the share are left unused. When the rounds run out
first, the places left are filled with zero-spread groups of the first round, which the
zero-spread filter takes out of the loss (keep = 0), so the batch keeps its compiled shape.

Why whole rounds rather than topping up freed slots inside one engine run: a group's spread is
known only after its completions are scored on the host, while the engine's slots were filled
when the round started; a round of the step's size reuses its programs, and its prompts beyond
the shortfall cost no extra decode steps when slots are free (sampling.slots >= rows), only
rows in the same chunks. Each process decides from its own groups; the round count is agreed
with `agree` (the largest shortfall over processes), so every process runs the same programs,
and every process reassembles its batch (and reruns the reference pass on it) exactly when more
than one round was sampled.

Metrics (counts of this process's groups): dynamic/rounds, dynamic/sampled_groups,
dynamic/discarded_groups (sampled without spread), dynamic/unused_groups (with spread, beyond
the share), dynamic/short_groups (places filled without spread), dynamic/first_reward_mean (the
first round's mean reward: the on-policy sample that reward/mean shows without this filter).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxrl.rewards.pool import ScoredBatch, reward_metrics
from jaxrl.rl.rollout import Rollout, take_groups

Scored = tuple[Rollout, ScoredBatch]


def has_spread(rewards, group: int) -> np.ndarray:
    """[P] bool: groups (G consecutive rewards) whose rewards are not all equal."""
    r = np.asarray(rewards, np.float64).reshape(-1, group)
    return r.max(axis=1) != r.min(axis=1)


def _pick(parts: list[Scored], group: int, share: int) -> tuple[list, list]:
    """(picks with spread, up to `share` of them, in order; the first round's zero-spread
    groups), as (part, group) pairs."""
    spread = [(p, g) for p, (_, scored) in enumerate(parts)
              for g in np.flatnonzero(has_spread(scored.rewards, group))]
    flat = [(0, g) for g in np.flatnonzero(~has_spread(parts[0][1].rewards, group))]
    return spread[:share], flat


def _scored_rows(parts: list[Scored], picks: list[tuple[int, int]], group: int,
                 first: ScoredBatch) -> ScoredBatch:
    rows = [(p, g * group + i) for p, g in picks for i in range(group)]
    rewards = tuple(parts[p][1].rewards[r] for p, r in rows)
    results = {name: tuple(parts[p][1].results[name][r] for p, r in rows)
               for name in first.results}
    timing = {k: v for k, v in first.metrics.items()
              if k in ("rewards/time_s", "rewards/wait_s", "rewards/overlap", "rewards/per_s")}
    return ScoredBatch(rewards, results, {**timing, **reward_metrics(rewards, results)})


def fill_groups(first: Scored, draw: Callable[[int], Scored], group: int, max_rounds: int,
                agree: Callable[[int], int] = lambda shortfall: shortfall,
                ) -> tuple[Rollout, ScoredBatch, dict[str, float]]:
    """(rollout, its scores, metrics) of the step's batch (module docstring). first: the
    step's scored rollout; draw(k): the scored rollout of extra round k = 1, 2, ...; agree:
    the largest shortfall over the processes (distributed.host_max)."""
    parts = [first]
    share = len(first[1].rewards) // group
    while agree(share - len(_pick(parts, group, share)[0])) > 0 and len(parts) < max_rounds:
        parts.append(draw(len(parts)))
    picks, flat = _pick(parts, group, share)
    short = share - len(picks)
    picks = sorted(picks + flat[:short])
    sampled = len(parts) * share
    with_spread = sum(int(has_spread(scored.rewards, group).sum()) for _, scored in parts)
    metrics = {"dynamic/rounds": float(len(parts)), "dynamic/sampled_groups": float(sampled),
               "dynamic/discarded_groups": float(sampled - with_spread),
               "dynamic/unused_groups": float(with_spread - (share - short)),
               "dynamic/short_groups": float(short),
               "dynamic/first_reward_mean": float(np.mean(first[1].rewards))}
    if len(parts) == 1:  # one round: its groups as they are (spread or short), reference kept
        return first[0], first[1], metrics
    rollout = take_groups([rollout for rollout, _ in parts], picks, group)
    return rollout, _scored_rows(parts, picks, group, first[1]), metrics


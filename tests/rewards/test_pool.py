"""The reward pool: workers that hang or crash, timeouts, ordering, metrics and overlap."""
import pytest

from jaxrl.config import Config, RewardEntry, apply_overrides
from jaxrl.rewards import REWARDS
from jaxrl.rewards.base import RewardConfigError, Sample
from jaxrl.rewards.pool import RewardPool, pipelined
from jaxrl.rewards.workers import ProcessWorkers
from tests.rewards.helpers import AwaitsRollout


@pytest.fixture
def registered(monkeypatch):
    for name in ("misbehave", "sleepy", "fails_in_worker", "awaits_rollout"):
        monkeypatch.setitem(REWARDS, name, f"tests.rewards.helpers:{name.title().replace('_', '')}")
    return apply_overrides(Config(), ["rewards.timeout_s=1.5", "rewards.sandbox_timeout_s=1",
                                      "rewards.workers=2"])


def _samples(*completions):
    return [Sample("p", c, {"id": str(i)}) for i, c in enumerate(completions)]


def test_hung_crashed_and_raising_workers_score_the_default_and_are_replaced(registered):
    with RewardPool(registered, [RewardEntry("misbehave", 2.0)]) as pool:
        ticket = pool.submit(_samples("ok1", "hang", "crash", "raise", "ok22", "ok333"))
        assert not ticket.future.done()  # submit returned; "hang" holds the batch for 1.5 s
        batch = pool.collect(ticket)
        again = pool.score(_samples("ok4444"))
        restarts = pool.restarts
    results = batch.results["misbehave"]
    assert [r.value for r in results] == [3.0, 0.0, 0.0, 0.0, 4.0, 5.0]
    assert batch.rewards == (6.0, 0.0, 0.0, 0.0, 8.0, 10.0)
    assert [r.info.get("failure") for r in results[1:4]] == ["timeout", "worker_crashed",
                                                             "reward_error"]
    assert "boom" in results[3].info["error"]
    assert batch.metrics["rewards/failures"] == 3 and batch.metrics["rewards/failures/timeout"] == 1
    assert batch.metrics["rewards/misbehave/length/mean"] == 4.0
    assert restarts == 2 and again.rewards == (12.0,)
    assert pool.failures == {"timeout": 1, "worker_crashed": 1, "reward_error": 1}


def test_io_rewards_time_out_and_errors_are_caught(registered):
    with RewardPool(registered, [RewardEntry("sleepy")]) as pool:
        batch = pool.score(_samples("sleep:0", "sleep:5", "raise"))
    values = [(r.value, r.info.get("failure")) for r in batch.results["sleepy"]]
    assert values == [(1.0, None), (0.0, "timeout"), (0.0, "reward_error")]
    assert batch.metrics["rewards/time_s"] < 5.0  # the timeout cut the 5 s sleep short


def test_bad_records_are_refused_at_submit(registered):
    with RewardPool(registered, [RewardEntry("correctness")]) as pool:
        bad = Sample("p", "<answer>1</answer>", {"id": "r1", "answer": "1",
                                                "verifier": {"kind": "nope"}})
        with pytest.raises(RewardConfigError, match="unknown verifier kind 'nope'"):
            pool.submit([bad])
        good = Sample("p", "<answer>1</answer>", {"id": "r2", "answer": "1",
                                                 "verifier": {"kind": "numeric"}})
        assert pool.score([good]).rewards == (1.0,)


def test_workers_that_cannot_start_fail_their_samples(registered):
    with RewardPool(registered, [RewardEntry("fails_in_worker")]) as pool:
        batch = pool.score(_samples("a", "b"))
    failures = [r.info["failure"] for r in batch.results["fails_in_worker"]]
    assert failures == ["worker_start_failed"] * 2
    assert "no GPU driver" in batch.results["fails_in_worker"][0].info["detail"]


def test_fork_is_refused():
    with pytest.raises(ValueError, match="spawn, forkserver"):
        ProcessWorkers({}, Config(), 1, 1.0, {}, start_method="fork")


def _run_steps(pool, steps, max_staleness, events):
    """Batch t asks for rollout t + 1 to have begun while it is scored (the last one asks for
    nothing)."""
    def rollouts():
        for step in range(steps):
            AwaitsRollout.started = step + 1
            events.append(f"rollout {step}")
            yield step

    def samples_of(step):
        return _samples(*[str(step + 2 if step + 1 < steps else 0)] * 2)

    batches = []
    for step, batch, ahead in pipelined(pool, rollouts(), samples_of, max_staleness):
        events.append(f"update {step} ahead {ahead}")
        batches.append(batch)
    return batches


def test_max_staleness_one_scores_while_the_next_rollout_runs(registered, monkeypatch):
    monkeypatch.setattr(AwaitsRollout, "started", 0)
    with RewardPool(registered, [RewardEntry("awaits_rollout")]) as pool:
        stale_events, fresh_events = [], []
        stale = _run_steps(pool, 4, 1, stale_events)
        fresh = _run_steps(pool, 2, 0, fresh_events)
    assert stale_events == ["rollout 0", "rollout 1", "update 0 ahead 1", "rollout 2",
                            "update 1 ahead 2", "rollout 3", "update 2 ahead 3",
                            "update 3 ahead None"]
    assert [b.rewards for b in stale] == [(1.0, 1.0)] * 4  # each batch met the next rollout
    assert fresh_events == ["rollout 0", "update 0 ahead None", "rollout 1",
                            "update 1 ahead None"]
    assert fresh[0].metrics["rewards/failures/timeout"] == 2  # scored before rollout 1 began


def test_pipelined_rejects_other_staleness(registered):
    with RewardPool(registered, [RewardEntry("sleepy")]) as pool, pytest.raises(
            ValueError, match="max_staleness must be 0 or 1"):
        list(pipelined(pool, [1], lambda b: [], 2))

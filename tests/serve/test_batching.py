"""The batching queue without a model: grouping, overload, failures reaching the requests."""
import threading

import pytest

from jaxrl.serve.batching import Batcher, Closed, Job, Overloaded, plan_groups


def _job(n=1, temperature=0.0, top_p=1.0, prompt_len=3, max_tokens=8, seed=None):
    return Job(tuple(range(prompt_len)), n, max_tokens, temperature, top_p, (), seed)


def test_groups_share_what_the_compiled_program_fixes():
    greedy = [_job(top_p=0.5), _job(top_p=0.9, prompt_len=15)]  # greedy ignores top-p
    sampled = [_job(temperature=0.7), _job(temperature=0.7)]
    longer_prompt, more_tokens = _job(prompt_len=17), _job(max_tokens=17)
    seeded = [_job(temperature=0.7, seed=1), _job(temperature=0.7, seed=1)]
    greedy_seeded = _job(seed=3)  # greedy: the seed changes nothing, so it may share
    jobs = [*greedy, *sampled, longer_prompt, more_tokens, *seeded, greedy_seeded]
    groups = plan_groups(jobs, max_rows=64)
    assert groups == [[greedy[0], greedy[1], greedy_seeded], sampled, [longer_prompt],
                      [more_tokens], [seeded[0]], [seeded[1]]]


def test_groups_split_at_max_rows_without_splitting_a_job():
    jobs = [_job(n=3), _job(n=2), _job(n=4), _job(n=1)]
    assert plan_groups(jobs, max_rows=5) == [jobs[:2], [jobs[2], jobs[3]]]
    big = _job(n=9)
    assert plan_groups([big], max_rows=5) == [[big]]


def test_overload_then_the_queue_drains_in_one_batch():
    release, started, seen = threading.Event(), threading.Event(), []

    def run_group(jobs):
        seen.append(len(jobs))
        started.set()
        release.wait(10)
        return [job.prompt for job in jobs]

    batcher = Batcher(run_group, max_rows=8, max_queue=2)
    first = _job()
    batcher.submit([first])
    assert started.wait(10)
    queued = [_job(prompt_len=4), _job(prompt_len=5)]
    batcher.submit([queued[0]])
    batcher.submit([queued[1]])
    assert batcher.stats()["queued"] == 2 and batcher.stats()["running"] == 1
    with pytest.raises(Overloaded):
        batcher.submit([_job()])
    release.set()
    assert [j.future.result(10) for j in queued] == [(0, 1, 2, 3), (0, 1, 2, 3, 4)]
    assert seen == [1, 2] and batcher.stats()["batches"] == 2
    batcher.close()
    with pytest.raises(Closed):
        batcher.submit([_job()])


def test_a_failing_group_fails_its_requests_and_the_worker_lives_on():
    def run_group(jobs):
        if jobs[0].n == 2:
            raise RuntimeError("boom")
        return ["ok"] * len(jobs)

    batcher = Batcher(run_group, max_rows=8, max_queue=4)
    bad, good = _job(n=2), _job(n=1)
    batcher.submit([bad])
    with pytest.raises(RuntimeError, match="boom"):
        bad.future.result(10)
    batcher.submit([good])
    assert good.future.result(10) == "ok"
    batcher.close()

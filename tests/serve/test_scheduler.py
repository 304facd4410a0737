"""The engine thread's scheduling with a stand-in engine that emits one token per live slot per
step: adapters take turns and never share a step, waiting jobs join as slots free up, the
queue limit, cancellation, and recovery from a failing step."""
import threading
import time

import numpy as np
import pytest

from jaxrl.sampling.requests import EngineStats
from jaxrl.sampling.sampling_fns import Decoding
from jaxrl.serve.scheduler import Closed, Job, Overloaded, Scheduler


class StandIn:
    """Engine's interface: `slots`, `lora`, `stats`, submit / busy / step."""

    def __init__(self, slots=2, fail=False, gate=None):
        self.slots, self.lora, self.stats, self.fail = slots, None, EngineStats(), fail
        self.gate = gate  # a step waits for it: requests pile up meanwhile
        self.queue, self.active, self.steps = [], [], []  # steps: (lora, prompts) per step

    def submit(self, request):
        self.queue.append(request)

    def busy(self):
        return bool(self.queue or self.active)

    def step(self):
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.fail:
            raise RuntimeError("the device is gone")
        while self.queue and len(self.active) < self.slots:
            self.active.append(self.queue.pop(0))
        self.steps.append((self.lora, tuple(r.prompt[0] for r in self.active)))
        for r in list(self.active):
            r.tokens.append(len(r.tokens))
            r.on_token(r.tokens[-1], 0.0)
            if len(r.tokens) == r.max_new_tokens:
                self.active.remove(r)
                r.finish_reason = "length"
                r.on_done(r)
        return self.busy()


class Sink:
    def __init__(self):
        self.tokens, self.finished, self.error = [], threading.Event(), None

    def token(self, token, logprob, top):
        self.tokens.append(token)

    def done(self, reason):
        self.finished.set()

    def fail(self, error):
        self.error = error
        self.finished.set()


def _jobs(prompt, n=1, tokens=3):
    return [Job([prompt], Decoding(), tokens, np.zeros(2, np.uint32), Sink()) for _ in range(n)]


def _wait(*groups):
    for job in (j for g in groups for j in g):
        assert job.sink.finished.wait(30)


def test_adapters_take_turns_and_never_share_a_step():
    engine = StandIn(slots=4)
    scheduler = Scheduler(lambda: engine, {"base": None, "a": "A", "b": "B"}, max_queue=16)
    groups = {name: [_jobs(i * 10 + j) for j in range(3)]
              for i, name in enumerate(("base", "a", "b"))}
    for name, requests in groups.items():
        for jobs in requests:
            scheduler.submit(name, jobs)
    _wait(*(jobs for requests in groups.values() for jobs in requests))
    scheduler.close()
    owner = {p: lora for lora, base in (("A", 10), ("B", 20), (None, 0)) for p in range(base,
                                                                                      base + 3)}
    assert all(owner[p] == lora for lora, prompts in engine.steps for p in prompts)
    assert {lora for lora, _ in engine.steps} == {None, "A", "B"}
    assert all(job.sink.tokens == [0, 1, 2] for requests in groups.values()
               for jobs in requests for job in jobs)


def test_a_request_never_waits_for_a_round():
    engine = StandIn(slots=2)
    scheduler = Scheduler(lambda: engine, {"base": None}, max_queue=4)
    long, short = _jobs(1, tokens=50), _jobs(2, tokens=2)
    scheduler.submit("base", long)
    scheduler.submit("base", short)
    _wait(long, short)
    scheduler.close()
    last = {p: i for i, (_, prompts) in enumerate(engine.steps) for p in prompts}
    assert last[2] < last[1]  # the short one finished while the long one decoded


def test_the_queue_is_bounded_and_cancelled_jobs_never_reach_the_engine():
    gate = threading.Event()
    engine = StandIn(slots=1, gate=gate)
    scheduler = Scheduler(lambda: engine, {"base": None}, max_queue=1)
    first, dropped = _jobs(1, tokens=2), _jobs(2)
    scheduler.submit("base", first)
    while not engine.queue:  # taken into the engine; its step waits for the gate
        time.sleep(0.001)
    scheduler.submit("base", dropped)
    with pytest.raises(Overloaded):
        scheduler.submit("base", _jobs(3))
    scheduler.cancel(dropped)
    gate.set()
    _wait(first)
    scheduler.close()
    assert all(2 not in prompts for _, prompts in engine.steps)
    with pytest.raises(Closed):
        scheduler.submit("base", _jobs(4))


def test_a_failing_step_fails_its_jobs_and_the_engine_is_rebuilt():
    engines = [StandIn(fail=True), StandIn()]
    scheduler = Scheduler(lambda: engines.pop(0), {"base": None}, max_queue=8)
    failed = _jobs(1)
    scheduler.submit("base", failed)
    _wait(failed)
    assert str(failed[0].sink.error) == "the device is gone"
    ok = _jobs(2)
    scheduler.submit("base", ok)
    _wait(ok)
    scheduler.close()
    assert ok[0].sink.tokens == [0, 1, 2] and ok[0].sink.error is None

"""The engine thread's scheduling with a stand-in engine that emits one token per live slot per
step: the engine's lora for the served models, requests of every model share steps first come
first served, waiting jobs join as slots free up, the queue limit, cancellation, and recovery
from a failing step (the per-model counts go on over it)."""
import threading
import time

import numpy as np
import pytest

from jaxrl.lora.adapters import AdapterSet
from jaxrl.lora.lora import Lora
from jaxrl.sampling.requests import EngineStats
from jaxrl.sampling.sampling_fns import Decoding
from jaxrl.serve.scheduler import Closed, Job, Overloaded, Scheduler, engine_lora


def _lora(value):
    """A one-layer q_proj adapter (never run: the stand-in engine only passes it along)."""
    return Lora(weights={"layers": {"q_proj": {"a": np.full((1, 2, 1), value, np.float32),
                                               "b": np.full((1, 1, 2), value, np.float32)}}},
                scale=1.0)


class StandIn:
    """Engine's interface: `slots`, `lora`, `stats`, submit / busy / step."""

    def __init__(self, slots=2, fail=False, gate=None):
        self.slots, self.lora, self.stats, self.fail = slots, None, EngineStats(), fail
        self.gate = gate  # a step waits for it: requests pile up meanwhile
        # steps: ((adapter, prompt) of each live row) per step
        self.queue, self.active, self.steps = [], [], []

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
        self.steps.append(tuple((r.adapter, r.prompt[0]) for r in self.active))
        adapters = np.array([r.adapter for r in self.active] + [0] * (self.slots
                                                                       - len(self.active)))
        emitted = np.arange(self.slots)[:, None] < len(self.active)
        self.stats.count_chunk(emitted, adapters)
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


def test_the_engine_holds_every_served_adapter_once():
    a, b = _lora(1.0), _lora(2.0)
    assert engine_lora({"base": None}) == (None, {"base": 0})
    assert engine_lora({"tuned": a}) == (a, {"tuned": 0})  # --adapter alone: the plain one
    assert engine_lora({"tuned": a, "again": a}) == (a, {"tuned": 0, "again": 0})
    lora, index = engine_lora({"base": None, "x": a, "y": b, "z": a})
    assert isinstance(lora, AdapterSet) and lora.loras[0] is a and lora.loras[1] is b
    assert index == {"base": 0, "x": 1, "y": 2, "z": 1}
    lora, index = engine_lora({"tuned": a, "other": b})  # no bare base: still a set
    assert len(lora) == 2 and index == {"tuned": 1, "other": 2}


def test_models_share_steps_first_come_first_served():
    gate = threading.Event()
    engine = StandIn(slots=4, gate=gate)
    a, b = _lora(1.0), _lora(2.0)
    scheduler = Scheduler(lambda: engine, {"base": None, "a": a, "b": b}, max_queue=16)
    assert isinstance(engine.lora, AdapterSet) and len(engine.lora) == 2
    order = [("a", 10), ("base", 0), ("b", 20), ("a", 11), ("b", 21), ("base", 1)]
    groups = [_jobs(prompt) for _, prompt in order]
    for (model, _), jobs in zip(order, groups):
        scheduler.submit(model, jobs)
    gate.set()
    _wait(*groups)
    scheduler.close()
    index = {"base": 0, "a": 1, "b": 2}
    assert all(job.sink.tokens == [0, 1, 2] for jobs in groups for job in jobs)
    # every row decoded with its model's adapter, beside rows of other adapters
    adapter_of = {prompt: index[model] for model, prompt in order}
    assert all(adapter == adapter_of[p] for step in engine.steps for adapter, p in step)
    assert any(len({adapter for adapter, _ in step}) > 1 for step in engine.steps)
    ran = [p for step in engine.steps for _, p in step]
    first_seen = sorted(set(ran), key=ran.index)
    assert first_seen == [p for _, p in order]  # first come, first served
    counts = scheduler.counts
    assert counts.mixed_steps == engine.stats.mixed_steps > 0
    assert counts.model_tokens == {"base": 6, "a": 6, "b": 6}
    assert counts.model_steps == {m: engine.stats.adapter_steps[i] for m, i in index.items()}


def test_a_request_never_waits_for_a_round():
    engine = StandIn(slots=2)
    scheduler = Scheduler(lambda: engine, {"base": None}, max_queue=4)
    long, short = _jobs(1, tokens=50), _jobs(2, tokens=2)
    scheduler.submit("base", long)
    scheduler.submit("base", short)
    _wait(long, short)
    scheduler.close()
    last = {p: i for i, step in enumerate(engine.steps) for _, p in step}
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
    assert all(p != 2 for step in engine.steps for _, p in step)
    with pytest.raises(Closed):
        scheduler.submit("base", _jobs(4))


def test_a_failing_step_fails_its_jobs_and_the_engine_is_rebuilt():
    a = _lora(1.0)
    engines = [StandIn(), StandIn()]
    built = list(engines)
    scheduler = Scheduler(lambda: engines.pop(0), {"base": None, "a": a}, max_queue=8)
    first = _jobs(0)
    scheduler.submit("a", first)
    _wait(first)
    built[0].fail = True  # its stats counted 3 steps of "a"
    failed = _jobs(1)
    scheduler.submit("base", failed)
    _wait(failed)
    assert str(failed[0].sink.error) == "the device is gone"
    engine = scheduler.engine
    assert engine is built[1] and isinstance(engine.lora, AdapterSet)  # rebuilt, with the set
    ok = _jobs(2)
    scheduler.submit("a", ok)
    _wait(ok)
    scheduler.close()
    assert ok[0].sink.tokens == [0, 1, 2] and ok[0].sink.error is None
    assert engine.stats.adapter_tokens == {1: 3}  # the new engine's stats started from 0
    assert scheduler.counts.model_tokens == {"base": 0, "a": 6}

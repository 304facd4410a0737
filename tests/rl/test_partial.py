"""Partial rollouts (jaxrl/rl/partial.py) on a tiny random model, float32: a row carried into
the next rollout decodes the tokens the same row decodes uninterrupted under the same adapter
sequence; a completion resumed from its tokens so far (`Request.drawn`) decodes on as the
uninterrupted one; staleness is bounded by sampling.max_carry (rows finished at their length,
or dropped with their group); restarting from a packed state is what a resumed run does."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ConfigError, SamplingConfig, from_dict
from jaxrl.hf.load import load_params
from jaxrl.lora.lora import init_lora
from jaxrl.rl.partial import Partial
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.sampling.requests import row_keys
from tests.tiny_models import make_model

KEY = jax.random.PRNGKey(7)
PROMPTS = [[5, 9, 31, 7], [17, 2, 88, 3, 60], [64, 12], [3, 1, 4, 1, 5, 9], [40, 41, 42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("partial_model")
    make_model("qwen2", tie=True).save_pretrained(path)
    return load_params(path)


def _lora(spec, seed):
    """An adapter that changes the model: LoRA B filled too."""
    lora = init_lora(spec, jax.random.PRNGKey(seed), rank=4, alpha=8.0,
                     targets=("q_proj", "v_proj", "down_proj"))
    rng = np.random.RandomState(seed)
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)
        if x.ndim == 3 else x, lora)


def _pull(first=0, budgets=None):
    """The data: group i (from `first`) of prompt i, its rows' budgets budgets(i) (None: the
    config's)."""
    counter = [first]

    def pull():
        i = counter[0]
        counter[0] += 1
        item = ({"id": i}, f"p{i}", PROMPTS[i % len(PROMPTS)])
        return [item if budgets is None else (*item, budgets(i))]
    return pull


def _long_second(i):
    return [40, 40] if i == 1 else [24, 24]


def _partial(spec, params, lora, eos=(), **sampling):
    cfg = SamplingConfig(temperature=1.0, **{"max_new_tokens": 24, **sampling})
    return Partial(params, spec, cfg, groups=1, group_size=2, prompt_width=8, key=KEY,
                   eos_ids=eos, lora=lora, slots=4, chunk=16)


def test_a_resumed_request_decodes_on_as_the_uninterrupted_one(tiny):
    spec, params = tiny
    key = row_keys(KEY, [3])[0]
    whole = Request(PROMPTS[1], Decoding(1.0), 20, key)
    engine = Engine(params, spec, slots=2, capacity=32, chunk=4)
    engine.submit(whole)
    engine.run()
    cut = Request(PROMPTS[1], Decoding(1.0), 20, key)
    engine = Engine(params, spec, slots=2, capacity=32, chunk=4)
    engine.submit(cut)
    engine.step()
    engine.step()  # 1 + 4 + 4 tokens
    k = len(cut.tokens)
    assert k == 9 and cut.tokens == whole.tokens[:k]
    resumed = Request(PROMPTS[1] + cut.tokens, Decoding(1.0), 20, key, drawn=k)
    engine = Engine(params, spec, slots=2, capacity=32, chunk=4)
    engine.submit(resumed)
    engine.run()
    assert resumed.tokens == whole.tokens[k:] and resumed.finish_reason == "length"
    np.testing.assert_allclose(resumed.logprobs, whole.logprobs[k:], atol=1e-5)
    with pytest.raises(ValueError, match="resumed"):
        Engine(params, spec, slots=2, capacity=32, chunk=4, prefill_chunk=4).submit(
            Request(PROMPTS[1] + cut.tokens, Decoding(1.0), 20, key, drawn=k))


def test_a_carried_row_decodes_what_it_does_uninterrupted_under_the_same_adapters(tiny):
    """Slots for two groups of two, both admitted at once: the second's rows have 40 tokens to
    the first's 24, are still decoding when the first finishes (the CPU's chunk ends there, a
    group's slots being free), and are carried into the next rollout (adapter B), whose freed
    slots take a third group."""
    spec, params = tiny
    a, b = _lora(spec, 1), _lora(spec, 2)
    partial = _partial(spec, params, a, max_new_tokens=40)
    pull = _pull(budgets=_long_second)
    ready, metrics = partial.rollout(0, 0, a, pull)
    assert [g.serial for g in ready] == [0]
    assert metrics["partial/carried_over_rows"] == 2
    ready, metrics = partial.rollout(1, 1, b, pull)
    assert [g.serial for g in ready] == [1] and metrics["partial/carried_rows"] == 2
    assert [g.serial for g in partial.pending] == [2]  # begun in rollout 1
    carried = ready[0].rows
    for row in carried:
        assert row.versions == [0] * 24 + [1] * 16 and row.finish_reason == "length"
    assert metrics["partial/tokens_age_1"] == 48 and metrics["partial/tokens_age_0"] == 32

    # the same rows in an engine of their own: 24 tokens under A, then B
    engine = Engine(params, spec, slots=4, capacity=8 + 64, chunk=23, lora=a)
    replay = [engine.submit(Request(PROMPTS[1], partial.decoding, 40, row.key))
              for row in carried]
    engine.step()
    engine.lora = b
    engine.run()
    for row, request in zip(carried, replay):
        assert row.tokens == request.tokens
        np.testing.assert_allclose(row.logprobs, request.logprobs, atol=1e-5)
    # and under A throughout they differ: the carried tokens did change adapter
    engine = Engine(params, spec, slots=4, capacity=8 + 64, chunk=16, lora=a)
    alone = engine.submit(Request(PROMPTS[1], partial.decoding, 40, carried[0].key))
    engine.run()
    assert alone.tokens[:24] == carried[0].tokens[:24] and alone.tokens != carried[0].tokens

    records, prompts, out = partial.output(ready)
    assert records == [{"id": 1}] * 2 and prompts == ["p1"] * 2
    np.testing.assert_array_equal(out.versions[0], [0] * 24 + [1] * 16)
    np.testing.assert_array_equal(out.tokens[1], carried[1].tokens)


def test_restarting_from_a_packed_state_is_what_a_resumed_run_does(tiny):
    spec, params = tiny
    a, b = _lora(spec, 1), _lora(spec, 2)
    partial = _partial(spec, params, a, max_new_tokens=40)
    partial.rollout(0, 0, a, _pull(budgets=_long_second))
    packed = partial.pack()
    assert [g["serial"] for g in packed["groups"]] == [1]
    partial.restart(packed, b)  # the uninterrupted run, after it saved a checkpoint
    resumed = _partial(spec, params, None, max_new_tokens=40)  # a new process
    resumed.restart(packed, b)
    outs = []
    for p in (partial, resumed):
        ready, metrics = p.rollout(1, 1, b, _pull(2, _long_second))
        outs.append(p.output(ready)[2])
    for name in ("tokens", "mask", "logprobs", "versions"):
        np.testing.assert_array_equal(getattr(outs[0], name), getattr(outs[1], name))
    np.testing.assert_array_equal(outs[0].versions[0], [0] * 24 + [1] * 16)


@pytest.mark.parametrize("overflow", ["finish", "drop"])
def test_no_trained_row_spans_more_than_max_carry_updates(tiny, overflow):
    """EOS ids that are drawn often give long-tailed lengths; over 8 rollouts rows that would
    be carried a second time are finished at their length, or dropped with their group."""
    spec, params = tiny
    loras = [_lora(spec, s) for s in range(3)]
    partial = _partial(spec, params, loras[0], eos=tuple(range(3, 9)), max_new_tokens=64,
                       carry_overflow=overflow)
    pull, seen, cut = _pull(), 0.0, 0
    for step in range(8):
        ready, metrics = partial.rollout(step, step, loras[step % 3], pull)
        assert len(ready) == 1 and 0 <= metrics["partial/slot_utilization"] <= 1
        seen += metrics[f"partial/overflow_{'finished_rows' if overflow == 'finish' else 'dropped_groups'}"]
        for row in ready[0].rows:
            assert max(row.versions) - min(row.versions) <= 1  # max_carry 1
            cut += row.finish_reason == "length" and len(row.tokens) < 64
    assert seen > 0
    assert (cut > 0) == (overflow == "finish")


def test_the_config_refuses_what_partial_rollouts_do_not_combine_with():
    base = {"model": {"path": "default"}, "sampling": {"partial": True}}
    from_dict(base)
    for extra, key in ((({"data": {"env": "calculator"}}), "data.env"),
                       ({"grpo": {"dynamic_sampling": True}}, "grpo.dynamic_sampling"),
                       ({"judge": {"local": "base"}}, "judge.local")):
        merged = {**base, **extra}
        with pytest.raises(ConfigError, match=f"sampling.partial.*{key}"):
            from_dict(merged)
    assert dataclasses.asdict(from_dict({"model": {"path": "default"}}).sampling)[
        "partial"] is False

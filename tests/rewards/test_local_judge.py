"""judge.local: the judge's requests decode in the training process's engine, beside rollout
rows (the engine's own counters say so), keep the `Judge` contract (cache, failure kinds) and
reply what the judge model alone would."""
import asyncio
import threading

import jax
import numpy as np
import pytest

from jaxrl.config import load_config
from jaxrl.hf.load import load_params
from jaxrl.hf.tokenizer import chat_prompt_text, eos_token_ids, load_tokenizer, text_ids
from jaxrl.lora.lora import init_lora
from jaxrl.rewards.base import RewardConfigError
from jaxrl.rewards.judge import Judge, JudgeFailure
from jaxrl.rewards.local_judge import JudgeService, layout
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.sampling.sampler import sample

ASK = [{"role": "system", "content": "Grade the trace."},
       {"role": "user", "content": "PROBLEM: 2 + 2. TRACE: four."}]


def _cfg(tmp_path, *extra):
    return load_config(None, ["model.path=default", "judge.local=base", "judge.slots=2",
                              "judge.max_prompt_tokens=128", "judge.max_tokens=6",
                              "data.max_prompt_tokens=32", "sampling.max_new_tokens=24",
                              f"run.output_dir={tmp_path}", *extra])


@pytest.fixture(scope="module")
def chat_model(tiny_chat):
    path, _ = tiny_chat
    spec, params = load_params(path)
    tokenizer = load_tokenizer(path)
    lora = init_lora(spec, jax.random.PRNGKey(0), rank=4, alpha=8)
    lora = lora.replace(weights=jax.tree_util.tree_map(lambda x: x + 0.02, lora.weights))
    return spec, params, tokenizer, eos_token_ids(tokenizer, path), lora


class _Asker:
    """Judge.ask calls run on an event loop of their own thread, as the reward pool's."""

    def __init__(self, judge: Judge):
        self.judge, self.loop = judge, asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def ask(self, messages):
        return asyncio.run_coroutine_threadsafe(self.judge.ask(messages), self.loop)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_layout_counts_the_judges_slots_and_columns(tmp_path):
    lay = layout(_cfg(tmp_path), rows=8)
    assert (lay.rollout_slots, lay.judge_slots, lay.policy_slots) == (8, 2, 10)
    assert lay.rollout_capacity == 32 + 32 and lay.judge_capacity == 128 + 6
    assert lay.policy_capacity == 134 and lay.shared
    separate = layout(_cfg(tmp_path, "judge.local=model:default"), rows=8)
    assert not separate.shared and separate.policy_slots == 8 and separate.policy_capacity == 64


def test_judge_rows_decode_beside_the_rollout_and_reply_as_the_base_alone(chat_model, tmp_path):
    spec, params, tokenizer, eos, lora = chat_model
    cfg = _cfg(tmp_path)
    with JudgeService(cfg, spec, params, tokenizer, eos, lora, rows=4, log=lambda m: None) as s:
        asker = _Asker(Judge(cfg.judge, tmp_path))
        replies = [asker.ask(ASK), asker.ask(ASK[:1] + [{"role": "user", "content": "other"}])]
        while s._inbox.__len__() < 2:  # both requests are queued before the rollout starts
            pass
        engine = s.policy_engine(lora)
        out = sample(params, spec, [[5, 6, 7, 8]] * 4, jax.random.PRNGKey(0),
                     cfg.sampling, eos_ids=eos, engine=engine, adapter=s.policy_adapter)
        assert out.mask.any(axis=1).all()
        s.wait(lambda: all(r.done() for r in replies))
        texts = [r.result(timeout=5).text for r in replies]
        metrics = s.metrics()
        asker.close()
    assert engine.stats.mixed_steps > 0  # steps that held judge and rollout rows at once
    assert metrics["judge/beside_rollout_steps"] == engine.stats.mixed_steps
    assert metrics["judge/requests"] == 2 and metrics["judge/tokens"] > 0
    assert 0 < metrics["judge/step_share"] <= 1
    # the judge's reply is what the base alone decodes greedily from the rendered prompt
    alone = Engine(params, spec, eos_ids=eos, slots=1, capacity=256)
    ids = text_ids(tokenizer, chat_prompt_text(tokenizer, ASK, thinking=False))
    request = alone.submit(Request(ids, Decoding(0.0), 6))
    alone.run()
    assert texts[0] == tokenizer.decode(request.tokens, skip_special_tokens=True)
    # and the rollout's rows are the policy's: the same as a rollout without a judge
    plain = sample(params, spec, [[5, 6, 7, 8]] * 4, jax.random.PRNGKey(0), cfg.sampling,
                   lora=lora, eos_ids=eos)
    np.testing.assert_array_equal(out.tokens[out.mask], plain.tokens[plain.mask])


def test_a_prompt_too_long_fails_as_a_judge_failure_and_replies_are_cached(chat_model,
                                                                           tmp_path):
    spec, params, tokenizer, eos, lora = chat_model
    cfg = _cfg(tmp_path)
    with JudgeService(cfg, spec, params, tokenizer, eos, lora, rows=4, log=lambda m: None) as s:
        asker = _Asker(Judge(cfg.judge, tmp_path))
        long = asker.ask([{"role": "user", "content": "word " * 400}])
        s.wait(long.done)
        with pytest.raises(JudgeFailure) as failure:
            long.result()
        assert failure.value.kind == "judge_prompt_too_long"
        first = asker.ask(ASK)
        s.wait(first.done)
        again = asker.ask(ASK)  # answered from the cache: nothing to decode
        assert again.result(timeout=5).cached and not first.result().cached
        assert s.metrics()["judge/requests"] == 1
        asker.close()


def test_a_local_judge_outside_training_is_a_config_error(tmp_path):
    with pytest.raises(RewardConfigError, match="only `jaxrl train` runs"):
        Judge(_cfg(tmp_path).judge, tmp_path)


def test_a_second_model_judges_in_an_engine_of_its_own(chat_model, tiny_chat, tmp_path):
    spec, params, tokenizer, eos, lora = chat_model
    cfg = _cfg(tmp_path, f"judge.local=model:{tiny_chat[0]}", "quant.mode=none",
               "model.dtype=float32")
    with JudgeService(cfg, spec, params, tokenizer, eos, lora, rows=4, log=lambda m: None) as s:
        assert s.judge is not s.policy and s.policy_adapter == 0
        asker = _Asker(Judge(cfg.judge, tmp_path))
        reply = asker.ask(ASK)
        while not s._inbox:
            pass
        sample(params, spec, [[5, 6, 7, 8]] * 4, jax.random.PRNGKey(0), cfg.sampling,
               eos_ids=eos, engine=s.policy_engine(lora), adapter=s.policy_adapter)
        s.wait(reply.done)
        text = reply.result().text
        metrics = s.metrics()
        assert s.resident_bytes() > 0
        asker.close()
    assert metrics["judge/requests"] == 1 and metrics["judge/beside_rollout_steps"] > 0
    alone = Engine(params, spec, eos_ids=eos, slots=1, capacity=256)  # the same weights here
    ids = text_ids(tokenizer, chat_prompt_text(tokenizer, ASK, thinking=False))
    request = alone.submit(Request(ids, Decoding(0.0), 6))
    alone.run()
    assert text == tokenizer.decode(request.tokens, skip_special_tokens=True)


def test_a_json_object_judge_replies_with_json(chat_model, tmp_path):
    """judge.response_format json_object: the local judge's reply decodes under the grammar,
    so even a random model's reply opens a JSON object (cut by judge.max_tokens, it may not
    close), where the free reply does not."""
    spec, params, tokenizer, eos, lora = chat_model
    cfg = _cfg(tmp_path, "judge.response_format=json_object", "judge.max_tokens=12")
    with JudgeService(cfg, spec, params, tokenizer, eos, lora, rows=4, log=lambda m: None) as s:
        asker = _Asker(Judge(cfg.judge, tmp_path))
        reply = asker.ask(ASK)
        s.wait(reply.done)
        text = reply.result(timeout=5).text
        asker.close()
    assert text.startswith("{"), text
    free = _cfg(tmp_path / "free", "judge.max_tokens=12")
    with JudgeService(free, spec, params, tokenizer, eos, lora, rows=4,
                      log=lambda m: None) as s:
        asker = _Asker(Judge(free.judge, tmp_path / "free"))
        reply = asker.ask(ASK)
        s.wait(reply.done)
        assert not reply.result(timeout=5).text.startswith("{")
        asker.close()

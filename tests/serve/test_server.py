"""`jaxrl serve` through the openai client on a tiny random model: outputs equal the sampler's
and the engine's under the same settings (n, seed, stop, log-probs, penalties, top-k, min-p,
logit_bias), requests join a running batch, 400 / 401 / 404 / 503 replies after which the
server keeps serving."""
import threading
import time

import jax
import numpy as np
import openai
import pytest

from jaxrl.cli import main
from jaxrl.config import SamplingConfig
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.sampling.requests import row_keys
from jaxrl.serve import start_server
from tests.serve.helpers import HELLO, SERVE, client, post

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with start_server(tiny_chat_model, port=0, **SERVE) as handle:
        yield handle


def test_chat_with_seed_n_and_stop_equals_the_sampler(server, tiny_chat_model):
    model = tiny_chat_model
    ids = model.chat_ids(HELLO)
    cfg = SamplingConfig(temperature=0.8, max_new_tokens=12)
    free = model.sample([ids] * 2, jax.random.PRNGKey(7), cfg)
    stop = free.texts[0][6:9]
    ref = model.sample([ids] * 2, jax.random.PRNGKey(7), SamplingConfig(
        temperature=0.8, max_new_tokens=12, stop=(stop,)))
    c = client(server)
    assert [m.id for m in c.models.list().data] == [server.model_id]
    reply = c.chat.completions.create(model=server.model_id, messages=HELLO, n=2, seed=7,
                                      temperature=0.8, max_tokens=12, stop=[stop], logprobs=True)
    # OpenAI's texts end before the stop sequence; the sampler's keep it
    expected = [t[:t.find(stop)] if t.endswith(stop) else t for t in ref.texts]
    assert [ch.message.content for ch in reply.choices] == expected
    assert [ch.finish_reason for ch in reply.choices] == list(ref.finish_reasons)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == int(ref.mask.sum())
    logprobs = [t.logprob for t in reply.choices[0].logprobs.content]
    np.testing.assert_allclose(logprobs, ref.logprobs[0][ref.mask[0]], rtol=1e-5)


def test_completions_batch_of_prompts_token_ids_and_n(server, tiny_chat_model):
    model = tiny_chat_model
    texts = ["Once upon a time", "The cat sat on"]
    ids = [model.ids(t) for t in texts]
    ref = model.sample(ids, jax.random.PRNGKey(0), GREEDY)
    c = client(server)
    reply = c.completions.create(model=server.model_id, prompt=texts, temperature=0,
                                 max_tokens=8, logprobs=0)
    assert [ch.text for ch in reply.choices] == list(ref.texts)
    assert [ch.index for ch in reply.choices] == [0, 1]
    assert reply.choices[1].logprobs.token_logprobs == pytest.approx(
        ref.logprobs[1][ref.mask[1]].tolist(), rel=1e-5)
    assert reply.usage.prompt_tokens == sum(map(len, ids))
    assert reply.usage.completion_tokens == int(ref.mask.sum())
    by_ids = c.completions.create(model=server.model_id, prompt=ids[1], n=2, temperature=0,
                                  max_tokens=8)
    assert [ch.text for ch in by_ids.choices] == [ref.texts[1]] * 2


def _engine_tokens(model, prompt, decoding, n, seed):
    engine = Engine(model.params, model.spec, eos_ids=model.eos_ids, slots=4, capacity=256,
                    chunk=4)
    request = engine.submit(Request(prompt, decoding, n, row_keys(jax.random.PRNGKey(seed),
                                                                  [0])[0]))
    engine.run()
    return request


def test_sampling_fields_reach_the_engine(server, tiny_chat_model):
    model = tiny_chat_model
    fields = dict(top_k=40, min_p=0.01, repetition_penalty=1.3)
    decoding = Decoding(0.9, top_k=40, min_p=0.01, repetition_penalty=1.3, presence_penalty=0.5,
                        frequency_penalty=0.7, top_logprobs=3,
                        logit_bias=((42, 3.0), (7, -100.0)))
    want = _engine_tokens(model, model.chat_ids(HELLO), decoding, 12, seed=3)
    reply = client(server).chat.completions.create(
        model=server.model_id, messages=HELLO, max_tokens=12, temperature=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.7, logit_bias={"42": 3.0, "7": -100},
        logprobs=True, top_logprobs=3, extra_body=fields)
    assert reply.choices[0].message.content == model.detokenize(want.tokens)
    content = reply.choices[0].logprobs.content
    np.testing.assert_allclose([[t.logprob for t in c.top_logprobs] for c in content],
                               [[lp for _, lp in top] for top in want.top_logprobs], rtol=1e-5)
    assert [[t.token for t in c.top_logprobs] for c in content] == [
        [model.tokenizer.decode([i]) for i, _ in top] for top in want.top_logprobs]


def test_logit_bias_forces_a_token_and_penalties_change_greedy_text(server, tiny_chat_model):
    c = client(server)
    forced = c.completions.create(model=server.model_id, prompt="Once upon a time",
                                  max_tokens=6, temperature=0, logit_bias={"1000": 100})
    assert forced.choices[0].text == tiny_chat_model.detokenize([1000] * 6)
    plain, penalized = (c.completions.create(
        model=server.model_id, prompt="Once upon a time", max_tokens=24, temperature=0,
        extra_body=extra) for extra in ({}, {"frequency_penalty": 2, "repetition_penalty": 3}))
    model = tiny_chat_model
    want = _engine_tokens(model, model.ids("Once upon a time"),
                          Decoding(0.0, frequency_penalty=2.0, repetition_penalty=3.0), 24, 0)
    assert penalized.choices[0].text == model.detokenize(want.tokens)
    assert penalized.choices[0].text != plain.choices[0].text


def test_requests_join_a_running_batch(server):
    """Short requests sent while a long one decodes finish before it (continuous batching)."""
    c, done = client(server), {}

    def ask(name, max_tokens):
        c.completions.create(model=server.model_id, prompt="Hello there", temperature=0.5,
                             max_tokens=max_tokens, extra_body={"logit_bias": {"0": -100}})
        done[name] = time.monotonic()

    long = threading.Thread(target=ask, args=("long", 240))
    long.start()
    deadline = time.monotonic() + 60
    while server.counts.running < 1:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    short = [threading.Thread(target=ask, args=(i, 4)) for i in range(2)]
    for t in short:
        t.start()
    for t in (long, *short):
        t.join(120)
    assert done["long"] > max(done[0], done[1])


def test_overload_gets_503_and_the_server_keeps_serving(tiny_chat_model):
    with start_server(tiny_chat_model, port=0, max_queue=1, **SERVE) as handle:
        c, errors, replies = client(handle), [], []

        def ask():
            try:
                replies.append(c.completions.create(  # each fills every slot for a while
                    model=handle.model_id, prompt="Hi", n=4, max_tokens=200, temperature=0,
                    logit_bias={"0": -100, "2": -100}))
            except openai.APIStatusError as error:
                errors.append(error)

        threads = [threading.Thread(target=ask) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors and all(e.status_code == 503 and "overloaded" in str(e) for e in errors)
        assert len(replies) + len(errors) == 10 and replies
        assert c.completions.create(model=handle.model_id, prompt="Hi", max_tokens=2).choices


@pytest.mark.parametrize("path,payload,status,param", [
    ("/chat/completions", None, 400, None),
    ("/chat/completions", {"model": "M"}, 400, "messages"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "temperature": "hot"}, 400,
     "temperature"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "n": 0}, 400, "n"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "stream": "yes"}, 400, "stream"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "stream_options": {}}, 400,
     "stream_options"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].tool_call_id"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "max_tokens": 10 ** 6}, 400,
     "max_tokens"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "logprobs": True,
                           "top_logprobs": 21}, 400, "top_logprobs"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "tool_choice": "required"}, 400,
     "tool_choice"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "presence_penalty": 3}, 400,
     "presence_penalty"),
    ("/chat/completions", {"model": "other", "messages": HELLO}, 404, "model"),
    ("/completions", {"model": "M", "prompt": []}, 400, "prompt"),
    ("/completions", {"model": "M", "prompt": [10 ** 9]}, 400, "prompt"),
    ("/completions", {"model": "M", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/completions", {"model": "M", "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/completions", {"model": "M", "prompt": "x", "logit_bias": {"5": 101}}, 400,
     "logit_bias"),
    ("/completions", {"model": "M", "prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("/embeddings", {"model": "M", "input": "x"}, 404, None),
])
def test_bad_requests_get_openai_errors(server, path, payload, status, param):
    if payload is not None and payload.get("model") == "M":
        payload = {**payload, "model": server.model_id}
    code, body = post(server, path, payload, raw=b"{not json" if payload is None else None)
    assert code == status, body
    assert body["error"]["param"] == param and body["error"]["message"]


def test_the_server_keeps_serving_after_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model=server.model_id, messages=HELLO, temperature=5)
    reply = c.completions.create(model=server.model_id, prompt="The cat sat on", n=2,
                                 temperature=0, max_tokens=8)
    assert len(reply.choices) == 2 and reply.choices[0].text


def test_api_key_with_the_bearer_scheme_in_any_case(tiny_chat_model):
    with start_server(tiny_chat_model, port=0, api_key="s3cret", **SERVE) as handle:
        with pytest.raises(openai.AuthenticationError):
            client(handle, key="wrong").models.list()
        assert client(handle, key="s3cret").models.list().data[0].id == handle.model_id
        payload = {"model": handle.model_id, "prompt": "Hi", "max_tokens": 1}
        for scheme in ("bearer", "BEARER"):
            status, _ = post(handle, "/completions", payload,
                             headers={"Authorization": f"{scheme} s3cret"})
            assert status == 200
        assert post(handle, "/completions", payload)[0] == 401


def test_cli_flags_are_checked_before_loading(capsys):
    assert main(["serve", "--model", "nowhere", "--max-queue", "0"]) == 2
    assert "--max-queue must be >= 1" in capsys.readouterr().err
    unset = "JAXRL_SERVE_TEST_KEY_NEVER_SET"
    assert main(["serve", "--model", "nowhere", "--api-key-env", unset]) == 2
    assert unset in capsys.readouterr().err
    assert main(["serve", "--model", "nowhere", "--lora", "just-a-dir"]) == 2
    assert "NAME=DIR" in capsys.readouterr().err

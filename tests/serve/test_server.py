"""`jaxrl serve` through the openai client on a tiny random model: outputs equal the sampler's,
n > 1, stop strings, log-probs and usage, batching of concurrent requests, 400 / 404 / 401 / 503
replies after which the server keeps serving. Three programs are compiled in this module."""
import json
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import openai
import pytest

from jaxrl.cli import main
from jaxrl.config import SamplingConfig
from jaxrl.serve import start_server

HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with start_server(tiny_chat_model, port=0) as handle:
        yield handle


def _client(handle, key="unused"):
    return openai.OpenAI(base_url=handle.url, api_key=key, max_retries=0, timeout=120)


def _post(handle, path, payload, raw=None):
    """(status, JSON reply) of a POST with `payload` (or raw bytes) as the body."""
    data = raw if raw is not None else json.dumps(payload).encode()
    request = urllib.request.Request(handle.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _wait_for(handle, **counts):
    deadline = time.monotonic() + 60
    while any(handle.stats()[k] < v for k, v in counts.items()):
        assert time.monotonic() < deadline, handle.stats()
        time.sleep(0.005)


def test_chat_with_seed_n_and_stop_equals_the_sampler(server, tiny_chat_model):
    model = tiny_chat_model
    ids = model.chat_ids(HELLO)
    cfg = SamplingConfig(temperature=0.8, max_new_tokens=12)
    free = model.sample([ids] * 2, jax.random.PRNGKey(7), cfg)
    stop = free.texts[0][6:9]
    ref = model.sample([ids] * 2, jax.random.PRNGKey(7), SamplingConfig(
        temperature=0.8, max_new_tokens=12, stop=(stop,)))
    client = _client(server)
    assert [m.id for m in client.models.list().data] == [server.model_id]
    reply = client.chat.completions.create(model=server.model_id, messages=HELLO, n=2, seed=7,
                                           temperature=0.8, max_tokens=12, stop=[stop],
                                           logprobs=True)
    # OpenAI's texts end before the stop sequence; the sampler's keep it
    expected = [t[:t.find(stop)] if t.endswith(stop) else t for t in ref.texts]
    assert [c.message.content for c in reply.choices] == expected
    assert reply.choices[0].finish_reason == "stop"
    assert [c.finish_reason for c in reply.choices] == list(ref.finish_reasons)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == int(ref.mask.sum())
    logprobs = [t.logprob for t in reply.choices[0].logprobs.content]
    np.testing.assert_allclose(logprobs, ref.logprobs[0][ref.mask[0]], rtol=1e-6)
    again = client.chat.completions.create(model=server.model_id, messages=HELLO, n=2, seed=7,
                                           temperature=0.8, max_tokens=12, stop=[stop])
    assert [c.message.content for c in again.choices] == expected


def test_completions_batch_of_prompts_token_ids_and_n(server, tiny_chat_model):
    model = tiny_chat_model
    texts = ["Once upon a time", "The cat sat on"]
    ids = [model.ids(t) for t in texts]
    ref = model.sample(ids, jax.random.PRNGKey(0), GREEDY)
    client = _client(server)
    reply = client.completions.create(model=server.model_id, prompt=texts, temperature=0,
                                      max_tokens=8, logprobs=0)
    assert [c.text for c in reply.choices] == list(ref.texts)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[1].logprobs.token_logprobs == pytest.approx(
        ref.logprobs[1][ref.mask[1]].tolist(), rel=1e-6)
    assert reply.usage.prompt_tokens == sum(map(len, ids))
    assert reply.usage.completion_tokens == int(ref.mask.sum())
    by_ids = client.completions.create(model=server.model_id, prompt=ids[1], n=2,
                                       temperature=0, max_tokens=8)
    assert [c.text for c in by_ids.choices] == [ref.texts[1]] * 2


def test_concurrent_requests_share_a_batch_and_overload_gets_503(tiny_chat_model):
    model = tiny_chat_model
    texts = ["Once upon a time", "The cat sat on"]
    ref = model.sample([model.ids(t) for t in texts], jax.random.PRNGKey(0), GREEDY)
    with start_server(model, port=0, max_queue=2) as handle:
        client, replies = _client(handle), {}

        def ask(name, **kw):
            replies[name] = client.completions.create(model=handle.model_id, temperature=0, **kw)

        long = threading.Thread(target=ask, args=("long",),
                                kwargs={"prompt": "Hello there", "max_tokens": 500})
        long.start()
        _wait_for(handle, running=1)
        short = [threading.Thread(target=ask, args=(i,), kwargs={"prompt": t, "max_tokens": 8})
                 for i, t in enumerate(texts)]
        for thread in short:
            thread.start()
        _wait_for(handle, queued=2)
        with pytest.raises(openai.APIStatusError) as overloaded:
            client.completions.create(model=handle.model_id, prompt="x", max_tokens=1)
        for thread in (long, *short):
            thread.join(120)
        stats = handle.stats()
    assert overloaded.value.status_code == 503 and "overloaded" in str(overloaded.value)
    assert replies["long"].choices[0].finish_reason == "length"  # it ran the whole time
    assert [replies[i].choices[0].text for i in (0, 1)] == list(ref.texts)
    assert stats["batches"] == 2 and stats["rows"] == 3  # the two queued requests ran together


@pytest.mark.parametrize("path,payload,status,param", [
    ("/chat/completions", None, 400, None),
    ("/chat/completions", {"model": "M"}, 400, "messages"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "temperature": "hot"}, 400,
     "temperature"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "n": 0}, 400, "n"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "stream": True}, 400, "stream"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "frobnicate": 1}, 400,
     "frobnicate"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/chat/completions", {"model": "M", "messages": HELLO, "max_tokens": 10 ** 6}, 400,
     "max_tokens"),
    ("/chat/completions", {"model": "other", "messages": HELLO}, 404, "model"),
    ("/completions", {"model": "M", "prompt": []}, 400, "prompt"),
    ("/completions", {"model": "M", "prompt": [10 ** 9]}, 400, "prompt"),
    ("/completions", {"model": "M", "prompt": "x", "logprobs": 5}, 400, "logprobs"),
    ("/embeddings", {"model": "M", "input": "x"}, 404, None),
])
def test_bad_requests_get_openai_errors(server, path, payload, status, param):
    if payload is not None and payload.get("model") == "M":
        payload = {**payload, "model": server.model_id}
    code, body = _post(server, path, payload, raw=b"{not json" if payload is None else None)
    assert code == status, body
    assert body["error"]["param"] == param and body["error"]["message"]


def test_the_server_keeps_serving_after_errors(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=server.model_id, messages=HELLO, temperature=5)
    reply = client.completions.create(model=server.model_id, prompt="The cat sat on", n=2,
                                      temperature=0, max_tokens=8)
    assert len(reply.choices) == 2 and reply.choices[0].text


def test_api_key(tiny_chat_model):
    with start_server(tiny_chat_model, port=0, api_key="s3cret") as handle:
        with pytest.raises(openai.AuthenticationError):
            _client(handle, key="wrong").models.list()
        assert _client(handle, key="s3cret").models.list().data[0].id == handle.model_id


def test_cli_flags_are_checked_before_loading(capsys):
    assert main(["serve", "--model", "nowhere", "--max-queue", "0"]) == 2
    assert "--max-queue must be >= 1" in capsys.readouterr().err
    unset = "JAXRL_SERVE_TEST_KEY_NEVER_SET"
    assert main(["serve", "--model", "nowhere", "--api-key-env", unset]) == 2
    assert unset in capsys.readouterr().err

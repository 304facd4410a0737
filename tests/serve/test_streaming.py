"""Streaming through the openai client's iterator: chunks open with the role, their deltas add
up to the non-streamed reply (stop strings and log-probs included), each choice ends with its
finish reason, and include_usage adds a last chunk with the usage."""
import pytest

from jaxrl.serve import start_server
from tests.serve.helpers import HELLO, SERVE, client


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with start_server(tiny_chat_model, port=0, **SERVE) as handle:
        yield handle


def _chat(server, **kw):
    return client(server).chat.completions.create(model=server.model_id, messages=HELLO,
                                                  seed=5, temperature=0.9, **kw)


def test_chat_stream_adds_up_to_the_reply_with_usage_last(server):
    whole = _chat(server, max_tokens=16, n=2, logprobs=True, top_logprobs=2)
    chunks = list(_chat(server, max_tokens=16, n=2, logprobs=True, top_logprobs=2, stream=True,
                        stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    first = {ch.choices[0].index: ch.choices[0].delta for ch in reversed(chunks[:-1])}
    assert all(d.role == "assistant" for d in first.values())
    for i, choice in enumerate(whole.choices):
        mine = [ch.choices[0] for ch in chunks[:-1] if ch.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert mine[-1].finish_reason and not mine[-1].delta.content
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.content]
        assert [(t.token, t.logprob) for t in tokens] == [
            (t.token, t.logprob) for t in choice.logprobs.content]
        assert all(len(t.top_logprobs) == 2 for t in tokens)
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_a_stop_string_ends_the_stream_before_it(server):
    free = _chat(server, max_tokens=24).choices[0].message.content
    stop = free[8:12]
    whole = _chat(server, max_tokens=24, stop=[stop])
    deltas = [ch.choices[0].delta.content or "" for ch in _chat(server, max_tokens=24,
                                                                  stop=[stop], stream=True)]
    assert "".join(deltas) == whole.choices[0].message.content == free[:free.find(stop)]
    assert not any(stop in d for d in deltas)


def test_completions_stream(server):
    kw = dict(model=server.model_id, prompt=["Once upon a time", "The cat"], max_tokens=10,
              temperature=0, logprobs=1)
    whole = client(server).completions.create(**kw)
    chunks = list(client(server).completions.create(stream=True, **kw))
    assert all(ch.object == "text_completion" and ch.usage is None for ch in chunks)
    for choice in whole.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == \
            choice.logprobs.tokens
        assert mine[-1].finish_reason == choice.finish_reason == "length"

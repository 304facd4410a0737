"""Warm start: with warmup the server compiles its programs before /health says ok, so a first
request of a warmed shape (a prompt width, greedy or sampled, n up to the slots) compiles
nothing; a long prompt is prefilled in pieces (--prefill-chunk)."""
import time

from jaxrl.sampling import programs
from jaxrl.serve import start_server
from tests.serve.helpers import HELLO, client, get


def _compiled():
    return programs.admit._cache_size(), programs.generate.cache_size(), \
        programs.extend._cache_size()


def test_a_warmed_server_compiles_nothing_for_a_first_request(tiny_chat_model):
    with start_server(tiny_chat_model, port=0, slots=4, max_model_len=128, chunk=4,
                      prefill_chunk=32, warmup=True) as handle:
        deadline = time.monotonic() + 300
        while '"warming"' in get(handle, "/health").replace('":"', '": "'):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        before = _compiled()
        openai = client(handle)
        for request in ({"temperature": 0}, {"temperature": 0.8, "n": 4}, {"temperature": 0.8}):
            reply = openai.chat.completions.create(model=handle.model_id, messages=HELLO,
                                                   max_tokens=4, **request)
            assert reply.choices[0].message.content is not None
        long = [{"role": "user", "content": "word " * 60}]  # over 32 tokens: in pieces
        openai.chat.completions.create(model=handle.model_id, messages=long, max_tokens=2,
                                       temperature=0)
        assert _compiled() == before
        assert handle._scheduler.engine.stats.prefill_pieces > 0

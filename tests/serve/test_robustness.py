"""What clients send that a server must survive: lone surrogates, a failing engine (JSON 500,
then the server goes on), bodies that stop halfway (408) or are too large (413), a huge prompt
that must not hold up other requests, unknown fields (one warning per name); and what
operations see: one access-log line per request without prompt text or key, and /metrics."""
import dataclasses
import logging
import socket
import threading
import time

import numpy as np
import pytest

from jaxrl.serve import start_server
from tests.serve.helpers import HELLO, SERVE, client, get, post


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with start_server(tiny_chat_model, port=0, api_key="k3y", body_timeout_s=1.0,
                      **SERVE) as handle:
        yield handle


AUTH = {"Authorization": "Bearer k3y"}


def _raw(handle, request: bytes, wait: float = 10.0) -> bytes:
    """Send raw bytes on a new connection; what comes back until the server closes it."""
    with socket.create_connection((handle.host, handle.port), timeout=wait) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def test_a_lone_surrogate_is_a_400_and_the_server_goes_on(server):
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % (
        server.model_id.encode())
    status, body = post(server, "/chat/completions", raw=raw, headers=AUTH)
    assert status == 400 and "surrogate" in body["error"]["message"]
    assert client(server, "k3y").completions.create(model=server.model_id, prompt="Hi",
                                                     max_tokens=2).choices


def test_a_body_that_stops_halfway_gets_408(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k3y\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    started = time.monotonic()
    reply = _raw(server, head + b'{"model": ')
    assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply
    assert time.monotonic() - started < 8


def test_an_oversized_body_gets_413(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k3y\r\n"
            b"Content-Length: 999999999\r\n\r\n")
    assert _raw(server, head).startswith(b"HTTP/1.1 413")


def test_a_huge_prompt_does_not_hold_up_other_requests(server):
    c, finished = client(server, "k3y"), {}
    huge = "many words to tokenize " * 80_000  # ~1.8 MB, seconds of tokenizing

    def ask(name, prompt):
        try:
            c.completions.create(model=server.model_id, prompt=prompt, max_tokens=2)
        except Exception as error:  # the huge one exceeds the context: a 400
            finished[name + "-error"] = error
        finished[name] = time.monotonic()

    big = threading.Thread(target=ask, args=("huge", huge))
    big.start()
    time.sleep(0.3)
    ask("small", "Hello")
    big.join(120)
    assert finished["small"] < finished["huge"]
    assert "context" in str(finished["huge-error"])


def test_unknown_fields_are_warned_about_once(server, caplog):
    c = client(server, "k3y")
    with caplog.at_level(logging.WARNING, logger="jaxrl.serve"):
        for _ in range(2):
            c.chat.completions.create(model=server.model_id, messages=HELLO, max_tokens=2,
                                      extra_body={"guided_decoding_backend": "x", "best_of_vendor": 2})
    warned = [r.getMessage() for r in caplog.records if "ignoring the request field" in
              r.getMessage()]
    assert len(warned) == 2 and "'best_of_vendor'" in warned[0]


def test_one_access_log_line_per_request_without_prompt_or_key(server, caplog):
    c = client(server, "k3y")
    with caplog.at_level(logging.INFO, logger="jaxrl.serve.access"):
        c.chat.completions.create(model=server.model_id, max_tokens=3, messages=[
            {"role": "user", "content": "secret prompt words"}])
        list(c.completions.create(model=server.model_id, prompt="more secret words",
                                  max_tokens=3, stream=True))
        post(server, "/chat/completions", {"model": "x", "messages": HELLO}, headers=AUTH)
        lines, deadline = [], time.monotonic() + 10
        while len(lines) < 3 and time.monotonic() < deadline:  # written once the reply is sent
            time.sleep(0.01)
            lines = [r.getMessage() for r in caplog.records if r.name == "jaxrl.serve.access"]
    assert len(lines) == 3
    assert "POST /v1/chat/completions 200" in lines[0] and "completion_tokens=3" in lines[0]
    assert "POST /v1/completions 200" in lines[1] and "completion_tokens=3" in lines[1]
    assert " 404 " in lines[2]
    assert not any("secret" in line or "k3y" in line for line in lines)


def test_metrics_count_requests_tokens_and_latency(server):
    c = client(server, "k3y")
    c.completions.create(model=server.model_id, prompt="Hi", max_tokens=4)
    text = get(server, "/metrics")
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['jaxrl_serve_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values[f'jaxrl_serve_completion_tokens_total{{model="{server.model_id}"}}'] >= 4
    assert values["jaxrl_serve_time_to_first_token_seconds_count"] >= 1
    assert values["jaxrl_serve_time_per_output_token_seconds_count"] >= 1
    for name in ("jaxrl_serve_queue_depth", "jaxrl_serve_running",
                 "jaxrl_serve_slot_utilization", "jaxrl_serve_prompt_tokens_total"):
        assert any(key.startswith(name) for key in values), name


def test_a_failing_engine_gives_json_500s_and_the_server_goes_on(tiny_chat_model):
    params = dict(tiny_chat_model.params)
    params["norm"] = {"scale": np.ones(3, np.float32)}  # a wrong shape: every step fails
    broken = dataclasses.replace(tiny_chat_model, params=params)
    with start_server(broken, port=0, **SERVE) as handle:
        for _ in range(2):
            status, body = post(handle, "/completions", {"model": handle.model_id,
                                                         "prompt": "Hi", "max_tokens": 2})
            assert status == 500 and body["error"]["type"] == "server_error"
            assert "generation failed" in body["error"]["message"]
        assert '"status": "ok"' in get(handle, "/health").replace('":"', '": "')

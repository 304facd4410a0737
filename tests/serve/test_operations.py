"""Admission and what /metrics and the access log say: --max-queue counts only the requests
that no free slot takes, the gauges follow admissions and completions (utilization 0 when
idle), the latency histogram is per endpoint and leaves out /health and /metrics, and a client
that disconnects before its reply is done is counted and logged with status 499 (stream or
not), its waiting jobs dropped."""
import http.client
import json
import logging
import re
import socket
import threading
import time

import numpy as np
import pytest

import jaxrl.serve.server
from jaxrl.sampling import Engine
from jaxrl.sampling.sampling_fns import Decoding
from jaxrl.serve import start_server
from jaxrl.serve.scheduler import Job, Overloaded, Scheduler
from tests.serve.helpers import HELLO, SERVE, client, get
from tests.serve.test_scheduler import Sink, StandIn


class _Gated(Engine):
    """The server's engine, whose steps wait while `gate` is clear."""

    gate = threading.Event()

    def step(self):
        assert self.gate.wait(120)
        return super().step()


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    _Gated.gate.set()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jaxrl.serve.server, "Engine", _Gated)
        with start_server(tiny_chat_model, port=0, max_queue=1, **SERVE) as handle:
            yield handle
    _Gated.gate.set()


@pytest.fixture
def access_log():
    """The access log's lines, as the server writes them."""
    lines, logger = [], logging.getLogger("jaxrl.serve.access")

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _metric(text, name, **labels):
    """The value of `name` with exactly these labels (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        found = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if found and ",".join(sorted((found.group(1) or "").split(","))) == want:
            return float(found.group(2))
    return 0.0


def _until(check, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_burst_at_an_idle_server_fills_the_slots_then_the_queue():
    gate = threading.Event()
    engine = StandIn(slots=16, gate=gate)
    scheduler = Scheduler(lambda: engine, {"base": None}, max_queue=4)
    accepted, refused = [], 0
    for i in range(40):
        jobs = [Job([i], Decoding(), 2, np.zeros(2, np.uint32), Sink())]
        try:
            scheduler.submit("base", jobs)
            accepted.append(jobs)
        except Overloaded as error:
            refused += 1
            assert "--max-queue 4" in str(error)
    assert (len(accepted), refused) == (16 + 4, 20)
    gate.set()
    for job in (j for jobs in accepted for j in jobs):
        assert job.sink.finished.wait(30)
    _until(lambda: scheduler.counts.running == 0, "the engine went idle")
    assert scheduler.counts.utilization == 0
    scheduler.close()


def _ask_chat(handle, results, max_tokens=40):
    try:
        results.append(client(handle).chat.completions.create(
            model=handle.model_id, messages=HELLO, max_tokens=max_tokens, temperature=0,
            logit_bias={"0": -100, "2": -100}, n=4))  # every slot, no early EOS
    except Exception as error:  # noqa: BLE001 -- the test looks at it
        results.append(error)


def test_gauges_follow_admission_and_completion(server):
    before = get(server, "/metrics")
    results = []
    _Gated.gate.clear()
    try:
        threads = [threading.Thread(target=_ask_chat, args=(server, results)) for _ in range(2)]
        for t in threads:
            t.start()
        # the first request took the 4 slots, the second waits; no step has run yet
        _until(lambda: server.counts.running == 4 and server.counts.waiting == 4, "admitted")
        text = get(server, "/metrics")
        assert _metric(text, "jaxrl_serve_running") == 4
        assert _metric(text, "jaxrl_serve_queue_depth") == 4
    finally:
        _Gated.gate.set()
    for t in threads:
        t.join(120)
    assert all(not isinstance(r, Exception) for r in results), results
    _until(lambda: _metric(get(server, "/metrics"), "jaxrl_serve_running") == 0, "idle")
    text = get(server, "/metrics")
    assert _metric(text, "jaxrl_serve_queue_depth") == 0
    assert _metric(text, "jaxrl_serve_slot_utilization") == 0  # idle, after a busy chunk
    # latency per endpoint; probes and scrapes are not requests of the API
    endpoint = "/v1/chat/completions"
    assert (_metric(text, "jaxrl_serve_request_seconds_count", endpoint=endpoint)
            == _metric(before, "jaxrl_serve_request_seconds_count", endpoint=endpoint) + 2)
    get(server, "/health")
    text = get(server, "/metrics")
    for path in ("/health", "/metrics"):
        assert f'endpoint="{path}"' not in text


def test_the_queue_counts_only_requests_that_no_slot_takes(server):
    # 4 slots and --max-queue 1: one request holding every slot, one waiting, a third refused
    results = []
    _Gated.gate.clear()
    try:
        threads = [threading.Thread(target=_ask_chat, args=(server, results))
                   for _ in range(2)]
        for t in threads:
            t.start()
        _until(lambda: server.counts.running == 4 and server.counts.waiting == 4, "admitted")
        _ask_chat(server, results)
        assert len(results) == 1 and getattr(results[0], "status_code", None) == 503
    finally:
        _Gated.gate.set()
    for t in threads:
        t.join(120)
    assert len(results) == 3 and all(not isinstance(r, Exception) for r in results[1:])


def _send(handle, path, payload) -> socket.socket:
    """A raw connection that has sent a POST of `payload` (its reply left unread)."""
    sock = socket.create_connection((handle.host, handle.port))
    body = json.dumps(payload).encode()
    sock.sendall(f"POST /v1{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_a_client_that_leaves_early_is_logged_and_counted_as_499(server, access_log):
    before = get(server, "/metrics")
    chat = {"model": server.model_id, "messages": HELLO, "max_tokens": 30, "temperature": 0,
            "logit_bias": {"0": -100, "2": -100}}
    _Gated.gate.clear()
    try:
        # a stream: its first chunk arrives, then the client goes
        stream = _send(server, "/chat/completions", {**chat, "stream": True})
        assert stream.recv(1 << 16).startswith(b"HTTP/1.1 200")
        # a whole reply, waiting behind the stream's slot and three more
        full = _send(server, "/chat/completions", {**chat, "n": 4})
        _until(lambda: server.counts.waiting == 4, "the whole reply's jobs wait")
        full.close()
        _until(lambda: server.counts.waiting == 0, "its waiting jobs are dropped")
        stream.close()
        _until(lambda: sum(" 499 " in line for line in access_log) == 2, "logged as 499",
               timeout=30)
    finally:
        _Gated.gate.set()
    text = get(server, "/metrics")
    key = {"endpoint": "/v1/chat/completions", "status": "499"}
    assert _metric(text, "jaxrl_serve_requests_total", **key) == \
        _metric(before, "jaxrl_serve_requests_total", **key) + 2
    assert not any(" 200 " in line and "chat/completions" in line for line in access_log)
    # the server goes on serving
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def _engine(server):
    return server._scheduler.engine


def test_a_stream_whose_client_hangs_up_frees_its_slot(server):
    engine = _engine(server)
    chat = {"model": server.model_id, "messages": HELLO, "max_tokens": 200, "temperature": 0,
            "logit_bias": {"0": -100, "2": -100}, "stream": True}  # no EOS: 200 tokens
    before = engine.stats.tokens
    stream = _send(server, "/chat/completions", chat)
    assert stream.recv(1 << 16).startswith(b"HTTP/1.1 200")
    stream.close()
    _until(lambda: server.counts.running == 0, "the slot is freed", timeout=60)
    assert engine.stats.tokens - before < 150  # decoding stopped long before 200 tokens


def test_a_reply_ended_by_a_stop_string_frees_its_slot(server):
    engine = _engine(server)
    chat = {"model": server.model_id, "messages": HELLO, "max_tokens": 200, "temperature": 0,
            "logit_bias": {"0": -100, "2": -100}}
    free = client(server).chat.completions.create(**{**chat, "max_tokens": 12})
    stop = free.choices[0].message.content[2:5]  # a piece of the first words
    before = engine.stats.tokens
    reply = client(server).chat.completions.create(**chat, stop=[stop])
    assert reply.choices[0].finish_reason == "stop"
    _until(lambda: server.counts.running == 0, "the slot is freed", timeout=60)
    assert engine.stats.tokens - before < 40  # not 200: cancelled at the stop string

"""A scripted OpenAI-compatible chat-completions server on 127.0.0.1 for judge tests.

The reply is chosen by a `SCENARIO=<name>` marker anywhere in the request's messages:
  good        200, a valid judgement (coverage: 3 details, 2 addressed; directionality: 1.0)
  http500     500 every time
  http429     429 with Retry-After: 1 the first time a request body is seen, then good
  slow        good, after `slow_s` seconds (longer than the client's timeout)
  malformed   200 whose message content is not JSON
  badbody     200 whose HTTP body is not JSON at all
  wrongshape  200 whose content is JSON of the wrong shape
  echo_key    401 whose error message repeats the Authorization header (a careless server)
Every request waits `latency_s` first. `requests` records each request's scenario, headers
(lower-case names), body and arrival time (time.monotonic()).
"""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

COVERAGE_REPLY = {"details": [{"detail": "the lawn is wet", "addressed": True},
                              {"detail": "the street is dry", "addressed": True},
                              {"detail": "the sprinkler timer", "addressed": False}]}
DIRECTIONALITY_REPLY = {"rationale": "From the observations to the cause.", "score": 1.0}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default 5 drops bursts of connections (SYN retried after 1 s)


class Request(NamedTuple):
    scenario: str
    headers: dict
    body: dict
    time: float


class StubServer:
    """Use as a context manager; `base_url` ends in /v1."""

    def __init__(self, latency_s: float = 0.0, slow_s: float = 3.0):
        self.latency_s, self.slow_s = latency_s, slow_s
        self.requests: list[Request] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> StubServer:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def count(self, scenario: str) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.scenario == scenario)

    def _reply(self, scenario: str, body: dict, headers: dict) -> tuple[int, dict, dict | str]:
        """(status, extra headers, JSON body or raw text) for one request."""
        key = json.dumps(body, sort_keys=True)
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
        if scenario == "badbody":
            return 200, {}, "<html>oops"
        if scenario == "http500":
            return 500, {}, {"error": {"message": "internal error", "type": "server_error"}}
        if scenario == "http429" and first:
            return 429, {"Retry-After": "1"}, {"error": {"message": "slow down"}}
        if scenario == "echo_key":
            text = f"bad key: {headers.get('authorization')}"
            return 401, {}, {"error": {"message": text, "type": "invalid_request_error"}}
        if scenario == "slow":
            time.sleep(self.slow_s)
        system = body["messages"][0]["content"]
        content = json.dumps(COVERAGE_REPLY if "coverage" in system else DIRECTIONALITY_REPLY)
        if scenario == "malformed":
            content = '{"details": [{"detail": "x", "addressed": tru'
        elif scenario == "wrongshape":
            content = json.dumps({"details": "several", "score": "high"})
        return 200, {}, _completion(body.get("model", ""), content)

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = " ".join(str(m.get("content")) for m in body.get("messages", []))
                match = re.search(r"SCENARIO=(\w+)", text)
                scenario = match.group(1) if match else "good"
                headers = {k.lower(): v for k, v in self.headers.items()}
                with stub._lock:
                    stub.requests.append(Request(scenario, headers, body, time.monotonic()))
                time.sleep(stub.latency_s)
                status, extra, payload = stub._reply(scenario, body, headers)
                data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                try:
                    self.send_response(status)
                    for name, value in {"Content-Type": "application/json", **extra}.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout)

            def log_message(self, *args):
                pass

        return Handler


def _completion(model: str, content: str) -> dict:
    return {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

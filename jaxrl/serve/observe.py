"""Operations: Prometheus metrics (GET /metrics) and one access-log line per request.

Each server has its own registry, so servers started in one process do not share counters.
The access log (logger `jaxrl.serve.access`) writes method, path, status, seconds, the
served model, prompt and completion tokens and the client address: never prompt text, never
the API key. A request whose client disconnected before its reply was complete is logged and
counted with status 499 (whatever status its reply began with). The request counter and the
latency histogram count the API's requests, by endpoint: not GET /health and GET /metrics
(probes and scrapes). The gauges follow the scheduler's counts as they change (on submit,
admission, completion and each engine step), not only after steps.
"""
from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

access_log = logging.getLogger("jaxrl.serve.access")

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    """The server's counters, gauges and histograms (names start with jaxrl_serve_)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("jaxrl_serve_requests", "requests answered",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("jaxrl_serve_prompt_tokens", "prompt tokens", ["model"],
                                     registry=r)
        self.completion_tokens = Counter("jaxrl_serve_completion_tokens",
                                         "completion tokens returned", ["model"], registry=r)
        self.waiting = Gauge("jaxrl_serve_queue_depth", "completions waiting for a slot",
                             registry=r)
        self.scoring = Gauge("jaxrl_serve_prompt_logprob_jobs",
                             "prompt log-prob jobs (echo) waiting for the engine thread",
                             registry=r)
        self.running = Gauge("jaxrl_serve_running", "completions in decode slots", registry=r)
        self.utilization = Gauge("jaxrl_serve_slot_utilization",
                                 "share of slot-steps that emitted a token in the last chunk "
                                 "(0 while no completion is in a slot)", registry=r)
        self.adapter_steps = Counter("jaxrl_serve_engine_adapter_steps",
                                     "decode steps in which the model's rows emitted a token",
                                     ["model"], registry=r)
        self.adapter_tokens = Counter("jaxrl_serve_engine_adapter_tokens",
                                      "tokens the model's rows emitted in decode steps",
                                      ["model"], registry=r)
        self.mixed_steps = Counter("jaxrl_serve_engine_mixed_adapter_steps",
                                   "decode steps whose emitting rows used more than one adapter",
                                   registry=r)
        self._seen: dict = {}  # what the counters above have counted of the scheduler's counts
        self._lock = threading.Lock()  # `engine` is called from the engine and HTTP threads
        self.first_token = Histogram("jaxrl_serve_time_to_first_token_seconds",
                                     "from a request's arrival to its first token",
                                     buckets=_LATENCY, registry=r)
        self.per_token = Histogram("jaxrl_serve_time_per_output_token_seconds",
                                   "after the first token, per further token of a request",
                                   buckets=_PER_TOKEN, registry=r)
        self.latency = Histogram("jaxrl_serve_request_seconds", "from arrival to the last byte",
                                 ["endpoint"], buckets=_LATENCY, registry=r)

    def engine(self, counts) -> None:
        """The scheduler's counts, whenever they change."""
        with self._lock:
            self.waiting.set(counts.waiting)
            self.running.set(counts.running)
            self.utilization.set(counts.utilization)
            self.scoring.set(counts.scoring)
            # the scheduler's counts only grow (it sums each step's change of the engine's
            # stats, over engine rebuilds); the counters take what is new since the last call
            for counter, per_model in ((self.adapter_steps, counts.model_steps),
                                       (self.adapter_tokens, counts.model_tokens)):
                for model, n in per_model.items():
                    self._add(counter.labels(model), (counter, model), n)
            self._add(self.mixed_steps, self.mixed_steps, counts.mixed_steps)

    def _add(self, counter, key, total: int) -> None:
        new = total - self._seen.get(key, 0)
        if new > 0:
            counter.inc(new)
            self._seen[key] = total

    def generation(self, model: str, arrived: float, prompt_tokens: int, gen) -> None:
        """A finished request's tokens and timings (`gen`: its Generation)."""
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        tokens = gen.completion_tokens
        self.completion_tokens.labels(model).inc(tokens)
        if gen.first_token_at is not None:
            self.first_token.observe(gen.first_token_at - arrived)
            if tokens > 1 and gen.finished_at is not None:
                self.per_token.observe((gen.finished_at - gen.first_token_at) / (tokens - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class AccessLog:
    """ASGI middleware: one log line per HTTP request once its response has been sent (for a
    stream, after its last chunk), and the request counter and latency. A client that
    disconnects before the last byte of its reply was sent makes the status 499."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), [500]
        sent, aborted = [False], [False]  # the reply's last byte went out; the client left
        scope.setdefault("state", {})

        async def receiving():
            message = await receive()
            if message["type"] == "http.disconnect" and not sent[0]:
                aborted[0] = True
            return message

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                sent[0] = True
            try:
                await send(message)
            except OSError:  # the connection is gone
                aborted[0] = True
                raise

        try:
            await self.app(scope, receiving, sending)
        finally:
            self._log(scope, ABORTED if aborted[0] else status[0], time.monotonic() - start)

    def _log(self, scope, status: int, seconds: float) -> None:
        state, path = scope["state"], scope["path"]
        client = scope.get("client") or ("-", 0)
        if path not in _UNCOUNTED:
            endpoint = path if path in _ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(seconds)
        access_log.info("%s %s %s %d %.3fs model=%s prompt_tokens=%s completion_tokens=%s",
                        client[0], scope["method"], path[:200], status, seconds,
                        state.get("model", "-"), state.get("prompt_tokens", "-"),
                        state.get("completion_tokens", "-"))


ABORTED = 499  # nginx's "client closed request"
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
_UNCOUNTED = ("/health", "/metrics")

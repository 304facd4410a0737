"""The HTTP server: OpenAI's /v1/models, /v1/chat/completions and /v1/completions over the
sampler, plus GET /health ({"status": "ok"} and the queue's counters).

Standard library only (`ThreadingHTTPServer`): one thread per connection parses and validates a
request, renders and tokenizes its prompt, submits it to the batching queue and waits for its
completions; one worker thread runs the sampler (batching.py). Error replies have the OpenAI
shape {"error": {message, type, param, code}}: 400 for a malformed request, 401 for a wrong API
key (when one is required), 404 for an unknown path or model, 413 for a body over 16 MiB, 503
when too many requests are queued, 500 when generation itself failed. The server binds to
127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jinja2 import TemplateError

from jaxrl.hf.pretrained import Pretrained
from jaxrl.hf.tokenizer import TokenizerError
from jaxrl.serve import protocol as p
from jaxrl.serve.batching import Batcher, Closed, Job, Overloaded
from jaxrl.serve.engine import Engine

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    model_id: str
    max_batch_rows: int = 64  # rows (prompts x n) per sampler call; also the largest n
    max_queue: int = 64  # requests waiting for the next batch before 503
    default_max_tokens: int = 512  # chat completions without max_tokens (within the context)
    api_key: str = dataclasses.field(default="", repr=False)  # "": no key required
    seed: int = 0  # of the keys unseeded sampled requests draw from


def _wait(futures: list[Future]) -> list:
    try:
        return [f.result() for f in futures]
    except Closed as error:
        raise p.ApiError(503, str(error), kind="server_error", code="shutting_down") from None
    except Exception as error:
        log.exception("generation failed")
        raise p.ApiError(500, f"generation failed: {type(error).__name__}: {error}",
                         kind="server_error") from None


class Api:
    """Requests in (method, path, headers, body bytes), (status, JSON body, headers) out."""

    def __init__(self, engine: Engine, batcher: Batcher, options: ServeOptions):
        self.engine, self.batcher, self.options = engine, batcher, options
        self.created = int(time.time())

    def handle(self, method: str, path: str, headers: Mapping[str, str],
               body: bytes) -> tuple[int, dict, dict[str, str]]:
        try:
            return 200, self._route(method, path.split("?", 1)[0].rstrip("/"), headers,
                                    body), {}
        except p.ApiError as error:
            extra = {"Retry-After": "1"} if error.status == 503 else {}
            return error.status, error.body(), extra

    def _route(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> dict:
        if path == "/health" and method == "GET":
            return {"status": "ok", **self.batcher.stats()}
        self._authorize(headers)
        routes = {("GET", "/v1/models"): lambda: p.models_response(self.options.model_id,
                                                                   self.created),
                  ("GET", f"/v1/models/{self.options.model_id}"):
                      lambda: p.models_response(self.options.model_id, self.created)["data"][0],
                  ("POST", "/v1/chat/completions"): lambda: self._chat(_json(body)),
                  ("POST", "/v1/completions"): lambda: self._completions(_json(body))}
        if (method, path) in routes:
            return routes[(method, path)]()
        if any(path == known for _, known in routes):
            raise p.ApiError(405, f"{method} is not allowed on {path}")
        raise p.ApiError(404, f"unknown path {path}; this server has /v1/models, "
                         "/v1/chat/completions, /v1/completions and /health", code="not_found")

    def _authorize(self, headers: Mapping[str, str]) -> None:
        key = self.options.api_key
        given = headers.get("Authorization") or ""
        if key and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise p.ApiError(401, "missing or incorrect API key in the Authorization header "
                             "(Bearer KEY)", code="invalid_api_key")

    def _check_model(self, body: Mapping) -> None:
        if body["model"] != self.options.model_id:
            raise p.ApiError(404, f"the model {body['model']!r} does not exist; this server "
                             f"serves {self.options.model_id!r}", param="model",
                             code="model_not_found")

    def _chat(self, body) -> dict:
        p.check_fields(body, p.CHAT_FIELDS, ("model", "messages"))
        self._check_model(body)
        s = p.settings(body, self.options.max_batch_rows, p.chat_logprobs(body))
        messages = p.chat_messages(body)
        try:
            ids = self.engine.chat_ids(messages)
        except (TemplateError, TokenizerError) as error:
            raise p.bad("messages", f"the chat template cannot render them: {error}") from None
        choices = self._generate([ids], s, self.options.default_max_tokens, "messages")
        return p.chat_response(self.options.model_id, choices, len(ids), s.logprobs)

    def _completions(self, body) -> dict:
        p.check_fields(body, p.COMPLETION_FIELDS, ("model", "prompt"))
        self._check_model(body)
        s = p.settings(body, self.options.max_batch_rows, p.completion_logprobs(body))
        prompts = [self.engine.text_ids(x) if isinstance(x, str) else x
                   for x in p.completion_prompts(body, self.engine.vocab_size)]
        if not all(prompts):
            raise p.bad("prompt", "a prompt has no tokens")
        choices = self._generate(prompts, s, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
        return p.completion_response(self.options.model_id, choices,
                                     sum(map(len, prompts)), s.logprobs)

    def _max_tokens(self, prompt: list[int], s: p.Settings, default: int, field: str) -> int:
        room = self.engine.context - len(prompt)
        if room < 1:
            raise p.bad(field, f"the model's context is {self.engine.context} tokens and the "
                        f"prompt has {len(prompt)}, which leaves no room for a completion")
        if s.max_tokens is None:
            return min(default, room)
        if s.max_tokens > room:
            raise p.bad("max_tokens", f"the model's context is {self.engine.context} tokens; "
                        f"{len(prompt)} in the prompt plus max_tokens {s.max_tokens} exceed it")
        return s.max_tokens

    def _generate(self, prompts: list[list[int]], s: p.Settings, default: int,
                  field: str) -> list[p.Choice]:
        jobs = [Job(tuple(ids), s.n, self._max_tokens(ids, s, default, field), s.temperature,
                    s.top_p, s.stop, s.seed, s.logprobs) for ids in prompts]
        try:
            self.batcher.submit(jobs)
        except Overloaded as error:
            raise p.ApiError(503, f"the server is overloaded: {error}; retry later",
                             kind="server_error", code="overloaded") from None
        except Closed as error:
            raise p.ApiError(503, str(error), kind="server_error",
                             code="shutting_down") from None
        return [c for choices in _wait([job.future for job in jobs]) for c in choices]


def _json(body: bytes):
    try:
        return json.loads(body)
    except ValueError as error:
        raise p.ApiError(400, f"the request body is not valid JSON: {error}") from None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every reply carries Content-Length

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True  # the body is left unread
            status, payload, extra = 413, p.ApiError(
                413, f"Content-Length must be a whole number of bytes up to {MAX_BODY}").body(), {}
        else:
            status, payload, extra = self.server.api.handle(
                method, self.path, self.headers, self.rfile.read(length))
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **extra}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        log.info("%s %s", self.address_string(), format % args)


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default 5 drops bursts of connections

    api: Api

    def __init__(self, address):
        super().__init__(address, _Handler)


class ServerHandle:
    """A running server: `url` is its OpenAI base URL (ending in /v1), `model_id` the model
    name requests must give; `close()` (or leaving a `with` block) stops it."""

    def __init__(self, httpd: _HttpServer, batcher: Batcher, model_id: str):
        self._httpd, self._batcher, self.model_id = httpd, batcher, model_id
        host, port = httpd.server_address[:2]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}/v1"
        self._thread = threading.Thread(target=httpd.serve_forever, name="jaxrl-serve-http",
                                        daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, int]:
        return self._batcher.stats()

    def wait(self) -> None:
        """Block until the server is closed (from another thread or by a signal)."""
        while self._thread.is_alive():
            self._thread.join(0.5)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._batcher.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_server(model: Pretrained, host: str = "127.0.0.1", port: int = 8000, *,
                 model_id: str | None = None, **options) -> ServerHandle:
    """Serve `model` (from `jaxrl.hf.pretrained.load_pretrained`) on host:port (port 0: any free
    port) in background threads. `model_id` defaults to the model directory's name; the other
    keywords are `ServeOptions` fields."""
    opts = ServeOptions(model_id=model_id or model.path.name, **options)
    httpd = _HttpServer((host, port))  # bound first: a taken port leaves no thread behind
    engine = Engine(model, seed=opts.seed)
    batcher = Batcher(engine.run_group, opts.max_batch_rows, opts.max_queue)
    httpd.api = Api(engine, batcher, opts)
    return ServerHandle(httpd, batcher, opts.model_id)

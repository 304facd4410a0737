"""The ASGI application (Starlette): OpenAI's /v1/models, /v1/chat/completions and
/v1/completions, plus GET /health and GET /metrics (Prometheus text; neither needs the key).

A request's body is read with a deadline (408 when it does not arrive in time) and a size
limit (413), then parsed, rendered and tokenized on a worker thread (prepare.py); its jobs go
to the engine thread (scheduler.py) and the handler awaits their tokens (generation.py),
answering with one JSON body or, with `stream: true`, server-sent events in OpenAI's chunk
format ending in `data: [DONE]`. With `echo` (completions), each choice's text starts with its
prompt; with `logprobs` too, the prompt tokens' log-probs come first, from a teacher-forced
forward of the request's model that the engine thread runs between steps (scoring.py).

A client that disconnects before its reply is done is noticed (a stream by Starlette, a
whole reply by a watcher on the connection while it is generated): its waiting jobs are
dropped and the access log and /metrics count it with status 499.

Every error reply has OpenAI's shape {"error": {message, type, param, code}}: 400 malformed
request, 401 wrong or missing key (the `Bearer` scheme in any case), 404 unknown path or
model, 405 wrong method, 408 body too slow, 413 body too large, 503 overloaded or shutting
down, 500 anything unexpected (logged with its traceback).
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxrl.serve import protocol as p
from jaxrl.serve.generation import Generation
from jaxrl.serve.observe import ABORTED, AccessLog, Metrics
from jaxrl.serve.prepare import Echo, Prepared, Preparer
from jaxrl.serve.responses import (Choice, Piece, Reply, TokenLogprob, model_card,
                                   models_response)
from jaxrl.serve.scheduler import Closed, Job, Overloaded, Scheduler, Score
from jaxrl.serve.textstream import TextStream

log = logging.getLogger("jaxrl.serve")

MAX_BODY = 16 * 1024 * 1024


def _error(error: p.ApiError, **headers) -> JSONResponse:
    if error.status == 503:
        headers["Retry-After"] = "1"
    return JSONResponse(error.body(), error.status, headers=headers)


def _guarded(handler):
    """Answer ApiErrors in their shape and anything unexpected as a logged JSON 500."""
    @functools.wraps(handler)
    async def guarded(self, request: Request) -> Response:
        try:
            return await handler(self, request)
        except p.ApiError as error:
            close = {"Connection": "close"} if error.status in (408, 413) else {}
            return _error(error, **close)
        except Exception as error:  # noqa: BLE001 -- a reply, never a dropped connection
            log.exception("%s %s failed", request.method, request.url.path)
            return _error(p.ApiError(500, f"internal error: {type(error).__name__}",
                                     kind="server_error"))
    return guarded


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


class Api:
    """The handlers over one scheduler, preparer and decode tokenizer."""

    def __init__(self, scheduler: Scheduler, preparer: Preparer, decoder, metrics: Metrics,
                 api_key: str, body_timeout_s: float, workers: int):
        self.scheduler, self.preparer, self.metrics = scheduler, preparer, metrics
        self.api_key, self.body_timeout_s = api_key, body_timeout_s
        self.root = scheduler.models[0]
        self.created = int(time.time())
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="jaxrl-serve-prepare")
        self._decode = lambda ids: decoder.decode(list(ids), skip_special_tokens=True)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda i: decoder.decode([i]))

    def routes(self) -> list[Route]:
        return [Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"])]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 self.api_key.encode()):
            raise p.ApiError(401, "missing or incorrect API key in the Authorization header "
                             "(Bearer KEY)", code="invalid_api_key")

    async def health(self, request: Request) -> Response:
        c = self.scheduler.counts
        status = "warming" if self.scheduler.warming else "ok"
        return JSONResponse({"status": status, "waiting": c.waiting, "running": c.running,
                             "models": self.scheduler.models})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=self.metrics.content_type)

    @_guarded
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(models_response(self.scheduler.models, self.created, self.root))

    @_guarded
    async def model(self, request: Request) -> Response:
        self._authorize(request)
        name = request.path_params["model"]
        if name not in self.scheduler.models:
            raise p.ApiError(404, f"the model {name!r:.100} does not exist", param="model",
                             code="model_not_found")
        return JSONResponse(model_card(name, self.created, self.root))

    @_guarded
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, self.preparer.chat)

    @_guarded
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, self.preparer.completion)

    async def _body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            raise p.ApiError(413, f"Content-Length must be a whole number of bytes up to "
                             f"{MAX_BODY}; got {length[:40]!r}")

        async def read() -> bytes:
            data = bytearray()
            async for chunk in request.stream():
                data += chunk
                if len(data) > MAX_BODY:
                    raise p.ApiError(413, f"the request body exceeds {MAX_BODY} bytes")
            return bytes(data)

        try:
            return await asyncio.wait_for(read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise p.ApiError(408, f"the request body did not arrive within "
                             f"{self.body_timeout_s:g} s", code="request_timeout") from None

    async def _generate(self, request: Request, prepare: Callable[[bytes], Prepared]):
        arrived = time.monotonic()
        self._authorize(request)
        raw = await self._body(request)
        job = await asyncio.get_running_loop().run_in_executor(self._pool, prepare, raw)
        request.state.model = job.model
        request.state.prompt_tokens = sum(map(len, job.prompts))
        scores, scored = self._score(job)
        try:
            gen, jobs = self._start(job)
        except BaseException:
            self.scheduler.cancel(scores)
            raise
        finish = functools.partial(self._finished, request, job, gen, jobs + scores, arrived)
        if job.settings.stream:
            # watching starts now, not when the body is first iterated: a client gone before
            # the response starts never iterates it, and its jobs are cancelled all the same
            watcher = asyncio.ensure_future(
                _on_disconnect(request, lambda: self.scheduler.cancel(jobs + scores)))
            return StreamingResponse(self._stream(job, gen, scored, finish, watcher),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        try:
            choices = await _unless_disconnected(request, self._choices(job, gen, scored))
        except Exception as error:  # noqa: BLE001 -- an engine failure or shutdown
            raise _generation_error(error) from None
        finally:
            finish()
        if choices is None:  # nobody is left to read the reply
            return Response(status_code=ABORTED)
        reply = Reply(job.kind, job.model)
        return JSONResponse(reply.response(choices, request.state.prompt_tokens,
                                           gen.completion_tokens,
                                           job.settings.logprobs is not None))

    def _start(self, job: Prepared) -> tuple[Generation, list[Job]]:
        """The request's generation and its engine jobs (none for max_tokens 0: echo alone)."""
        s = job.settings
        streams = [TextStream(self._decode, s.stop, job.syntax, job.prefix,
                              offset=len(job.echo[i].text) if job.echo else 0)
                   for i in range(len(job.prompts)) for _ in range(s.n)]
        gen = Generation(streams, self.token_text, s.logprobs, job.tools, job.syntax)
        jobs = [Job(ids, s.decoding, job.max_tokens[i], job.keys[i * s.n + j],
                    gen.sink(i * s.n + j), constraint=job.constraint(i * s.n + j))
                for i, ids in enumerate(job.prompts) for j in range(s.n)]
        for empty in [j for j in jobs if j.max_tokens == 0]:
            empty.sink.done("length")
        by_choice = list(jobs)
        gen.on_stop = lambda index: self.scheduler.cancel([by_choice[index]])
        jobs = [j for j in jobs if j.max_tokens > 0]
        if jobs:
            with _admission():
                self.scheduler.submit(job.model, jobs)
        return gen, jobs

    def _score(self, job: Prepared) -> tuple[list[Score], list[asyncio.Future]]:
        """With echo and logprobs: each prompt's log-probs, computed on the engine thread
        (the jobs, to cancel, and the futures of their results)."""
        if not (job.settings.echo and job.settings.logprobs is not None):
            return [], []
        loop = asyncio.get_running_loop()
        scores, futures = [], []

        def settle(future: asyncio.Future, method: str, value) -> None:
            def settled() -> None:
                if not future.done():
                    getattr(future, method)(value)
            try:
                loop.call_soon_threadsafe(settled)
            except RuntimeError:  # the event loop has closed: nobody waits for this reply
                pass

        for ids in job.prompts:
            future = loop.create_future()
            scores.append(Score(ids, functools.partial(settle, future, "set_result"),
                                functools.partial(settle, future, "set_exception")))
            futures.append(future)
        try:
            with _admission():
                for score in scores:
                    self.scheduler.score(job.model, score)
        except BaseException:
            self.scheduler.cancel(scores)
            raise
        return scores, futures

    async def _echoes(self, job: Prepared, scored: list[asyncio.Future]) -> list[Piece]:
        """Per choice, what echo puts before its completion: the prompt's text and, with
        logprobs, the prompt tokens' log-probs (the first token's null)."""
        s = job.settings
        prompts = []
        for i, echo in enumerate(job.echo):
            entries = [] if not scored else self._prompt_logprobs(echo, await scored[i],
                                                                  s.logprobs)
            prompts.append((echo.text, entries))
        return [Piece(i * s.n + j, text, list(entries))
                for i, (text, entries) in enumerate(prompts) for j in range(s.n)]

    def _prompt_logprobs(self, echo: Echo, scored, k: int) -> list[TokenLogprob]:
        entries = [TokenLogprob(echo.tokens[0], None, (), echo.offsets[0])]
        for t in range(1, len(echo.tokens)):
            top = tuple((self.token_text(int(i)), float(lp)) for i, lp in
                        zip(scored.top_ids[t - 1, :k], scored.top_logprobs[t - 1, :k]))
            entries.append(TokenLogprob(echo.tokens[t], float(scored.logprobs[t - 1]), top,
                                        echo.offsets[t]))
        return entries

    async def _choices(self, job: Prepared, gen: Generation,
                       scored: list[asyncio.Future]) -> list[Choice]:
        choices = [Choice(i) for i in range(len(gen.streams))]
        if job.echo:
            for piece in await self._echoes(job, scored):
                choices[piece.index].add(piece)
        async for piece in gen.pieces():
            choices[piece.index].add(piece)
        return choices

    def _finished(self, request: Request, job: Prepared, gen: Generation, jobs: list[Job],
                  arrived: float) -> None:
        self.scheduler.cancel(jobs)
        request.state.completion_tokens = gen.completion_tokens
        self.metrics.generation(job.model, arrived, request.state.prompt_tokens, gen)

    async def _stream(self, job: Prepared, gen: Generation, scored: list[asyncio.Future],
                      finish: Callable[[], None], watcher: asyncio.Future
                      ) -> AsyncIterator[str]:
        """The reply's server-sent events; `watcher` (a task of `_on_disconnect`) runs beside
        them, so a client that hangs up frees its slots before the next event would have
        failed to go out; it is cancelled when the events end."""
        reply, s = Reply(job.kind, job.model), job.settings
        logprobs = s.logprobs is not None
        try:
            if job.kind == "chat":
                for i in range(len(gen.streams)):
                    yield _sse(reply.first_chunk(i))
            if job.echo:
                for piece in await self._echoes(job, scored):
                    yield _sse(reply.chunk(piece, logprobs))
            async for piece in gen.pieces():
                for part in _split(piece):
                    yield _sse(reply.chunk(part, logprobs))
            if s.include_usage:
                yield _sse(reply.usage_chunk(sum(map(len, job.prompts)), gen.completion_tokens))
            yield _sse("[DONE]")
        except Exception as error:  # noqa: BLE001 -- told to the client in the stream
            yield _sse(_generation_error(error).body())
        finally:
            watcher.cancel()
            finish()


class _admission:
    """Overloaded and Closed from the scheduler as 503 replies."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, Overloaded):
            raise p.ApiError(503, f"the server is overloaded: {error}; retry later",
                             kind="server_error", code="overloaded") from None
        if isinstance(error, Closed):
            raise p.ApiError(503, str(error), kind="server_error", code="shutting_down") from None
        return False


async def _on_disconnect(request: Request, then: Callable[[], None]) -> None:
    """Call then() once the client has disconnected (cancel this to stop watching)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    then()


async def _unless_disconnected(request: Request, work):
    """The result of the coroutine `work`, or None when the client disconnects first (then
    `work` is cancelled)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return None
    return task.result()


def _split(piece: Piece) -> list[Piece]:
    """A piece that ends its choice and carries text or tool calls goes out as two chunks:
    the delta, then the finish reason alone (as OpenAI streams it)."""
    if piece.finish_reason is None or not (piece.text or piece.tool_calls or piece.logprobs):
        return [piece]
    return [Piece(piece.index, piece.text, piece.logprobs, None, piece.tool_calls),
            Piece(piece.index, finish_reason=piece.finish_reason)]


def _generation_error(error: Exception) -> p.ApiError:
    if isinstance(error, p.ApiError):
        return error
    if isinstance(error, Closed):
        return p.ApiError(503, str(error), kind="server_error", code="shutting_down")
    log.error("generation failed: %s: %s", type(error).__name__, error)
    return p.ApiError(500, f"generation failed: {type(error).__name__}: {error}",
                      kind="server_error")


async def _http_error(request: Request, error: HTTPException) -> Response:
    message = {404: f"unknown path {request.url.path[:200]}; this server has /v1/models, "
                    "/v1/chat/completions, /v1/completions, /health and /metrics",
               405: f"{request.method} is not allowed on {request.url.path[:200]}"}
    code = "not_found" if error.status_code == 404 else None
    return _error(p.ApiError(error.status_code, message.get(error.status_code, error.detail),
                             code=code), **(error.headers or {}))


async def _server_error(request: Request, error: Exception) -> Response:
    log.error("%s %s failed: %s", request.method, request.url.path, error)
    return _error(p.ApiError(500, f"internal error: {type(error).__name__}", kind="server_error"))


def build_app(api: Api, metrics: Metrics) -> AccessLog:
    app = Starlette(routes=api.routes(),
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    return AccessLog(app, metrics)

"""An LLM judge over any OpenAI-compatible chat-completions server, through the openai client,
or (judge.local) decoded in the training process's own engine (jaxrl/rewards/local_judge.py).

`Judge.ask(messages)` returns the reply's text or raises `JudgeFailure(kind)`; the judge-based
rewards turn a failure into their default score (0) and count it. Requests use temperature
`judge.temperature` (0), `judge.max_tokens` and a per-request timeout; at most
`judge.concurrency` are in flight; with `judge.response_format: json_object` a server judge is
asked for a JSON object (response_format, part of the cached request) and a local one decodes
under that grammar. Timeouts, connection
errors, 408/409/429 and 5xx are retried up to `judge.max_retries` times after exponential
backoff with jitter (`judge.backoff_s` doubling, capped at `judge.max_backoff_s`), waiting at
least as long as a Retry-After header asks (within the same cap). Other 4xx and unreadable
responses fail at once.

Replies are cached in SQLite (`judge_cache.sqlite` in the run directory), keyed by model and a
hash of the request, so a resumed run never asks twice; identical requests in flight share one
call. The API key (from `judge.api_key`, else the environment variable `judge.api_key_env`) is
handed to the client and nowhere else: it is not stored in the cache, logged, or put in
failures, whose text is scrubbed of it in case a server echoes it back.

A local judge keeps this contract (the cache, keyed by `local:<judge.local>` unless
judge.model names it, in-flight sharing, the concurrency limit, failure kinds): its requests go
to the engine's queue instead of a socket and are not retried (a greedy local decode gives the
same reply again); a prompt that does not fit the judge's cache columns fails as
judge_prompt_too_long, one its chat template cannot render as judge_bad_request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import hashlib
import json
import logging
import os
import random
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from jaxrl.config import JudgeConfig
from jaxrl.rewards.base import RewardConfigError

log = logging.getLogger(__name__)

CACHE_FILE = "judge_cache.sqlite"
_RETRYABLE = frozenset({408, 409, 429})


class JudgeFailure(Exception):
    """A judgement that could not be had. kind: judge_timeout, judge_connection_error,
    judge_rate_limited, judge_http_error, judge_bad_response."""

    def __init__(self, kind: str, detail: str, attempts: int, status: int | None = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.attempts, self.status = kind, detail, attempts, status


@dataclass(frozen=True)
class JudgeReply:
    text: str
    cached: bool
    attempts: int


class JudgeCache:
    """Judge replies in SQLite, keyed by (model, request hash); safe across threads."""

    def __init__(self, path: str | os.PathLike):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS replies (model TEXT NOT NULL, request TEXT "
                         "NOT NULL, reply TEXT NOT NULL, created REAL NOT NULL, "
                         "PRIMARY KEY (model, request))")

    def get(self, model: str, request: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT reply FROM replies WHERE model = ? AND request = ?",
                                   (model, request)).fetchone()
        return None if row is None else row[0]

    def put(self, model: str, request: str, reply: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?)",
                             (model, request, reply, time.time()))


def request_hash(body: dict) -> str:
    """A stable hash of a request body (messages and sampling settings, never the key)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def retry_after_s(headers) -> float | None:
    """Seconds a Retry-After (or retry-after-ms) header asks for; None when absent or unreadable."""
    if headers is None:
        return None
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            return max(0.0, float(ms) / 1000)
        value = headers.get("retry-after")
        if value is None:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


class Judge:
    """A judge client for one model; create it anywhere, use it from one event loop at a time."""

    def __init__(self, cfg: JudgeConfig, run_dir: str | os.PathLike | None = None):
        self._local = None
        if cfg.local:
            from jaxrl.rewards import local_judge

            self._local = local_judge.current()
            if self._local is None:
                raise RewardConfigError(
                    f"judge.local={cfg.local} decodes the judge in the training process's "
                    "engine, which only `jaxrl train` runs; elsewhere serve the judge "
                    "(jaxrl serve) and set judge.base_url and judge.model")
            cfg = dataclasses.replace(cfg, model=cfg.model or f"local:{cfg.local}")
        elif not cfg.base_url or not cfg.model:
            raise RewardConfigError("judge-based rewards need 'judge.base_url' and 'judge.model' "
                                    "(an OpenAI-compatible server, e.g. judge.base_url="
                                    "http://127.0.0.1:8000/v1 judge.model=NAME)")
        self.cfg = cfg
        self._key = cfg.api_key or os.environ.get(cfg.api_key_env, "")
        if not self._key and self._local is None:
            log.info("judge: %s is not set; sending requests without an API key",
                     cfg.api_key_env)
        self._cache = JudgeCache(Path(run_dir) / CACHE_FILE) if cfg.cache and run_dir else None
        self._loop = None
        self._client = self._semaphore = None
        self._inflight: dict[str, asyncio.Task] = {}

    def __repr__(self) -> str:
        if self._local is not None:
            return f"Judge(local={self.cfg.local!r})"
        return f"Judge(model={self.cfg.model!r}, base_url={self.cfg.base_url!r})"

    def _bind(self) -> None:
        """A client and semaphore for the running loop (a new loop gets new ones)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._inflight = loop, {}
            self._semaphore = asyncio.Semaphore(self.cfg.concurrency)
            if self._local is not None:
                return
            self._client = openai.AsyncOpenAI(base_url=self.cfg.base_url,
                                              api_key=self._key or "EMPTY",
                                              timeout=self.cfg.timeout_s, max_retries=0)

    async def ask(self, messages: list[dict]) -> JudgeReply:
        """The judge's reply text to `messages`, from the cache when it has it."""
        self._bind()
        body = {"messages": messages, "temperature": self.cfg.temperature,
                "max_tokens": self.cfg.max_tokens}
        if self.cfg.response_format:  # a local judge decodes under the grammar's masks
            body["response_format"] = {"type": self.cfg.response_format}
        key = request_hash(body)
        if self._cache is not None and (text := self._cache.get(self.cfg.model, key)) is not None:
            return JudgeReply(text, True, 0)
        task = self._inflight.get(key)
        if task is None:
            task = self._inflight[key] = asyncio.ensure_future(self._fetch(key, body))
            task.add_done_callback(lambda done: self._settled(key, done))
        return await asyncio.shield(task)

    def _settled(self, key: str, task: asyncio.Task) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have timed out already

    async def _fetch(self, key: str, body: dict) -> JudgeReply:
        text, attempts = await self._request(body)
        if self._cache is not None:
            self._cache.put(self.cfg.model, key, text)
        return JudgeReply(text, False, attempts)

    async def _request(self, body: dict) -> tuple[str, int]:
        if self._local is not None:
            async with self._semaphore:
                future = self._local.submit(body["messages"], body["max_tokens"])
                return await asyncio.wrap_future(future), 1
        attempts = self.cfg.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                async with self._semaphore:
                    response = await self._client.chat.completions.create(
                        model=self.cfg.model, **body)
                return _reply_text(response, attempt), attempt
            except (openai.APIError, ValueError) as error:  # ValueError: a body that is not JSON
                failure, retry, wait = self._classify(error, attempt)
            if not retry or attempt == attempts:
                raise failure
            log.debug("judge: attempt %d failed (%s); retrying", attempt, failure)
            await asyncio.sleep(self._delay(attempt, wait))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _classify(self, error: Exception, attempt: int):
        """(failure, whether to retry, seconds the server asked to wait) for an API error."""
        if isinstance(error, openai.APITimeoutError):  # before its base, APIConnectionError
            detail = f"no reply within {self.cfg.timeout_s:g} s"
            return JudgeFailure("judge_timeout", detail, attempt), True, None
        if isinstance(error, openai.APIConnectionError):
            detail = self.scrub(str(error))[:300]
            return JudgeFailure("judge_connection_error", detail, attempt), True, None
        if isinstance(error, openai.APIStatusError):
            status = error.status_code
            kind = "judge_rate_limited" if status == 429 else "judge_http_error"
            detail = f"HTTP {status}: {self.scrub(str(error.message))[:300]}"
            retry = status in _RETRYABLE or status >= 500
            return JudgeFailure(kind, detail, attempt, status), retry, retry_after_s(
                error.response.headers)
        detail = f"{type(error).__name__}: {self.scrub(str(error))[:300]}"
        return JudgeFailure("judge_bad_response", detail, attempt), False, None

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        backoff = self.cfg.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
        return min(max(backoff, retry_after or 0.0), self.cfg.max_backoff_s)

    def scrub(self, text: str) -> str:
        """`text` with the API key, should it occur, replaced by [redacted]."""
        return text.replace(self._key, "[redacted]") if self._key else text

    async def aclose(self) -> None:
        """Close the client of the current loop (the cache stays open for later loops)."""
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.close()
            self._client = self._loop = None


def _reply_text(response, attempt: int) -> str:
    try:
        text = response.choices[0].message.content
    except (AttributeError, IndexError, TypeError):
        text = None
    if not isinstance(text, str):
        raise JudgeFailure("judge_bad_response", "the response has no message content", attempt)
    return text

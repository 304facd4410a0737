"""The host side of a decode request (`Request`), the engine's work counters (`EngineStats`) and
per-row keys (`row_keys`); jaxrl/sampling/engine.py decodes the requests.

A request that `hold`s its slot keeps it, with its conversation in the slot's KV cache, after it
finishes; a later request that `follows` it continues that conversation in the same slot: it
keeps the first `keep` tokens the held request generated (dropping the rest, e.g. what was
decoded past a stop string), appends its own `prompt` (an environment's reply, a tool result)
behind them and decodes on, without prefilling the conversation again. `Engine.release` gives a
held slot back.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.sampling.sampling_fns import Decoding


@dataclasses.dataclass(eq=False)
class Request:
    """One completion to decode: prompt token ids, settings, a budget and a key (the same key,
    prompt and settings always give the same tokens). on_token(token, logprob) is called with
    each new token as it is decoded (after `top_logprobs` got that token's alternatives, when
    decoding.top_logprobs asks for them); on_done(request) once it has finished. hold, follows
    and keep: multi-turn continuation in the same slot (module docstring). adapter: which of
    the engine's adapters the request decodes with, where the engine holds an
    `jaxrl.lora.adapters.AdapterSet` (0: the base alone, i: its i-th); an engine with one
    adapter (or none) decodes every request with it and takes adapter 0 only. A continuation
    decodes with the adapter of the request it follows. constraint: what the request's tokens
    must follow (a grammar, jaxrl/serve/structured.py), an object whose allowed(vocab) gives
    the tokens it may take next ([vocab] bool) and advance(token) takes each token emitted;
    while a constrained request decodes, the engine decodes every slot a token a step."""

    prompt: Sequence[int]
    decoding: Decoding = Decoding()
    max_new_tokens: int = 16
    key: jax.Array | np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(2, np.uint32))
    on_token: Callable[[int, float], None] | None = None
    on_done: Callable[["Request"], None] | None = None
    hold: bool = False  # keep the slot and its cache after finishing, for a follower
    follows: "Request | None" = None  # a finished request that held its slot
    keep: int | None = None  # tokens of `follows` kept before `prompt` (None: all of them)
    adapter: int = 0
    constraint: Any = None
    # the prompt's last `drawn` tokens are this completion's first ones, decoded before (by a
    # request whose slot is gone: a rollout row resumed from a checkpoint); its next token is
    # then the completion's token `drawn`, drawn with fold_in(key, drawn), so it decodes on as
    # the lost request would have where the cache holds the same keys and values;
    # max_new_tokens counts the drawn tokens too, `tokens` only the new ones
    drawn: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # per token: the decoding.top_logprobs most likely (token id, log-prob), best first
    top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" (an EOS id), "length" or "cancelled"
    cancelled: bool = False  # `Engine.cancel` was called: no token of it is handed out after
    slot: int | None = None  # the slot it decodes in (and holds, once finished, when `hold`)
    column: int = 0  # the cache column (= position) of its first generated token

    def _emit(self, token: int, logprob: float, top_ids: np.ndarray,
              top_logprobs: np.ndarray) -> None:
        if self.constraint is not None:
            self.constraint.advance(token)
        self.tokens.append(token)
        self.logprobs.append(logprob)
        k = self.decoding.top_logprobs
        if k:
            self.top_logprobs.append(tuple(zip(top_ids[:k].tolist(), top_logprobs[:k].tolist())))
        if self.on_token is not None:
            self.on_token(token, logprob)

    def _finish(self, stopped: bool) -> None:
        self._end("stop" if stopped else "length")

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        if self.on_done is not None:
            self.on_done(self)

    def kept(self) -> int:
        """How many tokens of `follows` this request keeps."""
        return len(self.follows.tokens) if self.keep is None else self.keep

    def start(self) -> int:
        """The cache column its appended tokens start at: behind the kept tokens of `follows`
        less one, since a slot's last generated token is fed (written to the cache) by the
        next step, so it leads the appended tokens."""
        return self.follows.column + self.kept() - 1

    def appended(self) -> list[int]:
        """The tokens a follower writes into the slot: the last kept token, then its prompt."""
        return [self.follows.tokens[self.kept() - 1], *self.prompt]


def row_keys(key: jax.Array, rows: Sequence[int]) -> np.ndarray:
    """[R, 2] the key of each row: fold_in(key, row), for requests numbered by row."""
    return np.asarray(jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.asarray(rows, jnp.uint32)))


@dataclasses.dataclass
class EngineStats:
    """Counters of this process's work: prompts prefilled, requests admitted, continuations
    appended to held slots, `generate` calls, decode steps run and tokens they emitted (a first
    token comes from the prefill or the append and is not counted here), the later pieces of
    prompts prefilled in chunks (`Engine`'s prefill_chunk); per adapter index,
    the decode steps in which rows of that adapter emitted and the tokens they emitted, and
    the decode steps whose emitting rows used more than one adapter."""

    prefills: int = 0
    admitted: int = 0
    continued: int = 0
    chunks: int = 0
    steps: int = 0
    tokens: int = 0
    prefill_pieces: int = 0
    adapter_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    adapter_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    mixed_steps: int = 0

    def count_chunk(self, emitted: np.ndarray, adapters: np.ndarray) -> None:
        """Count one `generate` chunk: emitted [S, N] of the slots whose adapter indices are
        adapters [S]."""
        emitted = np.asarray(emitted, bool)
        self.chunks += 1
        self.steps += int(emitted.any(axis=0).sum())
        self.tokens += int(emitted.sum())
        kinds = np.zeros(emitted.shape[1], np.int64)
        for a in np.unique(adapters[emitted.any(axis=1)]):
            rows = emitted[adapters == a]
            steps = rows.any(axis=0)
            a = int(a)
            self.adapter_steps[a] = self.adapter_steps.get(a, 0) + int(steps.sum())
            self.adapter_tokens[a] = self.adapter_tokens.get(a, 0) + int(rows.sum())
            kinds += steps
        self.mixed_steps += int((kinds > 1).sum())

    def utilization(self, slots: int) -> float:
        """Emitted tokens per slot-step of the decode steps run (1 = every slot always live)."""
        return self.tokens / (self.steps * slots) if self.steps else 0.0

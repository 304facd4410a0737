"""Prompt log-probs for `echo` with `logprobs` on /v1/completions: a teacher-forced forward of
the served model (with the request's model's adapter) over the prompt.

`PromptScorer(prompt, lora)` returns, for prompt tokens 1..n-1, log p(token | the tokens
before it) under the raw log-softmax of the logits (no temperature, no sampling filters), and
the `TOP` most likely tokens at each of those positions with their log-probs; the caller keeps
as many as the request asked for. The prompt is right-padded to its bucket
(`jaxrl.sampling.buckets.bucket`), so the forward compiles once per bucket (and per adapter
shape); the pads come after every real token and so, under causal attention, change nothing
before them. The LM head runs on `CHUNK` positions at a time, so at most [CHUNK, V] logits
exist at once. It runs on the scheduler's engine thread, between engine steps
(jaxrl/serve/scheduler.py): the device belongs to that one thread.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.backends.numerics import REFERENCE, Numerics
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import Params, hidden_states, lm_logits, logits_at
from jaxrl.sampling.buckets import bucket
from jaxrl.sampling.sampling_fns import MAX_TOP_LOGPROBS

TOP = MAX_TOP_LOGPROBS  # alternatives computed per position (the most a request may ask for)
CHUNK = 128  # positions per LM-head chunk


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Of prompt tokens 1..n-1 (token 0 has no prediction): logprobs [n-1] float32, the most
    likely tokens top_ids [n-1, TOP] int32 and their top_logprobs [n-1, TOP], best first."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@functools.partial(jax.jit, static_argnames=("spec", "numerics"))
def _score(params: Params, lora: Lora | None, tokens: jax.Array, *, spec: ModelSpec,
           numerics: Numerics):
    """(logp [T-1], top_lp [T-1, TOP], top_ids [T-1, TOP]) of tokens [T] (T a bucket)."""
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    h, _ = hidden_states(params, tokens[None], positions, spec, lora=lora, numerics=numerics)
    c = min(CHUNK, t)
    hs = h[0].reshape(t // c, c, -1)  # [K, C, E]; the last position predicts nothing kept
    targets = jnp.concatenate([tokens[1:], tokens[:1]]).reshape(t // c, c)

    def chunk(_, x):
        hc, tc = x
        logp = jax.nn.log_softmax(lm_logits(params, hc, spec, numerics).astype(jnp.float32))
        top_lp, top_ids = jax.lax.top_k(logp, TOP)
        return None, (logits_at(logp, tc), top_lp, top_ids.astype(jnp.int32))

    _, (logp, top_lp, top_ids) = jax.lax.scan(chunk, None, (hs, targets))
    flat = lambda x: x.reshape(t, *x.shape[2:])[:-1]
    return flat(logp), flat(top_lp), flat(top_ids)


class PromptScorer:
    """Teacher-forced prompt log-probs of the served model (module docstring)."""

    def __init__(self, params: Params, spec: ModelSpec, numerics: Numerics = REFERENCE):
        self.params, self.spec, self.numerics = params, spec, numerics

    def __call__(self, prompt: Sequence[int], lora: Lora | None) -> PromptLogprobs:
        n = len(prompt)
        if n < 1:
            raise ValueError("a prompt to score needs at least one token")
        tokens = np.zeros((bucket(n),), np.int32)
        tokens[:n] = prompt
        logp, top_lp, top_ids = jax.device_get(_score(self.params, lora, jnp.asarray(tokens),
                                                      spec=self.spec, numerics=self.numerics))
        k = n - 1
        return PromptLogprobs(np.asarray(logp[:k]), np.asarray(top_ids[:k]),
                              np.asarray(top_lp[:k]))

"""The model side of the server: prompts to token ids, and a group of jobs to completions through
one `Pretrained.sample` call.

Rows: each job's prompt repeated n times. Unless the group is one seeded job, the rows are
padded to a power of two by repeating the last row, so the number of compiled programs stays
bounded (batch sizes 1, 2, 4, ... times the sampler's own prompt and new-token buckets). The
sampler runs to the largest max_tokens of the group; each row is then cut to its own job's
max_tokens and stop sequences on the host. As in the OpenAI API, the returned text ends before
the stop sequence; the token ids (and usage) keep the token that completed it, which the model
did generate. A row that ended on an EOS id keeps that id too (the sampler's completion mask
includes it), and its finish reason is "stop".
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence

import jax

from jaxrl.config import SamplingConfig
from jaxrl.hf.pretrained import Pretrained
from jaxrl.sampling.buckets import bucket
from jaxrl.sampling.stop import cut_at_stop
from jaxrl.serve.batching import Job
from jaxrl.serve.protocol import Choice


def _stop_start(text: str, stop: Sequence[str]) -> int:
    """Where the earliest stop sequence in text begins (text holds at least one)."""
    return min(i for s in stop if (i := text.find(s)) >= 0)


class Engine:
    """Tokenizes for handler threads and samples for the batcher's thread; the tokenizer is
    used under a lock (a fast tokenizer may not be entered from two threads at once)."""

    def __init__(self, model: Pretrained, seed: int = 0):
        self.model = model
        self.vocab_size = model.spec.vocab_size
        self.context = model.spec.max_position_embeddings
        self._lock = threading.Lock()
        self._key = jax.random.PRNGKey(seed)
        self._calls = itertools.count()

    def chat_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        with self._lock:
            return self.model.chat_ids(messages)

    def text_ids(self, text: str) -> list[int]:
        with self._lock:
            return self.model.ids(text)

    def _decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self.model.detokenize(ids)

    def _token_texts(self, ids: Sequence[int]) -> tuple[str, ...]:
        """Each token's own text, special tokens included (an EOS shows as itself)."""
        with self._lock:
            return tuple(self.model.tokenizer.decode([i]) for i in ids)

    def run_group(self, jobs: list[Job]) -> list[list[Choice]]:
        """n choices per job, from one sampler call over all their rows."""
        first = jobs[0]
        rows = [list(job.prompt) for job in jobs for _ in range(job.n)]
        if not first.solo:
            rows += [rows[-1]] * (bucket(len(rows), minimum=1) - len(rows))
        key = (jax.random.PRNGKey(first.seed) if first.solo
               else jax.random.fold_in(self._key, next(self._calls)))
        cfg = SamplingConfig(temperature=first.temperature,
                             top_p=first.top_p if first.temperature > 0 else 1.0,
                             max_new_tokens=max(job.max_tokens for job in jobs))
        out = self.model.sample(rows, key, cfg)
        results, row = [], 0
        for job in jobs:
            results.append([self._choice(out, row + i, job) for i in range(job.n)])
            row += job.n
        return results

    def _choice(self, out, row: int, job: Job) -> Choice:
        mask = out.mask[row]
        ids = out.tokens[row][mask][:job.max_tokens].tolist()
        logprobs = out.logprobs[row][mask][:job.max_tokens].tolist()
        ended = bool(ids) and ids[-1] in self.model.eos_ids
        kept, text, stopped = cut_at_stop(ids, job.stop, self._decode)
        if stopped:
            text = text[:_stop_start(text, job.stop)]
        ids, logprobs = ids[:kept], logprobs[:kept]
        tokens, offsets = ((), ())
        if job.logprobs:
            tokens = self._token_texts(ids)
            offsets = tuple(len(self._decode(ids[:i])) for i in range(len(ids)))
        return Choice(text=text, token_ids=tuple(ids), tokens=tokens,
                      logprobs=tuple(logprobs) if job.logprobs else (), text_offsets=offsets,
                      finish_reason="stop" if stopped or ended else "length")

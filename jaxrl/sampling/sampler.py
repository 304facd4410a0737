"""`sample`: one completion per prompt through the decode engine (jaxrl/sampling/engine.py),
returned as padded arrays for the learner.

Every prompt is queued as one request (row i with key fold_in(key, i)); repeat a prompt for a
GRPO group and its G rows share one prefill. Rows that come in runs of R equal consecutive
prompts (R the greatest common divisor of the runs' lengths, G for GRPO's groups) decode in
blocks of R slots that also share the prompt's keys and values (`Engine`'s share), so each
decode step reads a group's prompt once instead of R times. The engine gets a slot per row,
or `cfg.slots` when that is fewer (blocks counted in powers of two; slots are then refilled a
block at a time as rows finish, a chunk of 16 steps at a time, else the whole new-token bucket
is one chunk), and a cache of the prompt bucket plus the new-token bucket per slot. A row finishes on any of the EOS
ids (chat models have several) or at `max_new_tokens`; its later columns hold the pad id, are
masked out and carry log-prob 0. The completion mask includes the EOS token itself.

Log-probs: of each chosen token under log_softmax(logits / T) for temperature T > 0, before
top-k / top-p / min-p filtering (what `jaxrl.rl.logprobs.token_logprobs(..., temperature=T)`
computes, so the GRPO ratio starts at 1); for T = 0 (greedy) under the untempered
log_softmax(logits).

Stop strings: between decode chunks (16 steps when there are stop strings) a row whose text
holds one is cancelled and its slot freed (refilled, or the rollout ends once every row has
ended); the rows are then cut at their first stop string on the host (jaxrl/sampling/stop.py).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.backends.numerics import Numerics
from jaxrl.config import SamplingConfig
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import Params
from jaxrl.sampling.buckets import bucket, left_pad
from jaxrl.sampling.engine import Engine
from jaxrl.sampling.requests import Request, row_keys
from jaxrl.sampling.sampling_fns import Decoding
from jaxrl.sampling.stop import cut_at_stop, stopped
from jaxrl.sharding import MeshRules

REFILL_CHUNK = 16  # decode steps between refills when rows outnumber slots

@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Host output of `sample`; the learner scores concat(prompt_tokens, tokens)."""

    prompt_tokens: np.ndarray  # [B, P] int32, left-padded to the prompt bucket
    prompt_mask: np.ndarray  # [B, P] bool
    tokens: np.ndarray  # [B, max_new_tokens] int32
    mask: np.ndarray  # [B, max_new_tokens] bool, cut at stop strings
    logprobs: np.ndarray  # [B, max_new_tokens] float32, 0 where masked
    finish_reasons: tuple[str, ...]  # "stop" (EOS id or stop string) or "length"
    texts: tuple[str, ...] | None  # the masked completions as text, with a detokenizer
    # [B, max_new_tokens] bool: the tokens the policy sampled, where a multi-turn rollout
    # (jaxrl/rl/episodes.py) also holds environment tokens; None: every token in `mask`
    policy_mask: np.ndarray | None = None
    # [B, max_new_tokens] int32: per token, the adapter version (updates it had taken) that
    # decoded it, -1 where masked; partial rollouts only (jaxrl/rl/partial.py), else None
    versions: np.ndarray | None = None

    @property
    def loss_mask(self) -> np.ndarray:
        """The tokens the loss and the KL cover: the policy's (`mask` unless multi-turn)."""
        return self.mask if self.policy_mask is None else self.policy_mask


def _apply_stop(out: SampleOutput, stop: Sequence[str],
                detokenize: Callable[[Sequence[int]], str]) -> SampleOutput:
    mask, reasons, texts = out.mask.copy(), list(out.finish_reasons), []
    for row in range(mask.shape[0]):
        ids = out.tokens[row, mask[row]].tolist()
        kept, text, stopped = cut_at_stop(ids, stop, detokenize)
        mask[row, kept:] = False
        reasons[row] = "stop" if stopped else reasons[row]
        texts.append(text)
    return dataclasses.replace(out, mask=mask, logprobs=np.where(mask, out.logprobs, 0.0),
                               finish_reasons=tuple(reasons), texts=tuple(texts))


def _runs_gcd(prompts: Sequence[Sequence[int]]) -> int:
    """The greatest common divisor of the lengths of the runs of equal consecutive prompts
    (0 without prompts): every run then splits into blocks of that many rows."""
    runs, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or list(prompts[i]) != list(prompts[start]):
            runs.append(i - start)
            start = i
    return math.gcd(*runs)


def slot_layout(rows: int, share: int, limit: int = 0, ways: int = 1) -> tuple[int, int]:
    """(slots, share) of the engine that decodes `rows` rows in runs of `share` equal prompts:
    blocks of `share` slots, a slot per row or `limit` slots (sampling.slots) when that is
    fewer, the block count rounded up to a power of two and to at least one block per batch
    shard (`ways`); share falls to 1 where blocks would straddle a shard."""
    def slots(share):
        blocks = bucket(-(-rows // share), minimum=1)
        if limit:
            blocks = min(blocks, bucket(-(-limit // share), minimum=1))
        return max(blocks, ways) * share

    share = max(share, 1)
    if share > 1 and (slots(share) // ways) % share:
        share = 1
    return slots(share), share


def sample(params: Params, spec: ModelSpec, prompts: Sequence[Sequence[int]], key: jax.Array,
           cfg: SamplingConfig = SamplingConfig(), *, lora: Lora | None = None,
           eos_ids: Sequence[int] = (), detokenize: Callable[[Sequence[int]], str] | None = None,
           shardings: MeshRules | None = None, numerics: Numerics | None = None,
           engine: Engine | None = None, adapter: int = 0) -> SampleOutput:
    """Sample one completion per prompt (lists of token ids; repeat a prompt for a group).

    cfg supplies temperature, top_k, top_p, min_p, max_new_tokens, stop strings and the number
    of decode slots (module docstring); eos_ids end a row (`jaxrl.hf.tokenizer.eos_token_ids`
    lists a model's; the first is the pad id after a row's end); detokenize (ids -> text) is needed
    for stop strings and fills `texts`. The same key, prompts and settings give the same output,
    and a row's output does not depend on the rows beside it. shardings: sample on a mesh; with
    several processes `prompts` are this process's rows (jaxrl/distributed.py) and so is the
    output. numerics: the backend forms (None: the choice for the mesh's devices, `Engine`).
    engine: decode in this engine (one process; rows of one slot each, `lora` ignored) under
    its adapter index `adapter` instead of in one laid out for these rows; it steps until
    these rows have finished, and other requests in it (a local judge's) decode beside them
    and may remain after.
    """
    if cfg.stop and detokenize is None:
        raise ValueError(f"stop strings {list(cfg.stop)} need a detokenize function (ids -> text)")
    decoding = Decoding.from_config(cfg)
    width = bucket(max(len(ids) for ids in prompts) if prompts else 1)
    rows, first = len(prompts), 0
    if shardings is not None:
        width = distributed.host_max(width)  # every process's rows share one cache width
        rows = distributed.global_rows(shardings, distributed.host_max(rows))
        first = distributed.local_rows(shardings, rows)[0]
    tokens, mask = left_pad(prompts, width)
    n = cfg.max_new_tokens
    if engine is not None:
        requests = _decode_in(engine, prompts, decoding, n, key, adapter, cfg.stop, detokenize)
        return finished_output(requests, tokens, mask, n, eos_ids, cfg, detokenize)
    share = _runs_gcd(prompts)
    if shardings is not None:
        share = distributed.host_gcd(share)
    slots, share = slot_layout(rows, share, cfg.slots,
                               1 if shardings is None else shardings.batch_ways)
    chunk = bucket(n) if slots >= rows and not cfg.stop else min(bucket(n), REFILL_CHUNK)
    engine = Engine(params, spec, eos_ids=eos_ids, slots=slots, capacity=width + bucket(n),
                    chunk=chunk, lora=lora, shardings=shardings, share=share,
                    prompt_capacity=width, numerics=numerics)
    keys = row_keys(key, range(first, first + len(prompts)))
    requests = [Request(list(ids), decoding, n, keys[i]) for i, ids in enumerate(prompts)]
    for i in range(0, len(requests), share):
        engine.submit_group(requests[i:i + share])
    _run_to_stops(engine, requests, cfg.stop, detokenize)
    return finished_output(requests, tokens, mask, n, eos_ids, cfg, detokenize)


def _decode_in(engine: Engine, prompts, decoding: Decoding, n: int, key: jax.Array,
               adapter: int, stop=(), detokenize=None) -> list[Request]:
    """The requests of `prompts`, decoded in a given engine until they have finished."""
    keys = row_keys(key, range(len(prompts)))
    requests = [engine.submit(Request(list(ids), decoding, n, keys[i], adapter=adapter))
                for i, ids in enumerate(prompts)]
    _run_to_stops(engine, requests, stop, detokenize, until_done=True)
    return requests


def _run_to_stops(engine: Engine, requests: list[Request], stop, detokenize,
                  until_done: bool = False) -> None:
    """Step `engine` until it has nothing left (until_done: until `requests` have finished),
    cancelling after each step the requests whose text holds a stop string."""
    while not (until_done and all(r.finish_reason is not None for r in requests)):
        busy = engine.step()
        for r in requests:
            if (stop and r.finish_reason is None and not r.cancelled
                    and stopped(r.tokens, stop, detokenize)):
                engine.cancel(r)
        if not busy:
            return


def finished_output(requests: Sequence[Request], tokens, mask, n: int, eos_ids,
                    cfg: SamplingConfig, detokenize) -> SampleOutput:
    """The finished `requests` (anything with tokens, logprobs and a finish_reason) as padded
    host arrays beside their left-padded prompts, cut at cfg's stop strings."""
    rows = len(requests)
    out = SampleOutput(prompt_tokens=tokens, prompt_mask=mask,
                       tokens=np.full((rows, n), eos_ids[0] if eos_ids else 0, np.int32),
                       mask=np.zeros((rows, n), bool),
                       logprobs=np.zeros((rows, n), np.float32),
                       finish_reasons=tuple(r.finish_reason for r in requests), texts=None)
    for row, r in enumerate(requests):
        k = len(r.tokens)
        out.tokens[row, :k], out.mask[row, :k], out.logprobs[row, :k] = r.tokens, True, r.logprobs
    return out if detokenize is None else _apply_stop(out, cfg.stop, detokenize)

"""One step's rollout, the packed form in which a checkpoint saves the rollout sampled ahead
of its update (`rewards.max_staleness: 1`; see jaxrl/checkpoint.py), and a rollout assembled
from the groups of several (dynamic sampling, jaxrl/rl/dynamic.py)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.sampling.buckets import bucket, quarter_bucket
from jaxrl.sampling.sampler import SampleOutput

_OUT_ARRAYS = ("prompt_tokens", "prompt_mask", "tokens", "mask", "logprobs")
_OPTIONAL = ("policy_mask", "versions")  # multi-turn rollouts; partial rollouts


@dataclasses.dataclass
class Rollout:
    """One step's prompts and completions, host side, plus the reference pass's log-probs."""

    step: int
    records: list[dict]  # P records, each repeated G times in the rows below (multi-turn:
    # each row's record with its "episode", jaxrl/rl/episodes.py)
    prompts: list[str]  # [B] rendered chat prompts
    out: SampleOutput
    ref_logp: jax.Array | None = None  # [B, columns[1]]
    # partial rollouts (jaxrl/rl/partial.py): the adapter version this rollout decoded with
    # (tokens of older ones were carried in) and its partial/* metrics
    version: int | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    _shares: dict[int, int] = dataclasses.field(  # limit -> `share`; a replaced copy starts
        default_factory=dict, init=False, repr=False, compare=False)  # empty

    @functools.cached_property
    def columns(self) -> tuple[int, int]:
        """(first prompt column, completion columns) that the reference pass and the update
        take: the sampler pads prompts to a power of two and completions to max_new_tokens,
        and the columns that are padding in every row are dropped, down to a quarter bucket of
        the longest prompt and a power-of-two bucket of the longest completion, so those
        programs compile for a few widths only. Dropped prompt columns are masked left padding
        and dropped completion columns follow every row's end, so no kept position's attention
        or log-prob changes. Agreed across processes (each holds its own rows)."""
        prompt, completion = self.out.prompt_mask.shape[1], self.out.tokens.shape[1]
        longest_prompt = int(self.out.prompt_mask.sum(axis=1).max(initial=1))
        used = np.flatnonzero(np.asarray(self.out.mask).any(axis=0))
        longest = int(used[-1]) + 1 if used.size else 1
        kept_prompt = distributed.host_max(min(prompt, quarter_bucket(longest_prompt)))
        kept = distributed.host_max(min(completion, bucket(longest)))
        return prompt - kept_prompt, kept

    def share(self, limit: int) -> int:
        """The most consecutive rows, a divisor of `limit`, that hold the same prompt in every
        block of them (a group's G rows do), agreed across processes (their greatest common
        divisor): the reference pass and the update then run each block's prompt once
        (`jaxrl.rl.train_step.Batch.share`). 1 where rows' prompts differ. Found once per
        limit: the reference pass and the update ask alike."""
        if limit not in self._shares:
            self._shares[limit] = self._find_share(limit)
        return self._shares[limit]

    def _find_share(self, limit: int) -> int:
        tokens, mask = self.out.prompt_tokens, np.asarray(self.out.prompt_mask, bool)
        tokens, rows = np.where(mask, tokens, -1), len(tokens)  # pad ids do not matter
        found = 1
        for d in range(limit, 1, -1):
            if limit % d or rows % d:
                continue
            blocks = (tokens.reshape(rows // d, d, -1), mask.reshape(rows // d, d, -1))
            if all((x == x[:, :1]).all() for x in blocks):
                found = d
                break
        return distributed.host_gcd(found)


def pack_rollout(rollout: Rollout) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(host arrays, JSON info) of a rollout, as a checkpoint holds it."""
    out = rollout.out
    arrays = {name: np.asarray(getattr(out, name)) for name in _OUT_ARRAYS + _OPTIONAL
              if getattr(out, name) is not None}
    if rollout.ref_logp is not None:  # this process's rows of it
        arrays["ref_logp"] = distributed.rows_to_local(rollout.ref_logp)
    info = {"step": rollout.step, "records": rollout.records, "prompts": rollout.prompts,
            "finish_reasons": list(out.finish_reasons),
            "texts": None if out.texts is None else list(out.texts),
            "version": rollout.version, "metrics": rollout.metrics}
    return arrays, info


def unpack_rollout(arrays: dict[str, np.ndarray], info: dict[str, Any]) -> Rollout:
    """The rollout `pack_rollout` packed; its arrays stay on the host (the programs place them
    as their shardings say)."""
    out = SampleOutput(**{name: arrays[name] for name in _OUT_ARRAYS},
                       **{name: arrays[name] for name in _OPTIONAL if name in arrays},
                       finish_reasons=tuple(info["finish_reasons"]),
                       texts=None if info["texts"] is None else tuple(info["texts"]))
    return Rollout(info["step"], info["records"], info["prompts"], out, arrays.get("ref_logp"),
                   info.get("version"), info.get("metrics", {}))


def take_groups(parts: list[Rollout], picks: list[tuple[int, int]], group: int) -> Rollout:
    """The rollout made of group `g` (rows g * group ... (g + 1) * group - 1) of parts[p] for
    each (p, g) in picks, in that order; prompts are left-padded to the widest part. It has
    no reference log-probs: its rows come from several passes."""
    rows = [(p, g * group + i) for p, g in picks for i in range(group)]
    width = max(part.out.prompt_tokens.shape[1] for part in parts)

    def column(name: str) -> np.ndarray:
        def row(p: int, r: int) -> np.ndarray:  # prompt rows gain masked padding on the left
            x = np.asarray(getattr(parts[p].out, name)[r])
            return np.pad(x, (width - x.shape[0], 0)) if name.startswith("prompt_") else x
        return np.stack([row(p, r) for p, r in rows])

    texts = None if any(part.out.texts is None for part in parts) else tuple(
        parts[p].out.texts[r] for p, r in rows)
    present = [name for name in _OPTIONAL if getattr(parts[0].out, name) is not None]
    out = SampleOutput(**{name: column(name) for name in _OUT_ARRAYS + tuple(present)},
                       finish_reasons=tuple(parts[p].out.finish_reasons[r] for p, r in rows),
                       texts=texts)
    return Rollout(parts[0].step, [parts[p].records[r] for p, r in rows],
                   [parts[p].prompts[r] for p, r in rows], out)

"""One step's rollout, and the packed form in which a checkpoint saves the rollout sampled ahead
of its update (`rewards.max_staleness: 1`; see jaxrl/checkpoint.py)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.sampling.sampler import SampleOutput

_OUT_ARRAYS = ("prompt_tokens", "prompt_mask", "tokens", "mask", "logprobs")


@dataclasses.dataclass
class Rollout:
    """One step's prompts and completions, host side, plus the reference pass's log-probs."""

    step: int
    records: list[dict]  # P records, each repeated G times in the rows below
    prompts: list[str]  # [B] rendered chat prompts
    out: SampleOutput
    ref_logp: jax.Array | None = None


def pack_rollout(rollout: Rollout) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(host arrays, JSON info) of a rollout, as a checkpoint holds it."""
    out = rollout.out
    arrays = {name: np.asarray(getattr(out, name)) for name in _OUT_ARRAYS}
    if rollout.ref_logp is not None:  # this process's rows of it
        arrays["ref_logp"] = distributed.rows_to_local(rollout.ref_logp)
    info = {"step": rollout.step, "records": rollout.records, "prompts": rollout.prompts,
            "finish_reasons": list(out.finish_reasons),
            "texts": None if out.texts is None else list(out.texts)}
    return arrays, info


def unpack_rollout(arrays: dict[str, np.ndarray], info: dict[str, Any]) -> Rollout:
    """The rollout `pack_rollout` packed; its arrays stay on the host (the programs place them
    as their shardings say)."""
    out = SampleOutput(**{name: arrays[name] for name in _OUT_ARRAYS},
                       finish_reasons=tuple(info["finish_reasons"]),
                       texts=None if info["texts"] is None else tuple(info["texts"]))
    return Rollout(info["step"], info["records"], info["prompts"], out, arrays.get("ref_logp"))

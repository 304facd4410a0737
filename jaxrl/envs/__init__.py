"""Environments: cases whose evidence is revealed only when an agent asks for it, and the
environments multi-turn GRPO trains in.

`base.Case` is the case interface (signals up front, tools to request the rest, a gold root
cause at two granularities); `diagnosis.generate_case` builds offline incident cases
deterministically from a seed. `protocol.Environment` is the multi-turn protocol
(reset(record) -> messages, step(text) -> messages, done, info); `ENVIRONMENTS` names the
environments `data.env` can select. Host side: nothing here imports jax.
"""
from __future__ import annotations

import importlib

ENVIRONMENTS = {  # config.ENV_NAMES lists the same names (data.env's choices)
    "calculator": "jaxrl.envs.calculator:Calculator",
    "diagnosis": "jaxrl.envs.diagnosis:Diagnosis",
}


def environment(name: str):
    """The Environment class registered as `name`."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; environments: "
                         f"{', '.join(ENVIRONMENTS)}")
    module, _, attr = ENVIRONMENTS[name].partition(":")
    return getattr(importlib.import_module(module), attr)

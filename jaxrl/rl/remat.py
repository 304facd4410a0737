"""`optim.remat`: what the GRPO update's backward pass recomputes of the forward pass.

Policies (`jaxrl.model.transformer.REMAT_POLICIES`), least recomputation first: none saves every
layer's intermediates and each chunk's logits, so the backward pass recomputes nothing; dots
saves each projection's output (the linear plus its LoRA delta) and recomputes attention, norms,
activations and the LoRA products (and the LM head chunks); full saves only each layer's input
and recomputes the whole forward pass. Less recomputation costs memory: none holds every
layer's activations at once.

`auto` tries dots, then full (AUTO_ORDER), and takes the first whose compiled program fits the
device: its peak (arguments + outputs - donated buffers + temporaries, from XLA's memory
analysis, the figures `jaxrl plan` reports) within the device's memory
(`jaxrl.devices.device_memory`: the reported limit, the chip's HBM, or on a CPU the memory
available when the step is compiled). When neither fits, full runs (its figures are the
smallest). A program the compiler refuses for lack of memory counts as not fitting. With several
processes, each picks by its own devices' memory and all then run the policy that recomputes
most among their picks, so that every process runs the same program. A run compiles its step
with `compile_step`, which dispatches auto here; `jaxrl.rl.train_step` knows only the named
policies.

none is never chosen by auto (ask for it by name): dots recomputes no matmul, only elementwise
work that XLA fuses into the backward's loops, while none makes the layer scan keep a stacked
[layers, ...] buffer for every intermediate, each filled, written per layer and read back,
which on the quickstart cost more than the recomputation (docs/benchmarks.md, Recomputation).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxrl import distributed
from jaxrl.devices import compiled_peak, device_memory
from jaxrl.rl.train_step import compile_train_step

POLICIES = ("none", "dots", "full")
AUTO_ORDER = ("dots", "full")  # what auto tries, in turn


def choose(lower: Callable[[str], Any], capacity: int | None) -> tuple[str, Any]:
    """(policy, compiled program): the first of AUTO_ORDER whose program `lower(policy)` (a
    jax Lowered) compiles within `capacity` bytes per device (None: no limit known), else
    full's."""
    for policy in AUTO_ORDER:
        last = policy == AUTO_ORDER[-1]
        try:
            compiled = lower(policy).compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e) or last:
                raise
            continue
        if last or capacity is None or compiled_peak(compiled) <= capacity:
            return policy, compiled
    raise AssertionError("unreachable: the last policy always returns")


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves)


class AutoRematStep:
    """The GRPO step under `optim.remat: auto`, called as the jitted step is:
    (state, params, batch) -> (state, metrics), the state donated. Each batch shape it meets is
    compiled once with the policy `choose` picks; `policies` and `compiled` map those shapes
    to it and to the compiled program. `reserve(bytes)`: memory per device that other buffers
    hold for the whole run (a local judge's engine), left out of what the step may take."""

    def __init__(self, spec, optimizer, opts, shardings=None):
        self._steps = {p: compile_train_step(spec, optimizer, dataclasses.replace(opts, remat=p),
                                             shardings) for p in AUTO_ORDER}
        devices = (jax.local_devices() if shardings is None
                   else list(jax.tree_util.tree_leaves(shardings)[0].device_set))
        self._capacity = device_memory(devices)[0]
        self._reserved = 0
        self.compiled: dict[tuple, Any] = {}
        self.policies: dict[tuple, str] = {}

    def __call__(self, state, params, batch):
        key = _signature(batch)
        if key not in self.compiled:
            lower = lambda p: self._steps[p].lower(state, params, batch)  # noqa: E731
            capacity = None if self._capacity is None else self._capacity - self._reserved
            policy, compiled = choose(lower, capacity)
            agreed = AUTO_ORDER[distributed.host_max(AUTO_ORDER.index(policy))]
            if agreed != policy:  # another process's memory holds less
                policy, compiled = agreed, lower(agreed).compile()
            self.compiled[key], self.policies[key] = compiled, policy
        return self.compiled[key](state, params, batch)


    def reserve(self, nbytes: int) -> None:
        self._reserved += int(nbytes)


def compile_step(spec, optimizer, opts, shardings=None):
    """The GRPO step for opts.remat, called as the jitted step is: under auto an
    `AutoRematStep`, else `jaxrl.rl.train_step.compile_train_step`'s jitted step."""
    if opts.remat == "auto":
        return AutoRematStep(spec, optimizer, opts, shardings)
    return compile_train_step(spec, optimizer, opts, shardings)

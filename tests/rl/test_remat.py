"""optim.remat: every policy gives the same update; auto takes dots, else full, whichever first
has a compiled step that fits the device's memory."""
import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxrl import distributed
from jaxrl.config import GrpoConfig, OptimConfig, load_config
from jaxrl.lora.lora import init_lora
from jaxrl.rl.remat import AUTO_ORDER, POLICIES, AutoRematStep, choose, compile_step
from jaxrl.rl.session import step_options
from jaxrl.rl.losses import token_weights
from jaxrl.rl.train_step import (StepOptions, accumulate_grads, compile_train_step,
                                 init_train_state, make_optimizer)
from tests.rl.test_train_step import N, setup  # noqa: F401  (the fixture)


class _Program:
    """A stand-in for a lowered and compiled program with the given memory figures (bytes)."""

    def __init__(self, argument, output, alias, temp, refuse=False):
        self.figures = SimpleNamespace(
            argument_size_in_bytes=argument, output_size_in_bytes=output,
            alias_size_in_bytes=alias, temp_size_in_bytes=temp)
        self.refuse = refuse

    def compile(self):
        if self.refuse:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: 9.1G of 8G hbm")
        return self

    def memory_analysis(self):
        return self.figures


# peaks: none 10 + 4 - 3 + 9 = 20, dots 10 + 4 - 3 + 5 = 16, full 10 + 4 - 3 + 1 = 12
PROGRAMS = {"none": _Program(10, 4, 3, 9), "dots": _Program(10, 4, 3, 5),
            "full": _Program(10, 4, 3, 1)}


@pytest.mark.parametrize("capacity,policy", [(None, "dots"), (20, "dots"), (16, "dots"),
                                             (15, "full"), (12, "full"), (1, "full")])
def test_choose_takes_dots_where_it_fits_else_full(capacity, policy):
    lowered = []
    chosen, compiled = choose(lambda p: lowered.append(p) or PROGRAMS[p], capacity)
    assert (chosen, compiled) == (policy, PROGRAMS[policy])
    assert lowered == list(AUTO_ORDER[:AUTO_ORDER.index(policy) + 1])  # no compile past the pick
    assert "none" not in lowered  # only by name


def test_choose_passes_over_a_program_the_compiler_refuses():
    programs = {**PROGRAMS, "dots": _Program(10, 4, 3, 5, refuse=True)}
    assert choose(programs.get, None)[0] == "full"
    refused = {p: _Program(1, 1, 0, 1, refuse=True) for p in POLICIES}
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        choose(refused.get, None)


def _lora(spec):
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=4, alpha=8)
    return lora.replace(weights=jax.tree_util.tree_map(
        lambda x: x + 0.1 if x.ndim == 3 and x.shape[1] == 4 else x, lora.weights))


def _options(remat):
    return StepOptions(grpo=GrpoConfig(beta=0.04), temperature=1.0, max_new_tokens=N,
                       remat=remat)


def test_every_policy_gives_the_same_gradients(setup):  # noqa: F811
    spec, params, batch = setup
    weights = token_weights(batch.completion_mask, "seq-mean-token-mean")
    grads = {p: jax.jit(lambda lora, params, batch, p=p: accumulate_grads(
        lora, params, spec, batch, weights, _options(p)))(_lora(spec), params, batch)
        for p in POLICIES}
    (loss, _), want = grads["full"]
    for policy in ("none", "dots"):
        (got_loss, _), got = grads[policy]
        np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            # float32 sums in another order
            np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()), err_msg=policy)


def test_auto_saves_the_projections_where_memory_allows(setup):  # noqa: F811
    spec, params, batch = setup
    optimizer, _ = make_optimizer(OptimConfig(lr=1e-2), total_steps=10)
    steps = {p: compile_step(spec, optimizer, _options(p)) for p in ("auto", "dots")}
    assert isinstance(steps["auto"], AutoRematStep)
    metrics = {p: step(init_train_state(_lora(spec), optimizer), params, batch)[1]
               for p, step in steps.items()}
    for key in ("loss", "grad_norm", "kl"):
        np.testing.assert_allclose(metrics["auto"][key], metrics["dots"][key], rtol=1e-6)
    # this machine's memory holds the tiny step many times over
    assert list(steps["auto"].policies.values()) == ["dots"]


def test_auto_runs_the_policy_of_the_process_with_least_memory(setup, monkeypatch):  # noqa: F811
    """Every process must run the same program: one whose memory holds only full makes all run
    full, though this one's holds dots."""
    spec, params, batch = setup
    optimizer, _ = make_optimizer(OptimConfig(lr=1e-2), total_steps=10)
    asked = []
    monkeypatch.setattr(distributed, "host_max",
                        lambda v: asked.append(v) or AUTO_ORDER.index("full"))
    step = compile_step(spec, optimizer, _options("auto"))
    metrics = step(init_train_state(_lora(spec), optimizer), params, batch)[1]
    assert asked == [AUTO_ORDER.index("dots")]  # what this process would have taken
    assert list(step.policies.values()) == ["full"]
    want = compile_train_step(spec, optimizer, _options("full"))(
        init_train_state(_lora(spec), optimizer), params, batch)[1]
    np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-6)


def test_step_options_carry_the_configured_policy():
    assert step_options(load_config(None, ["optim.remat=dots"])).remat == "dots"
    assert step_options(load_config(None)).remat == "auto"
    assert dataclasses.replace(StepOptions(GrpoConfig(), 1.0, 4), remat="none").remat == "none"

"""quant.dequantize auto by memory: the numerics' rule, the planner's dense fit against a fake
device memory (the dense weights by hand), the loader's choice and its one log line, and the
plan of such a config (a GPU's numerics on this CPU host)."""
import json

import jax.numpy as jnp
import pytest

from jaxrl import planner
from jaxrl.backends.numerics import Numerics, numerics_for
from jaxrl.config import QuantConfig, load_config
from jaxrl.hf.loader import architecture, load_model
from jaxrl.planner import DenseFit, ProgramMemory, dense_fit, plan_memory
from jaxrl.quant.nf4 import QTensor
from jaxrl.sharding import MeshRules, make_mesh

TINY = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
        "head_dim": 16, "eos_token_id": 2}
# dense bf16 weights of TINY: embedding and LM head 128*64 each (untied), final norm 64, per
# layer norms 64 + 64 + 16 + 16 and kernels q, k, v 64*128, o 128*64, gate and up 64*128,
# down 128*64 (57,344): 131,456 values, 2 bytes each
DENSE_WEIGHTS = 262_912
GIB = 1 << 30


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: {tmp_path / 'model'}}}\nquant: {{block_size: 16}}\n"
                    "lora: {rank: 4, alpha: 8}\nmesh: {data: 1}\n"
                    "data: {prompts_per_step: 1, max_prompt_tokens: 16}\n"
                    "sampling: {max_new_tokens: 8}\ngrpo: {num_generations: 2}\n"
                    "optim: {remat: dots}\n")  # one policy: the need does not follow memory
    cfg = load_config(str(path), [])
    rules = MeshRules(make_mesh(cfg.mesh, jax_devices()[:1]))
    return cfg, architecture(cfg.model.path), rules


def jax_devices():
    import jax

    return jax.devices()


def test_the_rule_asks_memory_only_where_auto_turns_on_it():
    gpu, cpu, tpu = numerics_for("gpu"), numerics_for("cpu"), numerics_for("tpu")
    auto = QuantConfig()

    def never():
        raise AssertionError("memory was asked where it decides nothing")

    assert gpu.dequantize_strategy(auto, lambda: True) == "once"
    assert tpu.dequantize_strategy(auto, lambda: True) == "once"
    assert gpu.dequantize_strategy(auto, lambda: False) == "per_layer"
    assert gpu.dequantize_strategy(auto, lambda: None) == "per_layer"  # memory unknown
    assert gpu.dequantize_strategy(auto) == "per_layer"  # not asked
    assert cpu.dequantize_strategy(auto, never) == "once"
    for named in ("once", "per_layer"):
        assert gpu.dequantize_strategy(QuantConfig(dequantize=named), never) == named


def test_a_small_model_dequantizes_once_and_less_memory_keeps_nf4(setup):
    cfg, spec, rules = setup
    # plenty: the plan with dense kernels is compiled and fits
    fit = dense_fit(cfg, spec, rules, (GIB, "a fake 1 GiB device"))
    assert fit.weights == DENSE_WEIGHTS and fit.fits is True
    assert DENSE_WEIGHTS < fit.need < GIB
    assert "fits" in fit.describe() and "a fake 1 GiB device" in fit.describe()
    # a byte less than the dense weights: no plan is compiled, NF4 is kept
    short = dense_fit(cfg, spec, rules, (DENSE_WEIGHTS - 1, "a fake small device"))
    assert (short.fits, short.need) == (False, None)
    assert "do not fit, NF4 kept" in short.describe()
    # the weights fit but not what the run needs beside them
    tight = dense_fit(cfg, spec, rules, (fit.need - 1, "need - 1"))
    assert tight.fits is False and tight.need == fit.need
    assert dense_fit(cfg, spec, rules, (None, "unknown")).fits is None

    gpu = numerics_for("gpu")
    lines = []
    for given, dense in ((fit, True), (short, False), (tight, False)):
        model = load_model(spec, dtype=jnp.bfloat16, quant=cfg.quant, numerics=gpu,
                           weights="abstract", dense_fit=lambda s, f=given: f,
                           log=lines.append)
        kernel = model.params["layers"]["q_proj"]["kernel"]
        assert isinstance(kernel, QTensor) is not dense
    assert lines[0].startswith("quant.dequantize auto: once (with dense kernels the run needs")
    assert lines[1].startswith("quant.dequantize auto: per_layer (dense weights alone")
    assert lines[2].startswith("quant.dequantize auto: per_layer (") and len(lines) == 3
    # the CPU dequantizes once without asking
    load_model(spec, dtype=jnp.bfloat16, quant=cfg.quant, numerics=numerics_for("cpu"),
               weights="abstract", dense_fit=lambda s: pytest.fail("asked"), log=lines.append)
    assert len(lines) == 3


def test_the_plan_of_auto_is_the_one_the_run_takes(setup, monkeypatch):
    cfg, spec, rules = setup
    # a GPU's XLA forms on this CPU host (the planner lowers on a mesh)
    gpu = Numerics(name="gpu", nf4_decode="split", nf4_many="split")
    monkeypatch.setattr(planner, "numerics_of", lambda rules=None: gpu)
    rows = plan_memory(cfg, spec, rules, GIB)
    assert isinstance(rows[0], ProgramMemory)
    assert rows[0].name == "sampler (quant.dequantize auto: once)"
    rows = plan_memory(cfg, spec, rules, DENSE_WEIGHTS - 1)
    assert rows[0].name == "sampler (quant.dequantize auto: per_layer)"
    unknown = plan_memory(cfg, spec, rules, None)  # memory unknown: NF4 kept
    assert unknown[0].name == "sampler (quant.dequantize auto: per_layer)"


def test_dense_fit_describes_an_unknown_memory():
    fit = DenseFit(None, DENSE_WEIGHTS, None, None, "the device reports none")
    assert fit.describe().endswith("device memory unknown (the device reports none): NF4 kept")


def test_a_plan_that_fails_leaves_nf4(setup, monkeypatch):
    cfg, spec, rules = setup

    def broken(*args):
        raise RuntimeError("no plan here")

    monkeypatch.setattr(planner, "_plan", broken)
    fit = dense_fit(cfg, spec, rules, (GIB, "fake"))
    assert fit.fits is None and "no plan here" in fit.note
    assert numerics_for("gpu").dequantize_strategy(QuantConfig(), lambda: fit.fits) == "per_layer"
    assert "not planned, NF4 kept" in fit.describe()

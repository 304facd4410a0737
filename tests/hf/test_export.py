"""Exported adapters load in PEFT with jaxrl's logits; merged exports load in transformers with
the logits of jaxrl's dequantized base plus LoRA; `jaxrl export` reads a run's checkpoints.
(An adapter written by PEFT itself importing into jaxrl: tests/hf/test_peft_io.py.)"""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.checkpoint import Checkpoints
from jaxrl.cli import main
from jaxrl.config import QuantConfig, apply_overrides
from jaxrl.hf.export import write_peft_adapter
from jaxrl.hf.load import load_params
from jaxrl.hf.peft_io import load_peft_adapter
from jaxrl.hf.safetensors_io import iter_tensors
from jaxrl.model.families import load_spec
from jaxrl.model.transformer import forward, positions_from_mask
from jaxrl.quant.qparams import dequantize_params
from tests.checkpoint import helpers
from tests.tiny_models import make_model, padded_batch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _jaxrl_logits(params, spec, lora) -> np.ndarray:
    tokens, mask = padded_batch(length=12)
    m = jnp.asarray(mask)
    logits = forward(params, jnp.asarray(tokens), positions_from_mask(m), spec, attn_mask=m,
                     lora=lora)[0]
    return np.asarray(logits)[mask]


def _torch_logits(model) -> np.ndarray:
    tokens, mask = padded_batch(length=12)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(int)))
    return out.logits.numpy()[mask]


def test_adapter_loads_in_peft_with_jaxrl_logits(tmp_path):
    from peft import PeftModel

    model = make_model("qwen2")
    model.save_pretrained(tmp_path / "base")
    spec, params = load_params(tmp_path / "base")
    cfg = apply_overrides(helpers.config(tmp_path / "base", tmp_path),
                          ["lora.targets=" + ",".join(ALL), "lora.alpha=12"])
    lora = helpers.state(cfg, spec).lora
    write_peft_adapter(tmp_path / "adapter", lora, spec, str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("r", "lora_alpha", "lora_dropout", "task_type", "bias",
                                   "peft_type", "base_model_name_or_path")} == {
        "r": 4, "lora_alpha": 12, "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "bias": "none",
        "peft_type": "LORA", "base_model_name_or_path": str(tmp_path / "base")}
    assert set(config["target_modules"]) == set(ALL)
    names = [name for name, _ in iter_tensors(tmp_path / "adapter/adapter_model.safetensors")]
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names
    assert len(names) == 2 * 2 * len(ALL)

    peft_model = PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    np.testing.assert_allclose(_torch_logits(peft_model), _jaxrl_logits(params, spec, lora),
                               atol=1e-5, rtol=0)
    back = load_peft_adapter(tmp_path / "adapter", spec)
    assert back.scale == lora.scale
    for x, y in zip(jax.tree_util.tree_leaves(back.weights),
                    jax.tree_util.tree_leaves(lora.weights)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, default_model_dir):
    """A run directory whose checkpoint 2 holds a random adapter over an NF4 tiny llama with
    tied embeddings and the default model's tokenizer files."""
    root = tmp_path_factory.mktemp("export")
    make_model("llama", tie=True).save_pretrained(root / "base")
    for f in default_model_dir.glob("tokenizer*"):
        shutil.copy(f, root / "base" / f.name)
    cfg = apply_overrides(helpers.config(root / "base", root / "run"),
                          ["quant.mode=nf4", "lora.targets=q_proj,o_proj,up_proj,down_proj"])
    spec = load_spec(root / "base")
    checkpoints = Checkpoints(cfg, root / "base", spec, log=lambda m: None)
    for step in (1, 2):
        checkpoints.after_step(step, helpers.state(cfg, spec, seed=step),
                               jax.random.PRNGKey(0), helpers.no_data())
    checkpoints.close()
    return root, cfg, spec


def test_merged_export_matches_dequantized_base_plus_lora(run_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, cfg, spec = run_dir
    assert main(["export", "--run", str(root / "run"), "--out", str(root / "m32"), "--merged",
                 "--dtype", "float32"]) == 0
    assert "step 2" in capsys.readouterr().err
    _, params = load_params(root / "base", spec, jnp.float32, QuantConfig(mode="nf4"))
    lora = helpers.state(cfg, spec, seed=2).lora
    want = _jaxrl_logits(dequantize_params(params, jnp.float32), spec, lora)
    model = AutoModelForCausalLM.from_pretrained(root / "m32", dtype=torch.float32).eval()
    np.testing.assert_allclose(_torch_logits(model), want, atol=1e-4, rtol=0)
    assert AutoTokenizer.from_pretrained(root / "m32").chat_template

    assert main(["export", "--run", str(root / "run"), "--out", str(root / "m16"),
                 "--merged"]) == 0
    assert json.loads((root / "m16" / "config.json").read_text())["dtype"] == "bfloat16"
    wide = dict(iter_tensors(root / "m32" / "model.safetensors"))
    for name, value in iter_tensors(root / "m16" / "model.safetensors"):
        assert str(value.dtype) == "bfloat16"
        np.testing.assert_array_equal(value, wide[name].astype(value.dtype))


def test_export_cli_writes_the_chosen_step_and_names_bad_input(run_dir, tmp_path, capsys):
    root, cfg, spec = run_dir
    assert main(["export", "--run", str(root / "run"), "--step", "1", "--out",
                 str(tmp_path / "a")]) == 0
    lora = load_peft_adapter(tmp_path / "a", spec)
    want = helpers.state(cfg, spec, seed=1).lora
    for x, y in zip(jax.tree_util.tree_leaves(lora.weights),
                    jax.tree_util.tree_leaves(want.weights)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert main(["export", "--run", str(root / "run"), "--step", "7", "--out",
                 str(tmp_path / "b")]) == 2
    assert "--step 7 is not a complete checkpoint" in capsys.readouterr().err
    assert main(["export", "--run", str(tmp_path), "--out", str(tmp_path / "b")]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["export", "--run", str(root / "run"), "--out", str(tmp_path / "file")]) == 2
    assert "--out" in capsys.readouterr().err

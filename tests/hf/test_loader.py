"""The one model loader: a checkpoint, or an architecture's abstract or random weights, each in
the layout a run holds (NF4 packed or dequantized once as the numerics says, held as it holds
them, laid out on a mesh)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.backends.cpu import Bits
from jaxrl.backends.numerics import dense_tree, numerics_for
from jaxrl.config import MeshConfig, QuantConfig, UsageError, load_config
from jaxrl.hf.load import load_params
from jaxrl.hf.loader import architecture, load_model
from jaxrl.model.families import spec_from_hf_config
from jaxrl.quant.nf4 import QTensor, dequantize
from jaxrl.quant.qparams import dequantize_params
from jaxrl.sharding import MeshRules, make_mesh
from tests.tiny_models import make_model

TINY = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "eos_token_id": 2, "tie_word_embeddings": True}
CPU, GPU = numerics_for("cpu"), numerics_for("gpu")
NF4 = QuantConfig(mode="nf4", block_size=16)


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "<|im_end|>": 2}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model("qwen2").save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_architecture(tmp_path_factory):
    """A directory holding only a config.json: an architecture, no weights."""
    path = tmp_path_factory.mktemp("tiny-architecture")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


def _same(got, want):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_checkpoint_for_the_cpu_is_dequantized_once_and_held_as_bits(checkpoint):
    model = load_model(checkpoint, dtype="bfloat16", quant=NF4, numerics=CPU)
    spec, want = load_params(checkpoint, dtype=jnp.bfloat16, quant=NF4)
    assert (model.spec, model.path) == (spec, checkpoint) and model.tokenizer is not None
    assert isinstance(model.params["layers"]["q_proj"]["kernel"], Bits)
    assert model.params["embed_tokens"]["embedding"].dtype == jnp.bfloat16  # not a layer
    _same(dense_tree(model.params), dequantize_params(want, jnp.bfloat16))


def test_a_checkpoint_for_a_gpu_keeps_its_kernels_packed(checkpoint):
    model = load_model(checkpoint, dtype="bfloat16", quant=NF4, numerics=GPU)
    _, want = load_params(checkpoint, dtype=jnp.bfloat16, quant=NF4)
    assert isinstance(model.params["layers"]["q_proj"]["kernel"], QTensor)
    _same(model.params, want)
    dense = load_model(checkpoint, dtype="float32", quant=None, numerics=GPU)
    _same(dense.params, load_params(checkpoint)[1])


def test_a_checkpoint_on_a_mesh_is_laid_out_by_its_rules(checkpoint):
    rules = MeshRules(make_mesh(MeshConfig(fsdp=2), jax.devices()))
    model = load_model(checkpoint, dtype="bfloat16", quant=NF4, numerics=CPU, rules=rules)
    bits = model.params["layers"]["gate_proj"]["kernel"].bits
    assert bits.sharding.mesh == rules.mesh and len(bits.sharding.device_set) == 8
    _same(model.params, load_model(checkpoint, dtype="bfloat16", quant=NF4, numerics=CPU).params)


def test_abstract_weights_carry_the_runs_layout_and_shardings():
    spec = spec_from_hf_config(TINY)
    rules = MeshRules(make_mesh(MeshConfig(fsdp=2), jax.devices()))
    held = load_model(spec, dtype="bfloat16", quant=NF4, numerics=CPU, rules=rules,
                      weights="abstract").params["layers"]["gate_proj"]["kernel"]
    assert isinstance(held, Bits) and isinstance(held.bits, jax.ShapeDtypeStruct)
    assert held.bits.dtype == jnp.uint16 and held.bits.sharding.mesh == rules.mesh
    packed = load_model(spec, dtype="bfloat16", quant=NF4, numerics=GPU, rules=rules,
                        weights="abstract").params["layers"]["gate_proj"]["kernel"]
    assert isinstance(packed, QTensor) and packed.codes.dtype == jnp.uint8
    assert packed.codes.sharding.mesh == rules.mesh


def test_random_weights_take_the_runs_nf4_layout(tiny_architecture):
    cfg = load_config(None, [f"model.path={tiny_architecture}", "quant.block_size=16"])
    params = load_model(cfg.model.path, dtype=cfg.model.dtype, quant=cfg.quant, numerics=GPU,
                        weights="random", key=jax.random.PRNGKey(0)).params
    q = params["layers"]["gate_proj"]["kernel"]
    assert isinstance(q, QTensor) and q.codes.dtype == jnp.uint8 and q.shape == (2, 64, 128)
    dense = np.asarray(dequantize(q, jnp.float32))
    # block scales 0.05 + c * 0.01 / 127 for 8-bit codes c in [-128, 127], times NF4 levels
    # in [-1, 1]
    assert 0.03 < np.abs(dense).max() <= (0.05 + 128 * 0.01 / 127) * 1.0001
    assert dense.std() > 0.005
    np.testing.assert_array_equal(
        np.asarray(params["layers"]["input_layernorm"]["scale"], np.float32), 1)
    embedding = np.asarray(params["embed_tokens"]["embedding"], np.float32)
    assert 0.015 < embedding.std() < 0.025


def test_random_bfloat16_weights_are_held_as_their_bits_on_the_cpu(tiny_architecture):
    params = load_model(spec_from_hf_config(TINY), dtype="bfloat16", quant=NF4, numerics=CPU,
                        weights="random", key=jax.random.PRNGKey(0)).params
    kernel = params["layers"]["gate_proj"]["kernel"]  # dequantized once, as the CPU runs
    assert isinstance(kernel, Bits) and kernel.bits.dtype == jnp.uint16
    layers = dense_tree(params["layers"])
    kernel = np.asarray(layers["gate_proj"]["kernel"], np.float32)
    assert layers["gate_proj"]["kernel"].dtype == jnp.bfloat16 and 0.015 < kernel.std() < 0.025
    np.testing.assert_array_equal(np.asarray(layers["input_layernorm"]["scale"], np.float32), 1)


def test_an_architecture_is_a_config_or_a_preset(tiny_architecture):
    assert architecture(str(tiny_architecture)) == spec_from_hf_config(TINY)
    assert architecture("Qwen/Qwen3-4B").family == "qwen3"
    with pytest.raises(UsageError, match="'model.path' = 'nowhere/unknown' is neither"):
        architecture("nowhere/unknown")
    with pytest.raises(ValueError, match="weights must be one of checkpoint, abstract, random"):
        load_model("nowhere/unknown", dtype="float32", quant=None, numerics=CPU,
                   weights="zeros")

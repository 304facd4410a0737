"""Checkpoint loading: shards, dtypes and key-table errors."""
import json

import ml_dtypes
import numpy as np
import pytest

from jaxrl.hf.keymap import KeyMapError, hf_key, key_table
from jaxrl.hf.load import load_host_params, load_params
from jaxrl.hf.safetensors_io import iter_tensors, write_tensors
from jaxrl.model.families import load_spec
from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model("qwen2").save_pretrained(path)
    return path


def _tensors(model_dir):
    return {k: np.array(v) for k, v in iter_tensors(model_dir / "model.safetensors")}


def _rewrite(src, dst, tensors):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    write_tensors(dst / "model.safetensors", tensors)
    return dst


def test_key_table_is_one_to_one_and_inverts(tiny_dir):
    spec = load_spec(tiny_dir)
    table = key_table(spec)
    assert len(table) == len(set((s.path, s.layer) for s in table.values()))
    for key, slot in table.items():
        assert hf_key(slot.path, slot.layer) == key
    assert set(table) == set(_tensors(tiny_dir))


def test_sharded_checkpoint_with_index(tiny_dir, tmp_path):
    tensors = _tensors(tiny_dir)
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in shards.items():
        write_tensors(tmp_path / file, {k: tensors[k] for k in keys})
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    spec = load_spec(tmp_path)
    a, b = load_host_params(tmp_path, spec), load_host_params(tiny_dir, spec)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(a["layers/q_proj/kernel"][1],
                                  tensors["model.layers.1.self_attn.q_proj.weight"].T)


def test_bf16_checkpoint_loads(tiny_dir, tmp_path):
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors(tiny_dir).items()}
    path = _rewrite(tiny_dir, tmp_path / "bf16", tensors)
    spec, params = load_params(path)
    ref = tensors["model.embed_tokens.weight"].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]["embedding"]), ref)


def test_unmapped_key_is_named(tiny_dir, tmp_path):
    tensors = _tensors(tiny_dir)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(4, np.float32)
    path = _rewrite(tiny_dir, tmp_path / "extra", tensors)
    with pytest.raises(KeyMapError, match="rotary_emb.inv_freq"):
        load_host_params(path, load_spec(path))


def test_missing_key_is_named(tiny_dir, tmp_path):
    tensors = _tensors(tiny_dir)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    path = _rewrite(tiny_dir, tmp_path / "missing", tensors)
    with pytest.raises(KeyMapError, match="misses 1 keys.*layers.1.mlp.down_proj"):
        load_host_params(path, load_spec(path))


def test_duplicate_key_across_shards_is_named(tiny_dir, tmp_path):
    tensors = _tensors(tiny_dir)
    path = _rewrite(tiny_dir, tmp_path / "dup", tensors)
    write_tensors(path / "z.safetensors", {"model.norm.weight": tensors["model.norm.weight"]})
    with pytest.raises(KeyMapError, match="'model.norm.weight' appears twice"):
        load_host_params(path, load_spec(path))


def test_shape_mismatch_is_named(tiny_dir, tmp_path):
    tensors = _tensors(tiny_dir)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    path = _rewrite(tiny_dir, tmp_path / "shape", tensors)
    with pytest.raises(KeyMapError, match="k_proj.weight' has shape"):
        load_host_params(path, load_spec(path))


def test_tied_head_that_differs_is_refused(tmp_path):
    src = tmp_path / "tied"
    make_model("llama", tie=True).save_pretrained(src)
    tensors = _tensors(src)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0
    path = _rewrite(src, tmp_path / "bad", tensors)
    with pytest.raises(KeyMapError, match="tie_word_embeddings"):
        load_host_params(path, load_spec(path))

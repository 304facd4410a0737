"""PEFT adapter directories saved by the real `peft` load as jaxrl LoRA: same logits and the
same greedy completions as the PEFT model; unsupported options and bad tensors are named."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.config import SamplingConfig
from jaxrl.hf.load import load_params
from jaxrl.hf.peft_io import AdapterError, load_peft_adapter
from jaxrl.model.transformer import forward, positions_from_mask
from jaxrl.sampling import sample
from tests.tiny_models import make_model, padded_batch

CASES = [("qwen2", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])),
         ("llama", dict(r=8, lora_alpha=16, target_modules="all-linear")),
         ("qwen3", dict(r=4, lora_alpha=4, use_rslora=True, target_modules=["o_proj", "up_proj"]))]


def _save_peft(family, tmp_path, **lora_kw):
    """(base model dir, adapter dir, PEFT model) with random (nonzero) A and B."""
    from peft import LoraConfig, get_peft_model

    base = make_model(family)
    base.save_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    peft_model = get_peft_model(make_model(family), LoraConfig(init_lora_weights=False, **lora_kw))
    peft_model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "base", tmp_path / "adapter", peft_model.eval()


@pytest.mark.parametrize("family,lora_kw", CASES, ids=[c[0] for c in CASES])
def test_loaded_adapter_gives_peft_logits_and_greedy_tokens(tmp_path, family, lora_kw):
    base_dir, adapter_dir, peft_model = _save_peft(family, tmp_path, **lora_kw)
    spec, params = load_params(base_dir)
    lora = load_peft_adapter(adapter_dir, spec)
    rank = lora_kw["r"]
    assert lora.rank == rank
    assert lora.scale == lora_kw["lora_alpha"] / (rank ** 0.5 if "use_rslora" in lora_kw else rank)
    tokens, mask = padded_batch(length=12)
    with torch.no_grad():
        ref = peft_model(input_ids=torch.tensor(tokens),
                         attention_mask=torch.tensor(mask.astype(int))).logits.numpy()
    m = jnp.asarray(mask)
    got = forward(params, jnp.asarray(tokens), positions_from_mask(m), spec, attn_mask=m,
                  lora=lora)[0]
    np.testing.assert_allclose(np.asarray(got)[mask], ref[mask], atol=1e-5, rtol=0)
    prompt = [5, 6, 7, 8]
    out = sample(params, spec, [prompt], jax.random.PRNGKey(0),
                 SamplingConfig(temperature=0.0, max_new_tokens=16), lora=lora)
    with torch.no_grad():
        want = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16,
                                   min_new_tokens=16, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, 4:].numpy()
    np.testing.assert_array_equal(out.tokens[0], want)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _save_peft("qwen2", tmp_path_factory.mktemp("peft"), r=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"])


def _edit_config(adapter_dir, **changes):
    path = adapter_dir / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("field,value", [("use_dora", True), ("bias", "all"),
                                         ("rank_pattern", {"q_proj": 8}),
                                         ("target_modules", ["c_attn"])])
def test_unsupported_options_are_named(saved, tmp_path, field, value):
    import shutil

    base_dir, adapter_dir, _ = saved
    copy = tmp_path / "a"
    shutil.copytree(adapter_dir, copy)
    _edit_config(copy, **{field: value})
    spec, _ = load_params(base_dir)
    with pytest.raises(AdapterError, match=field):
        load_peft_adapter(copy, spec)


def test_missing_and_misshapen_tensors_are_named(saved, tmp_path):
    import shutil

    base_dir, adapter_dir, _ = saved
    spec, _ = load_params(base_dir)
    copy = tmp_path / "a"
    shutil.copytree(adapter_dir, copy)
    _edit_config(copy, target_modules=["q_proj", "v_proj", "k_proj"])
    with pytest.raises(AdapterError, match="misses 4 tensors"):
        load_peft_adapter(copy, spec)
    _edit_config(copy, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="v_proj.lora_A.weight"):
        load_peft_adapter(copy, spec)
    _edit_config(copy, target_modules=["q_proj", "v_proj"], r=2)
    with pytest.raises(AdapterError, match="rank 2"):
        load_peft_adapter(copy, spec)
    with pytest.raises(AdapterError, match="adapter_config.json"):
        load_peft_adapter(tmp_path, spec)

"""config.json -> ModelSpec: supported fields map, the rest are refused by name."""
import pytest

from jaxrl.model.families import ModelConfigError, spec_from_hf_config
from tests.tiny_models import LLAMA3_ROPE, hf_config


def _cfg(family="llama", **kw):
    return hf_config(family, **kw).to_dict()


def test_families_map_their_features():
    llama, qwen2, qwen3 = (spec_from_hf_config(_cfg(f)) for f in ("llama", "qwen2", "qwen3"))
    assert (llama.qkv_bias, llama.qk_norm, llama.head_dim) == (False, False, 16)
    assert (qwen2.qkv_bias, qwen2.qk_norm) == (True, False)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    assert llama.num_kv_heads == 2 and llama.eos_token_ids == (2,)


def test_transformers4_rope_layout_is_read():
    cfg = _cfg()
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
    spec = spec_from_hf_config(cfg)
    assert spec.rope_theta == 500000.0 and spec.rope_scaling.factor == 8.0


@pytest.mark.parametrize("field,value,message", [
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_type 'yarn'"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("model_type", "mistral", "model_type 'mistral'"),
    ("logit_softcapping", 30.0, "logit_softcapping"),
])
def test_math_changing_fields_are_refused(field, value, message):
    cfg = _cfg()
    cfg[field] = value
    with pytest.raises(ModelConfigError, match=message):
        spec_from_hf_config(cfg)


def test_missing_required_field_is_named():
    cfg = _cfg()
    del cfg["hidden_size"]
    with pytest.raises(ModelConfigError, match="hidden_size"):
        spec_from_hf_config(cfg)

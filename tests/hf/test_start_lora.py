"""A run's adapter starts fresh or from a PEFT directory whose rank, targets and scale match."""
import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, apply_overrides
from jaxrl.hf.export import write_peft_adapter
from jaxrl.hf.peft_io import start_lora
from jaxrl.model.families import load_spec
from tests.checkpoint import helpers
from tests.tiny_models import make_model


def test_start_lora_from_a_peft_directory(tmp_path):
    base = tmp_path / "base"
    make_model("llama").save_pretrained(base)
    spec = load_spec(base)
    cfg = helpers.config(base, tmp_path)
    lora = helpers.state(cfg, spec).lora
    write_peft_adapter(tmp_path / "adapter", lora, spec, str(base))
    started = start_lora(apply_overrides(cfg, [f"lora.init_from={tmp_path / 'adapter'}",
                                               "lora.dropout=0.1"]).lora, spec, None)
    for got, want in zip(jax.tree_util.tree_leaves(started.weights),
                         jax.tree_util.tree_leaves(lora.weights), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (started.scale, started.dropout) == (lora.scale, 0.1)
    with pytest.raises(ConfigError, match="has rank 4, targets q_proj,v_proj .* set lora.rank=4"):
        start_lora(apply_overrides(cfg, [f"lora.init_from={tmp_path / 'adapter'}",
                                         "lora.rank=8"]).lora, spec, None)
    with pytest.raises(ConfigError, match="'lora.init_from'.*no adapter_config.json"):
        start_lora(apply_overrides(cfg, [f"lora.init_from={tmp_path}"]).lora, spec, None)


def test_start_lora_fresh_has_zero_b(tmp_path):
    base = tmp_path / "base"
    make_model("llama").save_pretrained(base)
    spec = load_spec(base)
    lora = start_lora(helpers.config(base, tmp_path).lora, spec, jax.random.PRNGKey(0))
    assert lora.targets == ("q_proj", "v_proj") and (lora.rank, lora.scale) == (4, 2.0)
    assert all(not np.asarray(ab["b"]).any() for ab in lora.weights["layers"].values())

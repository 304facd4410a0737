"""Mesh sizes from the config, logical-axis rules, and the shardings derived from them."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl.config import ConfigError, MeshConfig, QuantConfig
from jaxrl.lora.lora import init_lora
from jaxrl.model.kv_cache import init_cache
from jaxrl.quant.qparams import abstract_quantized_params
from jaxrl.sharding import (DEFAULT_RULES, MeshRules, cache_shardings, lora_shardings,
                            make_mesh, mesh_shape, param_shardings)
from tests.sharding.common import SPEC


def test_mesh_shape_fills_data_and_names_the_keys():
    assert mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert mesh_shape(MeshConfig(fsdp=2, tensor=2), 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"mesh.data=-1, mesh.fsdp=3.*8 devices"):
        mesh_shape(MeshConfig(fsdp=3), 8)
    with pytest.raises(ConfigError, match="mesh.data=2"):
        mesh_shape(MeshConfig(data=2), 8)


def test_an_array_using_a_mesh_axis_twice_is_refused():
    rules = dict(DEFAULT_RULES)
    rules["embed"] = ("tensor",)
    bad = MeshRules(make_mesh(MeshConfig(1, 1, 8)), tuple(rules.items()))
    with pytest.raises(ValueError, match="'embed' and 'heads'.*mesh axis 'tensor'"):
        bad.spec(("layers", "embed", "heads"), (2, 64, 128))
    with pytest.raises(ValueError, match="mesh axes \\['model'\\]"):
        MeshRules(bad.mesh, (("heads", ("model",)),))
    with pytest.raises(ValueError, match="'seq2' has no rule"):
        bad.spec(("seq2",), (4,))


def test_nf4_codes_and_scales_shard_like_their_kernel():
    rules = MeshRules(make_mesh(MeshConfig(1, 4, 2)))
    params = abstract_quantized_params(SPEC, QuantConfig(block_size=16), jnp.bfloat16)
    q = param_shardings(rules, params, SPEC)["layers"]["q_proj"]["kernel"]
    assert q.codes.spec == P(None, "fsdp", "tensor")  # [L, 32, 128]
    assert q.scales.spec == P(None, "fsdp", "tensor")  # [L, 4, 128]
    assert q.scale_scales.spec == P(None, None) and q.scale_offset.spec == P(None)
    embed = param_shardings(rules, params, SPEC)["embed_tokens"]["embedding"]
    assert embed.spec == P(("fsdp", "tensor"), None)  # the table splits by the vocab alone


def test_lora_cache_and_indivisible_dims():
    rules = MeshRules(make_mesh(MeshConfig(2, 2, 2)))
    lora = init_lora(SPEC, jax.random.PRNGKey(0), rank=4, alpha=8, targets=("q_proj", "down_proj"))
    shard = lora_shardings(rules, lora, SPEC).weights["layers"]
    assert shard["q_proj"]["a"].spec == P(None, "fsdp", None)
    assert shard["q_proj"]["b"].spec == P(None, None, "tensor")
    assert shard["down_proj"]["a"].spec == P(None, "tensor", None)
    cache = jax.eval_shape(lambda: init_cache(SPEC, 8, 32))
    assert cache_shardings(rules, cache).k.spec == P(None, ("data", "fsdp"), "tensor", None, None)
    assert rules.rows((6, 5)).spec == P(None, None)  # 6 rows do not split 4 ways

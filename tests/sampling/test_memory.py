"""The memory path: the compiled decode program over NF4 params keeps one dequantized layer at
a time (the layer scan's index varies, so XLA cannot hoist the dequantization out of the decode
loop as loop-invariant)."""
import math

import jax
import jax.numpy as jnp
import pytest

from jaxrl.config import QuantConfig
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import declare
from jaxrl.quant.qparams import abstract_quantized_params
from jaxrl.sampling.programs import generate, init_slots

# runs on an accelerator too (tools/accelerator_check.sh)
pytestmark = pytest.mark.accelerator

# ~45 MB of dense fp32 weights per layer, ~540 MB for the model (as in tests/quant/test_qlinear.py)
MID = dict(model_type="llama", vocab_size=1024, hidden_size=1024, intermediate_size=2816,
           num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
           tie_word_embeddings=True)
B, P, N = 4, 64, 64


def test_nf4_decode_keeps_one_dequantized_layer_at_a_time():
    spec = spec_from_hf_config(MID)
    params = abstract_quantized_params(spec, QuantConfig(mode="nf4"), jnp.float32)
    layer = 4 * sum(math.prod(d.shape[1:]) for p, d in declare(spec).items()
                    if p.startswith("layers/") and p.endswith("/kernel"))
    cache = 2 * 4 * spec.num_layers * B * spec.num_kv_heads * (P + N) * spec.head_dim
    state = jax.eval_shape(lambda p: init_slots(p, spec=spec, slots=B, capacity=P + N), params)
    compiled = generate.lower(state, params, None, spec=spec, eos_ids=(2,), steps=N).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"temp {temp / 2**20:.1f} MiB, one dense layer {layer / 2**20:.1f} MiB, "
          f"cache {cache / 2**20:.1f} MiB")
    assert temp < 1.5 * layer + 2 * cache, (temp, layer, cache)

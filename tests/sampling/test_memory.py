"""The memory path: NF4 params decode through the layer scan, and the compiled sampler keeps one
dequantized layer at a time (XLA hoists loop-invariant dequantization out of a while loop, which
is why the unrolled fast path refuses quantized params)."""
import math

import jax
import jax.numpy as jnp

from jaxrl.config import QuantConfig
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import declare
from jaxrl.quant.qparams import abstract_quantized_params
from jaxrl.sampling import choose_layer_loop
from jaxrl.sampling.engine import generate, init_slots

# ~45 MB of dense fp32 weights per layer, ~540 MB for the model (as in tests/quant/test_qlinear.py)
MID = dict(model_type="llama", vocab_size=1024, hidden_size=1024, intermediate_size=2816,
           num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
           tie_word_embeddings=True)
B, P, N = 4, 64, 64


def test_nf4_decode_keeps_one_dequantized_layer_at_a_time():
    spec = spec_from_hf_config(MID)
    params = abstract_quantized_params(spec, QuantConfig(mode="nf4"), jnp.float32)
    assert choose_layer_loop(params) == "scan"
    layer = 4 * sum(math.prod(d.shape[1:]) for p, d in declare(spec).items()
                    if p.startswith("layers/") and p.endswith("/kernel"))
    cache = 2 * 4 * spec.num_layers * B * spec.num_kv_heads * (P + N) * spec.head_dim
    state = jax.eval_shape(lambda p: init_slots(p, spec=spec, slots=B, capacity=P + N,
                                                layer_loop="scan"), params)
    compiled = generate.lower(state, params, None, spec=spec, eos_ids=(2,), steps=N,
                              layer_loop="scan").compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"temp {temp / 2**20:.1f} MiB, one dense layer {layer / 2**20:.1f} MiB, "
          f"cache {cache / 2**20:.1f} MiB")
    assert temp < 1.5 * layer + 2 * cache, (temp, layer, cache)

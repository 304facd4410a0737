"""NF4 kernels inside the model: loading, forward, and memory that survives compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import QuantConfig
from jaxrl.hf.load import load_params
from jaxrl.lora.lora import init_lora
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.kv_cache import init_cache
from jaxrl.model.params import count_params, declare
from jaxrl.model.transformer import forward, positions_from_mask
from jaxrl.quant.nf4 import QTensor, dequantize, quantize_np, quantized_bytes_per_param
from jaxrl.quant.qparams import (abstract_quantized_params, dequantize_params, quantized_paths,
                                 resident_bytes)
from tests.tiny_models import make_model, padded_batch

NF4 = QuantConfig(mode="nf4", double_quant=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("q")
    make_model("qwen3").save_pretrained(path)
    return path


def _logits(spec, params, tokens, mask):
    m = jnp.asarray(mask)
    return np.asarray(forward(params, jnp.asarray(tokens), positions_from_mask(m), spec,
                              attn_mask=m)[0])


def test_loading_quantizes_linears_and_honours_skip(tiny_dir):
    skip = QuantConfig(mode="nf4", skip=("embed_tokens", "norm", "lm_head", "down_proj"))
    spec, params = load_params(tiny_dir, quant=skip)
    layers = params["layers"]
    assert isinstance(layers["q_proj"]["kernel"], QTensor)
    assert layers["q_proj"]["kernel"].codes.dtype == jnp.uint8
    assert layers["q_proj"]["kernel"].shape == (2, 64, 128)  # [L, in, out]: qwen3 q is 4 x 32
    assert not isinstance(layers["down_proj"]["kernel"], QTensor)
    assert not isinstance(params["lm_head"]["kernel"], QTensor)
    assert quantized_paths(spec, QuantConfig(mode="none")) == set()


@pytest.mark.accelerator
def test_forward_on_nf4_equals_forward_on_its_dequantized_weights(tiny_dir):
    spec, qparams = load_params(tiny_dir, quant=NF4)
    dense = jax.tree_util.tree_map(lambda x: dequantize(x) if isinstance(x, QTensor) else x,
                                   qparams, is_leaf=lambda x: isinstance(x, QTensor))
    tokens, mask = padded_batch(length=16)
    got, want = _logits(spec, qparams, tokens, mask), _logits(spec, dense, tokens, mask)
    # The quantized matmul sums the same float32 products per scale block (jaxrl/quant/
    # qmatmul.py), so the logits agree to float32 rounding (3.5e-6 here), not bit for bit.
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-5, rtol=0)
    _, fp = load_params(tiny_dir)
    full = _logits(spec, fp, tokens, mask)
    assert np.abs(got - full)[mask].max() > 1e-3  # quantization did change the weights


def test_dequantizing_at_load_is_one_program_with_no_kernel_sized_temporaries(tiny_dir):
    # quant.dequantize "once" (the CPU's default): the same kernels as dequantizing each tensor
    # op by op, compiled as one program whose selects and scaling fuse. Op by op, the unpacked
    # codes, sixteen candidate levels and fifteen selects are each a kernel-sized float32 array;
    # compiled, the one temporary left is the unpacked codes, a byte per parameter.
    spec, qparams = load_params(tiny_dir, quant=NF4)
    dense = dequantize_params(qparams, jnp.dtype(jnp.bfloat16))
    by_op = jax.tree_util.tree_map(
        lambda x: dequantize(x, jnp.bfloat16) if isinstance(x, QTensor) else x, qparams,
        is_leaf=lambda x: isinstance(x, QTensor))
    for got, want in zip(jax.tree_util.tree_leaves(dense), jax.tree_util.tree_leaves(by_op)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    kernel = quantize_np(np.random.RandomState(0).randn(4, 512, 1024).astype(np.float32),
                         double_quant=True)
    compiled = dequantize_params.lower({"k": kernel}, jnp.dtype(jnp.bfloat16)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= 4 * 512 * 1024  # 2 MiB measured


def test_abstract_quantized_params_match_loaded_ones(tiny_dir):
    spec, params = load_params(tiny_dir, quant=NF4)
    abstract = abstract_quantized_params(spec, NF4, jnp.float32)
    shapes = lambda t: jax.tree_util.tree_map(lambda x: (x.shape, jnp.dtype(x.dtype)), t)
    assert shapes(abstract) == shapes(params)
    assert resident_bytes(abstract) == resident_bytes(params)


QWEN3_4B = dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0)


def test_qwen3_4b_quantized_bytes_per_param_from_shapes():
    spec = spec_from_hf_config(QWEN3_4B)
    abstract = abstract_quantized_params(spec, NF4, jnp.bfloat16)
    qpaths = quantized_paths(spec, NF4)
    decls = declare(spec)
    n_quant = sum(int(np.prod(decls[p].shape)) for p in qpaths)
    q_bytes = sum(resident_bytes({"k": abstract_leaf(abstract, p)}) for p in qpaths)
    assert q_bytes / n_quant <= 0.52
    mlp = quantized_bytes_per_param((36, 2560, 9728), 64, True)
    assert abs(mlp - (0.5 + 1 / 64 + 4 / (64 * 256))) < 1e-3
    # everything else (bf16 embedding, norms) stays 2 bytes per parameter
    rest = resident_bytes(abstract) - q_bytes
    assert rest == 2 * (count_params(spec) - n_quant)


def abstract_leaf(tree, path):
    for part in path.split("/"):
        tree = tree[part]
    return tree


# A mid-size model: the dense fp32 weights of one layer are ~45 MB, of the model ~540 MB.
MID = dict(model_type="llama", vocab_size=1024, hidden_size=1024, intermediate_size=2816,
           num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
           tie_word_embeddings=True)
B, T = 4, 64


def _mid():
    spec = spec_from_hf_config(MID)
    layer = 4 * sum(int(np.prod(d.shape[1:])) for p, d in declare(spec).items()
                    if p.startswith("layers/") and p.endswith("/kernel"))
    return spec, abstract_quantized_params(spec, NF4, jnp.float32), layer


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _live_layers() -> float:
    """Dense layers a layer loop may hold at once. XLA:GPU double-buffers while loops (the body
    runs two iterations per trip, so one layer's dequantization overlaps the other's matmuls):
    the forward below held 1.50-1.63 dense layers on an H200 (jax 0.11.2) and 0.76 with
    --xla_gpu_enable_while_loop_double_buffering=false; XLA:CPU holds one (1.05 here). A
    dequantized model would hold all 12."""
    return 2.0 if jax.default_backend() == "gpu" else 1.5


@pytest.mark.accelerator
def test_forward_keeps_one_dequantized_layer_at_a_time():
    spec, params, layer = _mid()
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    temp = _temp_bytes(lambda p, t: forward(p, t, pos, spec)[0], params, tokens)
    assert temp < _live_layers() * layer, (temp, layer)


@pytest.mark.accelerator
def test_decode_loop_keeps_one_dequantized_layer_at_a_time():
    """XLA hoists loop-invariant work out of while loops; the per-layer dequantization inside
    the layer scan depends on the layer index, so it cannot be hoisted out of decoding."""
    spec, params, layer = _mid()

    def decode(p, cache, tok):
        def step(i, carry):
            cache, tok = carry
            logits, cache = forward(p, tok, jnp.full((B, 1), i), spec, cache=cache)
            return cache, jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, 8, step, (cache, tok))

    cache = jax.eval_shape(lambda: init_cache(spec, B, 64))
    temp = _temp_bytes(decode, params, cache, jax.ShapeDtypeStruct((B, 1), jnp.int32))
    assert temp < _live_layers() * layer, (temp, layer)


@pytest.mark.accelerator
@pytest.mark.parametrize("remat", ["dots", "full"])
def test_train_step_with_remat_keeps_dequantized_layers_out_of_residuals(remat):
    spec, params, layer = _mid()
    lora = jax.eval_shape(lambda: init_lora(spec, jax.random.PRNGKey(0), rank=16, alpha=32))
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    def grad_fn(remat):
        loss = lambda l, p, t: forward(p, t, pos, spec, lora=l, remat=remat)[0].mean()
        return jax.grad(loss)

    with_remat = _temp_bytes(grad_fn(remat), lora, params, tokens)
    without = _temp_bytes(grad_fn("none"), lora, params, tokens)
    # dots keeps one float32 output per projection and layer: q 1024 + k, v 256 each + o 1024 +
    # gate, up 2816 each + down 1024 = 9216 floats per token, x 256 tokens x 12 layers
    # (113 MB, 2.5 layers); neither the two halves of the NF4 matmul nor the LoRA products
    saved = {"dots": 9216 * B * T * 4 * 12, "full": 0}[remat]
    assert with_remat < saved + 2.5 * layer, (with_remat, saved, layer)
    # the measurement can see the failure: without remat every dequantized layer is saved
    assert without > 8 * layer, (without, layer)


def test_quantize_while_loading_keeps_host_peak_near_the_quantized_model(default_model_dir):
    """Peak host allocation while loading the default model as NF4 (numpy allocations, traced)
    stays within a few full-precision layer tensors of the final resident size; measured here:
    168 MB resident, 186 MB peak (the fp32 model is 538 MB)."""
    import tracemalloc

    from jaxrl.hf.load import load_host_params
    from jaxrl.model.families import load_spec
    from jaxrl.model.params import unflatten

    spec = load_spec(default_model_dir)
    largest = 4 * max(int(np.prod(d.shape[1:])) for p, d in declare(spec).items()
                      if p.startswith("layers/"))
    tracemalloc.start()
    try:
        host = load_host_params(default_model_dir, spec, np.float32, NF4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    resident = resident_bytes(unflatten(host))
    assert peak - resident < 8 * largest, (peak, resident, largest)

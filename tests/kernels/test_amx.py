"""The AMX bf16 matmul kernel: its packed layout worked by hand, its products against a float64
reference over awkward shapes, inside a decode-style loop, and the sampler with it against the
sampler with XLA's dot. Skipped where the kernel is unavailable (no AMX, no compiler)."""
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import SamplingConfig
from jaxrl.hf.load import load_params
from jaxrl.kernels import amx
from jaxrl.sampling import choose_matmul, sample
from tests.sampling.test_sampler import PROMPTS, _random_lora
from tests.tiny_models import make_model

needs_amx = pytest.mark.skipif(not amx.available(), reason="AMX kernel unavailable here")


def _bf16(key, shape, scale=1.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(key), shape)).astype(jnp.bfloat16)


def test_pack_kernel_layout_by_hand():
    """W [3, 2] = [[1, 2], [3, 4], [5, 6]]: K pads to 32, N to 64; packed[p, k2, c] holds the
    pair (W[2*k2, 64p + c], W[2*k2 + 1, 64p + c])."""
    w = jnp.asarray([[1, 2], [3, 4], [5, 6]], jnp.bfloat16)
    packed = amx.pack_kernel(w)
    assert packed.n == 2 and packed.packed.shape == (1, 16, 64, 2)
    got = np.asarray(packed.packed, np.float32)
    np.testing.assert_array_equal(got[0, 0, 0], [1, 3])
    np.testing.assert_array_equal(got[0, 0, 1], [2, 4])
    np.testing.assert_array_equal(got[0, 1, 0], [5, 0])  # K's padding row
    np.testing.assert_array_equal(got[0, 1, 1], [6, 0])
    assert not got[0, 2:].any() and not got[0, :, 2:].any()


@needs_amx
@pytest.mark.parametrize("m,k,n", [(1, 32, 1), (1, 576, 576), (3, 100, 70), (16, 64, 64),
                                   (17, 576, 200), (40, 1536, 130), (32, 576, 4100)])
def test_matmul_equals_a_float64_reference(m, k, n):
    x, w = _bf16(0, (m, k)), _bf16(1, (k, n), 0.05)
    got = jax.jit(lambda x, w: amx.matmul(x, amx.pack_kernel(w)))(x, w)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # bf16 products are exact in float32; only the float32 summation order differs
    bound = 1e-6 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)))
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-30)


@needs_amx
def test_leading_dims_and_a_loop_invariant_packed_kernel():
    """x [B, T, K] keeps its leading dims; packed once outside a fori_loop, as the sampler does."""
    x, w = _bf16(2, (2, 3, 96)), _bf16(3, (96, 96), 0.1)

    @jax.jit
    def run(x, w):
        packed = amx.pack_kernel(w)
        return jax.lax.fori_loop(0, 4, lambda _, h: amx.matmul(h, packed).astype(h.dtype), x)

    def ref(x, w):
        for _ in range(4):
            x = jnp.einsum("btk,kn->btn", x, w, preferred_element_type=jnp.float32)
            x = x.astype(jnp.bfloat16)
        return x
    got, want = run(x, w), jax.jit(ref)(x, w)
    assert got.shape == (2, 3, 96)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=1e-2)  # bf16 rounding between the 4 products


@pytest.fixture(scope="module")
def bf16_models():
    out = {}
    for name, (family, kw) in {"qwen2-tied": ("qwen2", dict(tie=True)),
                               "llama": ("llama", {})}.items():
        path = tempfile.mkdtemp()
        make_model(family, **kw).save_pretrained(path)
        out[name] = load_params(path, dtype=jnp.bfloat16)
    return out


@needs_amx
@pytest.mark.parametrize("case", ["qwen2-tied", "llama"])
@pytest.mark.parametrize("with_lora", [False, True])
def test_sampler_with_amx_equals_the_sampler_with_xlas_dot(bf16_models, case, with_lora):
    spec, params = bf16_models[case]
    lora = _random_lora(spec) if with_lora else None
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=32)
    outs = {m: sample(params, spec, PROMPTS, jax.random.PRNGKey(0), cfg, lora=lora,
                      layer_loop="unrolled", matmul=m) for m in ("xla", "amx")}
    np.testing.assert_array_equal(outs["amx"].tokens, outs["xla"].tokens)
    np.testing.assert_allclose(outs["amx"].logprobs, outs["xla"].logprobs, atol=1e-4)
    alone = sample(params, spec, PROMPTS[:1], jax.random.PRNGKey(0), cfg, lora=lora,
                   layer_loop="unrolled", matmul="amx")  # one row: no padding to two rows
    np.testing.assert_array_equal(alone.tokens[0], outs["amx"].tokens[0])


def test_choose_matmul(bf16_models, monkeypatch):
    spec, params = bf16_models["llama"]
    fp32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)
    assert choose_matmul(fp32, "unrolled") == "xla"
    assert choose_matmul(params, "scan") == "xla"
    assert choose_matmul(params, "unrolled", "xla") == "xla"
    assert choose_matmul(params, "unrolled") == ("amx" if amx.available() else "xla")
    with pytest.raises(ValueError, match="needs bf16 weights"):
        choose_matmul(fp32, "unrolled", "amx")
    with pytest.raises(ValueError, match="one of"):
        choose_matmul(params, "unrolled", "mkl")
    monkeypatch.setenv("JAXRL_AMX", "0")
    assert amx._unavailable_reason() == "JAXRL_AMX=0"


@needs_amx
def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXRL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    assert amx._unavailable_reason().startswith("could not build or load the kernel")
    assert not list((tmp_path / "kernels").glob("*.so"))

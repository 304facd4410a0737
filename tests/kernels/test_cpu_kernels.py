"""jaxrl's CPU kernels: the matmul's packed layout worked by hand, its products against a float64
reference over awkward shapes and inside a decode-style loop, decode attention against
`jaxrl.model.attention.attend`, and the sampler with the kernels against the sampler with XLA's
ops. Skipped where the kernels are unavailable (no AMX, no compiler)."""
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import SamplingConfig
from jaxrl.hf.load import load_params
from jaxrl.kernels import cpu as cpu_kernels
from jaxrl.model.attention import attend
from jaxrl.sampling import choose_kernels, sample
from tests.sampling.test_sampler import PROMPTS, _random_lora, _teacher_forced
from tests.tiny_models import make_model

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="jaxrl's CPU kernels are unavailable here")


def _bf16(key, shape, scale=1.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(key), shape)).astype(jnp.bfloat16)


def test_pack_kernel_layout_by_hand():
    """W [3, 2] = [[1, 2], [3, 4], [5, 6]]: K pads to 32, N to 64; packed[p, k2, c] holds the
    pair (W[2*k2, 64p + c], W[2*k2 + 1, 64p + c])."""
    w = jnp.asarray([[1, 2], [3, 4], [5, 6]], jnp.bfloat16)
    packed = cpu_kernels.pack_kernel(w)
    assert packed.n == 2 and packed.packed.shape == (1, 16, 64, 2)
    got = np.asarray(packed.packed, np.float32)
    np.testing.assert_array_equal(got[0, 0, 0], [1, 3])
    np.testing.assert_array_equal(got[0, 0, 1], [2, 4])
    np.testing.assert_array_equal(got[0, 1, 0], [5, 0])  # K's padding row
    np.testing.assert_array_equal(got[0, 1, 1], [6, 0])
    assert not got[0, 2:].any() and not got[0, :, 2:].any()


@needs_kernels
@pytest.mark.parametrize("m,k,n", [(1, 32, 1), (1, 576, 576), (3, 100, 70), (16, 64, 64),
                                   (17, 576, 200), (40, 1536, 130), (32, 576, 4100)])
def test_matmul_equals_a_float64_reference(m, k, n):
    x, w = _bf16(0, (m, k)), _bf16(1, (k, n), 0.05)
    got = jax.jit(lambda x, w: cpu_kernels.matmul(x, cpu_kernels.pack_kernel(w)))(x, w)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # bf16 products are exact in float32; only the float32 summation order differs
    bound = 1e-6 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)))
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-30)


@needs_kernels
def test_leading_dims_and_a_loop_invariant_packed_kernel():
    """x [B, T, K] keeps its leading dims; packed once outside a fori_loop, as the sampler does."""
    x, w = _bf16(2, (2, 3, 96)), _bf16(3, (96, 96), 0.1)

    @jax.jit
    def run(x, w):
        packed = cpu_kernels.pack_kernel(w)
        return jax.lax.fori_loop(0, 4, lambda _, h: cpu_kernels.matmul(h, packed).astype(h.dtype), x)

    def ref(x, w):
        for _ in range(4):
            x = jnp.einsum("btk,kn->btn", x, w, preferred_element_type=jnp.float32)
            x = x.astype(jnp.bfloat16)
        return x
    got, want = run(x, w), jax.jit(ref)(x, w)
    assert got.shape == (2, 3, 96)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=1e-2)  # bf16 rounding between the 4 products


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("b,h,kv,d,s,pos", [(1, 9, 3, 64, 192, 59), (5, 8, 2, 128, 64, 63),
                                            (3, 4, 4, 64, 32, 16), (2, 6, 3, 64, 16, 0)])
def test_decode_attention_equals_a_cache_write_and_attend(b, h, kv, d, s, pos, dtype):
    """Rows left-padded by different amounts; slots after pos hold garbage, which the kernel must
    skip exactly as the mask does in `attend`; the new key and value land in slot pos."""
    ks = jax.random.split(jax.random.PRNGKey(4), 5)
    q = jax.random.normal(ks[0], (b, 1, h, d))
    kt = (3 * jax.random.normal(ks[1], (b, kv, d, s))).astype(dtype)
    v = jax.random.normal(ks[2], (b, kv, s, d)).astype(dtype)
    k_new = jax.random.normal(ks[3], (b, kv, d)).astype(dtype)
    v_new = jax.random.normal(ks[4], (b, kv, d)).astype(dtype)
    pads = np.arange(b) * 3 % max(pos, 1)
    slots = np.arange(s)[None, :]
    mask = jnp.asarray((slots >= pads[:, None]) & (slots <= pos))
    mask = mask.at[:, pos].set(True)  # every row sees its own token
    got, got_kt, got_v = jax.jit(cpu_kernels.decode_attention)(
        q[:, 0], k_new, v_new, kt, v, mask, jnp.int32(pos))
    want_kt = kt.at[:, :, :, pos].set(k_new)
    want_v = v.at[:, :, pos, :].set(v_new)
    np.testing.assert_array_equal(np.asarray(got_kt, np.float32), np.asarray(want_kt, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
    f32 = lambda a: a.astype(jnp.float32)
    want = attend(q, f32(want_kt), f32(want_v), mask[:, None, :], keys_transposed=True)
    np.testing.assert_allclose(np.asarray(got).reshape(b, 1, h * d), want, rtol=2e-5, atol=1e-5)


@pytest.fixture(scope="module")
def bf16_models():
    out = {}
    # hidden 256 over 4 heads: head dim 64, which the decode attention kernel takes
    for name, (family, kw) in {"qwen2-tied": ("qwen2", dict(tie=True, hidden=256)),
                               "llama": ("llama", dict(hidden=256))}.items():
        path = tempfile.mkdtemp()
        make_model(family, **kw).save_pretrained(path)
        out[name] = load_params(path, dtype=jnp.bfloat16)
    return out


@needs_kernels
@pytest.mark.parametrize("case", ["qwen2-tied", "llama"])
@pytest.mark.parametrize("with_lora", [False, True])
def test_sampler_with_cpu_kernels_equals_the_sampler_with_xla(bf16_models, case, with_lora,
                                                              monkeypatch):
    spec, params = bf16_models[case]
    traced = []
    attention, matmul = cpu_kernels.decode_attention, cpu_kernels.matmul
    monkeypatch.setattr(cpu_kernels, "decode_attention",
                        lambda *a: traced.append("attention") or attention(*a))
    monkeypatch.setattr(cpu_kernels, "matmul", lambda *a: traced.append("matmul") or matmul(*a))
    jax.clear_caches()  # trace again, so the counters see which kernels the program calls
    lora = _random_lora(spec) if with_lora else None
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=32)
    outs = {m: sample(params, spec, PROMPTS, jax.random.PRNGKey(0), cfg, lora=lora,
                      layer_loop="unrolled", kernels=m) for m in ("xla", "cpu")}
    np.testing.assert_array_equal(outs["cpu"].tokens, outs["xla"].tokens)
    # bf16 activations: a summation order that differs in the last float32 bit flips some bf16
    # roundings, which grow over the layers, so the two bf16 runs are compared by their distance
    # to the same weights run in float32 (teacher-forced on the same tokens), not to each other
    fp32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)
    lora32 = None if lora is None else jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32), lora)
    want = _teacher_forced(fp32, spec, outs["xla"], 1.0, lora32)
    err = {k: np.abs(o.logprobs - want).max() for k, o in outs.items()}
    assert err["cpu"] <= 2 * err["xla"] + 1e-3, err
    alone = sample(params, spec, PROMPTS[:1], jax.random.PRNGKey(0), cfg, lora=lora,
                   layer_loop="unrolled", kernels="cpu")  # one row: no padding to two rows
    np.testing.assert_array_equal(alone.tokens[0], outs["cpu"].tokens[0])
    assert {"attention", "matmul"} <= set(traced)


def test_choose_kernels(bf16_models, monkeypatch):
    spec, params = bf16_models["llama"]
    fp32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)
    assert choose_kernels(fp32, "unrolled") == "xla"
    assert choose_kernels(params, "scan") == "xla"
    assert choose_kernels(params, "unrolled", "xla") == "xla"
    assert choose_kernels(params, "unrolled") == ("cpu" if cpu_kernels.available() else "xla")
    with pytest.raises(ValueError, match="need the 'unrolled' layer loop"):
        choose_kernels(params, "scan", "cpu")
    with pytest.raises(ValueError, match="one of"):
        choose_kernels(params, "unrolled", "mkl")
    monkeypatch.setenv("JAXRL_CPU_KERNELS", "0")
    assert cpu_kernels._unavailable_reason() == "JAXRL_CPU_KERNELS=0"


@needs_kernels
def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXRL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    assert cpu_kernels._unavailable_reason().startswith("could not build or load the kernel")
    assert not list((tmp_path / "kernels").glob("*.so"))


@needs_kernels
def test_fp32_weights_with_the_attention_kernel_decode_as_with_xla(bf16_models, monkeypatch):
    """kernels="cpu" with fp32 weights: XLA's matmuls, the attention kernel over a fp32 cache."""
    spec, params = bf16_models["qwen2-tied"]
    fp32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)
    traced = []
    attention = cpu_kernels.decode_attention
    monkeypatch.setattr(cpu_kernels, "decode_attention",
                        lambda *a: traced.append(a[3].dtype) or attention(*a))
    jax.clear_caches()
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=32)
    outs = {k: sample(fp32, spec, PROMPTS, jax.random.PRNGKey(0), cfg, layer_loop="unrolled",
                      kernels=k) for k in ("xla", "cpu")}
    np.testing.assert_array_equal(outs["cpu"].tokens, outs["xla"].tokens)
    np.testing.assert_allclose(outs["cpu"].logprobs, outs["xla"].logprobs, atol=1e-5)
    assert traced and set(traced) == {jnp.dtype(jnp.float32)}  # the kernel ran, on a fp32 cache


@needs_kernels
def test_sample_packs_the_weights_once_per_params(bf16_models, monkeypatch):
    from jaxrl.sampling import sampler

    spec, params = bf16_models["llama"]
    sampler._PACKED.clear()  # other tests sampled from these params
    calls = []
    pack = sampler.pack_params
    monkeypatch.setattr(sampler, "pack_params", lambda p: calls.append(1) or pack(p))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=4)
    run = lambda p: sample(p, spec, PROMPTS[:1], jax.random.PRNGKey(0), cfg).tokens
    first = run(params)
    np.testing.assert_array_equal(run(dict(params)), first)  # same arrays, new dict
    assert len(calls) == 1
    other = jax.tree_util.tree_map(lambda a: a + 0, params)  # equal values, new arrays
    np.testing.assert_array_equal(run(other), first)
    assert len(calls) == 2
    del other
    assert not sampler._PACKED  # freed with the params it was packed from

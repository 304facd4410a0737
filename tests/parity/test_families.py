"""jaxrl logits equal PyTorch transformers logits (fp32, 1e-5) for each family."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.hf.load import load_params
from jaxrl.model.families import load_spec
from jaxrl.model.transformer import forward, positions_from_mask
from tests.tiny_models import LLAMA3_ROPE, make_model, padded_batch

# runs on an accelerator too (tools/accelerator_check.sh)
pytestmark = pytest.mark.accelerator

CASES = [
    ("llama", dict(tie=False)),
    ("llama", dict(tie=True)),
    ("llama", dict(tie=False, rope_scaling=LLAMA3_ROPE)),
    ("qwen2", dict(tie=False)),
    ("qwen2", dict(tie=True)),
    ("qwen3", dict(tie=False)),
    ("qwen3", dict(tie=True)),
]


def _torch_logits(model, tokens, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(int)))
    return out.logits.numpy()


def _jax_logits(model_dir, tokens, mask):
    spec, params = load_params(model_dir)
    mask = jnp.asarray(mask)
    fn = jax.jit(lambda p, t, m: forward(p, t, positions_from_mask(m), spec, attn_mask=m)[0])
    return np.asarray(fn(params, jnp.asarray(tokens), mask))


@pytest.mark.parametrize("family,kw", CASES, ids=lambda c: str(c))
def test_logits_match_transformers(tmp_path, family, kw):
    model = make_model(family, **kw)
    model.save_pretrained(tmp_path)
    tokens, mask = padded_batch(length=40)
    ref = _torch_logits(model, tokens, mask)
    got = _jax_logits(tmp_path, tokens, mask)
    assert np.abs(ref).max() > 1.0  # the weights are large enough for errors to show
    np.testing.assert_allclose(got[mask], ref[mask], atol=1e-5, rtol=0)


def test_llama3_rope_scaling_changes_logits(tmp_path):
    """The scaled-rope case above is only meaningful if scaling changes the result."""
    tokens, mask = padded_batch(length=40)
    plain = make_model("llama")
    scaled = make_model("llama", rope_scaling=LLAMA3_ROPE)
    assert load_spec_and_save(plain, tmp_path / "a").rope_scaling is None
    assert load_spec_and_save(scaled, tmp_path / "b").rope_scaling is not None
    diff = np.abs(_jax_logits(tmp_path / "a", tokens, mask) - _jax_logits(tmp_path / "b", tokens, mask))
    assert diff[mask].max() > 1e-3


def load_spec_and_save(model, path):
    model.save_pretrained(path)
    return load_spec(path)


def test_left_padding_equals_unpadded(tmp_path):
    """A left-padded row gives the same logits as the same tokens alone."""
    model = make_model("qwen3")
    model.save_pretrained(tmp_path)
    tokens, mask = padded_batch(length=16)
    batch = _jax_logits(tmp_path, tokens, mask)
    alone = _jax_logits(tmp_path, tokens[1:2, 4:], mask[1:2, 4:])
    np.testing.assert_allclose(batch[1, 4:], alone[0], atol=1e-5, rtol=0)


def test_bf16_forward_close_to_fp32(tmp_path):
    model = make_model("llama")
    model.save_pretrained(tmp_path)
    tokens, mask = padded_batch(length=16)
    spec = load_spec(tmp_path)
    _, p32 = load_params(tmp_path, spec, jnp.float32)
    _, p16 = load_params(tmp_path, spec, jnp.bfloat16)
    assert p16["layers"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    m = jnp.asarray(mask)
    run = jax.jit(lambda p: forward(p, jnp.asarray(tokens), positions_from_mask(m), spec,
                                    attn_mask=m)[0])
    l32, l16 = np.asarray(run(p32)), np.asarray(run(p16))
    assert l16.dtype == np.float32
    # bf16 keeps ~3 significant digits; the argmax agrees on nearly every token
    agree = (l32.argmax(-1) == l16.argmax(-1))[mask].mean()
    assert agree > 0.9
    assert np.abs(l32 - l16)[mask].max() < 0.1 * np.abs(l32).max()

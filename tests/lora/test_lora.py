"""LoRA: PEFT's init rule, identity at init, parity with PEFT (logits and gradients), merging,
gradients reach only the adapters, and dropout."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.hf.keymap import hf_key
from jaxrl.hf.load import load_params
from jaxrl.lora.lora import Lora, init_lora, lora_delta, merged_kernel
from jaxrl.model.params import LINEAR_NAMES, linear_shape
from jaxrl.model.transformer import forward, positions_from_mask
from tests.tiny_models import make_model, padded_batch

FAMILIES = ("llama", "qwen2", "qwen3")
RANK, ALPHA = 4, 8.0


@functools.partial(jax.jit, static_argnames=("spec",))
def _logits(params, tokens, mask, spec, lora=None, rng=None):
    return forward(params, tokens, positions_from_mask(mask), spec, attn_mask=mask,
                   lora=lora, rng=rng)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: (dir, spec, params)}: one saved tiny model per family, loaded once."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        make_model(family).save_pretrained(path)
        spec, params = load_params(path)
        out[family] = (path, spec, params)
    return out


@pytest.fixture(scope="module")
def batch():
    tokens, mask = padded_batch(length=12)  # row 1 left-padded, row 2 right-padded
    return jnp.asarray(tokens), jnp.asarray(mask)


def random_lora(spec, seed, rank=RANK, alpha=ALPHA, targets=LINEAR_NAMES, dropout=0.0):
    """PEFT-initialized A and a random (nonzero) B, so the adapter changes the model."""
    lora = init_lora(spec, jax.random.PRNGKey(seed), rank=rank, alpha=alpha, targets=targets,
                     dropout=dropout)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1000), len(targets))
    layers = {name: {"a": ab["a"],
                     "b": 0.5 / np.sqrt(rank) * jax.random.normal(k, ab["b"].shape)}
              for k, (name, ab) in zip(keys, lora.weights["layers"].items())}
    return dataclasses.replace(lora, weights={"layers": layers})


# ---------------------------------------------------------------------------------------------
# 1. init


def test_init_follows_peft_rule(saved):
    _, spec, _ = saved["qwen2"]
    lora = init_lora(spec, jax.random.PRNGKey(0), rank=8, alpha=16.0)
    assert lora.targets == LINEAR_NAMES and lora.rank == 8
    assert lora.scale == 2.0 and lora.dropout == 0.0
    assert init_lora(spec, jax.random.PRNGKey(0), rank=32, alpha=16.0).scale == 0.5
    for name in LINEAR_NAMES:
        fan_in, fan_out = linear_shape(spec, name)
        a, b = np.asarray(lora.weights["layers"][name]["a"]), lora.weights["layers"][name]["b"]
        assert a.shape == (spec.num_layers, fan_in, 8)
        assert b.shape == (spec.num_layers, 8, fan_out)
        assert not np.any(np.asarray(b))  # B exactly zero
        bound = 1.0 / np.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)): sqrt(1/3)*sqrt(3/in)
        assert np.abs(a).max() <= bound
        assert np.abs(a).max() > 0.95 * bound  # >= 1024 draws reach near the bound
        # U(-c, c) has std c/sqrt(3); >= 1024 draws: the sample std is within ~2% of it
        assert abs(a.std() / (bound / np.sqrt(3)) - 1) < 0.08
        assert abs(a.mean()) < 0.1 * bound
    # layers and targets draw different numbers
    a = lora.weights["layers"]["q_proj"]["a"]
    assert not np.array_equal(a[0], a[1])
    assert not np.array_equal(a, lora.weights["layers"]["k_proj"]["a"])


def test_init_bound_is_what_peft_draws():
    """PEFT's own default init for the same layer stays within, and reaches, 1/sqrt(in)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_model("llama"), LoraConfig(r=8, lora_alpha=16,
                                                           target_modules=["gate_proj"]))
    for name, p in model.named_parameters():
        if "lora_A" in name:
            bound = 1.0 / np.sqrt(p.shape[1])  # PEFT stores A as [r, in]
            assert bound * 0.95 < p.abs().max().item() <= bound
        if "lora_B" in name:
            assert not p.detach().any()


def test_unknown_target_raises_naming_it(saved):
    _, spec, _ = saved["llama"]
    with pytest.raises(ValueError, match="qkv_proj"):
        init_lora(spec, jax.random.PRNGKey(0), rank=4, alpha=8, targets=("q_proj", "qkv_proj"))


def test_lora_delta_and_merge_by_hand():
    x = jnp.array([[1.0, 2.0]])
    ab = {"a": jnp.array([[1.0], [1.0]]), "b": jnp.array([[2.0, -1.0]])}
    # x @ A = 3; 3 @ B = [6, -3]; times scale 0.5
    np.testing.assert_array_equal(lora_delta(x, ab, 0.5), [[3.0, -1.5]])
    kernel = jnp.array([[[1.0, 0.0], [0.0, 1.0]]])
    ab = {"a": jnp.array([[[1.0], [2.0]]]), "b": jnp.array([[[3.0, 4.0]]])}
    # A @ B = [[3, 4], [6, 8]]
    np.testing.assert_array_equal(merged_kernel(kernel, ab, 0.5), [[[2.5, 2.0], [3.0, 5.0]]])


# ---------------------------------------------------------------------------------------------
# 2. a fresh adapter is the identity


@pytest.mark.parametrize("family", FAMILIES)
def test_fresh_lora_leaves_logits_unchanged(saved, batch, family):
    _, spec, params = saved[family]
    tokens, mask = batch
    base = np.asarray(_logits(params, tokens, mask, spec))
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=RANK, alpha=ALPHA)
    got = np.asarray(_logits(params, tokens, mask, spec, lora))
    np.testing.assert_allclose(got[mask], base[mask], atol=1e-7, rtol=0)


# ---------------------------------------------------------------------------------------------
# 3. parity with PEFT


def peft_model(family, lora: Lora, spec, alpha):
    """The tiny torch model wrapped by PEFT (rank, alpha, targets as given), with `lora`'s A and B
    copied in. alpha is passed, not derived from lora.scale, so a wrong scale cannot hide."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=alpha,
                        target_modules=list(lora.targets), lora_dropout=0.0)
    model = get_peft_model(make_model(family), config)
    params = dict(model.named_parameters())
    want = set()
    with torch.no_grad():
        for name, ab in lora.weights["layers"].items():
            for i in range(spec.num_layers):
                module = hf_key(f"layers/{name}/kernel", i).removesuffix(".weight")
                prefix = f"base_model.model.{module}"
                for part, w in (("lora_A", ab["a"][i]), ("lora_B", ab["b"][i])):
                    key = f"{prefix}.{part}.default.weight"
                    want.add(key)
                    params[key].copy_(torch.from_numpy(np.asarray(w).T.copy()))
    assert want == {k for k in params if "lora_" in k}  # every PEFT adapter weight was set
    model.eval()
    return model


def _torch_logits(model, tokens, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(tokens)),
                    attention_mask=torch.tensor(np.asarray(mask).astype(int)))
    return out.logits.numpy()


PARITY = [(f, RANK, ALPHA, LINEAR_NAMES) for f in FAMILIES] + [
    ("qwen2", 8, 16.0, ("q_proj", "v_proj"))]


@pytest.mark.parametrize("family,rank,alpha,targets", PARITY,
                         ids=[f"{f}-r{r}-{len(t)}targets" for f, r, _, t in PARITY])
def test_logits_match_peft(saved, batch, family, rank, alpha, targets):
    _, spec, params = saved[family]
    tokens, mask = batch
    lora = random_lora(spec, seed=3, rank=rank, alpha=alpha, targets=targets)
    assert lora.scale == alpha / rank
    ref = _torch_logits(peft_model(family, lora, spec, alpha), tokens, mask)
    got = np.asarray(_logits(params, tokens, mask, spec, lora))
    base = np.asarray(_logits(params, tokens, mask, spec))
    m = np.asarray(mask)
    assert np.abs(got - base)[m].max() > 1e-2  # the adapter matters, so parity means something
    np.testing.assert_allclose(got[m], ref[m], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# 4. merging


@pytest.mark.parametrize("family", ["qwen3"])
def test_merged_kernels_equal_lora_forward(saved, batch, family):
    _, spec, params = saved[family]
    tokens, mask = batch
    lora = random_lora(spec, seed=5)
    layers = dict(params["layers"])
    for name, ab in lora.weights["layers"].items():
        layers[name] = {**layers[name],
                        "kernel": merged_kernel(layers[name]["kernel"], ab, lora.scale)}
    merged = {**params, "layers": layers}
    with_lora = np.asarray(_logits(params, tokens, mask, spec, lora))
    got = np.asarray(_logits(merged, tokens, mask, spec))
    base = np.asarray(_logits(params, tokens, mask, spec))
    m = np.asarray(mask)
    assert np.abs(with_lora - base)[m].max() > 1e-2
    np.testing.assert_allclose(got[m], with_lora[m], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# 5. gradients reach only the adapters


def _weighted_logits_loss(w):
    """loss(params, lora) = sum over valid tokens of logits * w (w fixed, random)."""
    def loss(params, lora, tokens, mask, spec):
        logits = forward(params, tokens, positions_from_mask(mask), spec, attn_mask=mask,
                         lora=lora)[0]
        return jnp.sum(jnp.where(mask[..., None], logits * w, 0.0))
    return loss


def _all_shapes(jaxpr):
    """Shapes of every value any equation computes, sub-jaxprs (scan bodies, pjit) included."""
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for sub in jax.core.jaxprs_in_params(eqn.params):
            shapes += _all_shapes(sub)
    return shapes


def test_grad_of_fresh_lora_is_zero_for_a_and_nonzero_for_b(saved, batch):
    _, spec, params = saved["llama"]
    tokens, mask = batch
    lora = init_lora(spec, jax.random.PRNGKey(0), rank=RANK, alpha=ALPHA)
    w = jax.random.normal(jax.random.PRNGKey(1), (spec.vocab_size,))
    loss = _weighted_logits_loss(w)
    grads = jax.jit(jax.grad(loss, argnums=1), static_argnames="spec")(
        params, lora, tokens, mask, spec=spec)
    assert isinstance(grads, Lora)
    assert jax.tree.structure(grads) == jax.tree.structure(lora)
    assert grads.scale == lora.scale
    for name in LINEAR_NAMES:
        g = grads.weights["layers"][name]
        # y = x W + s (x A) B: dL/dA = s x^T (dL/dy B^T) = 0 when B = 0,
        # while dL/dB = s (x A)^T dL/dy is nonzero.
        assert not np.any(np.asarray(g["a"])), name
        assert np.all(np.abs(np.asarray(g["b"])).max(axis=(1, 2)) > 1e-3), name


def test_base_params_are_never_differentiated(saved, batch):
    _, spec, params = saved["qwen2"]
    tokens, mask = batch
    lora = random_lora(spec, seed=7)
    loss = functools.partial(_weighted_logits_loss(jnp.ones(spec.vocab_size)), spec=spec)
    kernel_shapes = set()
    for name in LINEAR_NAMES:
        fan_in, fan_out = linear_shape(spec, name)
        kernel_shapes |= {(spec.num_layers, fan_in, fan_out), (fan_in, fan_out)}

    closed = jax.make_jaxpr(jax.grad(loss, argnums=1))(params, lora, tokens, mask)
    lora_shapes = [tuple(x.shape) for x in jax.tree.leaves(lora)]
    assert [tuple(a.shape) for a in closed.out_avals] == lora_shapes  # exactly the LoRA leaves
    computed = set(_all_shapes(closed.jaxpr))
    assert not computed & kernel_shapes  # no kernel-shaped cotangent is ever formed

    # the check can fail: differentiating w.r.t. the base does form kernel-shaped values
    closed_base = jax.make_jaxpr(jax.grad(loss, argnums=0))(params, lora, tokens, mask)
    assert set(_all_shapes(closed_base.jaxpr)) & kernel_shapes


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_lora_grads_match_torch_autograd_through_peft(saved, batch, family):
    _, spec, params = saved[family]
    tokens, mask = batch
    lora = random_lora(spec, seed=11)
    w = np.random.RandomState(0).randn(spec.vocab_size).astype(np.float32)
    loss = _weighted_logits_loss(jnp.asarray(w))
    grads = jax.jit(jax.grad(loss, argnums=1), static_argnames="spec")(
        params, lora, tokens, mask, spec=spec)

    model = peft_model(family, lora, spec, ALPHA)
    logits = model(input_ids=torch.tensor(np.asarray(tokens)),
                   attention_mask=torch.tensor(np.asarray(mask).astype(int))).logits
    m = torch.tensor(np.asarray(mask))
    (logits[m] * torch.from_numpy(w)).sum().backward()
    named = dict(model.named_parameters())
    for p_name, p in named.items():  # the frozen base gets no gradient in PEFT either
        assert (p.grad is None) == ("lora_" not in p_name), p_name
    for name in LINEAR_NAMES:
        for i in range(spec.num_layers):
            prefix = "base_model.model." + hf_key(f"layers/{name}/kernel", i).removesuffix(".weight")
            for part, g in (("lora_A", grads.weights["layers"][name]["a"][i]),
                            ("lora_B", grads.weights["layers"][name]["b"][i])):
                ref = named[f"{prefix}.{part}.default.weight"].grad.numpy().T
                got = np.asarray(g)
                assert np.abs(ref).max() > 1e-2
                np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0,
                                           err_msg=f"{part} of {name} layer {i}")


# ---------------------------------------------------------------------------------------------
# 6. dropout


def test_dropout_forward(saved, batch):
    _, spec, params = saved["llama"]
    tokens, mask = batch
    m = np.asarray(mask)
    lora = random_lora(spec, seed=13, dropout=0.5)
    eval_lora = dataclasses.replace(lora, dropout=0.0)
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    no_rng = np.asarray(_logits(params, tokens, mask, spec, lora))
    np.testing.assert_array_equal(no_rng, np.asarray(_logits(params, tokens, mask, spec,
                                                             eval_lora)))
    d1 = np.asarray(_logits(params, tokens, mask, spec, lora, k1))
    np.testing.assert_array_equal(d1, np.asarray(_logits(params, tokens, mask, spec, lora, k1)))
    d2 = np.asarray(_logits(params, tokens, mask, spec, lora, k2))
    assert np.abs(d1 - no_rng)[m].max() > 1e-2
    assert np.abs(d1 - d2)[m].max() > 1e-2
    # dropout acts on the adapter's input only: with B = 0 the base is untouched
    fresh = init_lora(spec, jax.random.PRNGKey(0), rank=RANK, alpha=ALPHA, dropout=0.5)
    base = np.asarray(_logits(params, tokens, mask, spec))
    np.testing.assert_allclose(np.asarray(_logits(params, tokens, mask, spec, fresh, k1))[m],
                               base[m], atol=1e-7, rtol=0)


def test_dropout_is_inverted_and_keeps_the_expectation():
    p, n_keys, scale = 0.5, 256, 2.0
    rs = np.random.RandomState(0)
    x = jnp.asarray(rs.randn(4, 32), jnp.float32)
    ab = {"a": jnp.asarray(rs.randn(32, 4) / np.sqrt(32), jnp.float32),
          "b": jnp.asarray(rs.randn(4, 16) / 2, jnp.float32)}
    exact = np.asarray(lora_delta(x, ab, scale))
    keys = jax.random.split(jax.random.PRNGKey(0), n_keys)
    draws = np.asarray(jax.vmap(lambda k: lora_delta(x, ab, scale, p, k))(keys))
    assert not np.allclose(draws[0], exact)
    assert not np.allclose(draws[0], draws[1])
    # each input element is zeroed with probability p or scaled by 1/(1-p)
    masked = np.asarray(jax.vmap(lambda k: lora_delta(x, {"a": jnp.eye(32), "b": jnp.eye(32)},
                                                          1.0, p, k))(keys))
    ratio = masked / np.asarray(x)
    assert set(np.round(np.unique(ratio), 5)) <= {0.0, 2.0}
    assert abs((ratio == 0).mean() - p) < 0.02  # 32768 draws: std 0.003
    # delta_j = s sum_i x_i m_i W_ij with E m_i = 1 and Var m_i = p / (1 - p), so the mean over
    # n keys has standard error s sqrt(p / (1 - p) sum_i x_i^2 W_ij^2 / n)
    w = np.asarray(ab["a"] @ ab["b"])
    se = scale * np.sqrt(p / (1 - p) * (np.asarray(x) ** 2) @ (w ** 2) / n_keys)
    z = (draws.mean(0) - exact) / se
    assert np.abs(z).max() < 5
    # without the 1 / (1 - p) rescaling the mean would be (1 - p) * exact: far outside
    assert np.median(np.abs((1 - p) * exact - exact) / se) > 5


def test_hand_written_lora_backward_equals_automatic_differentiation():
    """lora_delta's custom backward against autodiff of the same expression (fp32: exact up to
    summation order; bf16: within bf16 rounding of the reference's own bf16 casts)."""
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    x = jax.random.normal(k[0], (2, 5, 12))
    ab = {"a": jax.random.normal(k[1], (12, 4)), "b": jax.random.normal(k[2], (4, 7))}
    w = jax.random.normal(k[3], (2, 5, 7))

    def reference(x, ab):
        return 0.5 * jnp.einsum("...i,ir,ro->...o", x, ab["a"], ab["b"])

    def loss(fn, x, ab):
        return jnp.sum(fn(x, ab).astype(jnp.float32) * w)

    ours = jax.grad(lambda x, ab: loss(lambda x, ab: lora_delta(x, ab, 0.5), x, ab),
                    argnums=(0, 1))(x, ab)
    expected = jax.grad(lambda x, ab: loss(reference, x, ab), argnums=(0, 1))(x, ab)
    for got, want in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    low = jax.grad(lambda x, ab: loss(lambda x, ab: lora_delta(x, ab, 0.5), x, ab),
                   argnums=(0, 1))(x.astype(jnp.bfloat16), ab)
    for got, want in zip(jax.tree_util.tree_leaves(low), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.1)

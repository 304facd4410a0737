"""Rows of several adapters in one batch (`AdapterSet`): the rows form's arithmetic by hand,
and exactness through the engine: a row decodes the same tokens (greedy and seeded) whatever
adapters the rows beside it use, on one device and on the (2, 2, 2) mesh, with float32 and NF4
weights; one adapter in the set decodes what the plain adapter decodes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.lora.adapters import AdapterSet
from jaxrl.lora.lora import Lora, lora_delta
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.sampling.requests import row_keys
from tests.sharding.common import SPEC, mesh_rules, model, placed, quantized_model

GREEDY, SEEDED = Decoding(0.0), Decoding(1.0, top_k=20)
PROMPTS = [[5, 9, 31, 7], [17, 2, 88], [40, 41, 42, 43, 44, 45], [3, 4]]


def _two(a: float, b: float, rank: int, fan_in: int = 2, fan_out: int = 1) -> Lora:
    """A one-layer adapter of q_proj with A all `a` and B all `b`."""
    return Lora(weights={"layers": {"q_proj": {
        "a": jnp.full((1, fan_in, rank), a), "b": jnp.full((1, rank, fan_out), b)}}},
        scale=2.0 / rank)


def test_rows_form_gives_each_row_its_adapters_term_by_hand():
    # x = [1, 2] per row; adapter 1: rank 2, A = 1, B = 3, scale 1 -> x@A = [3, 3],
    # term = 1 * (3 * 3 + 3 * 3) = 18; adapter 2: rank 1, A = 2, B = -1, scale 2 ->
    # x@A = [6], term = 2 * 6 * -1 = -12; the base: 0
    lora_set = AdapterSet.of([_two(1.0, 3.0, 2), _two(2.0, -1.0, 1)])
    np.testing.assert_array_equal(lora_set.column_scales(),
                                  [[0, 0, 0], [1, 1, 0], [0, 0, 2]])
    rows = lora_set.for_rows(jnp.asarray([1, 2, 0, 1, 7]))  # 7: not an adapter, the base
    ab = rows.weights["layers"]["q_proj"]
    assert ab["a"].shape == (1, 2, 3) and ab["b"].shape == (1, 3, 1)
    x = jnp.tile(jnp.asarray([[[1.0, 2.0]]]), (5, 1, 1))  # [B, T, in]
    layer = {"a": ab["a"][0], "b": ab["b"][0]}
    out = lora_delta(x, layer, rows.scale_for(x))
    np.testing.assert_array_equal(out[:, 0, 0], [18.0, -12.0, 0.0, 18.0, 0.0])


def test_a_missing_target_is_a_zero_block():
    only_v = Lora(weights={"layers": {"v_proj": {"a": jnp.ones((1, 2, 1)),
                                                 "b": jnp.ones((1, 1, 1))}}}, scale=1.0)
    rows = AdapterSet.of([_two(1.0, 3.0, 2), only_v]).for_rows(jnp.asarray([2]))
    assert set(rows.weights["layers"]) == {"q_proj", "v_proj"}
    np.testing.assert_array_equal(rows.weights["layers"]["v_proj"]["a"][0, :, :2], 0.0)
    np.testing.assert_array_equal(rows.weights["layers"]["q_proj"]["a"][0, :, 2:], 0.0)


def _adapters(lora: Lora) -> list[Lora]:
    """Three distinct adapters of the test model's shape."""
    def moved(i):
        return lora.replace(weights=jax.tree_util.tree_map(
            lambda x: x * (1.0 + 0.5 * i) + 0.03 * i if x.shape[1] == 4 else x, lora.weights))
    return [moved(i) for i in range(3)]


def _decode(params, lora, rows, rules=None, slots=4) -> list[list[int]]:
    """Tokens of each (prompt index, adapter, decoding, key index) row, decoded together."""
    engine = Engine(params, SPEC, slots=slots, capacity=32, chunk=4, lora=lora,
                    shardings=rules)
    keys = row_keys(jax.random.PRNGKey(7), range(8))
    requests = [engine.submit(Request(PROMPTS[p], d, 8, keys[k], adapter=a))
                for p, a, d, k in rows]
    engine.run()
    assert engine.stats.mixed_steps > 0 or len({a for _, a, _, _ in rows}) == 1
    return [r.tokens for r in requests]


@pytest.fixture(scope="module", params=["float32", "nf4"])
def weights(request):
    return model() if request.param == "float32" else quantized_model()


@pytest.mark.parametrize("where", ["one device", "mesh"])
def test_a_row_decodes_the_same_whatever_adapters_beside_it(weights, where):
    params, policy = weights
    rules = mesh_rules() if where == "mesh" else None
    params = placed(rules, params)
    lora_set = AdapterSet.of(_adapters(policy))
    watched = [(0, 1, GREEDY, 0), (1, 2, SEEDED, 1)]  # rows 0 and 1 are compared
    mixes = [[(2, 0, GREEDY, 2), (3, 3, SEEDED, 3)],
             [(2, 1, SEEDED, 4), (3, 1, GREEDY, 5)],
             [(0, 2, GREEDY, 6), (1, 0, SEEDED, 7)]]
    decoded = [_decode(params, lora_set, watched + mix, rules)[:2] for mix in mixes]
    assert decoded[0] == decoded[1] == decoded[2]
    # and the adapters differ: a row's tokens depend on its own adapter
    alone = [_decode(params, lora_set, [(0, a, GREEDY, 0)], rules)[0] for a in range(4)]
    assert len({tuple(t) for t in alone}) > 1


def test_one_adapter_in_a_set_decodes_as_the_plain_adapter_and_index_0_as_the_base():
    params, policy = model()
    rows = [(p, 1, d, p) for p, d in enumerate([GREEDY, SEEDED, GREEDY, SEEDED])]
    in_set = _decode(params, AdapterSet.of([policy]), rows)
    plain = _decode(params, policy, [(p, 0, d, k) for p, _, d, k in rows])
    assert in_set == plain
    base_rows = [(p, 0, d, k) for p, _, d, k in rows]
    assert _decode(params, AdapterSet.of([policy]), base_rows) == _decode(params, None,
                                                                           base_rows)


def test_engine_counts_steps_of_each_adapter_and_refuses_an_unknown_one():
    params, policy = model()
    engine = Engine(params, SPEC, slots=4, capacity=32, chunk=4,
                    lora=AdapterSet.of(_adapters(policy)[:2]))
    for p, a in ((0, 0), (1, 2)):
        engine.submit(Request(PROMPTS[p], GREEDY, 6, adapter=a))
    engine.run()
    stats = engine.stats
    assert stats.adapter_tokens == {0: 5, 2: 5} and stats.mixed_steps == 5
    assert stats.adapter_steps == {0: 5, 2: 5}
    with pytest.raises(ValueError, match="0 \\(the base\\) to 2"):
        engine.submit(Request(PROMPTS[0], GREEDY, 6, adapter=3))
    plain = Engine(params, SPEC, slots=2, capacity=32, chunk=4, lora=policy)
    with pytest.raises(ValueError, match="adapter 0"):
        plain.submit(Request(PROMPTS[0], GREEDY, 6, adapter=1))


def test_the_gpu_kernels_decode_mixed_rows_as_the_xla_forms():
    """The GPU choice (Pallas NF4 kernels with the LoRA term in their epilogue and the joined
    q|k|v and gate|up A matrices, in interpret mode) on rows of three adapters and the base."""
    import dataclasses

    from jaxrl.backends.numerics import numerics_for

    params, policy = quantized_model()
    gpu = dataclasses.replace(numerics_for("gpu"), interpret=True)
    assert gpu.in_place_layers
    rows = [(0, 1, GREEDY, 0), (1, 2, SEEDED, 1), (2, 0, GREEDY, 2), (3, 3, SEEDED, 3)]
    lora_set = AdapterSet.of(_adapters(policy))

    def run(numerics):
        engine = Engine(numerics.hold(params), SPEC, slots=4, capacity=32, chunk=4,
                        lora=lora_set, numerics=numerics)
        keys = row_keys(jax.random.PRNGKey(7), range(4))
        requests = [engine.submit(Request(PROMPTS[p], d, 8, keys[k], adapter=a))
                    for p, a, d, k in rows]
        engine.run()
        return [r.tokens for r in requests]

    assert run(gpu) == run(numerics_for("cpu"))

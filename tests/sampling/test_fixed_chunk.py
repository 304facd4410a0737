"""The decode chunk with `Numerics.fixed_chunk` (the GPU's and TPU's choice): its lowered
program holds no conditional, no loop whose trip count depends on data and no host transfer,
and it decodes what the early-stopping chunk (the CPU's choice) decodes."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.backends.numerics import numerics_for
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.params import init_params
from jaxrl.sampling import Decoding, Engine, Request
from jaxrl.sampling.programs import abstract_slots, admit, extend, generate, init_slots
from jaxrl.sampling.requests import row_keys
from jaxrl.sampling.sampling_fns import ALL, Features, RowSettings
from tests.sharding.common import SPEC as MESH_SPEC
from tests.sharding.common import mesh_rules

# vocab 512 > the 256 candidates top-k and top-p read, so ALL holds both bisections
SPEC = spec_from_hf_config({
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "eos_token_id": 2})
STEPS = 8
ROLLOUT = Features.of([Decoding(0.7)])
HOST = re.compile(r"stablehlo\.(send|recv|infeed|outfeed)\b|callback|host_compute", re.I)
BRANCH = re.compile(r"stablehlo\.(case|if)\b|\"stablehlo\.(case|if)\"")
WHILE = re.compile(r"^( *)(%[\w#:]+ = )?stablehlo\.while\((.*?)\)\s*:")
DEF = r"^\s*{} = stablehlo\.constant dense<(-?\d+)> : tensor<i32>"


def _functions(text: str) -> list[list[str]]:
    """The lines of each func.func of a module's text."""
    funcs = []
    for line in text.splitlines():
        if line.lstrip().startswith("func.func"):
            funcs.append([])
        if funcs:
            funcs[-1].append(line)
    return funcs


def _constant(name: str, lines: list[str]) -> int | None:
    """The value of the scalar int32 constant `name` defined among lines, else None."""
    for line in lines:
        m = re.match(DEF.format(re.escape(name)), line)
        if m:
            return int(m.group(1))
    return None


def _counted_loop(func: list[str], at: int) -> tuple[int | None, str]:
    """(trip count, why not) of the stablehlo.while at line `at` of func: a count when its
    condition only compares one loop variable that starts at a constant and grows by a
    constant each trip with a constant bound, else None and the reason."""
    m = WHILE.match(func[at])
    indent = m.group(1)
    inits = dict(re.findall(r"(%iterArg\w*) = (%[\w#]+)", m.group(3)))
    names = list(inits)
    end = next(i for i in range(at + 1, len(func)) if func[i] == indent + "}")
    split = next(i for i in range(at + 1, end) if func[i] == indent + "} do {")
    if func[at + 1] != indent + "cond {":
        return None, "no condition region"
    cond, body = func[at + 2:split], func[split + 1:end]
    ops = [line.strip() for line in cond]
    compares = [re.match(r"(%\w+) = stablehlo\.compare\s+LT, (%iterArg\w*), (%\w+), SIGNED", op)
                for op in ops]
    compares = [c for c in compares if c]
    kinds = {re.sub(r"^%\w+ = ", "", op).split(" ")[0] for op in ops}
    if len(compares) != 1 or not kinds <= {"stablehlo.constant", "stablehlo.compare",
                                           "stablehlo.return"}:
        return None, "condition " + "; ".join(ops)
    result, counter, bound = compares[0].groups()
    if ops[-1] != f"stablehlo.return {result} : tensor<i1>":
        return None, "condition returns something else"
    limit, start = _constant(bound, cond), _constant(inits[counter], func[:at])
    if limit is None or start is None:
        return None, f"bound {bound} or start {inits[counter]} not constant"
    body_indent = indent + "  "
    returns = [line for line in body if line.startswith(body_indent + "stablehlo.return ")]
    operands = re.findall(r"%[\w#]+", returns[-1].split(":")[0])
    step = re.escape(operands[names.index(counter)])
    grown = [re.match(rf"^\s*{step} = stablehlo\.add {re.escape(counter)}, (%\w+)", line)
             for line in body if line.startswith(body_indent)]
    grown = [g for g in grown if g]
    by = _constant(grown[0].group(1), body) if grown else None
    if not by or by < 1:
        return None, f"{counter} does not grow by a constant"
    return -(-(limit - start) // by), ""


def assert_no_round_trip(text: str) -> list[int]:
    """Assert a lowered module holds no conditional, no host transfer and only loops of
    constant trip counts; returns the trip counts."""
    assert not BRANCH.search(text), BRANCH.search(text).group(0)
    assert not HOST.search(text), HOST.search(text).group(0)
    assert text.count("stablehlo.while") == len(re.findall(r"stablehlo\.while\(", text)), \
        "a while in generic form"
    trips = []
    for func in _functions(text):
        for at, line in enumerate(func):
            if WHILE.match(line):
                trips.append(_counted_loop(func, at))
    bad = [why for count, why in trips if count is None]
    assert not bad, "\n".join(bad)
    return [count for count, _ in trips]


def _params(spec):
    return jax.eval_shape(lambda: init_params(spec, jax.random.PRNGKey(0)))


def _lowered(numerics, features, share=1, spec=SPEC, rules=None, **options) -> str:
    params = _params(spec)
    kw = dict(slots=4, capacity=32, share=share, prompt_capacity=8 if share > 1 else 0,
              numerics=numerics)
    if rules is None:
        state = jax.eval_shape(lambda p: init_slots(p, spec=spec, **kw), params)
    else:
        state = abstract_slots(params, spec, shardings=rules, **kw)
    return generate.lower(state, params, None, spec=spec, eos_ids=(2,), steps=STEPS, **options,
                          shardings=rules, numerics=numerics, features=features,
                          lowering_platforms=numerics.lowering_platforms).as_text()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("features", [ALL, ROLLOUT], ids=["all", "rollout"])
@pytest.mark.parametrize("share", [1, 2])
def test_the_fixed_chunk_has_no_branch_data_loop_or_host_transfer(platform, features, share):
    trips = assert_no_round_trip(_lowered(numerics_for(platform), features, share))
    assert STEPS in trips  # the chunk itself: STEPS trips
    layers = SPEC.num_layers
    if features is ALL:  # both bisections' loops are in, as fixed loops
        assert 33 in trips and 32 in trips
    assert set(trips) <= {STEPS, layers, 33, 32, 5}, trips  # 5: threefry's rounds


def test_the_fixed_chunk_on_a_mesh_has_no_branch_data_loop_or_host_transfer():
    assert STEPS in assert_no_round_trip(_lowered(numerics_for("gpu", 8), ALL, spec=MESH_SPEC,
                                                  rules=mesh_rules()))


def test_the_cpu_chunk_stops_early_and_the_check_sees_it():
    """The CPU's chunk keeps its early exit: a loop on whether any slot is live; a server's
    (interruptible) also polls the host (`interrupt_chunks`); the check sees both."""
    assert numerics_for("gpu").fixed_chunk and numerics_for("tpu", 8).fixed_chunk
    assert not numerics_for("cpu").fixed_chunk
    text = _lowered(numerics_for("cpu"), ROLLOUT)
    with pytest.raises(AssertionError, match="stablehlo.reduce"):
        assert_no_round_trip(text)
    text = _lowered(numerics_for("cpu"), ROLLOUT, interruptible=True)
    with pytest.raises(AssertionError, match="callback"):
        assert_no_round_trip(text)


@pytest.mark.parametrize("fun,found", [
    (lambda x: jax.lax.cond(x[0] > 0, lambda: x + 1, lambda: x - 1), "stablehlo.case"),
    (lambda x: jax.lax.while_loop(lambda c: c[0] < 9, lambda c: c * 2, x), "condition"),
    (lambda x: jax.lax.fori_loop(0, x.shape[0].bit_length(), lambda i, c: c * i, x), None),
    (lambda x: jax.lax.fori_loop(0, jnp.int32(x[0]), lambda i, c: c + 1, x), "not constant"),
    (lambda x: jax.pure_callback(lambda v: v, x, x), "callback"),
])
def test_the_check_tells_counted_loops_from_branches_and_transfers(fun, found):
    text = jax.jit(fun).lower(jnp.ones((4,), jnp.float32)).as_text()
    if found is None:
        assert assert_no_round_trip(text) == [3]
    else:
        with pytest.raises(AssertionError, match=found):
            assert_no_round_trip(text)


@pytest.mark.parametrize("share", [1, 2])
def test_admit_has_no_branch_data_loop_or_host_transfer(share):
    numerics = numerics_for("gpu")
    params = _params(SPEC)
    state = jax.eval_shape(lambda p: init_slots(p, spec=SPEC, slots=4, capacity=32,
                                                share=share, prompt_capacity=8,
                                                numerics=numerics), params)
    m = 4
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    settings = RowSettings.of([Decoding()] * m)
    text = admit.trace(state, params, None, i32(2, 8), i32(2), i32(2), i32(m), i32(m),
                       jax.ShapeDtypeStruct((m, 2), jnp.uint32), settings, i32(m), spec=SPEC,
                       eos_ids=(2,), numerics=numerics, features=ALL).lower(
        lowering_platforms=numerics.lowering_platforms).as_text()
    assert_no_round_trip(text)


def test_extend_has_no_branch_data_loop_or_host_transfer():
    numerics = numerics_for("gpu")
    params = _params(SPEC)
    state = jax.eval_shape(lambda p: init_slots(p, spec=SPEC, slots=4, capacity=32,
                                                numerics=numerics), params)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    text = extend.trace(state, params, None, i32(2), i32(2, 4), i32(2), i32(2),
                        jax.ShapeDtypeStruct((2, 2), jnp.uint32), RowSettings.of([Decoding()] * 2),
                        i32(2), spec=SPEC, eos_ids=(2,), numerics=numerics,
                        features=ALL).lower(lowering_platforms=numerics.lowering_platforms).as_text()
    assert_no_round_trip(text)


def _engine_run(params, numerics, decodings, budgets, eos_ids, slots=3, chunk=4):
    keys = row_keys(jax.random.PRNGKey(4), range(len(decodings)))
    prompts = [[5, 9, 31, 7], [17, 2, 88], [64], list(range(10, 30)), [3, 1, 4]]
    engine = Engine(params, SPEC, eos_ids=eos_ids, slots=slots, capacity=48, chunk=chunk,
                    numerics=numerics)
    requests = [engine.submit(Request(prompts[i % 5], d, budgets[i], keys[i]))
                for i, d in enumerate(decodings)]
    engine.run()
    return requests, engine


@pytest.mark.parametrize("decodings", [
    [Decoding(0.7)] * 6,
    [Decoding(0.0), Decoding(0.8, top_k=300), Decoding(1.0, top_p=0.9), Decoding(0.7, min_p=0.1),
     Decoding(1.1, repetition_penalty=1.3, top_logprobs=3), Decoding(0.0, frequency_penalty=1.0)],
], ids=["rollout", "mixed"])
def test_the_fixed_chunk_decodes_what_the_early_stopping_chunk_decodes(decodings):
    """Requests whose budgets and EOS end them mid-chunk, so that slots idle in the fixed
    chunk's later steps, decode the same tokens, log-probs and top log-probs."""
    params = init_params(SPEC, jax.random.PRNGKey(0), std=0.3)
    cpu = numerics_for("cpu")
    budgets = [3, 9, 2, 13, 6, 5]
    want, want_engine = _engine_run(params, cpu, decodings, budgets, eos_ids=(2, 7))
    got, engine = _engine_run(params, dataclasses.replace(cpu, fixed_chunk=True), decodings,
                              budgets, eos_ids=(2, 7))
    assert engine.stats.chunks == want_engine.stats.chunks > 2
    for a, b in zip(got, want):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(np.asarray(a.top_logprobs), np.asarray(b.top_logprobs))


def test_one_fixed_chunk_equals_one_early_stopping_chunk():
    """One call of each form on the same slots, where every slot ends before the chunk does:
    the same chunk and the same state (cache columns past each slot's filled ones aside)."""
    params = init_params(SPEC, jax.random.PRNGKey(0), std=0.3)
    cpu = numerics_for("cpu")
    decodings = [Decoding(0.7), Decoding(0.0), Decoding(1.0, top_p=0.8), Decoding(0.9, top_k=3)]
    outs = []
    for numerics in (cpu, dataclasses.replace(cpu, fixed_chunk=True)):
        engine = Engine(params, SPEC, eos_ids=(), slots=4, capacity=48, chunk=16,
                        numerics=numerics)
        keys = row_keys(jax.random.PRNGKey(1), range(4))
        for i, d in enumerate(decodings):
            engine.submit(Request([3 + i, 8, 1], d, [2, 5, 3, 1][i], keys[i]))
        engine._admit()
        state, chunk = generate(engine.state, params, None, spec=SPEC, eos_ids=(), steps=16,
                                numerics=numerics, features=Features.of(decodings))
        outs.append(jax.device_get((state, chunk)))
    (state_a, chunk_a), (state_b, chunk_b) = outs
    assert not chunk_a.emitted[:, 5:].any()  # every slot ended within the first steps
    jax.tree_util.tree_map(np.testing.assert_array_equal, chunk_a, chunk_b)
    filled = np.arange(state_a.cache.k.shape[3]) < state_a.cache.index[:, None]  # [S, C]
    for a, b in ((state_a.cache.k, state_b.cache.k), (state_a.cache.v, state_b.cache.v)):
        mask = filled[None, :, None, :, None]
        np.testing.assert_array_equal(np.where(mask, a, 0), np.where(mask, b, 0))
    jax.tree_util.tree_map(np.testing.assert_array_equal, state_a.replace(cache=None),
                           state_b.replace(cache=None))
    np.testing.assert_array_equal(state_a.cache.index, state_b.cache.index)

"""jaxrl/bench/lowered.py: the decode program's structural counts (lowered for the CPU and, from
this CPU host, exported for CUDA), the counting rules on a hand-made program, the bytes a decode
step must move by hand, and `jaxrl bench decode` on a tiny architecture."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.backends.numerics import numerics_for
from jaxrl.bench import decode_forms, lowered
from jaxrl.cli import main
from jaxrl.commands.bench import numerics_overrides
from jaxrl.config import UsageError
from jaxrl.model.families import spec_from_hf_config

TINY = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "eos_token_id": 2, "tie_word_embeddings": True}
SPEC = spec_from_hf_config(TINY)
STEPS = 3  # decode steps per chunk: neither the layer count nor a sampling loop's


def _structure(numerics, target="cpu", quant="nf4"):
    case = lowered.DecodeCase(SPEC, numerics, slots=2, capacity=32, quant=quant, lora_rank=4,
                              steps=STEPS)
    return lowered.structure(case, target)


def _interpreted(numerics):
    """numerics with its Pallas kernels (if any) in interpret mode, as a CPU runs them."""
    return decode_forms._replace(numerics, {"interpret": True}) or numerics


@pytest.fixture(scope="module")
def counts():
    """Structures of the tiny decode program: the CPU's numerics and the GPU's (its kernels
    interpreted) lowered for the CPU (compiled); the GPU's exported for CUDA; the GPU's XLA split
    form both ways; dense kernels under either platform's numerics."""
    cpu, gpu = numerics_for("cpu"), numerics_for("gpu")
    split = {f.name: f for f in decode_forms.decode_forms(gpu, interpret=False)}["split"].numerics
    return {"cpu": _structure(cpu), "gpu on cpu": _structure(_interpreted(gpu)),
            "gpu on cuda": _structure(gpu, "cuda"),
            "split on cpu": _structure(split), "split on cuda": _structure(split, "cuda"),
            "cpu dense": _structure(cpu, quant="dense"),
            "cpu dense, xla attention": _structure(dataclasses.replace(cpu, attention="xla"),
                                                   quant="dense"),
            "gpu dense on cuda": _structure(gpu, "cuda", quant="dense")}


def test_the_decode_program_lowers_for_the_cpu_and_counts_its_layer(counts):
    for name, result in counts.items():
        layer, chunk = result["layer"], result["chunk"]
        assert layer is not None and layer["trip_count"] == SPEC.num_layers, name
        # the seven linears at least (an XLA form: a dot each; a kernel: a custom call each)
        assert layer["dots"] + sum(layer["custom_calls"].values()) >= 7, name
        assert chunk["dots"] > layer["dots"], name  # the LM head and sampling besides
        assert not chunk["host_transfers"], name
        numerics = result["case"]["numerics"]
        loops = chunk["while_loops"]
        if numerics.get("interpret"):  # interpreted kernels loop on data themselves
            assert STEPS in loops["trip_counts"] or loops["data_dependent"], name
        elif numerics.get("fixed_chunk"):  # the chunk counts its steps: nothing on data
            assert STEPS in loops["trip_counts"] and loops["data_dependent"] == 0, name
            assert chunk["conditionals"] == 0, name
        else:  # the chunk stops once no slot is live
            assert loops["data_dependent"] >= 1, name
    compiled = counts["cpu"]["compiled"]
    assert compiled["layer"]["dots"] > 0 and compiled["layer"]["launches"] > 0
    assert compiled["chunk"]["while_loops"]["trip_counts"].count(SPEC.num_layers) >= 1


def test_cuda_export_from_this_host_gives_the_cpu_lowerings_layer(counts):
    """The same XLA numerics lowered for the CPU and exported for CUDA: the same layer. The
    GPU's Pallas kernels (where its numerics takes them) are custom calls for CUDA and loops of
    XLA ops in interpret mode. The dense products of the CPU's numerics and the GPU's XLA ones
    alike."""
    assert counts["gpu on cuda"]["compiled"] is None  # StableHLO only
    on_cpu, on_cuda = counts["split on cpu"]["layer"], counts["split on cuda"]["layer"]
    assert (on_cuda["dots"], on_cuda["custom_calls"]) == (on_cpu["dots"],
                                                          on_cpu["custom_calls"]) == (
        on_cuda["dots"], {})
    assert not counts["gpu on cpu"]["layer"]["custom_calls"]
    kernels = counts["gpu on cuda"]["layer"]["custom_calls"]
    assert set(kernels) <= set(lowered.GPU_KERNEL_TARGETS), kernels
    if getattr(numerics_for("gpu"), "nf4_decode", "") == "kernel":
        assert kernels, "the GPU's numerics takes the NF4 kernel: custom calls per layer"
    assert (counts["cpu dense, xla attention"]["layer"]["dots"]
            == counts["split on cuda"]["layer"]["dots"] - 7)
    # the CPU's attention over filled columns weighs the step's own key and value elementwise
    # where the XLA form takes a product of each
    assert numerics_for("cpu").attention == "xla_blocks"
    assert (counts["cpu dense"]["layer"]["dots"]
            == counts["cpu dense, xla attention"]["layer"]["dots"] - 2)


def test_the_nf4_forms_lower_for_cuda_and_the_kernels_are_custom_calls():
    gpu = numerics_for("gpu")
    forms = {f.name: f for f in decode_forms.decode_forms(gpu, interpret=False)}
    layers = {}
    for name in ("block", "split"):
        layers[name] = _structure(forms[name].numerics, "cuda")["layer"]
    assert layers["split"]["dots"] > layers["block"]["dots"]  # two half products per linear
    if "kernels" not in forms:
        pytest.skip("this tree's numerics has no kernel fields")
    layer = _structure(forms["kernels"].numerics, "cuda")["layer"]
    assert set(layer["custom_calls"]) & set(lowered.GPU_KERNEL_TARGETS), layer["custom_calls"]


def test_counting_rules_on_a_hand_made_program():
    """A counted loop holding a dot (the 'layer' loop of a 3-layer model), a loop on data, a
    conditional and a host callback."""
    def f(x, w):
        x = jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)
        x = jax.lax.while_loop(lambda x: jnp.sum(x) < 100.0, lambda x: x + 1.0, x)
        x = jax.lax.cond(jnp.sum(x) > 0, lambda x: x, lambda x: -x, x)
        jax.debug.callback(lambda v: None, x)
        return x

    arg = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    low = jax.jit(f).lower(arg, arg)
    result = lowered.count(low.as_text(), layers=3, hlo=low.compile().as_text())
    layer, chunk = result["layer"], result["chunk"]
    assert layer["trip_count"] == 3 and layer["dots"] == 1 and layer["while_loops"][
        "counted"] == 0
    assert chunk["while_loops"]["counted"] == 1 and chunk["while_loops"]["data_dependent"] == 1
    assert sorted(t for t in chunk["while_loops"]["trip_counts"] if t is not None) == [3]
    assert chunk["conditionals"] == 1
    assert sum(chunk["host_transfers"].values()) == 1
    assert all("callback" in k for k in chunk["host_transfers"])
    assert lowered.count(low.as_text(), layers=5)["layer"] is None  # no 5-trip loop
    compiled = result["compiled"]
    assert compiled["chunk"]["while_loops"]["counted"] >= 1


def test_step_bytes_by_hand():
    """The tiny model (tied embedding 256 x 64, 2 layers) with LoRA r4, 2 slots holding 10
    columns each."""
    gpu, cpu = numerics_for("gpu"), numerics_for("cpu")
    dense_case = lowered.DecodeCase(SPEC, gpu, 2, 32, "dense", 4, 2)
    slots, params, lora = lowered.abstract_inputs(dense_case)
    got = decode_forms.step_bytes(SPEC, params, lora, slots=2, filled=10,
                             cache_dtype=slots.cache.k.dtype)
    # dense bf16: embedding 256*64 (it is the head), final norm 64, per layer norms 64 + 64 +
    # q/k norms 16 + 16 and kernels q 64*64, k and v 64*32, o 64*64, gate and up 64*128, down
    # 128*64 (36,864): 90,496 values, 2 bytes each
    assert got.weights == 180_992
    # LoRA r4 on all 7 linears: 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192) = 4,096 per layer,
    # 8,192 values in the compute dtype (bf16)
    assert got.adapter == 16_384
    # a cache column: 2 layers x (K, V) x 2 kv heads x 16 x 2 bytes (bf16) = 256 bytes;
    # 2 slots x 10 filled columns read, 2 slots x 1 column written
    assert (got.cache_read, got.cache_write) == (5_120, 512)
    assert got.total == 180_992 + 16_384 + 5_120 + 512
    # NF4 (blocks of 64, double-quantized scales) per layer: codes I*O/2 bytes, one uint8 scale
    # per block, one float32 step per 256 scales (rounded up) and one float32 offset per kernel:
    # q 2,048 + 64 + 4 + 4, k and v 1,024 + 32 + 8 each, o as q, gate, up and down
    # 4,096 + 128 + 8 each = 19,064; two layers, plus the bf16 embedding, final norm and layer
    # norms (16,768 values) = 38,128 + 33,536
    nf4_case = lowered.DecodeCase(SPEC, cpu, 2, 32, "nf4", 4, 2)
    slots, params, lora = lowered.abstract_inputs(nf4_case)
    got = decode_forms.step_bytes(SPEC, params, lora, slots=2, filled=10,
                             cache_dtype=slots.cache.k.dtype)
    assert got.weights == 71_664 and got.adapter == 16_384
    assert (got.cache_read, got.cache_write) == (10_240, 1_024)  # the CPU's float32 cache
    # an untied model leaves its embedding out (only the fed rows are read)
    untied = spec_from_hf_config({**TINY, "tie_word_embeddings": False})
    case = lowered.DecodeCase(untied, gpu, 2, 32, "dense", 4, 2)
    slots, params, lora = lowered.abstract_inputs(case)
    got = decode_forms.step_bytes(untied, params, lora, slots=2, filled=10, cache_dtype=jnp.bfloat16)
    assert got.weights == 180_992  # the LM head [64, 256] replaces the table as read
    # 1e9 bytes in 1 ms on an H100 SXM (3.35 TB/s): 1e12 B/s, 29.85% of its peak
    assert decode_forms.bandwidth_share(1e9, 1e-3, "NVIDIA H100 80GB HBM3") == pytest.approx(
        1 / 3.35)
    assert decode_forms.bandwidth_share(1e9, 1e-3, "NVIDIA H200") == pytest.approx(1 / 4.8)
    assert decode_forms.bandwidth_share(1e9, 1e-3, "Mystery accelerator") is None


def test_decode_forms_set_their_fields_and_dense_keeps_the_platforms():
    gpu = numerics_for("gpu")
    forms = {f.name: f for f in decode_forms.decode_forms(gpu, interpret=False)}
    assert forms["dense"].numerics == gpu and forms["dense"].quant == "dense"
    assert forms["block"].numerics.nf4_decode == "block" and forms["block"].quant == "nf4"
    assert forms["split"].numerics.nf4_decode == "split"
    (only,) = decode_forms.decode_forms(gpu, ["split"], overrides={"nf4_many": "dense"})
    assert (only.numerics.nf4_decode, only.numerics.nf4_many) == ("split", "dense")
    with pytest.raises(ValueError, match="not one of"):
        decode_forms.decode_forms(gpu, ["fastest"])


def test_numerics_overrides_are_parsed_and_checked():
    assert numerics_overrides(["nf4_decode=block", "fixed-chunk=true"]) == {
        "nf4_decode": "block", "fixed_chunk": True}
    for bad, message in (("nf4_decode", "FIELD=VALUE"), ("speed=11", "not a numerics field"),
                         ("hold_bits=true", "how the weights are loaded"),
                         ("fixed_chunk=maybe", "true or false"),
                         ("nf4_decode=fastest", "--numerics")):
        with pytest.raises(UsageError, match=message):
            numerics_overrides([bad])


def test_bench_decode_times_forms_in_turn_and_writes_rows(tmp_path, capsys):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "decode.jsonl"
    assert main(["bench", "decode", "--batches", "2", "--capacities", "32", "--steps", "2",
                 "--repeats", "1", "--forms", "split,dense", "--out", str(out),
                 f"model.path={model}", "lora.rank=4"]) == 0
    table = capsys.readouterr().out
    assert "| split | 2 | 32 | 16 |" in table and "| dense | 2 | 32 | 16 |" in table
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["form"] for r in rows] == ["split", "dense"]
    for r in rows:
        assert r["status"] == "ok" and r["step_ms"] > 0 and r["filled"] == 16
        assert r["command"].startswith("jaxrl bench decode --batches 2 --capacities 32")
        assert f"--forms {r['form']}" in r["command"]
        # float32 cache on the CPU: 2 slots x 16 columns x 2 layers x 2 x 2 heads x 16 x 4
        assert r["bytes"]["cache_read"] == 2 * 16 * 2 * 2 * 2 * 16 * 4
    nf4, dense = rows
    assert nf4["bytes"]["weights"] == 71_664 and dense["bytes"]["weights"] == 180_992
    markdown = decode_forms.markdown_rows(rows, "1 x cpu", jax.__version__)
    assert markdown.count("`jaxrl bench decode") == 2 and "| split | 2 | 32 | 16 |" in markdown
    assert main(["bench", "decode", "--forms", "fastest", f"model.path={model}"]) == 2
    assert main(["bench", "step", "--numerics", "nf4_decode=block", f"model.path={model}"]) == 2


def test_the_check_report_reads_what_the_steps_wrote(tmp_path):
    row = {"devices": 1, "device_kind": "NVIDIA H200", "jax": "0.11.2", "form": "split",
           "batch": 32, "capacity": 2048, "filled": 1024, "status": "ok", "step_ms": 20.0,
           "bytes": {"total": 4.8e7}, "bandwidth_share": 0.5, "command": "jaxrl bench decode"}
    (tmp_path / "decode.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "profile.jsonl").write_text(json.dumps(
        {**row, "profile": {"per_layer_step": 12.0, "idle_share": 0.25}}) + "\n")
    (tmp_path / "commands.tsv").write_text("structure\tpython tools/decode_structure.py\n")
    report, markdown = decode_forms.check_report(tmp_path)
    assert report["device"] == "1 x NVIDIA H200" and report["jax"] == "0.11.2"
    assert ("| 1 x NVIDIA H200 | 0.11.2 | `jaxrl bench decode` | split | 32 | 2048 | 1024 | "
            "20.000 | 48.0 | 50.0% |") in markdown
    assert "| 12.0 | 25.0% |" in markdown
    assert np.isfinite(report["decode"][0]["step_ms"])

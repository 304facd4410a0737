"""`jaxrl bench`: a decode step's bytes and FLOPs by hand, the device time of a trace by hand,
and the command's tables, JSON lines and profiles on a tiny architecture (its random weights in
the run's layout: tests/hf/test_loader.py)."""
import gzip
import json

import jax
import pytest

from jaxrl.bench.limits import decode_cost, prefill_cost
from jaxrl.bench.profile import op_times
from jaxrl.cli import main
from jaxrl.devices import Peaks, published_peaks
from jaxrl.lora.lora import init_lora
from jaxrl.model.families import spec_from_hf_config
from jaxrl.model.kv_cache import init_cache
from jaxrl.model.params import init_params

TINY = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "eos_token_id": 2, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def architecture(tmp_path_factory):
    """A directory holding only a config.json: an architecture, benchmarked with random weights."""
    path = tmp_path_factory.mktemp("tiny-architecture")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


def test_decode_and_prefill_cost_by_hand():
    spec = spec_from_hf_config(TINY)
    params = init_params(spec, jax.random.PRNGKey(0))  # float32
    lora = init_lora(spec, jax.random.PRNGKey(1), rank=4, alpha=8)
    cache = init_cache(spec, 2, 32)  # float32, 32 columns
    cost = decode_cost(spec, params, lora, cache, slots=2, devices=1)
    # params: embedding 256*64 (tied: it is the LM head), final norm 64, 2 layers of two norms
    # 2*64, q/k norms 2*16 and kernels q 64*64, k and v 64*32, o 64*64, gate and up 64*128,
    # down 128*64 (36,864): 90,496 floats = 361,984 bytes. LoRA r4 per layer: 4 * (128 + 96 +
    # 96 + 128 + 192 + 192 + 192) = 4,096, two layers = 32,768 bytes. Cache: k and v of
    # 2 layers x 2 slots x 2 kv heads x 32 columns x 16 = 16,384 bytes each.
    assert cost.bytes == 361_984 + 32_768 + 2 * 16_384
    # per slot and layer: linears 2 * 36,864, LoRA 2 * 4,096, attention 2 * 2 * 4 heads * 16 *
    # 32 columns = 8,192, so 90,112; 2 layers plus the head 2 * 64 * 256: 212,992; two slots
    assert cost.flops == 2 * (2 * 90_112 + 32_768)
    shares = cost.shares(2.0, Peaks("test", 1e6, 1e6, "by hand"))
    assert shares["bandwidth"] == 427_520 / 2 and shares["bandwidth_share"] == 0.21376
    assert shares["flops_share"] == 0.212992
    assert cost.shares(2.0, None)["bandwidth_share"] is None
    # the same 2 slots as one block sharing a 24-column prompt, each with 8 own columns: the
    # prompt's k and v are read once (2 layers x 1 block x 2 heads x 24 x 16 floats = 6,144
    # bytes each) beside the own caches (2 layers x 2 slots x 2 heads x 8 x 16 floats = 4,096
    # bytes each); the attention still covers 32 columns
    shared = decode_cost(spec, params, lora, init_cache(spec, 2, 8), slots=2, devices=1,
                         prefix=init_cache(spec, 1, 24))
    assert shared.bytes == 361_984 + 32_768 + 2 * 6_144 + 2 * 4_096
    assert shared.flops == cost.flops
    # prefill of 2 prompts of 8 columns: 2 layers x (8 tokens x 81,920 + attention 2 * 2 * 4 *
    # 16 * 8 * 8 = 16,384) + the head at the last token 32,768, per prompt
    assert prefill_cost(spec, lora, 2, 8, devices=2).flops == (2 * (8 * 81_920 + 16_384)
                                                               + 32_768)


def test_published_peaks_by_device_kind():
    assert published_peaks("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert published_peaks("NVIDIA H100 PCIe").bandwidth == 2.0e12
    assert published_peaks("NVIDIA H200").bandwidth == 4.8e12
    assert published_peaks("NVIDIA A100-SXM4-40GB").name == "A100 40GB"
    assert published_peaks("TPU v5 lite").flops == 197e12
    assert published_peaks("TPU v5").name == "TPU v5p"
    assert published_peaks("Mystery accelerator") is None


def test_bench_sample_prints_a_table_and_writes_json_lines(architecture, tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    assert main(["bench", "sample", "--batches", "1,2", "--prompt-tokens", "5", "--repeats", "1",
                 "--out", str(out), f"model.path={architecture}",
                 "sampling.max_new_tokens=4"]) == 0
    text = capsys.readouterr().out
    assert "random weights (architecture of" in text and "peaks (measured)" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["mode"] == "sample" and r["device_kind"] and r["jax"] == jax.__version__
        assert len(r["config_hash"]) == 12 and set(r["compile_s"]) == {"admit", "generate"}
        assert r["decode_tok_s"] == pytest.approx(r["batch"] * 3 / r["decode_s"])
        assert 0 < r["decode_limits"]["bandwidth_share"] and r["peak_bytes"]["generate"] > 0
        assert r["peaks"]["source"] == "measured"
        assert f"| {r['batch']} | 1 | 5 | 4 |" in text


def test_bench_sample_decodes_groups_in_blocks_sharing_their_prompt(architecture, tmp_path,
                                                                    capsys):
    out = tmp_path / "bench.jsonl"
    assert main(["bench", "sample", "--batches", "4", "--group", "2", "--prompt-tokens", "5",
                 "--repeats", "1", "--out", str(out), "--profile", str(tmp_path / "prof"),
                 f"model.path={architecture}", "sampling.max_new_tokens=4"]) == 0
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (r["batch"], r["group"], r["slots"]) == (4, 2, 4)
    assert r["prefill_tok_s"] == pytest.approx(2 * 5 / r["prefill_s"])  # 2 prompts prefilled
    assert r["decode_tok_s"] == pytest.approx(4 * 3 / r["decode_s"])
    text = capsys.readouterr().out
    assert "| 4 | 2 | 5 | 4 |" in text
    # the last call traced: both engine programs ran once in it
    assert r["profile"]["dir"] == str(tmp_path / "prof" / "batch-4")
    ran = {op["program"] for op in r["profile"]["ops"]}
    assert {"admit", "generate"} <= ran and "| generate |" in text


def test_bench_engine_with_static_batches(architecture, tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    assert main(["bench", "engine", "--requests", "6", "--mean-new-tokens", "3", "--static",
                 "--prompt-tokens", "8", "--out", str(out), f"model.path={architecture}",
                 "sampling.max_new_tokens=6", "sampling.slots=2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["engine", "static"]
    assert rows[0]["useful_tokens"] == rows[1]["useful_tokens"] and rows[0]["slots"] == 2
    assert all(0 < r["utilization"] <= 1 for r in rows)
    assert "| engine | 6 | 2 |" in capsys.readouterr().out


def test_bench_step_times_phases_and_each_remat_policy(architecture, tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    assert main(["bench", "step", "--steps", "1", "--compare-remat", "none,full",
                 "--prompt-tokens", "6", "--out", str(out), "--profile", str(tmp_path / "prof"),
                 f"model.path={architecture}",
                 "data.prompts_per_step=2", "grpo.num_generations=2", "sampling.max_new_tokens=4",
                 "optim.remat=dots"]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["mode"] == "step" and row["rows"] == 4 and row["remat"] == "dots"
    median = row["median_s"]
    assert median["step"] == pytest.approx(median["rollout"] + median["reference"]
                                           + median["update"])
    assert row["tok_s"]["rollout"] == pytest.approx(4 * 4 / median["rollout"])
    assert [c["policy"] for c in row["remat_compare"]] == ["none", "full"]
    assert all(len(c["runs_s"]) == 1 and c["update_s"] > 0 for c in row["remat_compare"])
    text = capsys.readouterr().out
    assert "optim.remat: dots" in text and "| none |" in text and "| full |" in text
    assert {op["program"] for op in row["profile"]["ops"]} >= {"generate", "reference_logprobs",
                                                          "train_step"}


@pytest.mark.parametrize("args,message", [
    (["sample", "--batches", "1,x"], "--batches '1,x' must be comma-separated row counts"),
    (["sample", "sampling.max_new_tokens=1"], "set sampling.max_new_tokens to at least 2"),
    (["sample", "--batches", "2,3", "--group", "2"],
     "--batches 3 does not split into groups of --group 2"),
    (["step", "--steps", "0"], "--steps must be at least 1; got 0"),
    (["step", "--compare-remat", "none,some"],
     "--compare-remat takes policies of none, dots, full; got 'some'"),
    (["step", "--compare-remat", "none,full,none"],
     "--compare-remat names each policy once; got none,full,none"),
    (["sample", "model.path=/nowhere/Mystery-7B"], "qwen3-4b"),
    (["engine", "--profile", "p"], "--profile traces jaxrl bench sample and step, not engine"),
])
def test_bad_usage_exits_2_naming_it(args, message, capsys):
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_device_time_by_program_and_op_from_a_trace(tmp_path):
    """Durations (us) of a hand-made trace: a while thunk spans the ops inside it and is left
    out, and so are events that name no program (host work)."""
    def op(module, name, dur, hlo_op=None):
        return {"ph": "X", "name": name, "dur": dur, "ts": 0, "pid": 1, "tid": 1,
                "args": {"hlo_module": module, "hlo_op": hlo_op or name}}
    events = [op("jit_generate", "fusion.1", 300.0), op("jit_generate", "fusion.1", 100.0),
              op("jit_generate", "dot.2", 100.0), op("jit_generate", "while.3", 900.0),
              op("jit_admit", "gemm_fusion", 50.0, hlo_op="command_buffer_1"),
              {"ph": "X", "name": "PjitFunction(jit(generate))", "dur": 1e6, "ts": 0,
               "pid": 1, "tid": 2, "args": {}}]
    folder = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = op_times(tmp_path)
    assert [(r["program"], r["op"], r["calls"]) for r in rows] == [
        ("generate", "fusion.1", 2), ("generate", "dot.2", 1), ("admit", "gemm_fusion", 1)]
    assert [r["ms"] for r in rows] == pytest.approx([0.4, 0.1, 0.05])
    assert [r["share"] for r in rows] == pytest.approx([0.8, 0.2, 1.0])
    assert rows[0]["mean_us"] == pytest.approx(200.0)

"""`jaxrl plan`: compile the sampler, reference pass and GRPO step from abstract shapes and
report memory; with libtpu, for a TPU slice (skipped without it: pip install -e '.[tpu]')."""
import importlib.util
import json
import os

import pytest

from jaxrl.cli import main
from jaxrl.planner import ProgramMemory, report

GIB = 1 << 30
TINY = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
        "head_dim": 16, "eos_token_id": 2}
CONFIG = """model: {path: %s}
quant: {block_size: 16}
lora: {rank: 4, alpha: 8}
mesh: {data: -1, fsdp: 2, tensor: 2}
data: {prompts_per_step: 2, max_prompt_tokens: 16}
sampling: {max_new_tokens: 8}
grpo: {num_generations: 2}
"""


@pytest.fixture
def config(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    path = tmp_path / "plan.yaml"
    path.write_text(CONFIG % (tmp_path / "model"))
    return path


def test_report_sums_peak_and_what_stays_resident():
    rows = [ProgramMemory("sampler", 2 * GIB, GIB, 0, GIB, GIB),
            ProgramMemory("grpo step", 3 * GIB, GIB, GIB, 2 * GIB, 0)]
    assert (rows[0].peak, rows[0].need, rows[1].peak) == (4 * GIB, 5 * GIB, 5 * GIB)
    text, fits = report(rows, 5 * GIB)
    assert fits and "needs 5.00 GiB of 5.00 GiB: fits, 0.00 GiB to spare" in text
    assert report(rows, 5 * GIB - 1)[1] is False
    text, fits = report(rows, 6 * GIB, "0.75 x 8.00 GiB, XLA's default")
    assert "needs 5.00 GiB of 6.00 GiB (0.75 x 8.00 GiB, XLA's default): fits, 1.00 GiB to " \
        "spare" in text


def test_plan_on_local_devices_exits_1_when_it_does_not_fit(config, capsys):
    assert main(["plan", "--config", str(config), "--device-memory", "0.0001"]) == 1
    out, err = capsys.readouterr()
    assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in out and "hosts: one host" in out
    assert "| sampler |" in out and "| reference |" in out and "DOES NOT FIT" in out
    # optim.remat auto: no policy fits 0.0001 GiB, so the step is planned with full remat
    assert "| grpo step (remat full) |" in out
    assert "does not fit the device memory" in err


def test_plan_names_an_unknown_architecture(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text("model: {path: /nowhere/Mystery-7B}\n")
    assert main(["plan", "--config", str(path)]) == 2
    assert "qwen3-8b" in capsys.readouterr().err


@pytest.mark.skipif(not (importlib.util.find_spec("libtpu") or os.environ.get("TPU_LIBRARY_PATH")),
                    reason="compiling for a TPU topology needs libtpu: pip install -e '.[tpu]'")
def test_plan_compiles_for_a_tpu_slice_without_tpus(config, capsys):
    assert main(["plan", "--config", str(config), "--topology", "v5e:2x4"]) == 0
    out = capsys.readouterr().out
    assert "8 x TPU v5 lite (v5e:2x4)" in out and "fits" in out

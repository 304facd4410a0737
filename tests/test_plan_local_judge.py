"""`jaxrl plan` with judge.local: the engines as the run holds them (the judge's slots and
columns in the policy's engine, or a second model with an engine of its own), the report's judge
line, and a judge too large for the device refused with the settings to shrink named."""
import json

import jax
import pytest

from jaxrl import planner
from jaxrl.cli import main
from jaxrl.config import load_config
from jaxrl.hf.loader import architecture, load_model
from jaxrl.planner import ProgramMemory, judge_share, plan_memory
from jaxrl.sharding import MeshRules, make_mesh

TINY = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
        "head_dim": 16, "eos_token_id": 2}
# a cache column of one slot: 2 layers x (keys, values) x 8 KV heads x 16 dims, float32 on CPU
COLUMN = 2 * 2 * 8 * 16 * 4
JUDGE = ["judge.slots=2", "judge.max_prompt_tokens=32", "judge.max_tokens=16"]


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: {tmp_path / 'model'}}}\nquant: {{block_size: 16}}\n"
                    "lora: {rank: 4, alpha: 8}\nmesh: {data: 1}\n"
                    "data: {prompts_per_step: 2, max_prompt_tokens: 16}\n"
                    "sampling: {max_new_tokens: 8}\ngrpo: {num_generations: 2}\n"
                    "optim: {remat: dots}\n")  # one policy: the figures do not follow memory

    def make(*overrides):
        cfg = load_config(str(path), list(overrides))
        rules = MeshRules(make_mesh(cfg.mesh, jax.devices()[:1]))
        return cfg, architecture(cfg.model.path), rules

    return make, path, tmp_path / "model"


def by_name(entries) -> dict[str, ProgramMemory]:
    assert all(isinstance(e, ProgramMemory) for e in entries)
    return {e.name.split(" (")[0]: e for e in entries}


def slot_bytes(cfg, spec, rules) -> int:
    """Bytes of the policy's engine's slots as the plan lowers them."""
    return planner._tree_bytes(planner._slots(cfg, spec, rules,
                                              planner.abstract_run(cfg, spec, rules)))


def test_a_base_judge_adds_its_slots_and_columns_to_the_policys_engine(setup):
    make = setup[0]
    plain = make()
    judged = make("judge.local=base", *JUDGE)
    share = judge_share(*judged)
    # 4 rollout rows + 2 judge slots, each of max(16 + 16, 32 + 16) = 48 columns, no prompt sharing
    assert (share.shared, share.slots, share.columns) == (True, 2, 48)
    assert (share.engine_slots, share.engine_columns) == (6, 48)
    assert share.cache == 2 * 48 * COLUMN and share.engine_cache == 6 * 48 * COLUMN
    assert share.weights == 0 and share.judge_state == 0
    # without the judge: 2 prompts of 16 shared columns + 4 slots of 16 columns of their own
    assert planner._tree_bytes(_cache(planner._slots(
        *plain, planner.abstract_run(*plain)))) == (2 * 16 + 4 * 16) * COLUMN
    before, after = by_name(plan_memory(*plain)), by_name(plan_memory(*judged))
    grown = slot_bytes(*judged) - slot_bytes(*plain)
    assert grown > (6 * 48 - 6 * 16) * COLUMN - 1  # the cache alone grows by that much
    # the sampler takes the larger engine as its argument (the adapter set of one is the
    # policy's adapter, the same bytes) ...
    assert after["sampler"].argument - before["sampler"].argument == grown
    assert after["sampler"].resident_other == before["sampler"].resident_other
    # ... and the engine stays allocated through the reference pass and the GRPO step
    assert (after["reference"].resident_other - before["reference"].resident_other
            == share.engine_state == slot_bytes(*judged))
    assert "judge (judge.local base): 2 slots x 48 columns" in planner.report(
        list(after.values()), None, judge=share)[0]


def _cache(slots):
    return (slots.cache.k, slots.cache.v, slots.prefix.k, slots.prefix.v)


def test_an_adapter_judge_plans_a_stand_in_adapter_of_the_policys_structure(setup):
    make = setup[0]
    base, adapter = make("judge.local=base", *JUDGE), make("judge.local=adapter:/nowhere", *JUDGE)
    share = judge_share(*adapter)
    lora = planner.abstract_run(*adapter).lora
    assert share.adapter == planner._tree_bytes(lora) > 0
    before, after = by_name(plan_memory(*base)), by_name(plan_memory(*adapter))
    # the set holds the policy's adapter twice: the sampler's argument grows by one adapter
    assert after["sampler"].argument - before["sampler"].argument == share.adapter
    assert "a stand-in of the policy's rank and targets" in share.describe()


def test_a_second_model_counts_its_weights_and_its_engine(setup):
    make, _, model_dir = setup
    plain = make()
    judged = make(f"judge.local=model:{model_dir}", *JUDGE)
    cfg, spec, rules = judged
    share = judge_share(*judged)
    weights = load_model(architecture(str(model_dir)), dtype=cfg.model.dtype, quant=cfg.quant,
                         numerics=planner.numerics_of(rules), rules=rules,
                         weights="abstract").params
    # on CPU quant.dequantize auto holds the kernels dense: the bf16 weights of TINY, by hand in
    # tests/test_planner_dequantize.py
    assert share.weights == planner._tree_bytes(weights) == 262_912
    # the judge's engine: 2 slots of 32 + 16 columns; the policy's keeps the rollout's 4 x 32
    assert (share.shared, share.slots, share.columns) == (False, 2, 48)
    assert share.cache == 2 * 48 * COLUMN
    assert (share.engine_slots, share.engine_columns) == (4, 32)
    assert share.engine_cache == 4 * 32 * COLUMN
    before, after = by_name(plan_memory(*plain)), by_name(plan_memory(*judged))
    beside = share.weights + share.judge_state
    assert after["sampler"].resident_other - before["sampler"].resident_other == beside
    assert (after["grpo step"].resident_other - before["grpo step"].resident_other
            == beside + share.engine_state)
    assert after["grpo step"].need - before["grpo step"].need == beside + share.engine_state
    line = share.describe()
    assert "the second model (qwen3, 2 layers, 64 hidden)" in line and "of weights" in line


def test_a_judge_too_large_for_the_device_is_refused_naming_its_settings(setup, capsys):
    _, path, _ = setup
    args = ["plan", "--config", str(path), "--device-memory", "0.1", "mesh.data=-1",
            "mesh.fsdp=2", "mesh.tensor=2", "judge.local=base", "judge.max_prompt_tokens=32",
            "judge.max_tokens=16"]  # the 8 CPU devices of the tests: 4 batch shards
    assert main(args + ["judge.slots=2"]) == 0  # 2 judge slots: one per batch shard, 4
    out = capsys.readouterr().out
    assert ": fits" in out and "judge (judge.local base): 4 slots x 48 columns" in out
    # 1,024 judge slots: their cache and the prefill of their prompts are over 0.75 x 0.1 GiB
    assert main(args + ["judge.slots=1024"]) == 1
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and "judge (judge.local base): 1024 slots x 48 columns" in out
    assert "DOES NOT FIT with the local judge: shrink judge.slots, judge.max_tokens or " \
        "judge.max_prompt_tokens" in out
    assert "judge.slots" in err and "sampling.slots" in err

"""The shipped run configs load, and a paper config without a model path explains itself."""
from pathlib import Path

import pytest

from jaxrl.config import ConfigError, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = load_config(path, ["model.path=/models/some-model"])
    assert cfg.model.path == "/models/some-model"


def test_paper_configs_match_the_papers():
    root = CONFIGS[0].parent
    cedar = load_config(root / "cedar_qwen3_4b_1gpu.yaml", ["model.path=x"])
    assert (cedar.grpo.num_generations, cedar.quant.mode, cedar.run.seed) == (4, "nf4", 3407)
    assert [f.name for f in cedar.rewards.functions] == ["cedar"]
    spring = load_config(root / "spring_qwen3_4b.yaml", ["model.path=x"])
    assert (spring.grpo.num_generations, spring.grpo.beta, spring.sampling.temperature) == \
        (8, 0.01, 0.8)
    assert spring.data.max_prompt_tokens + spring.sampling.max_new_tokens == 8192


@pytest.mark.parametrize("name", ["cedar_qwen3_4b_1gpu.yaml", "spring_qwen3_4b.yaml"])
def test_paper_config_without_model_path_says_how_to_pass_one(name):
    with pytest.raises(ConfigError, match="'model.path' is empty.*model.path=DIR") as e:
        load_config(CONFIGS[0].parent / name)
    assert e.value.exit_code == 2


def test_train_cli_exits_2_without_model_path(capsys):
    from jaxrl.cli import main

    assert main(["train", "--config", str(CONFIGS[0].parent / "spring_qwen3_4b.yaml")]) == 2
    assert "model.path=DIR" in capsys.readouterr().err

"""The `jaxrl` command: help, model info, exit codes."""
import subprocess
import sys

import numpy as np
import pytest

from jaxrl.cli import main
from tests.tiny_models import make_model


def test_help_lists_verbs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "model" in capsys.readouterr().out


def test_model_info_on_local_dir(tmp_path, capsys):
    make_model("qwen3").save_pretrained(tmp_path)
    assert main(["model", "info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "qwen3" in out and "layers" in out and "float32" in out
    # 2 layers * (3 linears of 64x(128|64|64)... ) -- the exact count is the declared one
    from jaxrl.model.families import load_spec
    from jaxrl.model.params import count_params
    assert f"{count_params(load_spec(tmp_path)):,}" in out


def test_model_info_bad_path_exits_2(tmp_path, capsys):
    assert main(["model", "info", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


def test_model_info_unsupported_architecture_exits_1(tmp_path, capsys):
    make_model("llama").save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace('"silu"', '"gelu"')
    (tmp_path / "config.json").write_text(cfg)
    assert main(["model", "info", str(tmp_path)]) == 1
    assert "hidden_act 'gelu'" in capsys.readouterr().err


def test_model_info_on_an_incomplete_checkpoint_exits_1_naming_the_missing_key(tmp_path,
                                                                               capsys):
    from jaxrl.hf.safetensors_io import iter_tensors, write_tensors

    make_model("llama").save_pretrained(tmp_path / "whole")
    tensors = {k: np.array(v) for k, v in iter_tensors(tmp_path / "whole/model.safetensors")}
    del tensors["model.layers.1.mlp.down_proj.weight"]
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut/config.json").write_text((tmp_path / "whole/config.json").read_text())
    write_tensors(tmp_path / "cut/model.safetensors", tensors)
    assert main(["model", "info", str(tmp_path / "cut")]) == 1
    assert "misses 1 keys, e.g. ['model.layers.1.mlp.down_proj.weight']" in capsys.readouterr().err
    assert main(["model", "info", str(tmp_path / "whole")]) == 0


def test_unknown_verb_exits_2():
    proc = subprocess.run([sys.executable, "-m", "jaxrl.cli", "fly"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_model_info_quant_prints_resident_bytes(tmp_path, capsys):
    make_model("llama").save_pretrained(tmp_path)
    assert main(["model", "info", str(tmp_path), "--quant", "nf4", "--no-double-quant"]) == 0
    out = capsys.readouterr().out
    # 7 kernels of 2 layers: 2 * (64*64*2 + 64*32*2 + 3*64*128) = 73728 params at 0.5 + 4/64
    assert "73,728 params in 7 kernels, 0.5625 bytes/param" in out
    assert main(["model", "info", str(tmp_path), "--quant", "nf4", "--block-size", "48"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_more_generated_problems_than_exist_exits_2_naming_the_limit(tmp_path, capsys):
    from jaxrl.cli import _exit_code
    from jaxrl.data.generators.registry import GeneratorError

    with pytest.raises(SystemExit) as exit_info:
        main(["data", "--task", "arithmetic", "--n", "400", "--out", str(tmp_path / "x.jsonl")])
    assert exit_info.value.code == 2
    assert "ask for fewer than 400" in capsys.readouterr().err
    assert _exit_code(GeneratorError("too many")) == 2  # the same from `jaxrl train`


@pytest.mark.parametrize("own_dir", [False, True])
def test_cli_keeps_compiled_programs_across_runs(tmp_path, own_dir):
    """By default in $JAXRL_CACHE/jax-compile; $JAX_COMPILATION_CACHE_DIR wins when set."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JAXRL_CACHE=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    want = tmp_path / ("own" if own_dir else "cache/jax-compile")
    if own_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = str(want)
    code = ("import jax, jax.numpy as jnp\n"
            "from jaxrl.cli import enable_compilation_cache\n"
            "print(enable_compilation_cache())\n"
            "jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(5)).block_until_ready()\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == str(want)
    assert any(want.iterdir())  # the program was written there

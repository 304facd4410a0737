"""Checkpoints save and restore everything a run needs, skip unreadable steps, refuse another
base or changed shapes, and survive a kill during an asynchronous save."""
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl.checkpoint import Checkpoints, checkpoint_steps
from jaxrl.config import ConfigError, apply_overrides
from jaxrl.hf.peft_io import load_peft_adapter
from jaxrl.model.families import load_spec
from jaxrl.rl.rollout import pack_rollout, unpack_rollout
from tests.checkpoint import helpers
from tests.tiny_models import make_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two tiny llama directories of one architecture with different weights."""
    root = tmp_path_factory.mktemp("bases")
    for seed in (0, 1):
        make_model("llama", seed=seed).save_pretrained(root / f"base{seed}")
    return root / "base0", root / "base1", load_spec(root / "base0")


def _equal_trees(a, b) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restores_state_key_data_position_and_pending_rollout(bases, tmp_path):
    base, _, spec = bases
    cfg = helpers.config(base, tmp_path / "run", keep=2)
    state, data, pending = helpers.state(cfg, spec), helpers.data(cfg), helpers.rollout(3)
    next(data)
    checkpoints = Checkpoints(cfg, base, spec, log=lambda m: None)
    for step in (1, 2):
        checkpoints.after_step(step, state, jax.random.PRNGKey(7), data, pack_rollout(pending))
    following = next(data)
    checkpoints.close()
    assert checkpoint_steps(tmp_path / "run" / "checkpoints") == [1, 2]

    logs, fresh = [], helpers.data(cfg)
    template = helpers.state(cfg, spec, seed=5)
    restored = Checkpoints(cfg, base, spec, log=logs.append).restore(template, fresh)
    assert restored.step == 2 and "resuming from" in logs[-1]
    _equal_trees(restored.state, state)
    np.testing.assert_array_equal(restored.key, jax.random.PRNGKey(7))
    assert next(fresh) == following
    got = unpack_rollout(*restored.pending)
    assert (got.step, got.records, got.prompts) == (3, pending.records, pending.prompts)
    for name in ("prompt_tokens", "prompt_mask", "tokens", "mask", "logprobs"):
        np.testing.assert_array_equal(getattr(got.out, name), getattr(pending.out, name))
    assert got.out.texts == pending.out.texts
    assert got.out.finish_reasons == pending.out.finish_reasons
    np.testing.assert_array_equal(got.ref_logp, pending.ref_logp)
    exported = load_peft_adapter(tmp_path / "run" / "adapter", spec)
    _equal_trees(exported.weights, state.lora.weights)
    assert exported.scale == state.lora.scale


def test_every_and_keep(bases, tmp_path):
    base, _, spec = bases
    cfg = helpers.config(base, tmp_path, every=3, keep=1)
    checkpoints = Checkpoints(cfg, base, spec, log=lambda m: None)
    state = helpers.state(cfg, spec)
    for step in (1, 2, 3, 4):  # 3 by `every`, 4 as the last step of run.steps
        checkpoints.after_step(step, state, jax.random.PRNGKey(0), helpers.no_data())
    checkpoints.close()
    assert checkpoint_steps(tmp_path / "checkpoints") == [4]


def _corrupt(step_dir: Path) -> None:
    for path in step_dir.rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"garbage")


def test_unreadable_latest_is_reported_and_the_previous_used(bases, tmp_path):
    base, _, spec = bases
    cfg = helpers.config(base, tmp_path, keep=3)
    checkpoints = Checkpoints(cfg, base, spec, log=lambda m: None)
    states = [helpers.state(cfg, spec, seed) for seed in (1, 2)]
    for step, state in enumerate(states, 1):
        checkpoints.after_step(step, state, jax.random.PRNGKey(0), helpers.no_data())
    checkpoints.close()
    _corrupt(tmp_path / "checkpoints" / "2")
    logs = []
    resumed = Checkpoints(cfg, base, spec, log=logs.append)
    restored = resumed.restore(helpers.state(cfg, spec, 9), helpers.no_data())
    assert restored.step == 1
    _equal_trees(restored.state, states[0])
    assert any("checkpoints/2 is unreadable" in m for m in logs)
    assert (tmp_path / "checkpoints" / "corrupt-2").is_dir()  # kept for inspection
    resumed.after_step(2, states[1], jax.random.PRNGKey(0), helpers.no_data())
    resumed.close()  # the step can be written again
    assert checkpoint_steps(tmp_path / "checkpoints") == [1, 2]


def test_other_base_changed_shapes_and_resume_modes(bases, tmp_path):
    base, other, spec = bases
    cfg = helpers.config(base, tmp_path / "run")
    checkpoints = Checkpoints(cfg, base, spec, log=lambda m: None)
    checkpoints.after_step(1, helpers.state(cfg, spec), jax.random.PRNGKey(0), helpers.no_data())
    checkpoints.close()
    template = helpers.state(cfg, spec)

    def restore(cfg, model_dir=base, template=template):
        return Checkpoints(cfg, model_dir, spec, log=lambda m: None).restore(
            template, helpers.no_data())

    with pytest.raises(ConfigError, match="belongs to base model .*base0.*base1"):
        restore(apply_overrides(cfg, [f"model.path={other}"]), other)
    rank2 = apply_overrides(cfg, ["lora.rank=2"])
    with pytest.raises(ConfigError, match="written with lora.rank=4; this config has lora.rank=2"):
        restore(rank2, template=helpers.state(rank2, spec))
    with pytest.raises(ConfigError, match="needs shape"):
        restore(cfg, template=helpers.state(apply_overrides(cfg, ["optim.max_grad_norm=0"]),
                                            spec))
    with pytest.raises(ConfigError, match="'checkpoint.resume' is never but .* holds"):
        restore(apply_overrides(cfg, ["checkpoint.resume=never"]))
    with pytest.raises(ConfigError, match="holds no complete checkpoint; it must be auto"):
        restore(apply_overrides(cfg, [f"checkpoint.resume={tmp_path / 'nothing'}"]))
    for source in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "1"):
        elsewhere = apply_overrides(cfg, [f"run.output_dir={tmp_path / 'new'}",
                                          f"checkpoint.resume={source}"])
        assert restore(elsewhere).step == 1
    assert restore(apply_overrides(cfg, [f"run.output_dir={tmp_path / 'new'}"])) is None


KILL_DURING_SAVE = """
import os, signal, sys
import jax
from jaxrl.checkpoint import Checkpoints
from jaxrl.model.families import load_spec
from jaxrl.rl.rollout import pack_rollout
from tests.checkpoint import helpers
base, out = sys.argv[1], sys.argv[2]
spec = load_spec(base)
cfg = helpers.config(base, out)
checkpoints = Checkpoints(cfg, base, spec, log=print)
state = helpers.state(cfg, spec)
checkpoints.after_step(1, state, jax.random.PRNGKey(0), helpers.no_data())
# 2: a large pending rollout (~100 MB) keeps the background write busy when the kill comes
checkpoints.after_step(2, state, jax.random.PRNGKey(0), helpers.no_data(),
                       pack_rollout(helpers.rollout(3, rows=64, width=100_000)))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_during_async_save_leaves_the_run_resumable(bases, tmp_path):
    base, _, spec = bases
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(base), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp").is_dir()  # killed mid-write
    assert checkpoint_steps(tmp_path / "checkpoints") == [1]
    cfg = helpers.config(base, tmp_path)
    checkpoints = Checkpoints(cfg, base, spec, log=lambda m: None)
    restored = checkpoints.restore(helpers.state(cfg, spec, 3), helpers.no_data())
    assert restored.step == 1 and restored.pending is None
    _equal_trees(restored.state, helpers.state(cfg, spec))
    checkpoints.after_step(2, restored.state, restored.key, helpers.no_data())
    checkpoints.close()
    assert checkpoint_steps(tmp_path / "checkpoints") == [1, 2]
    assert not (tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp").exists()

"""Small configs, train states and rollouts for checkpoint tests (no training needed)."""
from __future__ import annotations

import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import Config, from_dict
from jaxrl.data.pipeline import build_pool, train_iterator
from jaxrl.lora.lora import init_lora
from jaxrl.rl.rollout import Rollout
from jaxrl.rl.train_step import init_train_state, make_optimizer
from jaxrl.sampling.sampler import SampleOutput


def config(base: Path, out: Path, **checkpoint) -> Config:
    return from_dict({
        "run": {"output_dir": str(out), "steps": 4},
        "model": {"path": str(base), "dtype": "float32"}, "quant": {"mode": "none"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        "data": {"tasks": ["arithmetic:12"], "prompts_per_step": 2},
        "grpo": {"num_generations": 2}, "checkpoint": {"every": 1, "keep": 2, **checkpoint}})


def data(cfg: Config):
    return train_iterator(build_pool(cfg.data), cfg.data)


def no_data():
    """Stands in for the data iterator where only its (empty) state is saved."""
    return types.SimpleNamespace(get_state=dict, set_state=lambda state: None)


def state(cfg: Config, spec, seed: int = 0):
    """A train state of random values: LoRA B and the optimizer moments nonzero (built from
    shapes with numpy, so that no jax op has to compile)."""
    optimizer, _ = make_optimizer(cfg.optim, cfg.run.steps)
    shapes = jax.eval_shape(lambda: init_train_state(init_lora(
        spec, jax.random.PRNGKey(0), rank=cfg.lora.rank, alpha=cfg.lora.alpha,
        targets=cfg.lora.targets), optimizer))
    rng = np.random.RandomState(seed)

    def fill(leaf):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.asarray(0.1 * rng.standard_normal(leaf.shape), leaf.dtype)
        return jnp.asarray(np.full(leaf.shape, seed + 1), leaf.dtype)
    return jax.tree_util.tree_map(fill, shapes)


def rollout(step: int, rows: int = 4, width: int = 6, seed: int = 0) -> Rollout:
    rng = np.random.RandomState(seed)
    out = SampleOutput(prompt_tokens=rng.randint(0, 128, (rows, 5)).astype(np.int32),
                       prompt_mask=rng.rand(rows, 5) > 0.2,
                       tokens=rng.randint(0, 128, (rows, width)).astype(np.int32),
                       mask=rng.rand(rows, width) > 0.3,
                       logprobs=-rng.rand(rows, width).astype(np.float32),
                       finish_reasons=("stop", "length") * (rows // 2),
                       texts=tuple(f"text {i}" for i in range(rows)))
    return Rollout(step, [{"id": f"r{i}", "answer": str(i)} for i in range(rows)],
                   [f"prompt {i}" for i in range(rows)], out,
                   jnp.asarray(-rng.rand(rows, width), jnp.float32))

"""Everything a training run holds: model, tokenizer, data, reward pool, optimizer state and the
compiled programs. Built once from the config; the loop in loop.py drives it."""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxrl import distributed
from jaxrl.checkpoint import Checkpoints
from jaxrl.config import Config
from jaxrl.data.pipeline import build_pool, train_iterator
from jaxrl.data.prompts import prompt_fits
from jaxrl.hf.default_model import resolve_model_path
from jaxrl.hf.tokenizer import (chat_prompt_text, detokenizer, eos_token_ids, load_tokenizer,
                                text_ids)
from jaxrl.lora.start import start_lora
from jaxrl.model.families import load_spec
from jaxrl.quant.qparams import dequantize_strategy
from jaxrl.rewards.pool import RewardPool, pipelined
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.rollout import unpack_rollout
from jaxrl.rl.train_step import StepOptions, compile_train_step, init_train_state, make_optimizer
from jaxrl.sharding import place, step_shardings


def learner_temperature(cfg: Config) -> float:
    """The temperature of the distribution the sampler's log-probs come from (1 for greedy)."""
    return cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0


def step_options(cfg: Config) -> StepOptions:
    """The train step's static settings; micro-batches from optim.micro_batch_size."""
    rows = cfg.data.prompts_per_step * cfg.grpo.num_generations
    micro = cfg.optim.micro_batch_size or rows
    if rows % micro:
        from jaxrl.config import ConfigError
        raise ConfigError(f"config key 'optim.micro_batch_size' = {micro} must divide the "
                          f"{rows} rows of a step (data.prompts_per_step * "
                          "grpo.num_generations)")
    return StepOptions(grpo=cfg.grpo, temperature=learner_temperature(cfg),
                       max_new_tokens=cfg.sampling.max_new_tokens, micro_batches=rows // micro)


class Session:
    def __init__(self, cfg: Config, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.rules = distributed.session_rules(cfg.mesh)  # None: one device
        model_dir = resolve_model_path(cfg.model.path)
        self.spec = load_spec(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_ids = eos_token_ids(self.tokenizer, model_dir)
        self.detokenize = detokenizer(self.tokenizer)
        log(f"loading {model_dir} ({self.spec.family}, {self.spec.num_layers} layers) as "
            f"{cfg.quant.mode} + LoRA r{cfg.lora.rank}")
        dtype = jnp.dtype(cfg.model.dtype)
        self.params = distributed.load_params(model_dir, self.spec, dtype, cfg.quant, self.rules)
        if dequantize_strategy(cfg.quant) == "once":
            self.params = distributed.dequantized(self.params, dtype, self.spec, self.rules)
        self.key = jax.random.PRNGKey(cfg.run.seed)
        lora = start_lora(cfg, self.spec, jax.random.fold_in(self.key, 1 << 20))
        optimizer, self.schedule = make_optimizer(cfg.optim, cfg.run.steps)
        self.state = init_train_state(lora, optimizer)
        rows = cfg.data.prompts_per_step * cfg.grpo.num_generations
        self.prompts = distributed.prompt_slice(self.rules, cfg.data.prompts_per_step,
                                                cfg.grpo.num_generations)  # this process's
        self.row_range = (self.prompts.start * cfg.grpo.num_generations,
                          self.prompts.stop * cfg.grpo.num_generations)
        shardings = None if self.rules is None else step_shardings(
            self.rules, self.state, self.params, self.spec, optimizer, rows)
        self.train_step = compile_train_step(self.spec, optimizer, step_options(cfg), shardings)
        pool = build_pool(cfg.data, keep=prompt_fits(self.tokenizer, cfg.data.max_prompt_tokens))
        self.data = train_iterator(pool, cfg.data)
        self.checkpoints = Checkpoints(cfg, model_dir, self.spec, log)
        self.start_step, self.pending = 0, None  # pending: the Rollout sampled before a stop
        restored = self.checkpoints.restore(self.state, self.data)
        if restored is not None:
            self.state, self.key, self.start_step = restored.state, restored.key, restored.step
            if restored.pending is not None:
                self.pending = unpack_rollout(*restored.pending)
        if shardings is not None:
            self.state = place(self.state, shardings[0][0])
        self.rewards = RewardPool(cfg)
        self._progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.description}"),
                                  console=None, transient=False, disable=not sys.stderr.isatty())
        self._task = self._progress.add_task("", total=cfg.run.steps, completed=self.start_step)

    def render(self, record: dict) -> str:
        return chat_prompt_text(self.tokenizer, record["messages"]) + self.cfg.data.response_prefix

    def prompt_ids(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text)

    @functools.cached_property
    def _reference_fn(self):
        return jax.jit(lambda params, tokens, mask, positions, width: token_logprobs(
            params, self.spec, tokens, positions, mask, None, start=tokens.shape[1] - width,
            temperature=learner_temperature(self.cfg), remat=False)[0],
            static_argnums=4)

    def reference_logprobs(self, tokens, mask, positions, width: int) -> jax.Array:
        """Log-probs [B, width] of the completion tokens under the frozen base (LoRA off)."""
        return self._reference_fn(self.params, *self.to_device((tokens, mask, positions)), width)

    def to_device(self, rows):
        """This process's rows [R, ...] (numpy) as the programs take them (jaxrl/distributed.py)."""
        return distributed.to_device(self.rules, rows)

    def pipelined(self, rollouts, samples_of, overlap):
        return pipelined(self.rewards, rollouts, samples_of, self.cfg.rewards.max_staleness,
                         overlap)

    def progress(self, step: int, metrics: dict[str, Any]) -> None:
        summary = (f"reward {metrics['reward/mean']:.3f}  len "
                   f"{metrics['completion/length_mean']:.0f}  {metrics['time/step']:.1f} s/step")
        self._progress.update(self._task, completed=step, description=summary)
        if not sys.stderr.isatty():
            self.log(f"step {step}/{self.cfg.run.steps}  {summary}")

    def __enter__(self) -> Session:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()
        self.rewards.close()
        self.checkpoints.close()

"""Everything a training run holds: model, tokenizer, data, reward pool, optimizer state and the
compiled programs. Built once from the config; the loop in loop.py drives it."""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxrl.config import Config
from jaxrl.data.pipeline import build_pool, train_iterator
from jaxrl.data.prompts import prompt_fits
from jaxrl.hf.default_model import resolve_model_path
from jaxrl.hf.load import load_params
from jaxrl.hf.tokenizer import (chat_prompt_text, detokenizer, eos_token_ids, load_tokenizer,
                                text_ids)
from jaxrl.lora.lora import init_lora
from jaxrl.model.families import load_spec
from jaxrl.quant.qparams import dequantize_params, dequantize_strategy
from jaxrl.rewards.pool import RewardPool, pipelined
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.rl.train_step import StepOptions, compile_train_step, init_train_state, make_optimizer


def learner_temperature(cfg: Config) -> float:
    """The temperature of the distribution the sampler's log-probs come from (1 for greedy)."""
    return cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0


class Session:
    def __init__(self, cfg: Config, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        model_dir = resolve_model_path(cfg.model.path)
        self.spec = load_spec(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_ids = eos_token_ids(self.tokenizer, model_dir)
        self.detokenize = detokenizer(self.tokenizer)
        log(f"loading {model_dir} ({self.spec.family}, {self.spec.num_layers} layers) as "
            f"{cfg.quant.mode} + LoRA r{cfg.lora.rank}")
        dtype = jnp.dtype(cfg.model.dtype)
        _, self.params = load_params(model_dir, self.spec, dtype, cfg.quant)
        if dequantize_strategy(cfg.quant) == "once":
            self.params = dequantize_params(self.params, dtype)
        self.key = jax.random.PRNGKey(cfg.run.seed)
        lora = init_lora(self.spec, jax.random.fold_in(self.key, 1 << 20), rank=cfg.lora.rank,
                         alpha=cfg.lora.alpha, targets=cfg.lora.targets,
                         dropout=cfg.lora.dropout)
        optimizer, self.schedule = make_optimizer(cfg.optim, cfg.run.steps)
        self.state = init_train_state(lora, optimizer)
        self.train_step = compile_train_step(self.spec, optimizer, self._step_options())
        pool = build_pool(cfg.data, keep=prompt_fits(self.tokenizer, cfg.data.max_prompt_tokens))
        self.data = train_iterator(pool, cfg.data)
        self.start_step = 0
        self.rewards = RewardPool(cfg)
        self._progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.description}"),
                                  console=None, transient=False, disable=not sys.stderr.isatty())
        self._task = self._progress.add_task("", total=cfg.run.steps, completed=self.start_step)

    def _step_options(self) -> StepOptions:
        cfg = self.cfg
        rows = cfg.data.prompts_per_step * cfg.grpo.num_generations
        micro = cfg.optim.micro_batch_size or rows
        if rows % micro:
            from jaxrl.config import ConfigError
            raise ConfigError(f"config key 'optim.micro_batch_size' = {micro} must divide the "
                              f"{rows} rows of a step (data.prompts_per_step * "
                              "grpo.num_generations)")
        return StepOptions(grpo=cfg.grpo, temperature=learner_temperature(cfg),
                           max_new_tokens=cfg.sampling.max_new_tokens, micro_batches=rows // micro)

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
        return self._reference_fn(self.params, tokens, mask, positions, width)

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

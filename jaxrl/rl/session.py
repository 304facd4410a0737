"""Everything a training run holds: model, tokenizer, data, reward pool, optimizer state and the
compiled programs. Built once from the config; the loop in loop.py drives it."""
from __future__ import annotations

import functools
import math
import sys
from typing import Any, Callable

import jax
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxrl import distributed
from jaxrl.backends.numerics import numerics_of
from jaxrl.checkpoint import Checkpoints
from jaxrl.config import Config, ConfigError
from jaxrl.data.pipeline import build_pool, train_iterator
from jaxrl.data.prompts import prompt_fits
from jaxrl.hf.loader import load_model
from jaxrl.hf.peft_io import start_lora
from jaxrl.hf.tokenizer import chat_prompt_text, detokenizer, eos_token_ids, text_ids
from jaxrl.rewards.pool import RewardPool, pipelined
from jaxrl.rl.episodes import Chat
from jaxrl.rl.remat import compile_step
from jaxrl.rl.rollout import Rollout, unpack_rollout
from jaxrl.rl.train_step import StepOptions, compile_reference, init_train_state, make_optimizer
from jaxrl.sharding import MeshRules, place, reference_shardings, step_shardings


def learner_temperature(cfg: Config) -> float:
    """The temperature of the distribution the sampler's log-probs come from (1 for greedy)."""
    return cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0


def completion_width(cfg: Config) -> int:
    """Completion columns the learner scores: an episode's token budget (env.max_tokens) with
    data.env, else sampling.max_new_tokens."""
    return cfg.env.max_tokens if cfg.data.env else cfg.sampling.max_new_tokens


def step_options(cfg: Config, rules: MeshRules | None = None) -> StepOptions:
    """The train step's static settings on `rules`' mesh (None: one device); micro-batches
    from optim.micro_batch_size."""
    rows = cfg.data.prompts_per_step * cfg.grpo.num_generations
    micro = cfg.optim.micro_batch_size or rows
    if rows % micro:
        raise ConfigError(f"config key 'optim.micro_batch_size' = {micro} must divide the "
                          f"{rows} rows of a step (data.prompts_per_step * "
                          "grpo.num_generations)")
    return StepOptions(grpo=cfg.grpo, temperature=learner_temperature(cfg),
                       max_new_tokens=completion_width(cfg), micro_batches=rows // micro,
                       remat=cfg.optim.remat, seed=cfg.run.seed, mesh=rules,
                       numerics=numerics_of(rules))


def prompt_share_limit(cfg: Config, rules: MeshRules | None, local_rows: int) -> int:
    """The most rows one block sharing a prompt may hold (`Rollout.share`): a divisor of a
    group's G rows, of this process's rows and of a micro-batch's rows per batch shard of the
    mesh, so blocks never straddle a group, a process, a micro-batch or a shard; 1 with LoRA
    dropout, whose masks are drawn per row."""
    if cfg.lora.dropout > 0:
        return 1
    micro = cfg.data.prompts_per_step * cfg.grpo.num_generations // step_options(cfg).micro_batches
    ways = 1 if rules is None else rules.batch_ways
    per_shard = micro // ways if micro % ways == 0 else 1
    return math.gcd(cfg.grpo.num_generations, local_rows, per_shard)


def reference_program(cfg: Config, spec, params, rules, width: int | None = None,
                      share: int = 1):
    """The compiled reference pass of a step's rows: (params, tokens, positions, mask [B, S])
    -> log-probs [B, width] (default: sampling.max_new_tokens) of the last `width` columns under
    the frozen base (LoRA off), micro-batched as the update is (`compile_reference`), on the
    mesh of `rules` (None: one device); share as `jaxrl.rl.train_step.Batch.share`."""
    rows = cfg.data.prompts_per_step * cfg.grpo.num_generations
    shardings = None if rules is None else reference_shardings(rules, params, spec, rows)
    return compile_reference(spec, step_options(cfg, rules), shardings, width, share)


def _my_prompts(cfg: Config, rules) -> tuple[slice, tuple[int, int]]:
    """This process's prompts of a step, and their rows [start, stop) among the step's rows."""
    g = cfg.grpo.num_generations
    prompts = distributed.prompt_slice(rules, cfg.data.prompts_per_step, g)
    return prompts, (prompts.start * g, prompts.stop * g)


def make_trainer(cfg: Config, spec, params, rules, key: jax.Array):
    """(fresh train state, lr schedule, compiled train step, the step's shardings or None)."""
    lora = start_lora(cfg.lora, spec, jax.random.fold_in(key, 1 << 20))
    optimizer, schedule = make_optimizer(cfg.optim, cfg.run.steps)
    state = init_train_state(lora, optimizer)
    rows = cfg.data.prompts_per_step * cfg.grpo.num_generations
    shardings = None if rules is None else step_shardings(rules, state, params, spec, optimizer,
                                                          rows)
    train_step = compile_step(spec, optimizer, step_options(cfg, rules), shardings)
    return state, schedule, train_step, shardings


def _resume(checkpoints: Checkpoints, state, key: jax.Array, data):
    """(train state, key, start step, pending Rollout or None, partial rollouts' state or
    None): restored from the checkpoint `checkpoint.resume` selects (moving `data` to its
    position), else as given."""
    restored = checkpoints.restore(state, data)
    if restored is None:
        return state, key, 0, None, None
    pending = None if restored.pending is None else unpack_rollout(*restored.pending)
    return restored.state, restored.key, restored.step, pending, restored.carry


def _duration(seconds: float) -> str:
    """seconds as h:mm:ss (m:ss under an hour)."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _progress_bar(cfg: Config, start_step: int):
    """(progress bar on a terminal, its task): steps done of run.steps."""
    progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                        TimeElapsedColumn(), TextColumn("{task.description}"), console=None,
                        transient=False, disable=not sys.stderr.isatty())
    return progress, progress.add_task("", total=cfg.run.steps, completed=start_step)


class Session:
    def __init__(self, cfg: Config, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.rules = distributed.session_rules(cfg.mesh)  # None: one device
        from jaxrl.planner import dense_fit  # the planner builds on this module

        # quant.dequantize auto, where memory decides it: dense kernels when the run fits
        model = load_model(cfg.model.path, dtype=cfg.model.dtype, quant=cfg.quant,
                           numerics=numerics_of(self.rules), rules=self.rules, log=log,
                           dense_fit=lambda spec: dense_fit(cfg, spec, self.rules))
        self.spec, self.tokenizer, self.params = model.spec, model.tokenizer, model.params
        self.eos_ids = eos_token_ids(self.tokenizer, model.path)
        self.detokenize = detokenizer(self.tokenizer)
        self.chat = Chat(self.tokenizer, self.eos_ids)  # renders episodes (data.env)
        self.prompts, self.row_range = _my_prompts(cfg, self.rules)
        self.key = jax.random.PRNGKey(cfg.run.seed)
        self.state, self.schedule, self.train_step, shardings = make_trainer(
            cfg, self.spec, self.params, self.rules, self.key)
        pool = build_pool(cfg.data, keep=prompt_fits(self.tokenizer, cfg.data.max_prompt_tokens))
        self.data = train_iterator(pool, cfg.data)
        self.checkpoints = Checkpoints(cfg, model.path, self.spec, log, rows=self.row_range)
        # pending: the Rollout sampled before the update of start_step, when resumed with it
        self.state, self.key, self.start_step, self.pending, carry = _resume(
            self.checkpoints, self.state, self.key, self.data)
        if shardings is not None:
            self.state = place(self.state, shardings[0][0])
        self.partial = self._partial(carry)  # None: sampling.partial is off
        if self.pending is not None and self.pending.ref_logp is not None:
            self.pending.ref_logp = self.to_device(self.pending.ref_logp)
        self.judge = self._local_judge()  # None: no judge, or one served elsewhere
        self.rewards = RewardPool(cfg)
        if self.judge is not None:
            self.rewards.while_waiting = self.judge.wait
            if hasattr(self.train_step, "reserve"):  # optim.remat auto: the engine stays
                self.train_step.reserve(self.judge.resident_bytes())
        self._progress, self._task = _progress_bar(cfg, self.start_step)
        self._times: list[float] = []

    def _partial(self, carry):
        """The partial rollouts' engine (jaxrl/rl/partial.py) holding the checkpoint's groups
        `carry`, or None without sampling.partial."""
        cfg = self.cfg
        if not cfg.sampling.partial:
            return None
        if jax.process_count() > 1:
            raise ConfigError("config key 'sampling.partial' runs in one process: which groups "
                              "have finished is not agreed across processes; set it to false")
        from jaxrl.rl.partial import PARTIAL_STREAM, Partial

        width = (cfg.data.max_prompt_tokens + len(self.prompt_ids(cfg.data.response_prefix))
                 + 8)  # a prefix may tokenize a little apart from the prompt's end
        partial = Partial(self.params, self.spec, cfg.sampling,
                          groups=cfg.data.prompts_per_step,
                          group_size=cfg.grpo.num_generations, prompt_width=width,
                          key=jax.random.fold_in(self.key, PARTIAL_STREAM), eos_ids=self.eos_ids,
                          detokenize=self.detokenize, lora=self.state.lora, shardings=self.rules,
                          numerics=numerics_of(self.rules), slots=cfg.sampling.slots)
        if carry is not None:
            partial.restart(carry, self.state.lora)
        return partial

    def _local_judge(self):
        """The engine the rollouts share with a judge.local judge (entered: judges built now
        decode in it), or None."""
        if not self.cfg.judge.local:
            return None
        from jaxrl.rewards.local_judge import JudgeService

        rows = self.row_range[1] - self.row_range[0]
        return JudgeService(self.cfg, self.spec, self.params, self.tokenizer, self.eos_ids,
                            self.state.lora, rows, self.rules, self.log).__enter__()

    def render(self, record: dict) -> str:
        return chat_prompt_text(self.tokenizer, record["messages"]) + self.cfg.data.response_prefix

    def prompt_ids(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text)

    @functools.cached_property
    def _reference_fns(self) -> dict[tuple[int, int], Any]:  # by (width, share)
        return {}

    def share(self, rollout: Rollout) -> int:
        """Rows per block of `rollout` that hold one prompt, run once (`Rollout.share`)."""
        return rollout.share(prompt_share_limit(self.cfg, self.rules, len(rollout.out.tokens)))

    def reference_logprobs(self, tokens, mask, positions, width: int,
                           share: int = 1) -> jax.Array:
        """Log-probs [B, width] of the last `width` tokens (the completions) under the frozen
        base (LoRA off), micro-batched as the update is, each block of `share` rows' prompt run
        once; one program per (width, share)."""
        if not 1 <= width <= completion_width(self.cfg):
            raise ValueError(f"the reference pass scores 1 to {completion_width(self.cfg)} "
                             "completion columns (sampling.max_new_tokens, or env.max_tokens "
                             f"with data.env); got {width}")
        if (width, share) not in self._reference_fns:
            self._reference_fns[width, share] = reference_program(
                self.cfg, self.spec, self.params, self.rules, width, share)
        tokens, mask, positions = self.to_device((tokens, mask, positions))
        return self._reference_fns[width, share](self.params, tokens, positions, mask)

    def to_device(self, rows):
        """This process's rows [R, ...] (numpy) as the programs take them (jaxrl/distributed.py)."""
        return distributed.to_device(self.rules, rows)

    def pipelined(self, rollouts, samples_of, overlap):
        return pipelined(self.rewards, rollouts, samples_of, self.cfg.rewards.max_staleness,
                         overlap)

    def progress(self, step: int, metrics: dict[str, Any]) -> None:
        """The progress line: reward, the share of groups with reward spread (the ones that
        train), length, step time, the held-out accuracy when evaluated, and the ETA from the
        mean step time so far."""
        self._times.append(metrics["time/step"])
        eta = (self.cfg.run.steps - step) * sum(self._times) / len(self._times)
        useful = 1.0 - metrics.get("grpo/zero_spread_frac", 0.0)
        held_out = (f"  eval {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics
                    else "")
        summary = (f"reward {metrics['reward/mean']:.3f}  useful groups {useful:.0%}  len "
                   f"{metrics['completion/length_mean']:.0f}  {metrics['time/step']:.1f} s/step"
                   f"{held_out}  ETA {_duration(eta)}")
        self._progress.update(self._task, completed=step, description=summary)
        if not sys.stderr.isatty():
            self.log(f"step {step}/{self.cfg.run.steps}  {summary}")

    def __enter__(self) -> Session:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()
        self.rewards.close()
        if self.judge is not None:
            self.judge.__exit__(*exc)
        self.checkpoints.close()

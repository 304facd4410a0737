"""`jaxrl train`: data -> rollout -> rewards (on host workers) -> advantages -> update.

With `rewards.max_staleness: 1` the rollout of step t+1 runs while step t is scored, so the
update of step t follows it; pi_old is then the sampler's log-probs either way, which is exact
because the update of step t uses only the tokens and log-probs of its own rollout.

With data.env each row is an episode of that environment (jaxrl/rl/episodes.py): replies and
the environment's answers form one trajectory, scored whole on the host workers, trained on
the policy's tokens only (the environment's are context), with episode/* metrics.

Between scoring and the update: the overlong penalty (rewards.overlong_buffer,
jaxrl/rewards/overlong.py) is added to the rewards; with grpo.dynamic_sampling further rounds
are sampled and scored until the step holds groups with reward spread (jaxrl/rl/dynamic.py);
with grpo.mask_truncated the rows cut at max_new_tokens count in their group's advantages but
leave the loss.

With sampling.partial one decode engine is kept across steps (jaxrl/rl/partial.py): a
rollout ends once a step's groups have finished, the slots they freed already decoding the next
prompts, and unfinished rows go on under the next adapter; the loss's ratio is against each
token's recorded log-prob, and the batch marks the tokens carried in from earlier rollouts.

Timings: a step's row reports what its wall time (time/step, from the previous row to this one)
went to, so its phases add up to it less the untimed host work (data, prompts, logging).
time/rollout and time/reference are the sampling and reference passes run within it: with
max_staleness 1 those of the next step (the first row also holds its own, the last row none),
plus those of dynamic sampling's extra rounds, whose scoring is time/reward_rounds.
Each phase is timed until its results are ready, since JAX dispatches asynchronously.
"""
from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import distributed
from jaxrl.config import Config
from jaxrl.model.transformer import positions_from_mask
from jaxrl.rewards.base import Sample
from jaxrl.rewards.overlong import with_overlong_penalty
from jaxrl.rewards.pool import ScoredBatch
from jaxrl.rl.advantages import compute_advantages
from jaxrl.rl.dynamic import fill_groups
from jaxrl.rl.episodes import episode_metrics, play
from jaxrl.rl.rollout import Rollout, pack_rollout
from jaxrl.rl.session import Session
from jaxrl.rl.train_step import Batch
from jaxrl.runlog import RunLog, trim_logs
from jaxrl.sampling.sampler import sample


def _rows(rollout: Rollout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens, attention mask and positions [B, P' + N'] of prompt + completion, in the columns
    `Rollout.columns` keeps."""
    out, (first, width) = rollout.out, rollout.columns
    tokens = np.concatenate([out.prompt_tokens[:, first:], out.tokens[:, :width]], axis=1)
    mask = np.concatenate([out.prompt_mask[:, first:], out.mask[:, :width]], axis=1)
    return tokens.astype(np.int32), mask, np.asarray(positions_from_mask(mask))


def make_batch(rollout: Rollout, advantages: np.ndarray, keep: np.ndarray,
               to_device=functools.partial(jax.tree_util.tree_map, jnp.asarray),
               share: int = 1) -> Batch:
    """The update's batch; to_device places host rows (`Session.to_device` on a mesh); share:
    rows per block holding one prompt (`Session.share`)."""
    tokens, mask, positions = _rows(rollout)
    width = rollout.columns[1]
    completion_mask = rollout.out.loss_mask[:, :width] & (keep[:, None] > 0)  # multi-turn:
    # the policy's tokens
    rows = to_device((tokens, positions, mask, completion_mask,
                      rollout.out.logprobs[:, :width], advantages))
    carried = None  # partial rollouts: the tokens decoded before this rollout began
    if rollout.out.versions is not None:
        carried = to_device((rollout.out.versions[:, :width] >= 0)
                            & (rollout.out.versions[:, :width] < rollout.version))
    return Batch(*rows, ref_logp=rollout.ref_logp, share=share, carried=carried)


class _Phases:
    """Seconds spent in each timed phase since the last `lap`."""

    NAMES = ("time/rollout", "time/reference", "time/reward_rounds", "time/update")

    def __init__(self):
        self._seconds = dict.fromkeys(self.NAMES, 0.0)

    @contextlib.contextmanager
    def timing(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start

    def lap(self) -> dict[str, float]:
        seconds, self._seconds = self._seconds, dict.fromkeys(self.NAMES, 0.0)
        return seconds


def _sample_rollout(s: Session, step: int, key: jax.Array, phases: _Phases) -> Rollout:
    """The rollout of the next data item's prompts (this process's, all G rows of each) with
    the adapter as it is at that moment."""
    g = s.cfg.grpo.num_generations
    records = [r for r in next(s.data)[s.prompts] for _ in range(g)]
    if s.cfg.data.env:
        with phases.timing("time/rollout"):  # episodes end on the host: it has finished
            prompts, out, records = play(s.params, s.spec, records, key, s.cfg, s.chat,
                                         lora=s.state.lora, shardings=s.rules)
        return Rollout(step, records, prompts, out)
    prompts = [s.render(r) for r in records]
    shared = {}  # with judge.local: the engine the judge decodes in too
    if s.judge is not None:
        shared = dict(engine=s.judge.policy_engine(s.state.lora), adapter=s.judge.policy_adapter)
    with phases.timing("time/rollout"):  # `sample` returns host arrays: it has finished
        out = sample(s.params, s.spec, [s.prompt_ids(p) for p in prompts], key, s.cfg.sampling,
                     lora=s.state.lora, eos_ids=s.eos_ids, detokenize=s.detokenize,
                     shardings=s.rules, **shared)
    return Rollout(step, records, prompts, out)


def _partial_rollout(s: Session, step: int, phases: _Phases) -> Rollout:
    """Step `step`'s rollout with sampling.partial (jaxrl/rl/partial.py): the groups that
    finish first in the engine kept across steps, under the adapter as it is now, whose
    version is the updates it has taken (the rollout of step t runs after update t - 1, or
    with max_staleness 1 beside the scoring of step t - 1, before that update)."""
    def pull():
        records = next(s.data)[s.prompts]
        return [(r, prompt, s.prompt_ids(prompt)) for r in records
                for prompt in [s.render(r)]]

    version = max(step - s.cfg.rewards.max_staleness, 0)
    with phases.timing("time/rollout"):  # it returns host rows: it has finished
        ready, metrics = s.partial.rollout(step, version, s.state.lora, pull)
    records, prompts, out = s.partial.output(ready)
    return Rollout(step, records, prompts, out, version=version, metrics=metrics)


def _rollouts(s: Session, phases: _Phases) -> Iterator[Rollout]:
    """Each pull runs one rollout (a resumed run first yields the rollout its checkpoint
    saved)."""
    resumed = s.pending is not None and s.start_step < s.cfg.run.steps
    if resumed:
        yield s.pending
    for step in range(s.start_step + resumed, s.cfg.run.steps):
        if s.partial is not None:
            yield _partial_rollout(s, step, phases)
        else:
            yield _sample_rollout(s, step, jax.random.fold_in(s.key, step), phases)


def _reference(s: Session, phases: _Phases) -> Callable[[Rollout], None]:
    def run(rollout: Rollout) -> None:
        if s.cfg.grpo.beta == 0 or rollout.ref_logp is not None:
            return  # no KL term, or a resumed rollout whose pass was saved with it
        with phases.timing("time/reference"):
            tokens, mask, positions = _rows(rollout)
            rollout.ref_logp = jax.block_until_ready(s.reference_logprobs(
                tokens, mask, positions, rollout.columns[1], s.share(rollout)))
    return run


def _samples(rollout: Rollout) -> list[Sample]:
    return [Sample(prompt=p, completion=text, record=r)
            for p, text, r in zip(rollout.prompts, rollout.out.texts, rollout.records)]


def _shaped(cfg: Config, rollout: Rollout, scored: ScoredBatch) -> ScoredBatch:
    """scored with the overlong penalty (rewards.overlong_buffer) added, when it is on."""
    if cfg.rewards.overlong_buffer == 0:
        return scored
    return with_overlong_penalty(scored, rollout.out.mask.sum(axis=1),
                                 cfg.sampling.max_new_tokens, cfg.rewards.overlong_buffer,
                                 cfg.rewards.overlong_penalty)


def _extra_rounds(s: Session, step: int, phases: _Phases):
    """draw(k): extra round k of `step` for dynamic sampling, sampled and scored now."""
    def draw(k: int):
        key = jax.random.fold_in(jax.random.fold_in(s.key, step), k)
        rollout = _sample_rollout(s, step, key, phases)
        with phases.timing("time/reward_rounds"):
            scored = s.rewards.score(_samples(rollout))
        return rollout, _shaped(s.cfg, rollout, scored)
    return draw


def _step_batch(s: Session, rollout: Rollout, scored: ScoredBatch, phases: _Phases):
    """(rollout, scores, metrics) the update trains on: the overlong penalty added, and with
    grpo.dynamic_sampling the groups of further rounds (jaxrl/rl/dynamic.py) and their
    reference pass."""
    scored = _shaped(s.cfg, rollout, scored)
    if not s.cfg.grpo.dynamic_sampling:
        return rollout, scored, {}
    rollout, scored, metrics = fill_groups(
        (rollout, scored), _extra_rounds(s, rollout.step, phases), s.cfg.grpo.num_generations,
        s.cfg.grpo.max_sampling_rounds, distributed.host_max)
    _reference(s, phases)(rollout)  # a reassembled rollout has no reference log-probs yet
    return rollout, scored, metrics


def _rollout_metrics(rollout: Rollout) -> dict[str, float]:
    """Completion lengths (the policy's tokens; with data.env also the episodes' metrics)."""
    lengths = rollout.out.loss_mask.sum(axis=1)
    truncated = np.mean([r == "length" for r in rollout.out.finish_reasons])
    episodes = episode_metrics(rollout.records) if "episode" in rollout.records[0] else {}
    return {"completion/length_mean": float(lengths.mean()),
            "completion/length_max": float(lengths.max()),
            "completion/truncated_frac": float(truncated),
            "tokens/completion": float(lengths.sum()), **episodes}


def _sample_rows(rollout: Rollout, scored) -> list[dict[str, Any]]:
    rows = []
    for i, (prompt, text) in enumerate(zip(rollout.prompts, rollout.out.texts)):
        components = {name: {"value": rs[i].value, **dict(rs[i].components)}
                      for name, rs in scored.results.items()}
        rows.append({"id": rollout.records[i].get("id"), "prompt": prompt, "completion": text,
                     "reward": scored.rewards[i], "components": components,
                     "finish_reason": rollout.out.finish_reasons[i],
                     **({"episode": rollout.records[i]["episode"]}
                        if "episode" in rollout.records[i] else {})})
    return rows


def _step_metrics(s: Session, rollout: Rollout, scored, adv, update: dict, seconds: dict,
                  extra: dict):
    rewards = np.asarray(scored.rewards)
    metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
               **{k.replace("rewards/", "reward/", 1): v for k, v in scored.metrics.items()
                  if k != "rewards/mean"},
               **{f"grpo/{k}": float(v) for k, v in adv.metrics.items()}, **extra,
               **_rollout_metrics(rollout), **rollout.metrics,
               **{("loss/" + k if k in ("kl", "kl_weighted", "loss") else "train/" + k): float(v)
                  for k, v in update.items()},
               "train/lr": float(s.schedule(int(s.state.step))), **seconds}
    if s.judge is not None:
        metrics.update(s.judge.metrics())
    metrics["time/reward"] = scored.metrics["rewards/time_s"]
    metrics["time/reward_wait"] = scored.metrics["rewards/wait_s"]
    metrics["tokens_per_s"] = metrics.pop("tokens/completion") / max(seconds["time/step"], 1e-9)
    return metrics


def _update(s: Session, rollout: Rollout, scored):
    """(advantages, the last update's metrics, grpo/truncated_masked_frac when masked)."""
    grpo = s.cfg.grpo
    rewards = distributed.gather_rows(np.asarray(scored.rewards, np.float32), s.row_range[0])
    # dynamic sampling's short places hold zero-spread groups: they must not train
    adv = compute_advantages(rewards, grpo.num_generations, scale=grpo.scale_rewards,
                             filter_zero_spread=grpo.filter_zero_spread or grpo.dynamic_sampling)
    mine = slice(*s.row_range)  # advantages see every process's rows; the batch holds ours
    keep, masked = np.asarray(adv.keep)[mine], {}
    if grpo.mask_truncated:  # cut at max_new_tokens: in the group's advantages, not the loss
        truncated = np.array([reason == "length" for reason in rollout.out.finish_reasons])
        keep = keep * ~truncated
        masked = {"grpo/truncated_masked_frac": float(truncated.mean())}
    batch = make_batch(rollout, np.asarray(adv.advantages)[mine], keep, s.to_device,
                       s.share(rollout))
    for _ in range(grpo.num_iterations):
        s.state, update = s.train_step(s.state, s.params, batch)
    jax.block_until_ready(s.state)
    return adv, jax.device_get(update), masked


def _evaluator(s: Session, run_dir, log):
    """The held-out evaluation of `eval.every` (jaxrl/eval/during.py), or None."""
    if not s.cfg.eval.every:
        return None
    from jaxrl.eval.during import Evaluator, RunModel

    model = RunModel(s.params, s.spec, s.tokenizer, s.eos_ids, lambda: s.state.lora, s.rules)
    return Evaluator(s.cfg, model, run_dir,
                     lambda target: s.checkpoints.export_to(target, s.state.lora), log)


def train(cfg: Config, log: Callable[[str], None] = print) -> Path:
    """Runs GRPO as configured; returns the run directory (it holds the logs and report)."""
    runlog = RunLog(cfg)
    log(f"run directory: {runlog.dir.resolve()}")
    with Session(cfg, log) as s:
        trim_logs(runlog.dir, s.start_step, log)
        phases = _Phases()
        evaluate = _evaluator(s, runlog.dir, log)
        try:
            last = time.perf_counter()
            for rollout, scored, ahead in s.pipelined(_rollouts(s, phases), _samples,
                                                      _reference(s, phases)):
                rollout, scored, extra = _step_batch(s, rollout, scored, phases)
                with phases.timing("time/update"):
                    adv, update, masked = _update(s, rollout, scored)
                evaluated = {}
                if evaluate is not None and evaluate.due(rollout.step + 1):
                    evaluated = evaluate(rollout.step + 1)  # its time is not the step's
                now = time.perf_counter()
                seconds = {**phases.lap(),
                           "time/step": now - last - evaluated.get("time/eval", 0.0)}
                last = now
                metrics = distributed.combine_metrics(_step_metrics(
                    s, rollout, scored, adv, update, seconds, {**extra, **masked}))
                metrics.update(evaluated)
                runlog.log_step(rollout.step + 1, metrics)  # process 0 writes the run log
                every = cfg.logging.samples_every
                if every and (rollout.step + 1) % every == 0:
                    runlog.log_samples(rollout.step + 1, distributed.gather_row_lists(
                        _sample_rows(rollout, scored), s.row_range[0]))
                carry = None if s.partial is None else s.partial.pack
                if s.checkpoints.after_step(rollout.step + 1, s.state, s.key, s.data,
                                            None if ahead is None else pack_rollout(ahead),
                                            carry) and carry is not None:
                    # go on as a run resumed from this checkpoint would (jaxrl/rl/partial.py)
                    s.partial.restart(carry(), s.state.lora)
                s.progress(rollout.step + 1, metrics)
            s.checkpoints.finish(cfg.run.steps, s.state)
        finally:
            report = runlog.finish()
            if report is not None:
                log(f"report: {report.resolve()}")
    return runlog.dir

"""`jaxrl sft`: LoRA supervised fine-tuning on chat records, loss on the assistant tokens.

The run directory, checkpoints, resume and adapter export are GRPO's (jaxrl/runlog.py,
jaxrl/checkpoint.py): a checkpoint holds the train state, the PRNG key and the batch order's
position, so a resumed run draws the same batches it would have drawn.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.backends.numerics import numerics_of
from jaxrl.checkpoint import Checkpoints
from jaxrl.config import Config, ConfigError
from jaxrl.hf.peft_io import start_lora
from jaxrl.hf.pretrained import Pretrained, load_pretrained
from jaxrl.rl.train_step import init_train_state, make_optimizer
from jaxrl.runlog import RunLog, trim_logs
from jaxrl.sft.data import BatchStream, encode_all, pad_rows, read_chat_records
from jaxrl.sft.step import SftBatch, SftOptions, compile_eval_loss, compile_sft_step


def _options(cfg: Config) -> SftOptions:
    micro = cfg.optim.micro_batch_size or cfg.sft.batch_size
    if cfg.sft.batch_size % micro:
        raise ConfigError(f"config key 'optim.micro_batch_size' = {micro} must divide "
                          f"'sft.batch_size' = {cfg.sft.batch_size}")
    return SftOptions(micro_batches=cfg.sft.batch_size // micro, seed=cfg.run.seed,
                      numerics=numerics_of(None))  # one device


def _rows(model: Pretrained, cfg: Config, key: str, log: Callable[[str], None]):
    path = getattr(cfg.data, key.split(".")[1])
    rows, counts = encode_all(model.tokenizer, read_chat_records(path, key), cfg.sft.max_length)
    log(f"{key}: {counts['records']} records, {counts['truncated']} cut to sft.max_length "
        f"{cfg.sft.max_length}, {counts['dropped']} left without assistant tokens and dropped")
    if not rows:
        raise ConfigError(f"config key {key!r}: no record keeps an assistant token within "
                          f"sft.max_length = {cfg.sft.max_length}")
    return rows


def _batch(rows, indices) -> SftBatch:
    return SftBatch(*map(jnp.asarray, pad_rows([rows[i] for i in indices])))


def _eval_loss(eval_fn, lora, params, rows, batch_size: int) -> float:
    """Token-mean loss over all rows: per-batch means weighted by their loss tokens."""
    total = tokens = 0.0
    for start in range(0, len(rows), batch_size):
        batch = _batch(rows, range(start, min(start + batch_size, len(rows))))
        n = float(batch.loss_mask[:, 1:].sum())
        total += float(eval_fn(lora, params, batch)) * n
        tokens += n
    return total / max(tokens, 1.0)


def _row(metrics, lr: float, batch: SftBatch, seconds: float) -> dict:
    return {"loss/train": float(metrics["loss"]), "train/grad_norm": float(metrics["grad_norm"]),
            "train/skipped": int(metrics["skipped"]), "train/lr": lr,
            "train/width": int(batch.tokens.shape[1]), "tokens/loss": float(metrics["tokens"]),
            "time/step": seconds,
            "tokens_per_s": float(np.sum(batch.attn_mask)) / max(seconds, 1e-9)}


@dataclasses.dataclass
class _Trainer:
    """What the SFT steps need besides the train state."""
    cfg: Config
    model: Pretrained
    rows: list
    evals: list | None
    step_fn: Callable
    eval_fn: Callable | None
    schedule: Callable
    stream: BatchStream

    def step(self, state, step: int):
        """(new state, metrics row) of update step + 1."""
        began = time.perf_counter()
        batch = _batch(self.rows, next(self.stream))
        state, metrics = self.step_fn(state, self.model.params, batch)
        metrics = jax.device_get(metrics)  # waits for the step, which runs asynchronously
        row = _row(metrics, float(self.schedule(step)), batch, time.perf_counter() - began)
        if self.evals and (step + 1) % self.cfg.sft.eval_every == 0:
            row["loss/eval"] = _eval_loss(self.eval_fn, state.lora, self.model.params,
                                          self.evals, self.cfg.sft.batch_size)
        return state, row


def _trainer(cfg: Config, log: Callable[[str], None]):
    """(trainer, fresh train state)."""
    model = load_pretrained(cfg.model.path, dtype=cfg.model.dtype, quant=cfg.quant)
    rows = _rows(model, cfg, "data.train_file", log)
    evals = _rows(model, cfg, "data.eval_file", log) \
        if cfg.data.eval_file and cfg.sft.eval_every else None
    optimizer, schedule = make_optimizer(cfg.optim, cfg.run.steps)
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.run.seed), 1 << 20)
    state = init_train_state(start_lora(cfg.lora, model.spec, key), optimizer)
    stream = BatchStream([len(ids) for ids, _ in rows], cfg.sft.batch_size,
                         cfg.sft.length_window, cfg.run.seed)
    return _Trainer(cfg, model, rows, evals, compile_sft_step(model.spec, optimizer,
                                                              _options(cfg)),
                    compile_eval_loss(model.spec, _options(cfg)) if evals else None, schedule,
                    stream), state


def _evaluator(cfg: Config, model, lora, run_dir, checkpoints, log):
    """The held-out evaluation of `eval.every` (jaxrl/eval/during.py) on data.eval_file's
    task records or the validation split of data.tasks (data.train_file holds SFT chats, not
    task records), or None."""
    if not cfg.eval.every:
        return None
    import dataclasses

    from jaxrl.eval.during import Evaluator, RunModel

    held_out = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_file=""))
    return Evaluator(held_out, RunModel(model.params, model.spec, model.tokenizer, model.eos_ids,
                                   lora),
                     run_dir, lambda target: checkpoints.export_to(target, lora()), log)


def sft(cfg: Config, log: Callable[[str], None] = print) -> Path:
    """Runs SFT as configured; returns the run directory."""
    if not cfg.data.train_file:
        raise ConfigError("config key 'data.train_file' is empty: jaxrl sft trains on a JSONL "
                          "of chat records; pass data.train_file=FILE.jsonl")
    runlog = RunLog(cfg)
    log(f"run directory: {runlog.dir.resolve()}")
    trainer, state = _trainer(cfg, log)
    key = jax.random.PRNGKey(cfg.run.seed)
    checkpoints = Checkpoints(cfg, trainer.model.path, trainer.model.spec, log)
    try:
        restored = checkpoints.restore(state, trainer.stream)
        start = 0 if restored is None else restored.step
        if restored is not None:
            state, key = restored.state, restored.key
        trim_logs(runlog.dir, start, log)
        current = [state]  # the adapter the held-out evaluation decodes with
        evaluate = _evaluator(cfg, trainer.model, lambda: current[0].lora, runlog.dir,
                              checkpoints, log)
        for step in range(start, cfg.run.steps):
            state, row = trainer.step(state, step)
            current[0] = state
            if evaluate is not None and evaluate.due(step + 1):
                row.update(evaluate(step + 1))  # after time/step was taken
            runlog.log_step(step + 1, row)
            checkpoints.after_step(step + 1, state, key, trainer.stream)
            log(f"step {step + 1}/{cfg.run.steps}  loss {row['loss/train']:.4f}  "
                f"{row['time/step']:.2f} s")
        checkpoints.finish(cfg.run.steps, state)
    finally:
        checkpoints.close()
        report = runlog.finish()
        if report is not None:
            log(f"report: {report.resolve()}")
    return runlog.dir

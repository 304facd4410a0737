"""Partial rollouts (`sampling.partial`): a GRPO rollout that never waits for its slowest row.

One decode engine lives across steps. Before each decode chunk a rollout queues the next
groups (pulling a data item's `data.prompts_per_step` groups of G rows when none waits) into
the slots finished rows have freed, a whole group whenever G slots are free (its prompt then
prefilled once), so freed slots go back to work within a chunk, and it stops as soon as
`data.prompts_per_step` whole groups (all G rows finished) are ready: those train, oldest
prompts first. Rows still decoding stay in their slots with their KV cache and go on at the
next rollout under the next adapter (the engine's `lora` is replaced between steps), each
token recording the adapter version that decoded it (`SampleOutput.versions`: the number of
updates that adapter had taken) beside the log-prob the sampler gave it, which the loss takes
its ratio against, token by token. Finished groups beyond the step's count wait for the next
rollout.

Staleness is bounded: a row begun in rollout s that has not finished by the end of rollout
s + `sampling.max_carry` is finished there (`sampling.carry_overflow: finish`: cut at that
length, finish reason "length") or dropped with its group (`drop`: the group never trains; its
prompt is used up). Each rollout reports partial/* metrics (`Partial.rollout`).

A row's key is fold_in(fold_in(key, serial), i) for the serial number of its group (the order
groups were pulled in) and its index i in the group, so its tokens depend on neither its slot
nor the rows beside it nor when it was admitted, but on the adapters in force while it decoded.

Checkpoints: `pack` gives the state as JSON (every pulled group not yet trained, with its rows'
tokens, log-probs, versions and finish reasons, and the serial counter). `restart` puts a packed
state into a fresh engine: each unfinished row is prefilled again, its prompt followed by its
tokens so far, under the adapter in force, and decodes on from its next token
(`Request.drawn`). A resumed run does that from its checkpoint, and the uninterrupted run does
the same right after it saves one, so both go on from the same engine state and a run killed
and resumed matches the run that was not; carried rows lose their kept cache at checkpoint
steps only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl.backends.numerics import Numerics, numerics_of
from jaxrl.config import SamplingConfig
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import Params
from jaxrl.sampling.buckets import bucket, left_pad
from jaxrl.sampling.engine import Engine
from jaxrl.sampling.requests import Request
from jaxrl.sampling.sampler import SampleOutput, finished_output
from jaxrl.sampling.sampling_fns import Decoding
from jaxrl.sampling.stop import stopped
from jaxrl.sharding import MeshRules

PARTIAL_STREAM = 0x50415254  # folded into the run's key: the partial rollouts' keys


@dataclasses.dataclass(eq=False)
class Row:
    """One completion of a group, across the engine requests that decoded it."""

    key: np.ndarray  # [2] uint32
    budget: int  # max new tokens
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # per token: the adapter's
    finish_reason: str | None = None  # "stop" or "length" once finished
    begun: int | None = None  # the rollout that decoded its first token
    request: Request | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(eq=False)
class Group:
    """A prompt's G rows and where it came from."""

    serial: int  # pull order: the key's stream
    record: dict
    prompt: str  # the rendered chat prompt
    ids: list[int]
    rows: list[Row]
    submitted: bool = False  # its rows are in the engine

    def done(self) -> bool:
        return all(row.finish_reason is not None for row in self.rows)


class Partial:
    """The engine of a run with `sampling.partial` and the groups it holds (module docstring).

    groups, group_size: the groups a step trains (data.prompts_per_step) and G; prompt_width:
    the widest prompt in tokens; slots: decode slots (0: a step's rows); chunk: decode steps
    between refills (0: the numerics' `refill_chunk`; an early-stopping chunk also ends once
    G slots are free); key: the run's sampling key; the rest as
    `jaxrl.sampling.sampler.sample` takes them."""

    def __init__(self, params: Params, spec: ModelSpec, cfg: SamplingConfig, *, groups: int,
                 group_size: int, prompt_width: int, key: jax.Array, eos_ids: Sequence[int],
                 detokenize: Callable[[Sequence[int]], str] | None = None,
                 lora: Lora | None = None, shardings: MeshRules | None = None,
                 numerics: Numerics | None = None, slots: int = 0, chunk: int = 0):
        if cfg.stop and detokenize is None:
            raise ValueError("stop strings need a detokenize function (ids -> text)")
        self.cfg, self.groups, self.group_size = cfg, groups, group_size
        self.key, self.eos_ids, self.detokenize = key, tuple(eos_ids), detokenize
        ways = 1 if shardings is None else shardings.batch_ways
        self.slots = bucket(max(slots or groups * group_size, ways), minimum=1)
        n = cfg.max_new_tokens
        numerics = numerics_of(shardings) if numerics is None else numerics
        chunk = chunk or numerics.refill_chunk
        def make(lora) -> Engine:
            engine = Engine(params, spec, eos_ids=eos_ids, slots=self.slots,
                            capacity=prompt_width + bucket(n),
                            chunk=min(bucket(n), chunk), lora=lora, shardings=shardings,
                            numerics=numerics)
            engine.refill = group_size  # a chunk may end once a group fits
            return engine
        self._make = make
        self.engine = self._make(lora)
        self.decoding = Decoding.from_config(cfg)
        self.pending: list[Group] = []  # pulled and not yet trained, in pull order
        self.serial = 0  # groups pulled so far
        self._version = self._step = 0

    # -- one rollout ------------------------------------------------------------------------

    def rollout(self, step: int, version: int, lora: Lora | None,
                pull: Callable[[], Sequence[tuple]]) -> tuple[list[Group], dict[str, float]]:
        """Decode under `lora` (the adapter after `version` updates) until a step's groups
        have finished, pulling (record, rendered prompt, prompt ids[, row budgets]) of a data
        item's groups whenever the queue runs dry; returns those groups, oldest first, and the
        rollout's partial/* metrics."""
        self.engine.lora, self._version, self._step = lora, version, step
        before = (self.engine.stats.steps, self.engine.stats.tokens)
        while sum(g.done() for g in self.pending) < self.groups:
            self._fill(pull)
            self.engine.step()
            self._stop_strings()
        ready = [g for g in self.pending if g.done()][:self.groups]
        self.pending = [g for g in self.pending if not any(g is r for r in ready)]
        steps = self.engine.stats.steps - before[0]
        metrics = {"partial/slot_utilization":
                   (self.engine.stats.tokens - before[1]) / max(steps * self.slots, 1),
                   **self._overflow(step), **self._ages(ready)}
        metrics["partial/carried_over_rows"] = float(sum(
            row.finish_reason is None and bool(row.tokens)
            for g in self.pending for row in g.rows))
        metrics["partial/pending_groups"] = float(len(self.pending))
        return ready, metrics

    def _fill(self, pull: Callable[[], Sequence[tuple]]) -> None:
        """Queue whole groups, oldest first, while the engine has free slots for all G rows of
        one (pulling a data item when none waits), so each group's prompt is prefilled once,
        in the step that admits its rows together."""
        free = self.engine.free_slots() - self.engine.queued()
        while free >= self.group_size:
            waiting = next((g for g in self.pending if not g.submitted), None)
            if waiting is None:
                items = pull()
                if not items:
                    raise ValueError("the data gave no prompts for the next groups")
                self._pull(items)
                continue
            for row in waiting.rows:
                self._start(waiting, row)
            waiting.submitted, free = True, free - self.group_size

    def _pull(self, items: Sequence[tuple]) -> None:
        """A data item's groups, waiting for slots: (record, prompt, ids), or (record, prompt,
        ids, budgets) with each row's own token budget (default sampling.max_new_tokens)."""
        for record, prompt, ids, *budgets in items:
            budgets = budgets[0] if budgets else [self.cfg.max_new_tokens] * self.group_size
            serial, self.serial = self.serial, self.serial + 1
            stream = jax.random.fold_in(self.key, serial)
            keys = np.asarray(jax.vmap(jax.random.fold_in, (None, 0))(
                stream, np.arange(self.group_size, dtype=np.uint32)))
            group = Group(serial, record, prompt, list(ids),
                          [Row(keys[i], int(budgets[i])) for i in range(self.group_size)])
            self.pending.append(group)

    def _start(self, group: Group, row: Row) -> None:
        """Queue `row` in the engine: from its prompt, or from its prompt and its tokens so far
        (`Request.drawn`) when it has some."""
        request = Request(group.ids + row.tokens, self.decoding, row.budget, row.key,
                          drawn=len(row.tokens))

        def token(t: int, logprob: float) -> None:
            if row.begun is None:
                row.begun = self._step
            row.tokens.append(t)
            row.logprobs.append(logprob)
            row.versions.append(self._version)

        def done(r: Request) -> None:
            if r.finish_reason != "cancelled":
                row.finish_reason = r.finish_reason
        request.on_token, request.on_done, row.request = token, done, request
        self.engine.submit(request)

    def _stop_strings(self) -> None:
        """Finish the rows whose text holds a stop string (cut there by `finished_output`)."""
        if not self.cfg.stop:
            return
        for group in self.pending:
            for row in group.rows:
                if (row.finish_reason is None and row.tokens
                        and stopped(row.tokens, self.cfg.stop, self.detokenize)):
                    self.engine.cancel(row.request)
                    row.finish_reason = "stop"

    def _overflow(self, step: int) -> dict[str, float]:
        """Rows begun max_carry rollouts ago and still decoding: finished at their length, or
        dropped with their group (sampling.carry_overflow)."""
        finished = dropped = 0
        for group in list(self.pending):
            old = [row for row in group.rows if row.finish_reason is None
                   and row.begun is not None and step - row.begun >= self.cfg.max_carry]
            if not old:
                continue
            if self.cfg.carry_overflow == "drop":
                for row in group.rows:
                    if row.finish_reason is None:
                        self.engine.cancel(row.request)
                self.pending.remove(group)
                dropped += 1
                continue
            for row in old:
                self.engine.cancel(row.request)
                row.finish_reason = "length"
                finished += 1
        return {"partial/overflow_finished_rows": float(finished),
                "partial/overflow_dropped_groups": float(dropped)}

    def _ages(self, ready: list[Group]) -> dict[str, float]:
        """The trained rows begun in an earlier rollout, and their tokens by age: how many
        updates older than this rollout's adapter the one that decoded each was."""
        rows = [row for g in ready for row in g.rows]
        ages = np.asarray([self._version - v for row in rows for v in row.versions], np.int64)
        metrics = {"partial/carried_rows": float(sum(
            bool(row.versions) and row.versions[0] < self._version for row in rows))}
        for age in range(self.cfg.max_carry + 1):
            metrics[f"partial/tokens_age_{age}"] = float((ages == age).sum())
        return metrics

    # -- the trained rows as arrays -----------------------------------------------------------

    def output(self, ready: list[Group]) -> tuple[list[dict], list[str], SampleOutput]:
        """(records, prompts, output) of the rows of `ready`, G consecutive rows a group, as
        `sample` gives them, with each token's adapter version (`SampleOutput.versions`)."""
        rows = [row for g in ready for row in g.rows]
        prompts = [g.ids for g in ready for _ in g.rows]
        tokens, mask = left_pad(prompts, bucket(max(len(p) for p in prompts)))
        out = finished_output(rows, tokens, mask, self.cfg.max_new_tokens, self.eos_ids,
                              self.cfg, self.detokenize)
        versions = np.full(out.tokens.shape, -1, np.int32)
        for i, row in enumerate(rows):
            versions[i, :len(row.versions)] = row.versions
        out = dataclasses.replace(out, versions=np.where(out.mask, versions, -1))
        return ([g.record for g in ready for _ in g.rows], [g.prompt for g in ready
                                                              for _ in g.rows], out)

    # -- checkpoints ------------------------------------------------------------------------

    def pack(self) -> dict[str, Any]:
        """The state a checkpoint keeps (JSON): every pending group and the serial counter."""
        return {"serial": self.serial, "groups": [
            {"serial": g.serial, "record": g.record, "prompt": g.prompt, "ids": g.ids,
             "rows": [{"key": row.key.tolist(), "budget": row.budget, "tokens": row.tokens,
                       "logprobs": row.logprobs, "versions": row.versions,
                       "finish_reason": row.finish_reason, "begun": row.begun}
                      for row in g.rows]} for g in self.pending]}

    def restart(self, packed: dict[str, Any], lora: Lora | None) -> None:
        """A fresh engine holding `packed`'s groups (module docstring): the unfinished rows of
        groups begun are queued at once, oldest first; the other groups wait for slots."""
        self.engine = self._make(lora)
        self.serial = int(packed["serial"])
        self.pending = [Group(g["serial"], g["record"], g["prompt"], list(g["ids"]), [
            Row(np.asarray(r["key"], np.uint32), int(r["budget"]), list(r["tokens"]),
                [float(x) for x in r["logprobs"]], list(r["versions"]), r["finish_reason"],
                r["begun"]) for r in g["rows"]]) for g in packed["groups"]]
        for g in self.pending:  # a group begun decodes on; the others wait for slots
            g.submitted = any(row.tokens for row in g.rows)
            for row in g.rows:
                if g.submitted and row.finish_reason is None:
                    self._start(g, row)

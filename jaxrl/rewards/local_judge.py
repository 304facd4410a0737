"""A judge decoded in the training process's own engine (`judge.local`).

`JudgeService` owns the decode engine that the rollouts and the judge share. With
`judge.local: base` or `adapter:DIR` it is one engine over the policy's frozen base whose
adapters are an `AdapterSet` (jaxrl/lora/adapters.py): index 1 the policy's adapter (replaced
before each rollout, `policy_engine`), index 2 the judge's adapter (adapter:DIR), index 0 the
base alone (a `base` judge). Rollout rows and judge rows then decode in one batch, each row
with its own adapter. With `judge.local: model:PATH` the judge is a second model (quantized as
`quant` says) with its own engine of judge.slots slots, stepped once per rollout step and while
the trainer waits for rewards.

Threads. Judge requests come from the reward pool's event-loop thread (`submit`, through
`Judge.ask`); the engine, the tokenizer and every device call stay on the training thread:
each engine step first takes waiting judge requests into free judge slots (`Engine.feed`: at
most judge.slots judge rows at once, so rollout rows always find theirs), renders them with the
judge model's chat template (thinking off unless judge.thinking), and a finished row's tokens
are detokenized there and handed back through a future. The training thread steps the engine
for the judge in two places: inside each rollout (rollout rows beside judge rows), and while it
waits for a step's rewards (`wait`, which `RewardPool.collect` calls), so with
`rewards.max_staleness: 1` step t's judge requests decode beside step t+1's rollout, and with 0
after it. One process only: the processes of a multi-host run step their engines in lockstep,
which a per-process judge queue would break.

Capacity. The shared engine has the rollout's slots plus judge.slots, every slot of
`capacity` cache columns: the larger of the rollout's (prompt bucket + new-token bucket) and
the judge's (judge.max_prompt_tokens + judge.max_tokens), so rollout rows hold the judge's
columns too (`jaxrl plan` counts them). A judge prompt longer than its columns is not decoded:
it fails as `judge_prompt_too_long` and the reward scores its default.

Judge rows never reach the policy's loss, KL or completion metrics: a rollout returns only its
own rows. `metrics()` reports them apart, per training step: judge/requests and judge/tokens
(decoded here; cached replies are not), time/judge (seconds the trainer stepped the engine for
the judge alone, while waiting for rewards), judge/step_share (the share of engine steps that
held judge rows) and judge/beside_rollout_steps (engine steps that held judge and rollout rows
at once).
"""
from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import jax

from jaxrl.config import Config, ConfigError
from jaxrl.lora.adapters import AdapterSet
from jaxrl.lora.lora import Lora
from jaxrl.sampling.buckets import bucket
from jaxrl.sampling.engine import Engine
from jaxrl.sampling.requests import Request
from jaxrl.sampling.sampler import REFILL_CHUNK, slot_layout
from jaxrl.sampling.sampling_fns import Decoding

POLICY, JUDGE_ADAPTER = 1, 2  # adapter indices in the shared engine (0: the base alone)
INSTRUCTION_TOKENS = 1024  # judge.max_prompt_tokens 0: room for the judge's instructions

_current: "JudgeService | None" = None


def current() -> "JudgeService | None":
    """The service a `Judge` with judge.local decodes in (None outside `jaxrl train`)."""
    return _current


def judge_kind(cfg: Config) -> tuple[str, str]:
    """(kind, path) of judge.local: ("", ""), ("base", ""), ("adapter", DIR), ("model", PATH)."""
    kind, _, path = cfg.judge.local.partition(":")
    return kind, path.strip()


def judge_prompt_tokens(cfg: Config) -> int:
    """Cache columns a judge prompt may fill (judge.max_prompt_tokens, 0: module docstring)."""
    return cfg.judge.max_prompt_tokens or (cfg.data.max_prompt_tokens
                                           + cfg.sampling.max_new_tokens + INSTRUCTION_TOKENS)


@dataclass(frozen=True)
class Layout:
    """Slots and cache columns of the engines: the policy's engine (rollout rows, plus the
    judge's rows where it is shared) and, for a second model, the judge's."""

    rollout_slots: int
    rollout_capacity: int
    judge_slots: int
    judge_capacity: int
    shared: bool  # the judge decodes in the policy's engine

    @property
    def policy_slots(self) -> int:
        return self.rollout_slots + (self.judge_slots if self.shared else 0)

    @property
    def policy_capacity(self) -> int:
        return max(self.rollout_capacity, self.judge_capacity if self.shared else 0)


def layout(cfg: Config, rows: int, ways: int = 1) -> Layout:
    """The engines' layout for `rows` rollout rows a step (this process's), slot counts rounded
    up to whole multiples of the mesh's `ways` batch shards."""
    whole = lambda n: math.ceil(n / ways) * ways
    return Layout(rollout_slots=slot_layout(rows, 1, cfg.sampling.slots, ways)[0],
                  rollout_capacity=bucket(cfg.data.max_prompt_tokens)
                  + bucket(cfg.sampling.max_new_tokens),
                  judge_slots=whole(cfg.judge.slots),
                  judge_capacity=judge_prompt_tokens(cfg) + cfg.judge.max_tokens,
                  shared=judge_kind(cfg)[0] in ("base", "adapter"))


@dataclass(eq=False)
class _Ask:
    messages: list[dict]
    max_tokens: int
    future: concurrent.futures.Future


class JudgeService:
    """The engine(s) of `jaxrl train` with judge.local (module docstring). params, spec,
    tokenizer and eos_ids: the policy's model; lora: an adapter of the policy's structure (its
    values are replaced before each rollout); rows: rollout rows a step."""

    def __init__(self, cfg: Config, spec, params, tokenizer, eos_ids, lora: Lora, rows: int,
                 rules=None, log: Callable[[str], None] = print):
        if jax.process_count() > 1:
            raise ConfigError("judge.local decodes the judge in the training process's engine, "
                              "which takes one process; with several, serve the judge "
                              "(jaxrl serve) and set judge.base_url")
        kind, path = judge_kind(cfg)
        self.cfg = cfg
        self.layout = lay = layout(cfg, rows, rules.batch_ways if rules is not None else 1)
        judges: list[Lora] = []
        self.judge_adapter = 0
        if kind == "adapter":
            from jaxrl.hf.peft_io import load_peft_adapter

            judges, self.judge_adapter = [load_peft_adapter(path, spec)], JUDGE_ADAPTER
            log(f"judge: adapter {path} over the policy's base, in the policy's engine")
        self._judges = judges
        # the policy's place in the set while the judge decodes alone: the training step
        # donates the adapter it updates, so the engine must not hold that one between
        # rollouts (zeros of the same structure compile nothing new)
        self._idle_policy = jax.tree_util.tree_map(jax.numpy.zeros_like, lora)
        engine_lora = AdapterSet.of([lora, *judges]) if lay.shared else lora
        self.policy = Engine(params, spec, eos_ids=eos_ids, slots=lay.policy_slots,
                             capacity=lay.policy_capacity, chunk=REFILL_CHUNK, lora=engine_lora,
                             shardings=rules)
        self.tokenizer, self.eos_ids = tokenizer, tuple(eos_ids)
        self._structured = None  # judge.response_format's grammars, built on first use
        if lay.shared:
            self.judge = self.policy
            if kind == "base":
                log("judge: the policy's frozen base (no adapter), in the policy's engine")
        else:
            from jaxrl.backends.numerics import numerics_of
            from jaxrl.hf.loader import load_model
            from jaxrl.hf.tokenizer import eos_token_ids

            model = load_model(path, dtype=cfg.model.dtype, quant=cfg.quant,
                               numerics=numerics_of(rules), rules=rules, log=log)
            self.tokenizer, self.eos_ids = model.tokenizer, eos_token_ids(model.tokenizer,
                                                                          model.path)
            self.judge = Engine(model.params, model.spec, eos_ids=self.eos_ids,
                                slots=lay.judge_slots, capacity=lay.judge_capacity,
                                chunk=REFILL_CHUNK, shardings=rules)
            log(f"judge: {model.path} in an engine of its own beside the policy's")
        self.policy.feed = self._tick
        self._inbox: deque[_Ask] = deque()
        self._cond = threading.Condition()
        self._live = 0  # judge rows in the judge's engine
        self._counts = {"requests": 0, "tokens": 0, "judge_s": 0.0, "beside": 0}
        self._last = self._snapshot()

    # the reward loop's thread
    def submit(self, messages: list[dict], max_tokens: int) -> concurrent.futures.Future:
        """A future of the judge's reply text to `messages` (decoded greedily, at most
        max_tokens tokens); it fails with `JudgeFailure` where the prompt does not fit."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._inbox.append(_Ask(messages, max_tokens, future))
            self._cond.notify_all()
        return future

    # the training thread
    def policy_engine(self, lora: Lora) -> Engine:
        """The engine a rollout decodes in, its policy adapter set to `lora` (index POLICY
        where the judge shares it; rows already decoding there, the judge's, go on)."""
        self.policy.lora = AdapterSet.of([lora, *self._judges]) if self.layout.shared else lora
        return self.policy

    def resident_bytes(self) -> int:
        """Bytes per device the engines (and a second model's weights) hold for the run."""
        from jaxrl.bench.limits import device_bytes

        held = [self.policy.state] + ([] if self.judge is self.policy
                                      else [self.judge.state, self.judge.params])
        return sum(device_bytes(tree) for tree in held)

    @property
    def policy_adapter(self) -> int:
        return POLICY if self.layout.shared else 0

    def wait(self, done: Callable[[], bool]) -> None:
        """Step the judge's engine until done() (the rewards a step waits for are in). No
        rollout rows decode now (a rollout steps until its rows have finished)."""
        if self.layout.shared:
            self.policy.lora = AdapterSet.of([self._idle_policy, *self._judges])
        while not done():
            with self._cond:
                idle = not self._inbox and not self.judge.busy()
                if idle:
                    self._cond.wait(0.05)
                    continue
            start = time.perf_counter()
            self._feed()
            self.judge.step()
            self._counts["judge_s"] += time.perf_counter() - start

    def _tick(self) -> None:
        """Each step of the policy's engine: take waiting judge requests in; a judge of its
        own steps once beside it."""
        self._feed()
        if self.judge is not self.policy and self.judge.busy():
            self._counts["beside"] += int(self.policy.busy())
            self.judge.step()

    def _feed(self) -> None:
        """Waiting judge requests into free judge slots (rendered and tokenized here)."""
        from jaxrl.rewards.judge import JudgeFailure

        while self._live < self.layout.judge_slots:
            with self._cond:
                if not self._inbox:
                    return
                ask = self._inbox.popleft()
            if not ask.future.set_running_or_notify_cancel():
                continue  # its reward timed out before it was decoded
            try:
                ids = self._prompt_ids(ask.messages)
            except Exception as error:  # noqa: BLE001 -- a template error fails this request
                ask.future.set_exception(JudgeFailure("judge_bad_request", str(error)[:300], 1))
                continue
            room = self.layout.judge_capacity - len(ids)
            if room < 1 or len(ids) > judge_prompt_tokens(self.cfg):
                ask.future.set_exception(JudgeFailure(
                    "judge_prompt_too_long", f"a {len(ids)}-token judge prompt does not fit "
                    f"judge.max_prompt_tokens ({judge_prompt_tokens(self.cfg)})", 1))
                continue
            self._live += 1
            self.judge.submit(Request(ids, Decoding(self.cfg.judge.temperature),
                                      min(ask.max_tokens, room),
                                      adapter=self.judge_adapter,
                                      on_done=lambda r, ask=ask: self._done(r, ask),
                                      constraint=self._constraint()))

    def _constraint(self):
        """judge.response_format json_object: the reply's grammar (`Request.constraint`, any
        JSON object, jaxrl/serve/structured.py; the engine then decodes a token a step while
        a judge reply is constrained), else None."""
        if not self.cfg.judge.response_format:
            return None
        if self._structured is None:
            from jaxrl.serve.structured import Structured

            self._structured = Structured(self.tokenizer, self.eos_ids)
        body = {"response_format": {"type": self.cfg.judge.response_format}}
        return self._structured.constraints(body, 1)[0]

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        from jaxrl.hf.tokenizer import chat_prompt_text, text_ids

        text = chat_prompt_text(self.tokenizer, messages, thinking=self.cfg.judge.thinking)
        return text_ids(self.tokenizer, text)

    def _done(self, request: Request, ask: _Ask) -> None:
        self._live -= 1
        self._counts["requests"] += 1
        self._counts["tokens"] += len(request.tokens)
        text = self.tokenizer.decode(request.tokens, skip_special_tokens=True)
        if not ask.future.cancelled():
            ask.future.set_result(text)

    def _snapshot(self) -> dict[str, float]:
        stats = [self.policy.stats] + ([] if self.judge is self.policy else [self.judge.stats])
        judge_steps = (self.policy.stats.adapter_steps.get(self.judge_adapter, 0)
                       if self.layout.shared else self.judge.stats.steps)
        beside = (self.policy.stats.mixed_steps if self.layout.shared
                  else self._counts["beside"])
        return {**self._counts, "steps": sum(s.steps for s in stats),
                "judge_steps": judge_steps, "beside": beside}

    def metrics(self) -> dict[str, float]:
        """The judge's work since the last call (module docstring)."""
        now = self._snapshot()
        delta = {k: now[k] - self._last[k] for k in now}
        self._last = now
        return {"judge/requests": float(delta["requests"]),
                "judge/tokens": float(delta["tokens"]), "time/judge": delta["judge_s"],
                "judge/step_share": delta["judge_steps"] / delta["steps"] if delta["steps"]
                else 0.0, "judge/beside_rollout_steps": float(delta["beside"])}

    def __enter__(self) -> "JudgeService":
        global _current
        _current = self
        return self

    def __exit__(self, *exc) -> None:
        global _current
        _current = None
        with self._cond:
            waiting, self._inbox = list(self._inbox), deque()
        for ask in waiting:
            ask.future.cancel()

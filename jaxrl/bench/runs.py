"""The three measurements of `jaxrl bench`, each returning rows of figures (dicts).

Prompts are random token ids and EOS is ignored, so every row decodes exactly
sampling.max_new_tokens tokens (or its drawn count in `engine`) whatever the weights say.
Compilation is kept apart: `sample` compiles its two programs ahead of time and times that;
`step` and `engine` report their first (compiling) pass apart from the timed ones.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import distributed
from jaxrl.bench.limits import decode_cost, prefill_cost
from jaxrl.bench.subject import Subject, random_prompts
from jaxrl.devices import compiled_peak
from jaxrl.rl.advantages import compute_advantages
from jaxrl.rl.loop import make_batch
from jaxrl.rl.remat import AutoRematStep
from jaxrl.rl.rollout import Rollout
from jaxrl.rl.session import make_trainer, prompt_share_limit, reference_program, step_options
from jaxrl.rl.train_step import compile_train_step, make_optimizer
from jaxrl.sampling.buckets import bucket
from jaxrl.sampling.engine import Engine
from jaxrl.lora.adapters import AdapterSet
from jaxrl.sampling.programs import admit, generate, init_slots
from jaxrl.sampling.requests import Request, row_keys
from jaxrl.sampling.sampler import REFILL_CHUNK, sample, slot_layout
from jaxrl.sampling.sampling_fns import Decoding, Features, RowSettings
from jaxrl.sharding import place


def device_peak_bytes() -> int | None:
    """The largest bytes in use so far on the first device, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def _timed(fn):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    return result, time.perf_counter() - start


def _admit_inputs(subject: Subject, batch: int, prompt_tokens: int, slots: int,
                  share: int = 1, adapters: int = 0):
    """Arguments of `admit` filling `batch` slots from batch / share distinct random prompts,
    each filling `share` consecutive slots (a block, when the slots share prompts); with
    `adapters` > 0, prompt i under adapter index 1 + i % adapters."""
    distinct = batch // share
    u, width = bucket(distinct, minimum=1), bucket(prompt_tokens)
    m = u * share
    prompts = np.zeros((u, width), np.int32)
    prompts[:distinct, :prompt_tokens] = random_prompts(subject.spec, [prompt_tokens] * distinct)
    lengths = np.asarray([prompt_tokens] * distinct + [1] * (u - distinct), np.int32)
    adapter = (1 + np.arange(u) % adapters if adapters else np.zeros(u)).astype(np.int32)
    pad = m - batch
    rows = (np.asarray([i // share for i in range(batch)] + [0] * pad, np.int32),  # src
            np.asarray(list(range(batch)) + [slots] * pad, np.int32),  # dst: pads dropped
            row_keys(jax.random.PRNGKey(subject.cfg.run.seed), range(m)),
            RowSettings.of([Decoding.from_config(subject.cfg.sampling)] * m),
            np.asarray([subject.cfg.sampling.max_new_tokens] * batch + [1] * pad, np.int32))
    data = (prompts, lengths, adapter, *rows)
    return data if subject.rules is None else distributed.rows_to_global(subject.rules, data)


def adapter_set(subject: Subject, n: int) -> AdapterSet:
    """The subject's adapter and n - 1 others like it (B scaled by 1 + i / n, so each row's
    term differs) as an `AdapterSet`, for decoding rows of n adapters in one batch."""
    def scaled(i):
        layers = {t: {"a": ab["a"], "b": ab["b"] * (1 + i / n)}
                  for t, ab in subject.lora.weights["layers"].items()}
        return subject.lora.replace(weights={"layers": layers})
    return AdapterSet.of([scaled(i) for i in range(n)])


def sample_batch(subject: Subject, batch: int, prompt_tokens: int, repeats: int, peaks,
                 group: int = 1, trace=contextlib.nullcontext, adapters: int = 0) -> dict:
    """Prefill and decode of `batch` rows through the engine's programs (`admit` of distinct
    prompts of `prompt_tokens` tokens, each the prompt of `group` rows, then `generate` to
    sampling.max_new_tokens): compile times, median times over `repeats` calls after a
    warm-up one, and their limits. Groups decode in blocks of slots sharing their prompt's
    cache, as `sample` lays them out (group 1: every row its own prompt). The last call runs
    inside `trace()` (a profile, `jaxrl.bench.profile.traced`). adapters > 0: the rows
    decode with `adapter_set(subject, adapters)`, prompt i's under adapter 1 + i % adapters,
    as a server or a local judge mixes them (0: the subject's one adapter, the rollout's
    form)."""
    cfg, spec, rules = subject.cfg, subject.spec, subject.rules
    lora = adapter_set(subject, adapters) if adapters else subject.lora
    n = cfg.sampling.max_new_tokens
    slots, share = slot_layout(batch, group, 0, rules.batch_ways if rules else 1)
    capacity = bucket(prompt_tokens) + bucket(n)
    empty = functools.partial(init_slots, subject.params, spec=spec, slots=slots,
                              capacity=capacity, share=share,
                              prompt_capacity=bucket(prompt_tokens), shardings=rules,
                              numerics=subject.numerics)
    # the sampling parts the engine's programs hold for rows of the run's setting
    features = Features.of([Decoding.from_config(cfg.sampling)])
    static = dict(spec=spec, eos_ids=(), shardings=rules, numerics=subject.numerics,
                  features=features)
    inputs = _admit_inputs(subject, batch, prompt_tokens, slots, share, adapters)
    start = time.perf_counter()
    admit_c = admit.lower(empty(), subject.params, lora, *inputs, **static).compile()
    compiled_admit = time.perf_counter()
    generate_c = generate.lower(empty(), subject.params, lora, steps=bucket(n),
                                **static).compile()
    compile_s = {"admit": compiled_admit - start, "generate": time.perf_counter() - compiled_admit}
    prefill, decode = [], []
    for i in range(repeats + 1):
        with trace() if i == repeats else contextlib.nullcontext():
            (state, *_), t_prefill = _timed(lambda: admit_c(empty(), subject.params,
                                                            lora, *inputs))
            (state, chunk), t_decode = _timed(lambda: generate_c(state, subject.params, lora))
        prefill.append(t_prefill)
        decode.append(t_decode)
    emitted = int(np.asarray(distributed.rows_to_local(chunk.emitted) if rules
                             else chunk.emitted).sum())
    assert emitted == batch * (n - 1), (emitted, batch, n)
    devices = len(rules.mesh.devices.flat) if rules else 1
    t_prefill, t_decode = statistics.median(prefill[1:]), statistics.median(decode[1:])
    step = t_decode / (n - 1)
    return {"batch": batch, "group": share, "slots": slots, "adapters": adapters,
            "prompt_tokens": prompt_tokens,
            "new_tokens": n,
            "capacity": capacity, "compile_s": compile_s,
            "prefill_s": t_prefill, "prefill_tok_s": batch // share * prompt_tokens / t_prefill,
            "decode_s": t_decode, "decode_step_ms": 1e3 * step,
            "decode_tok_s": batch * (n - 1) / t_decode, "runs_s": {"prefill": prefill[1:],
                                                                  "decode": decode[1:]},
            "decode_limits": decode_cost(spec, subject.params, subject.lora, state.cache, slots,
                                         devices, state.prefix).shares(step, peaks),
            "prefill_limits": prefill_cost(spec, subject.lora,
                                           bucket(batch // share, minimum=1),
                                           bucket(prompt_tokens), devices).shares(t_prefill,
                                                                                  peaks),
            "peak_bytes": {"admit": compiled_peak(admit_c),
                           "generate": compiled_peak(generate_c)},
            "device_peak_bytes": device_peak_bytes()}


@dataclasses.dataclass
class _StepRunner:
    """One GRPO step as `jaxrl.rl.loop` runs it (rollout, reference pass, update), timed per
    phase, each phase until its results are ready."""

    subject: Subject
    prompt_tokens: int

    def __post_init__(self):
        s, cfg = self.subject, self.subject.cfg
        self.key = jax.random.PRNGKey(cfg.run.seed)
        self.state, _, self.train_step, self.shardings = make_trainer(cfg, s.spec, s.params,
                                                                      s.rules, self.key)
        if self.shardings is not None:
            self.state = place(self.state, self.shardings[0][0])
        self.references = {}  # (completion width, share) -> the reference pass
        g = cfg.grpo.num_generations
        prompts = random_prompts(s.spec, [self.prompt_tokens] * cfg.data.prompts_per_step,
                                 cfg.run.seed)
        self.rows = [p for p in prompts for _ in range(g)]
        self.sampling = dataclasses.replace(cfg.sampling, stop=())  # no detokenizer here

    def step(self, i: int) -> dict[str, float]:
        s, cfg = self.subject, self.subject.cfg
        to_device = functools.partial(distributed.to_device, s.rules)
        out, t_rollout = _timed(lambda: sample(
            s.params, s.spec, self.rows, jax.random.fold_in(self.key, i), self.sampling,
            lora=self.state.lora, eos_ids=(), shardings=s.rules))
        rewards = np.random.default_rng(i).normal(size=len(self.rows)).astype(np.float32)
        adv = compute_advantages(rewards, cfg.grpo.num_generations, scale=cfg.grpo.scale_rewards)
        rollout = Rollout(i, [], [], out)
        batch = make_batch(rollout, np.asarray(adv.advantages), np.asarray(adv.keep), to_device,
                           rollout.share(prompt_share_limit(cfg, s.rules, len(self.rows))))
        if cfg.grpo.beta > 0:
            ref, t_reference = _timed(lambda: self.reference(batch)(
                s.params, batch.tokens, batch.positions, batch.attn_mask))
            batch = batch.replace(ref_logp=ref)
        else:
            t_reference = 0.0
        start = time.perf_counter()
        for _ in range(cfg.grpo.num_iterations):
            self.state, metrics = self.train_step(self.state, s.params, batch)
        metrics = jax.device_get(metrics)
        t_update = time.perf_counter() - start
        assert np.isfinite(metrics["loss"]), metrics
        self.batch = batch
        return {"rollout": t_rollout, "reference": t_reference, "update": t_update,
                "step": t_rollout + t_reference + t_update}

    def reference(self, batch):
        """The reference pass of `batch`'s completion width (`jaxrl.rl.rollout.Rollout.columns`)
        and prompt sharing (`Batch.share`)."""
        key = batch.completion_mask.shape[1], batch.share
        if key not in self.references:
            s = self.subject
            self.references[key] = reference_program(s.cfg, s.spec, s.params, s.rules, *key)
        return self.references[key]

    def memory(self) -> dict:
        """(remat policy, peak bytes of the reference and update programs)."""
        s, b = self.subject, self.batch
        if isinstance(self.train_step, AutoRematStep):
            (policy,), (update,) = (set(self.train_step.policies.values()),
                                    list(self.train_step.compiled.values()))
        else:
            policy = s.cfg.optim.remat
            update = self.train_step.lower(self.state, s.params, b).compile()
        reference = self.reference(b).lower(s.params, b.tokens, b.positions,
                                            b.attn_mask).compile()
        return {"remat": policy, "peak_bytes": {"reference": compiled_peak(reference),
                                                "update": compiled_peak(update)},
                "device_peak_bytes": device_peak_bytes()}

    def compare_remat(self, policies: list[str], rounds: int) -> list[dict]:
        """The last step's update under each remat policy: compiled apart, then run `rounds`
        times each from the same state, the policies taking turns."""
        s, cfg = self.subject, self.subject.cfg
        optimizer, _ = make_optimizer(cfg.optim, cfg.run.steps)
        compiled, compile_s = {}, {}
        for policy in policies:
            opts = dataclasses.replace(step_options(cfg), remat=policy)
            step = compile_train_step(s.spec, optimizer, opts, self.shardings)
            start = time.perf_counter()
            compiled[policy] = step.lower(self.state, s.params, self.batch).compile()
            compile_s[policy] = time.perf_counter() - start
        runs = {policy: [] for policy in policies}
        for _ in range(rounds):
            for policy in policies:
                state = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, self.state))
                _, seconds = _timed(lambda: compiled[policy](state, s.params, self.batch))
                runs[policy].append(seconds)
        return [{"policy": p, "compile_s": compile_s[p], "update_s": statistics.median(runs[p]),
                 "runs_s": runs[p], "peak_bytes": compiled_peak(compiled[p])} for p in policies]


def grpo_step(subject: Subject, steps: int, prompt_tokens: int,
              remat_policies: list[str] = (), trace=contextlib.nullcontext) -> dict:
    """Seconds per GRPO step and per phase: the first (compiling) step apart, then the median of
    `steps` steps, with each phase's tokens per second; then, for each of `remat_policies`, the
    last step's update under that policy, timed `steps` times (`_StepRunner.compare_remat`).
    The last timed step runs inside `trace()`."""
    cfg = subject.cfg
    runner = _StepRunner(subject, prompt_tokens)
    first = runner.step(0)
    runs = [runner.step(i) for i in range(1, steps)]
    with trace():
        runs.append(runner.step(steps))
    median = {k: statistics.median(r[k] for r in runs) for k in first}
    rows, n = len(runner.rows), cfg.sampling.max_new_tokens
    width = runner.batch.tokens.shape[1]
    tokens = {"rollout": rows * n, "reference": rows * width,
              "update": rows * width * cfg.grpo.num_iterations}
    return {"rows": rows, "prompt_tokens": prompt_tokens, "new_tokens": n, "width": width,
            "first_step_s": first, "median_s": median, "runs_s": runs,
            "tok_s": {k: tokens[k] / median[k] for k in tokens if median[k] > 0},
            **runner.memory(),
            "remat_compare": runner.compare_remat(list(remat_policies), steps)}


def engine_workload(subject: Subject, requests: int, mean_new_tokens: float,
                    prompt_tokens: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, new tokens) of `requests` requests: prompt lengths uniform in
    [prompt_tokens / 4, prompt_tokens], new tokens geometric with mean `mean_new_tokens` capped
    at sampling.max_new_tokens (seeded by run.seed)."""
    rng = np.random.default_rng(subject.cfg.run.seed)
    lengths = rng.integers(max(1, prompt_tokens // 4), prompt_tokens + 1, requests)
    new = np.minimum(rng.geometric(1.0 / mean_new_tokens, requests),
                     subject.cfg.sampling.max_new_tokens)
    return random_prompts(subject.spec, lengths, subject.cfg.run.seed), [int(n) for n in new]


def _engine_pass(subject: Subject, prompts, new, slots: int):
    capacity = bucket(max(map(len, prompts))) + bucket(subject.cfg.sampling.max_new_tokens)
    engine = Engine(subject.params, subject.spec, slots=slots, capacity=capacity,
                    chunk=REFILL_CHUNK, lora=subject.lora, shardings=subject.rules,
                    numerics=subject.numerics)
    keys = row_keys(jax.random.PRNGKey(subject.cfg.run.seed), range(len(prompts)))
    decoding = Decoding.from_config(subject.cfg.sampling)
    done = [engine.submit(Request(p, decoding, n, keys[i]))
            for i, (p, n) in enumerate(zip(prompts, new))]
    engine.run()
    assert [len(r.tokens) for r in done] == new
    return engine.stats


def _static_pass(subject: Subject, prompts, new, slots: int) -> float:
    """`sample` on static batches of `slots` requests, each to its longest; returns the share
    of decode-step row-tokens that were requested (the first token of each row comes from the
    prefill, as the engine's utilization counts it)."""
    live = total = 0
    for start in range(0, len(prompts), slots):
        rows, n = prompts[start:start + slots], new[start:start + slots]
        cfg = dataclasses.replace(subject.cfg.sampling, max_new_tokens=max(n), stop=())
        sample(subject.params, subject.spec, rows, jax.random.PRNGKey(start), cfg,
               lora=subject.lora, eos_ids=(), shardings=subject.rules)
        live, total = live + sum(n) - len(n), total + (max(n) - 1) * len(n)
    return live / total if total else 0.0


def engine(subject: Subject, requests: int, mean_new_tokens: float, prompt_tokens: int,
           static: bool) -> list[dict]:
    """Useful tokens per second of the slot engine (sampling.slots slots, 16 if unset, refilled
    as requests end) on a mixed-length workload: a first (compiling) pass, then a timed one; with
    `static`, the same workload through `sample` on static batches of as many rows."""
    prompts, new = engine_workload(subject, requests, mean_new_tokens, prompt_tokens)
    slots = subject.cfg.sampling.slots or 16
    passes = [("engine", lambda: _engine_pass(subject, prompts, new, slots))]
    if static:
        passes.append(("static", lambda: _static_pass(subject, prompts, new, slots)))
    rows = []
    for name, run in passes:
        times = []
        for _ in range(2):  # the first pass compiles
            start = time.perf_counter()
            result = run()
            times.append(time.perf_counter() - start)
        first, wall = times
        utilization = result.utilization(slots) if name == "engine" else result
        rows.append({"engine": name, "requests": requests, "slots": slots,
                     "useful_tokens": sum(new), "first_pass_s": first, "wall_s": wall,
                     "useful_tok_s": sum(new) / wall, "utilization": utilization,
                     "device_peak_bytes": device_peak_bytes()})
    return rows

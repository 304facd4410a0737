"""`jaxrl pilot`: before a run, will it learn and when will it finish?

A GRPO group (the G completions of one prompt) teaches something only when its rewards differ:
a group whose G rewards are all equal has advantage 0 on every row (jaxrl/rl/advantages.py,
`zero_spread`). The pilot samples G completions for N prompts of the training data as the run
would (its model, adapter, sampling settings, EOS ids and rewards), and `analyze` turns the
scored groups into the figures below, recommendations and a verdict. `run_pilot` does the
sampling, scoring and timing; `format_report` prints the result.

Figures, per task (records carry a "task" field) and over all groups:
  reward_mean    mean reward of every row
  reward_std     std of the rewards within each group (the unbiased estimator, as the
                 advantages use), averaged over the groups
  zero_spread    share of groups whose G rewards are all equal (no gradient), split into
                 groups all at the task's minimum (none solved) and all above it (all solved)
  success_rate   share of rows that succeed (the rule below)
  spread_at_G    the expected share of groups with spread at G = grpo.num_generations, from
                 the per-prompt success rates (the rule below)
  needed_G       the smallest G (2 to MAX_G) whose expected share of groups with spread is at
                 least 1/2; None where none is (overall: over the prompts of the tasks whose
                 success rate is neither 0 nor 1, those a larger G can help)
  length_mean / length_max / truncated   completion tokens and the share of rows cut at
                 sampling.max_new_tokens (finish_reason "length"), where given
  useful_groups_per_step (overall)   data.prompts_per_step x (1 - zero_spread): groups per
                 step that carry a gradient (with grpo.dynamic_sampling, up to
                 grpo.max_sampling_rounds rounds of them, capped at data.prompts_per_step)

Success. A row succeeds when its reward is above its task's minimum: the lowest reward the
pilot saw on that task. Where every row of a task scored the same, that minimum says nothing;
the rows then succeed when their reward is above `floor`, the reward of a completion that
earns nothing (0.0: every built-in reward scores a failure 0), so a task scoring 1.5 everywhere
counts as all solved and one scoring 0 everywhere as none solved. (A reward every completion
earns, e.g. the format reward alone, then reads as solved: the per-function means in the
report tell such a task apart.)

The G rule. For prompt i with s_i successes of the pilot's G rows, its success probability is
taken as p_i = (s_i + p) / (G + 1), p the task's success rate (a prior of one row's weight at
the task's rate, so a prompt the pilot saw only fail or only succeed keeps the task's chance of
the other outcome). A group of G' rows has spread when it holds at least one success and one
failure: probability 1 - p_i^G' - (1 - p_i)^G'. The expected share of groups with spread at G'
is its mean over the task's prompts; needed_G is the smallest G' where that share reaches 1/2.
A task whose rows all fail (or all succeed) has p = 0 (1), so no G helps it: it has no
needed_G, and its recommendation is to drop or re-weight it instead.

Recommendations (each with its reason; `set` is a key=value override where there is one):
  - a task with zero spread in >= ZERO_SPREAD_TASK of its groups: drop it or lower its weight,
    saying which way it fails (too hard: its zero-spread groups are mostly none solved; too
    easy: mostly all solved), and what to change (data.difficulty, SFT first);
  - grpo.dynamic_sampling=true when zero-spread groups are at least half of all groups but
    some groups have spread (with it already on, grpo.max_sampling_rounds when the rounds it
    allows cannot fill a step);
  - grpo.num_generations=G' when, over the prompts of the tasks a larger G can help, the
    expected share of groups with spread at G is below 1/2 and G' (<= MAX_G) brings it to 1/2;
  - sampling.max_new_tokens (doubled) when >= TRUNCATION_HIGH of the rows are truncated;
  - data.prompts_per_step=P' when fewer than `target_groups` useful groups per step are
    expected: P' = ceil(target_groups / (1 - zero_spread)) (with dynamic sampling, divided by
    min(1, (1 - zero_spread) x grpo.max_sampling_rounds) instead).
Verdict: "will not learn: ..." when no group has any spread (every advantage is 0), else
"will learn: ..." with the share of groups that carry a gradient.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ZERO_SPREAD_TASK = 0.9  # a task with this share of zero-spread groups is flagged
DYNAMIC_SAMPLING_AT = 0.5  # zero-spread share from which dynamic sampling pays
TRUNCATION_HIGH = 0.1  # truncated share from which max_new_tokens is too small
SPREAD_TARGET = 0.5  # expected share of groups with spread that needed_G aims at
MAX_G = 64
TARGET_GROUPS = 4  # default useful groups per step to aim at


@dataclass(frozen=True)
class Group:
    """One prompt's G scored rows: its task, rewards and (optionally) completion lengths in
    tokens and whether each row was cut at max_new_tokens."""

    task: str
    rewards: Sequence[float]
    lengths: Sequence[int] = ()
    truncated: Sequence[bool] = ()
    functions: Mapping[str, Sequence[float]] | None = None  # per reward function: the rows'


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _std(values: Sequence[float]) -> float:
    """The unbiased std (n - 1), as `jaxrl.rl.advantages.group_advantages` takes it."""
    n = len(values)
    if n < 2:
        return 0.0
    m = sum(values) / n
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))


def _spread(rewards: Sequence[float]) -> bool:
    return max(rewards) != min(rewards)


def spread_share(rates: Sequence[float], g: int) -> float:
    """Mean over prompts of P(a group of g rows holds a success and a failure)."""
    return _mean(1 - p ** g - (1 - p) ** g for p in rates) or 0.0


def prompt_rates(successes: Sequence[int], g: int, rate: float) -> list[float]:
    """Each prompt's success probability: (s_i + rate) / (g + 1) (module docstring)."""
    return [(s + rate) / (g + 1) for s in successes]


def needed_g(rates: Sequence[float], target: float = SPREAD_TARGET,
             max_g: int = MAX_G) -> int | None:
    """The smallest G in [2, max_g] with spread_share(rates, G) >= target, or None."""
    for g in range(2, max_g + 1):
        if spread_share(rates, g) >= target:
            return g
    return None


def _successes(groups: Sequence[Group], floor: float) -> list[int]:
    """Successes per group: rewards above the task's minimum (or above `floor` where the
    task's rows all scored the same)."""
    rows = [r for grp in groups for r in grp.rewards]
    low, high = min(rows), max(rows)
    threshold = low if high > low else floor
    return [sum(r > threshold for r in grp.rewards) for grp in groups]


def _stats(groups: Sequence[Group], successes: Sequence[int]) -> dict:
    g = len(groups[0].rewards)
    n_rows = sum(len(grp.rewards) for grp in groups)
    zero = [not _spread(grp.rewards) for grp in groups]
    rate = sum(successes) / n_rows
    rates = prompt_rates(successes, g, rate)
    lengths = [n for grp in groups for n in grp.lengths]
    truncated = [t for grp in groups for t in grp.truncated]
    functions: dict[str, list[float]] = {}
    for grp in groups:
        for name, values in (grp.functions or {}).items():
            functions.setdefault(name, []).extend(values)
    return {
        "groups": len(groups), "rows": n_rows,
        "reward_mean": _mean(r for grp in groups for r in grp.rewards),
        "reward_std": _mean(_std(grp.rewards) for grp in groups),
        "zero_spread": sum(zero) / len(groups),
        "zero_spread_none_solved": sum(z and s == 0 for z, s in zip(zero, successes)),
        "zero_spread_all_solved": sum(z and s > 0 for z, s in zip(zero, successes)),
        "success_rate": rate,
        "spread_at_G": spread_share(rates, g),
        "needed_G": needed_g(rates),
        "length_mean": _mean(lengths), "length_max": max(lengths) if lengths else None,
        "truncated": _mean(truncated),
        "functions": {name: _mean(values) for name, values in functions.items()},
    }


def _task_advice(task: str, t: dict) -> dict:
    hard = t["zero_spread_none_solved"] >= t["zero_spread_all_solved"]
    share = f"{100 * t['zero_spread']:.0f}% of its {t['groups']} groups have zero spread"
    if hard:
        why = (f"{share}, mostly none solved (success rate {100 * t['success_rate']:.0f}%): "
               "too hard for the model now. Drop it from data.tasks or lower its weight "
               "(data.weights), lower data.difficulty, or warm the model up with SFT first")
    else:
        why = (f"{share}, mostly all solved (success rate {100 * t['success_rate']:.0f}%): "
               "too easy, it only costs rollout time. Drop it from data.tasks or lower its "
               "weight (data.weights), or raise data.difficulty")
    return {"task": task, "set": None, "why": why, "direction": "too hard" if hard
            else "too easy"}


def analyze(groups: Sequence[Group], *, num_generations: int, prompts_per_step: int,
            max_new_tokens: int | None = None, dynamic_sampling: bool = False,
            max_sampling_rounds: int = 3, target_groups: int = TARGET_GROUPS,
            floor: float = 0.0) -> dict:
    """{overall, tasks, recommendations, verdict} of scored groups (module docstring)."""
    if not groups:
        raise ValueError("the pilot needs at least one scored group")
    if any(len(grp.rewards) != num_generations for grp in groups):
        raise ValueError(f"every group must hold num_generations={num_generations} rewards")
    by_task: dict[str, list[Group]] = {}
    for grp in groups:
        by_task.setdefault(grp.task, []).append(grp)
    tasks, successes, rates, helped = {}, [], [], []
    for task in sorted(by_task):
        found = _successes(by_task[task], floor)
        tasks[task] = _stats(by_task[task], found)
        successes += found
        # each prompt's rate with its own task's prior, for the overall spread estimate
        rate = tasks[task]["success_rate"]
        rates += prompt_rates(found, num_generations, rate)
        if 0 < rate < 1:  # the tasks a larger G can help
            helped += prompt_rates(found, num_generations, rate)
    ordered = [grp for task in sorted(by_task) for grp in by_task[task]]
    overall = _stats(ordered, successes)
    overall["spread_at_G"] = spread_share(rates, num_generations)
    overall["needed_G"] = needed_g(helped) if helped else None
    zero = overall["zero_spread"]
    rounds = max_sampling_rounds if dynamic_sampling else 1
    useful = min(prompts_per_step, prompts_per_step * (1 - zero) * rounds)
    overall["useful_groups_per_step"] = useful

    recs = [_task_advice(task, t) for task, t in tasks.items()
            if t["zero_spread"] >= ZERO_SPREAD_TASK]
    if zero < 1 and zero >= DYNAMIC_SAMPLING_AT:
        needed_rounds = math.ceil(1 / (1 - zero))
        if not dynamic_sampling:
            recs.append({"set": "grpo.dynamic_sampling=true", "why": (
                f"{100 * zero:.0f}% of groups have zero spread but {100 * (1 - zero):.0f}% "
                "have some: dynamic sampling draws further prompts until the step holds "
                f"data.prompts_per_step groups with spread (about {needed_rounds} rounds "
                f"each; grpo.max_sampling_rounds is {max_sampling_rounds})")})
        elif needed_rounds > max_sampling_rounds:
            recs.append({"set": f"grpo.max_sampling_rounds={needed_rounds}", "why": (
                f"with {100 * zero:.0f}% zero-spread groups a step needs about "
                f"{needed_rounds} rounds to fill, and {max_sampling_rounds} are allowed")})
    g_new = overall["needed_G"]
    if helped and g_new is not None and g_new > num_generations:
        names = ", ".join(t for t, s in tasks.items() if 0 < s["success_rate"] < 1)
        recs.append({"set": f"grpo.num_generations={g_new}", "why": (
            f"at G={num_generations} a group of {names} is expected to hold both a success "
            f"and a failure {100 * spread_share(helped, num_generations):.0f}% of the time "
            f"(success rate {100 * overall['success_rate']:.0f}% overall); G={g_new} brings "
            f"that to >= {100 * SPREAD_TARGET:.0f}% (more rows per step: rollout time grows "
            "with G)")})
    truncated = overall["truncated"]
    if max_new_tokens and truncated is not None and truncated >= TRUNCATION_HIGH:
        recs.append({"set": f"sampling.max_new_tokens={2 * max_new_tokens}", "why": (
            f"{100 * truncated:.0f}% of completions were cut at max_new_tokens="
            f"{max_new_tokens}: their rewards judge unfinished answers (or keep the length and "
            "set grpo.mask_truncated=true or rewards.overlong_buffer)")})
    if zero < 1 and useful < target_groups:
        per_prompt = min(1.0, (1 - zero) * rounds)  # useful groups per prompt of a step
        p_new = math.ceil(target_groups / per_prompt - 1e-9)
        if p_new > prompts_per_step:
            rounds_note = f" x up to {rounds} rounds" if rounds > 1 else ""
            recs.append({"set": f"data.prompts_per_step={p_new}", "why": (
                f"about {useful:.1f} groups per step carry a gradient (prompts_per_step "
                f"{prompts_per_step} x {100 * (1 - zero):.0f}% with spread{rounds_note}); "
                f"{p_new} keeps >= {target_groups} (optim.micro_batch_size must divide the "
                "step's rows)")})

    spread_groups = sum(_spread(grp.rewards) for grp in groups)
    if spread_groups == 0:
        lows = overall["zero_spread_none_solved"]
        state = ("none solved" if lows == len(groups) else "all solved"
                 if overall["zero_spread_all_solved"] == len(groups)
                 else "each all solved or none solved")
        verdict = (f"will not learn: none of the {len(groups)} groups has reward spread "
                   f"({state}), so every advantage is 0 and no step changes the adapter")
    else:
        verdict = (f"will learn: {spread_groups} of {len(groups)} groups "
                   f"({100 * spread_groups / len(groups):.0f}%) have reward spread, about "
                   f"{useful:.1f} useful groups per step")
    return {"overall": overall, "tasks": tasks, "recommendations": recs, "verdict": verdict}


def eta(rollout_s: float, reward_s: float, reference_s: float | None, update_s: float | None,
        steps_left: int, max_staleness: int, rounds: float = 1.0) -> dict:
    """Seconds per step and to the end: the rollout (times `rounds` with dynamic sampling's
    extra rounds), the reward scoring the device waits for (all of it with max_staleness 0;
    with 1, what the next rollout and reference pass do not hide), the reference pass and the
    update. Without the update's time (None) the step is not timed: step_s and eta_s None."""
    if update_s is None:
        return {"rollout_s": rollout_s * rounds, "reward_wait_s": None, "reference_s": None,
                "update_s": None, "step_s": None, "steps_left": steps_left, "eta_s": None}
    reference_s = reference_s or 0.0
    wait = reward_s if max_staleness == 0 else max(0.0, reward_s - rollout_s - reference_s)
    step = rollout_s * rounds + wait * rounds + reference_s + update_s
    return {"rollout_s": rollout_s * rounds, "reward_wait_s": wait * rounds,
            "reference_s": reference_s, "update_s": update_s, "step_s": step,
            "steps_left": steps_left, "eta_s": step * steps_left}


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_report(doc: Mapping) -> str:
    """The pilot's result as plain-text tables (the figures, timing, recommendations, verdict)."""
    lines = [(f"pilot: {doc['prompts']} prompts x G={doc['num_generations']} of "
              f"{doc['model']} ({doc['adapter']}); sampling T="
              f"{doc['sampling']['temperature']}, max_new_tokens "
              f"{doc['sampling']['max_new_tokens']}"), "",
             ("| scope | groups | reward mean | std in group | zero spread (none / all solved) "
              "| success | spread at G | needed G | length mean / max | truncated |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    # the overall row where there are several tasks (as `jaxrl eval`'s table)
    scopes = ([("all", doc["overall"])] if len(doc["tasks"]) > 1 else []) + list(
        doc["tasks"].items())
    for name, s in scopes:
        zero = (f"{_pct(s['zero_spread'])} ({s['zero_spread_none_solved']} / "
                f"{s['zero_spread_all_solved']})")
        length = ("-" if s["length_mean"] is None
                  else f"{s['length_mean']:.0f} / {s['length_max']}")
        lines.append(f"| {name} | {s['groups']} | {_num(s['reward_mean'])} | "
                     f"{_num(s['reward_std'])} | {zero} | {_pct(s['success_rate'])} | "
                     f"{_pct(s['spread_at_G'])} | {s['needed_G'] or '-'} | {length} | "
                     f"{_pct(s['truncated'])} |")
    for name, s in scopes:
        if s["functions"]:
            means = ", ".join(f"{k} {_num(v)}" for k, v in s["functions"].items())
            lines.append(f"{name}: per-function means {means}")
    lines.append(f"useful groups per step: {doc['overall']['useful_groups_per_step']:.1f} of "
                 f"data.prompts_per_step {doc['prompts_per_step']}")
    t = doc["timing"]
    lines += ["", ("| rollout (s) | reward wait (s) | reference (s) | update (s) | step (s) | "
                   "steps left | ETA |"), "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
              (f"| {_num(t['rollout_s'], 2)} | {_num(t['reward_wait_s'], 2)} | "
               f"{_num(t['reference_s'], 2)} | {_num(t['update_s'], 2)} | "
               f"{_num(t['step_s'], 2)} | {t['steps_left']} | {_duration(t['eta_s'])} |"),
              f"rollout: {t['rollout_basis']}; reference and update: {t['step_basis']}"]
    lines.append("")
    if doc["recommendations"]:
        lines.append("recommendations:")
        for r in doc["recommendations"]:
            head = r.get("set") or f"task {r['task']} ({r['direction']})"
            lines.append(f"- {head}: {r['why']}")
    else:
        lines.append("recommendations: none")
    lines.append(doc["verdict"])
    return "\n".join(lines)


# ---- the run: sample, score, time (imports jax, the loader and the data pipeline) ----


def _adapter(cfg, model_dir, log):
    """(lora or None, checkpoint step or 0, description): the adapter `checkpoint.resume` would
    continue from (read only: nothing in the run directory changes), else None (the base)."""
    from jaxrl.checkpoint import (
        CHECKPOINTS,
        base_identity,
        checkpoint_steps,
        load_run_lora,
    )

    resume = cfg.checkpoint.resume
    if resume == "never":
        return None, 0, "base model (checkpoint.resume=never)"
    step = None
    if resume == "auto":
        run_dir = Path(cfg.run.output_dir)
    else:
        path = Path(resume).expanduser()
        if checkpoint_steps(path / CHECKPOINTS):
            run_dir = path
        elif path.name.isdigit() and int(path.name) in checkpoint_steps(path.parent):
            run_dir, step = path.parent.parent, int(path.name)
        else:
            run_dir = path.parent
    if not checkpoint_steps(run_dir / CHECKPOINTS):
        return None, 0, f"base model (no checkpoint in {run_dir})"
    lora, _, base, step = load_run_lora(run_dir, step, log)
    if base["sha256"] != base_identity(model_dir, cfg.model.path)["sha256"]:
        return None, 0, (f"base model (the checkpoint in {run_dir} belongs to another base, "
                         f"{base['path']}: adapter skipped)")
    return lora, step, f"adapter of {run_dir / CHECKPOINTS / str(step)} (step {step})"


def _median(values):
    import statistics

    return statistics.median(values) if values else None


def run_pilot(cfg, prompts: int = 32, step_timing: bool = True,
              target_groups: int = TARGET_GROUPS, log=lambda message: None) -> dict:
    """The pilot of `cfg` on `prompts` training prompts (module docstring): the document
    `format_report` prints and `jaxrl pilot --out` writes."""
    import time

    import jax

    from jaxrl import distributed
    from jaxrl.backends.numerics import numerics_of
    from jaxrl.config import UsageError
    from jaxrl.data.pipeline import build_pool, train_iterator
    from jaxrl.data.prompts import prompt_fits
    from jaxrl.hf.loader import load_model
    from jaxrl.hf.peft_io import start_lora
    from jaxrl.hf.tokenizer import (
        chat_prompt_text,
        detokenizer,
        eos_token_ids,
        text_ids,
    )
    from jaxrl.planner import dense_fit
    from jaxrl.rewards.base import Sample
    from jaxrl.rewards.overlong import with_overlong_penalty
    from jaxrl.rewards.pool import RewardPool
    from jaxrl.sampling.sampler import sample

    if prompts < 1:
        raise UsageError(f"--prompts must be at least 1; got {prompts}")
    if cfg.judge.local:
        raise UsageError("jaxrl pilot does not run a judge.local judge (it shares the "
                         "training engine); pilot with a judge served at judge.base_url")
    rules = distributed.session_rules(cfg.mesh)
    numerics = numerics_of(rules)
    model = load_model(cfg.model.path, dtype=cfg.model.dtype, quant=cfg.quant,
                       numerics=numerics, rules=rules, log=log,
                       dense_fit=lambda spec: dense_fit(cfg, spec, rules))
    tokenizer, spec, params = model.tokenizer, model.spec, model.params
    eos_ids, detokenize = eos_token_ids(tokenizer, model.path), detokenizer(tokenizer)
    key = jax.random.PRNGKey(cfg.run.seed)
    fresh = start_lora(cfg.lora, spec, jax.random.fold_in(key, 1 << 20))
    lora, start_step, adapter = _adapter(cfg, model.path, log)
    log(f"pilot: sampling with the {adapter}")
    lora = fresh if lora is None else lora
    chat = None
    if cfg.data.env:
        from jaxrl.rl.episodes import Chat, play

        chat = Chat(tokenizer, eos_ids)
    pool = build_pool(cfg.data, keep=prompt_fits(tokenizer, cfg.data.max_prompt_tokens))
    data = train_iterator(pool, cfg.data)
    g, per_step = cfg.grpo.num_generations, cfg.data.prompts_per_step
    chunk = min(per_step, prompts)  # a step's prompts per sampling call, as training samples
    groups, rollout_s, reward_s, prompt_tokens = [], [], [], 0
    with RewardPool(cfg) as rewards:
        for i in range(math.ceil(prompts / chunk)):
            batch = next(data)[:min(chunk, prompts - i * chunk)]
            records = [r for r in batch for _ in range(g)]
            start = time.perf_counter()
            if cfg.data.env:
                texts, out, records = play(params, spec, records, jax.random.fold_in(key, i),
                                           cfg, chat, lora=lora, shardings=rules)
            else:
                texts = [chat_prompt_text(tokenizer, r["messages"]) + cfg.data.response_prefix
                         for r in records]
                ids = [text_ids(tokenizer, t) for t in texts]
                prompt_tokens = max(prompt_tokens, *map(len, ids))
                out = sample(params, spec, ids, jax.random.fold_in(key, i), cfg.sampling,
                             lora=lora, eos_ids=eos_ids, detokenize=detokenize,
                             shardings=rules)
            seconds = time.perf_counter() - start
            if len(batch) == chunk:
                rollout_s.append(seconds)
            start = time.perf_counter()
            scored = rewards.score([Sample(prompt=p, completion=text, record=r)
                                    for p, text, r in zip(texts, out.texts, records)])
            reward_s.append(time.perf_counter() - start)
            lengths = out.loss_mask.sum(axis=1)
            if cfg.rewards.overlong_buffer:
                scored = with_overlong_penalty(scored, out.mask.sum(axis=1),
                                               cfg.sampling.max_new_tokens,
                                               cfg.rewards.overlong_buffer,
                                               cfg.rewards.overlong_penalty)
            for j in range(len(batch)):
                rows = range(j * g, (j + 1) * g)
                groups.append(Group(
                    task=str(batch[j].get("task", "all")),
                    rewards=[float(scored.rewards[k]) for k in rows],
                    lengths=[int(lengths[k]) for k in rows],
                    truncated=[out.finish_reasons[k] == "length" for k in rows],
                    functions={name: [float(rs[k].value) for k in rows]
                               for name, rs in scored.results.items()}))
            log(f"pilot: {len(groups)} of {prompts} prompts sampled and scored")
    doc = analyze(groups, num_generations=g, prompts_per_step=per_step,
                  max_new_tokens=cfg.sampling.max_new_tokens,
                  dynamic_sampling=cfg.grpo.dynamic_sampling,
                  max_sampling_rounds=cfg.grpo.max_sampling_rounds,
                  target_groups=target_groups)
    # a step's rollout: the sampling calls after the first (which compiles), each of `chunk`
    # prompts, scaled to data.prompts_per_step prompts
    warm = rollout_s[1:]
    scale = per_step / chunk
    rollout = (_median(warm) if warm else rollout_s[0] if rollout_s else 0.0) * scale
    rollout_basis = (f"median of {len(warm)} sampling call{'s' * (len(warm) > 1)} (after "
                     f"the first, which compiles) of {chunk} prompts x G={g}"
                     if warm else f"one sampling call of {chunk} prompts x G={g}, "
                     "compilation included (an upper bound)")
    if scale != 1:
        rollout_basis += f", scaled x{scale:g} to data.prompts_per_step={per_step}"
    reward = (_median(reward_s[1:]) if len(reward_s) > 1 else reward_s[0]) * scale
    zero = doc["overall"]["zero_spread"]
    rounds = 1.0
    if cfg.grpo.dynamic_sampling:
        rounds = float(cfg.grpo.max_sampling_rounds if zero >= 1
                       else min(cfg.grpo.max_sampling_rounds, math.ceil(1 / (1 - zero))))
    reference = update = None
    step_basis = "not timed (--no-step-timing)"
    if step_timing:
        if cfg.data.env:
            step_basis = "not timed (data.env: `jaxrl bench step` times single-turn steps)"
        else:
            from jaxrl.bench.runs import grpo_step
            from jaxrl.bench.subject import Subject

            log("pilot: timing the reference pass and the update (jaxrl bench step)")
            subject = Subject(cfg, spec, params, fresh, rules, numerics,
                              f"checkpoint {model.path}")
            step = grpo_step(subject, 1, prompt_tokens or cfg.data.max_prompt_tokens)
            reference, update = step["median_s"]["reference"], step["median_s"]["update"]
            step_basis = (f"one GRPO step after a compiling one ({step['rows']} rows, "
                          f"{step['prompt_tokens']} prompt + {step['new_tokens']} new tokens, "
                          "as jaxrl bench step)")
    timing = eta(rollout, reward, reference, update, max(0, cfg.run.steps - start_step),
                 cfg.rewards.max_staleness, rounds)
    timing.update(rollout_basis=rollout_basis, step_basis=step_basis, rounds=rounds,
                  rollout_calls_s=rollout_s, reward_calls_s=reward_s,
                  device=jax.devices()[0].device_kind, start_step=start_step)
    return {"model": cfg.model.path, "adapter": adapter, "prompts": len(groups),
            "num_generations": g, "prompts_per_step": per_step,
            "sampling": {"temperature": cfg.sampling.temperature,
                         "max_new_tokens": cfg.sampling.max_new_tokens,
                         "stop": list(cfg.sampling.stop)},
            "rewards": [{"name": e.name, "weight": e.weight} for e in cfg.rewards.functions],
            **doc, "timing": timing}

"""`jaxrl eval` with `data.env`: one greedy episode per evaluation record, scored by its
environment (the `episode` reward with the run's `env.*` terms), overall and per task:

    n, correct, accuracy     the environment's outcome: calculator `correct`, diagnosis `match`
    accuracy_ci95_low/high   its Wilson score interval at 95%
    valid_call_frac          tool calls that were valid / all calls (unreadable markup, unknown
                             tools and bad arguments count as invalid), with its Wilson interval
    calls_mean, turns_mean   tool calls and replies per episode
    concluded_frac           episodes that ended in a conclusion (not the turn or token limit)
    truncated_frac           episodes cut at env.max_tokens
    reward_mean              the episode reward, process terms included
    relevant                 (diagnosis) the share naming the fault category or cause
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from jaxrl.config import Config
from jaxrl.envs import environment
from jaxrl.eval.metrics import accuracy, wilson
from jaxrl.rewards.base import sample_from_record
from jaxrl.rewards.episode import EpisodeReward


def play_records(model, records: Sequence[Mapping], cfg: Config, use_adapter: bool,
                 batch_size: int, advance: Callable[[], None]) -> list[dict]:
    """Each record with its greedy episode: `completion` (the transcript), `finish_reason` and
    `episode`. A short last batch is padded with repeats, so every batch has one size."""
    import jax

    from jaxrl.rl.episodes import Chat, play  # imports jax: scoring saved episodes needs neither

    cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, temperature=0.0))
    chat = Chat(model.tokenizer, model.eos_ids)
    out: list[dict] = []
    for start in range(0, len(records), batch_size):
        rows = list(records[start:start + batch_size])
        n = len(rows)
        rows += [rows[-1]] * (min(batch_size, len(records)) - n)
        _, sampled, played = play(model.params, model.spec, rows,
                                  jax.random.PRNGKey(cfg.run.seed), cfg, chat,
                                  lora=model.lora if use_adapter else None)
        for row in range(n):
            out.append({**played[row], "completion": sampled.texts[row],
                        "finish_reason": sampled.finish_reasons[row]})
            advance()
    return out


def _part(rows: list[tuple[Mapping, Mapping, float]], outcome: str) -> dict[str, float]:
    """Metrics of (episode, components, reward) rows."""
    episodes = [e for e, _, _ in rows]
    calls = sum(len(e["calls"]) for e in episodes)
    valid = sum(sum(bool(c["valid"]) for c in e["calls"]) for e in episodes)
    low, high = wilson(valid, calls)
    n = len(rows)
    metrics = {**accuracy([c[outcome] for _, c, _ in rows]),
               "valid_call_frac": valid / calls if calls else float("nan"),
               "valid_call_frac_ci95_low": low, "valid_call_frac_ci95_high": high,
               "calls_mean": calls / n, "turns_mean": sum(e["turns"] for e in episodes) / n,
               "concluded_frac": sum(e["finish"] == "answer" for e in episodes) / n,
               "truncated_frac": sum(e["finish"] == "token_budget" for e in episodes) / n,
               "reward_mean": sum(r for _, _, r in rows) / n}
    if all("relevant" in c for _, c, _ in rows):
        metrics["relevant"] = sum(c["relevant"] for _, c, _ in rows) / n
    return metrics


def evaluate_episodes(cfg: Config, records: Sequence[Mapping]) -> dict:
    """{"all", "tasks", "judge_failures", "correctness"} as `jaxrl.eval.metrics.evaluate`
    gives them, for records that carry an `episode`."""
    results = EpisodeReward(cfg).score([sample_from_record(r) for r in records])
    outcome = environment(records[0]["episode"]["env"]).outcome
    rows = [(r["episode"], dict(res.components), res.value) for r, res in zip(records, results)]
    tasks = sorted({str(r.get("task", "unknown")) for r in records})
    by_task = {t: _part([row for row, r in zip(rows, records) if r.get("task") == t], outcome)
               for t in tasks}
    return {"all": _part(rows, outcome) if len(tasks) > 1 else by_task[tasks[0]],
            "tasks": by_task, "judge_failures": {},
            "correctness": [c[outcome] for _, c, _ in rows]}

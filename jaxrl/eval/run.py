"""`jaxrl eval`: completions at temperature 0 on the evaluation records (or read from a file),
then the metrics of jaxrl/eval/metrics.py per variant, and their difference when there are two.
With `data.env` each record is played as one greedy episode of that environment and scored by
it (jaxrl/eval/episodes.py).

Records: the validation split of `data.tasks` (jaxrl/data/pipeline.py), or `data.eval_file`.
Prompts are rendered as in training (chat template, then `data.response_prefix`) and decoded
greedily with `sampling.max_new_tokens` and `sampling.stop`; a saved completion starts with the
response prefix, so it reads as the model's whole reply. Variants: "base" (the model alone) and
"adapter"; `compare` runs both from one load of the model. Saved outputs are JSONL lines of a
task record plus `completion` and optionally `variant` (default "outputs").

Scoring saved outputs runs no model, so what runs one (jax, the loader, the data pipeline with
grain, the episode player) is imported inside the functions that need it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxrl.config import Config, ConfigError
from jaxrl.data.prompts import prompt_fits
from jaxrl.data.records import read_jsonl
from jaxrl.eval.episodes import evaluate_episodes, play_records
from jaxrl.eval.metrics import difference, evaluate
from jaxrl.rewards.judge import Judge


@contextmanager
def progress_bar() -> Iterator[Callable[[str, int], Callable[[], None]]]:
    """`phase(label, total)` adds a bar and returns its advance-by-one; lines on stderr when
    stderr is not a terminal."""
    bar = Progress(TextColumn("{task.description}"), MofNCompleteColumn(), BarColumn(),
                   TimeElapsedColumn(), disable=not sys.stderr.isatty())

    def phase(label: str, total: int) -> Callable[[], None]:
        task = bar.add_task(label, total=total)
        if bar.disable:
            print(f"jaxrl eval: {label} ({total})", file=sys.stderr)
        return lambda: bar.advance(task)

    with bar:
        yield phase


def eval_records(cfg: Config, tokenizer) -> list[dict]:
    """The records evaluated on: data.eval_file, else the validation split of data.tasks (with
    prompts that fit data.max_prompt_tokens)."""
    from jaxrl.data.pipeline import build_pool  # grain and jax: not for data.eval_file

    if cfg.data.eval_file:
        return read_jsonl(cfg.data.eval_file)
    return build_pool(cfg.data, keep=prompt_fits(tokenizer, cfg.data.max_prompt_tokens)).validation


def generate(model, records: Sequence[Mapping], cfg: Config, use_adapter: bool,
             batch_size: int, advance: Callable[[], None]) -> list[dict]:
    """Each record with its greedy `completion` and `finish_reason`. Prompts of similar length
    share a batch; a short last batch is padded with repeats, so every batch has one size."""
    import jax

    sampling = dataclasses.replace(cfg.sampling, temperature=0.0)
    prefix = cfg.data.response_prefix
    ids = [model.ids(model.chat_text(r["messages"]) + prefix) for r in records]
    order = sorted(range(len(records)), key=lambda i: len(ids[i]))
    out: list[dict] = [{} for _ in records]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        rows = [ids[i] for i in chunk]
        rows += [rows[-1]] * (min(batch_size, len(order)) - len(rows))
        sampled = model.sample(rows, jax.random.PRNGKey(cfg.run.seed), sampling,
                               use_adapter=use_adapter)
        for row, i in enumerate(chunk):
            out[i] = {**records[i], "completion": prefix + sampled.texts[row],
                      "finish_reason": sampled.finish_reasons[row]}
            advance()
    return out


def _judging(cfg: Config) -> bool:
    return bool(cfg.judge.base_url and cfg.judge.model)


def score_variants(cfg: Config, variants: Mapping[str, list[dict]], phase) -> dict:
    """The results document: each variant's metrics, the second minus the first when there
    are two, and whether the CEDAR metrics ran."""
    results = {}
    for name, records in variants.items():
        if cfg.data.env:  # episodes, scored by their environment
            results[name] = evaluate_episodes(cfg, records)
            continue
        judge = Judge(cfg.judge, cfg.run.output_dir) if _judging(cfg) else None
        advance = phase(f"judging {name}", len(records)) if judge else (lambda: None)
        results[name] = evaluate(cfg, records, judge, advance)
    doc: dict = {"variants": {n: {k: v for k, v in r.items() if k != "correctness"}
                              for n, r in results.items()},
                 "cedar": f"judged by {cfg.judge.model}" if _judging(cfg) and not cfg.data.env
                 else "not run: set judge.base_url and judge.model (single-turn tasks)"}
    names = list(results)
    if len(names) == 2:
        doc["difference"] = {"of": f"{names[1]} - {names[0]}",
                             **difference(results[names[0]], results[names[1]])}
    for name, records in variants.items():
        for record, value in zip(records, results[name]["correctness"]):
            record["correctness"] = value
    return doc


def run_model(cfg: Config, adapter: str | None, compare: bool, batch_size: int,
              phase) -> tuple[dict, dict[str, list[dict]]]:
    """Generate with the model (base, adapter or both) and score: (results, outputs)."""
    from jaxrl.hf.pretrained import load_pretrained

    model = load_pretrained(cfg.model.path, adapter, dtype=cfg.model.dtype, quant=cfg.quant)
    records = eval_records(cfg, model.tokenizer)
    if not records:
        raise ConfigError("no evaluation records: data.validation_fraction leaves none of "
                          f"data.tasks {list(cfg.data.tasks)}; raise it or set data.eval_file")
    names = (["base", "adapter"] if compare else ["adapter"]) if adapter else ["base"]
    run = play_records if cfg.data.env else generate
    variants = {}
    for name in names:
        advance = phase(f"{'playing' if cfg.data.env else 'generating'} {name}", len(records))
        variants[name] = [{**r, "variant": name}
                          for r in run(model, records, cfg, name == "adapter", batch_size,
                                       advance)]
    doc = score_variants(cfg, variants, phase)
    doc.update(model=cfg.model.path, adapter=adapter, records=len(records),
               data={"tasks": list(cfg.data.tasks), "eval_file": cfg.data.eval_file or None,
                     "seed": cfg.data.seed},
               sampling={"temperature": 0.0, "max_new_tokens": cfg.sampling.max_new_tokens,
                         "stop": list(cfg.sampling.stop)})
    if cfg.data.env:
        doc["env"] = {"name": cfg.data.env, **dataclasses.asdict(cfg.env)}
    return doc, variants


def read_outputs(path: str) -> dict[str, list[dict]]:
    """Saved outputs grouped by `variant` in order of first appearance."""
    variants: dict[str, list[dict]] = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(f"--outputs {path!r} line {number} is not JSON: {error}") from None
        if not isinstance(record, dict) or not isinstance(record.get("completion"), str):
            raise ValueError(f"--outputs {path!r} line {number} must be a JSON object with a "
                             "string `completion` field")
        variants.setdefault(str(record.get("variant", "outputs")), []).append(record)
    if not variants:
        raise ValueError(f"--outputs {path!r} holds no records")
    return variants


def write(doc: dict, variants: Mapping[str, list[dict]], out: Path) -> Path:
    """results JSON at `out`, the completions beside it (NAME_outputs.jsonl); returns the
    latter's path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite(doc), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    outputs = out.with_name(out.stem + "_outputs.jsonl")
    with outputs.open("w", encoding="utf-8") as f:
        for records in variants.values():
            for record in records:
                f.write(json.dumps(record, default=str) + "\n")
    return outputs


def finite(value):
    """value with every nan (a metric with nothing to count) as None, which JSON can hold."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return [finite(v) for v in value] if isinstance(value, list) else value

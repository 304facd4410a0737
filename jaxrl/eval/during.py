"""Held-out evaluation inside `jaxrl train` and `jaxrl sft` (`eval.every`).

Every `eval.every` steps, and after the last step, the run's current adapter decodes the
evaluation records greedily and is scored as `jaxrl eval` scores it (jaxrl/eval/run.py: the same
records, rendering, batches of `eval.batch_size` prompts of similar length, and metrics:
accuracy per task with its Wilson interval, Spring's metrics for formal tasks, an environment's
for episodes; the CEDAR judge metrics are left to `jaxrl eval`), on the run's own weights, so a
row equals `jaxrl eval --adapter` of the adapter exported at that step. Records:
`data.eval_file` or the validation split of `data.tasks`, the first `eval.records` of them (0:
all). Each evaluation writes `eval/step_N.json` and `eval/step_N_outputs.jsonl` in the run
directory (the files `jaxrl eval --out` writes) and returns its metrics for the step's row in
metrics.jsonl: eval/accuracy, eval/accuracy_ci95_low / _high, eval/n, eval/<task>/accuracy ...
With `checkpoint.keep_best: METRIC` (an eval/ metric; higher is better unless its name ends in
loss) the adapter of the best evaluation so far is exported to `adapter-best/` (with
`best.json`: step, metric, value), and a resumed run reads that back, so the best is the run's.
One process only (the records are decoded whole by that process).
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxrl.config import Config, ConfigError
from jaxrl.eval.run import eval_records, generate, write

BEST_DIR = "adapter-best"


class RunModel:
    """The model interface `jaxrl.eval.run.generate` and `play_records` take, over a run's
    loaded weights and an adapter that `lora()` gives at the moment of the call."""

    def __init__(self, params, spec, tokenizer, eos_ids: Sequence[int], lora: Callable,
                 rules=None):
        from jaxrl.hf.tokenizer import detokenizer

        self.params, self.spec, self.tokenizer = params, spec, tokenizer
        self.eos_ids, self._lora, self.rules = tuple(eos_ids), lora, rules
        self._detokenize = detokenizer(tokenizer)

    @property
    def lora(self):
        return self._lora()

    def chat_text(self, messages) -> str:
        from jaxrl.hf.tokenizer import chat_prompt_text

        return chat_prompt_text(self.tokenizer, messages)

    def ids(self, text: str) -> list[int]:
        from jaxrl.hf.tokenizer import text_ids

        return text_ids(self.tokenizer, text)

    def sample(self, prompts, key, cfg, use_adapter: bool = True):
        from jaxrl.sampling.sampler import sample

        return sample(self.params, self.spec, prompts, key, cfg,
                      lora=self.lora if use_adapter else None, eos_ids=self.eos_ids,
                      detokenize=self._detokenize, shardings=self.rules)


def higher_is_better(metric: str) -> bool:
    return not metric.endswith("loss")


def flat_metrics(result: dict) -> dict[str, float]:
    """eval/<metric> of the whole and eval/<task>/<metric> of each task (numbers only)."""
    out = {}
    for key, value in result["all"].items():
        if isinstance(value, (int, float)):
            out[f"eval/{key}"] = float(value)
    if len(result["tasks"]) > 1:
        for task, metrics in result["tasks"].items():
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    out[f"eval/{task}/{key}"] = float(value)
    return out


class Evaluator:
    """Evaluates a run's adapter at the steps `eval.every` names (module docstring)."""

    def __init__(self, cfg: Config, model: RunModel, run_dir: Path,
                 export_best: Callable[[Path], None] | None = None,
                 log: Callable[[str], None] = print):
        import jax

        if jax.process_count() > 1:
            raise ConfigError("eval.every evaluates on one process; with several, set "
                              "eval.every=0 and run `jaxrl eval --adapter` on the exported "
                              "adapter")
        self.cfg, self.model, self.run_dir, self.log = cfg, model, Path(run_dir), log
        records = eval_records(cfg, model.tokenizer)
        self.records = records[:cfg.eval.records] if cfg.eval.records else records
        if not self.records:
            raise ConfigError("eval.every needs evaluation records: data.validation_fraction "
                              f"leaves none of data.tasks {list(cfg.data.tasks)}; raise it or "
                              "set data.eval_file")
        self.metric = cfg.checkpoint.keep_best
        self._export_best = export_best
        self.best = self._read_best()

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return bool(every) and (step % every == 0 or step == self.cfg.run.steps)

    def __call__(self, step: int) -> dict[str, float]:
        """Evaluate the adapter as it is now; the step's eval/ metrics and time/eval."""
        start = time.perf_counter()
        if self.cfg.data.env:
            from jaxrl.eval.episodes import evaluate_episodes, play_records

            records = play_records(self.model, self.records, self.cfg, True,
                                   self.cfg.eval.batch_size, lambda: None)
            result = evaluate_episodes(self.cfg, records)
        else:
            from jaxrl.eval.metrics import evaluate

            records = generate(self.model, self.records, self.cfg, True,
                               self.cfg.eval.batch_size, lambda: None)
            result = evaluate(self.cfg, records)
        metrics = flat_metrics(result)
        doc = {"step": step, "records": len(records),
               "variants": {"adapter": {k: v for k, v in result.items() if k != "correctness"}}}
        for record, value in zip(records, result["correctness"]):
            record["correctness"], record["variant"] = value, "adapter"
        write(doc, {"adapter": records}, self.run_dir / "eval" / f"step_{step}.json")
        self._keep_best(step, metrics)
        metrics["time/eval"] = time.perf_counter() - start
        return metrics

    def _keep_best(self, step: int, metrics: dict[str, float]) -> None:
        if not self.metric:
            return
        if self.metric not in metrics:
            raise ConfigError(f"checkpoint.keep_best names {self.metric!r}, which the "
                              f"evaluation does not report; it reports {sorted(metrics)}")
        value = metrics[self.metric]
        if math.isnan(value):
            return
        better = (self.best is None or (value > self.best["value"]
                                        if higher_is_better(self.metric)
                                        else value < self.best["value"]))
        if not better:
            return
        target = self.run_dir / BEST_DIR
        if self._export_best is not None:
            self._export_best(target)
        self.best = {"step": step, "metric": self.metric, "value": value}
        target.mkdir(parents=True, exist_ok=True)
        (target / "best.json").write_text(json.dumps(self.best) + "\n", encoding="utf-8")
        self.log(f"eval: {self.metric} {value:.4f} at step {step}, the best so far: "
                 f"{BEST_DIR}/")

    def _read_best(self) -> dict | None:
        path = self.run_dir / BEST_DIR / "best.json"
        if not self.metric or not path.is_file():
            return None
        best = json.loads(path.read_text(encoding="utf-8"))
        return best if best.get("metric") == self.metric else None

"""Seconds per GRPO step: jaxrl against TRL's GRPOTrainer (torch CPU), same model and setup,
measured in one run with the systems interleaved step by step.

Setup: SmolLM2-135M-Instruct, LoRA r 16 (alpha 32) on all seven projections,
4 prompts x G = 4 completions, exactly N new tokens (EOS ignored: jaxrl `eos_ids=()`, TRL
`min_new_tokens=N`), temperature 1, beta 0.04 (a reference pass every step), mu = 1, no vLLM. The
prompts are generated arithmetic records under a short system line (58 tokens; jaxrl pads them to
its 64-token bucket). The reward is trivial (distinct characters of the completion) so that the
groups have spread; reward time is negligible for both.

A jaxrl step is what `jaxrl.rl.loop` runs, timed per phase with every result fetched: `sample`
-> reference log-probs of the frozen base (as `Session.reference_logprobs`) -> advantages -> the
compiled train step. A TRL step runs from the trainer's `on_step_begin` to its `on_step_end`; its
sampling phase is `_generate` and its reference phase the rest of `_generate_and_score_completions`
(timed by a subclass). TRL runs in fp32 (its bf16 autocast is slower on CPU) with GRPOConfig's
default gradient checkpointing, as jaxrl rematerializes each layer.

jaxrl compiles in one step before TRL starts; after every TRL step a callback runs one step of
each jaxrl configuration, so all of them see the same machine load. TRL's first (warm-up) step and
the jaxrl steps beside it are not timed. On a shared machine a burst of other work can double one
step, so the table gives the fastest timed step (with its phases) and the median of each.

    python tools/bench_grpo_step.py                      # the docs/benchmarks.md table
    python tools/bench_grpo_step.py --dtypes bfloat16,float32 --new-tokens 64 --steps 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

# Idle OpenMP threads sleep instead of spinning: on a shared machine (more runnable threads than
# cores) spinning made torch 2.5x (forward + backward) to 7x (generate) slower on 2 threads here,
# which would inflate TRL's time; XLA's thread pool is not affected. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SYSTEM = "You are a careful reasoner."
PROMPTS, GROUP, RANK, ALPHA, BETA, LR = 4, 4, 16, 32.0, 0.04, 1e-5
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="model PATH (default: `default`)")
    parser.add_argument("--new-tokens", default="64,128", help="comma-separated N")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--dtypes", default="bfloat16",
                        help="jaxrl base weight dtypes, comma-separated (e.g. bfloat16,float32)")
    parser.add_argument("--trl-precision", default="fp32", choices=("fp32", "bf16"),
                        help="TRL: fp32, or bf16 autocast (GRPOConfig's default, slower on CPU)")
    return parser.parse_args()


def distinct_chars(completions, **_) -> list[float]:
    return [float(len(set(c))) for c in completions]


def prompt_texts(tokenizer) -> list[str]:
    from jaxrl.data.generators import generate
    from jaxrl.hf.tokenizer import chat_prompt_text

    records = generate("arithmetic", PROMPTS)
    return [chat_prompt_text(tokenizer, [{"role": "system", "content": SYSTEM},
                                         r["messages"][-1]]) + "<think>" for r in records]


class JaxrlRunner:
    """One jaxrl configuration (weight dtype, N): params, adapter, optimizer state, programs."""

    def __init__(self, spec, params, tokenizer, prompts: list[str], new_tokens: int):
        import jax

        from jaxrl.config import GrpoConfig, OptimConfig, SamplingConfig
        from jaxrl.hf.tokenizer import detokenizer, text_ids
        from jaxrl.lora.lora import init_lora
        from jaxrl.rl.logprobs import token_logprobs
        from jaxrl.rl.train_step import (StepOptions, compile_train_step, init_train_state,
                                         make_optimizer)

        self.spec, self.params, self.detokenize = spec, params, detokenizer(tokenizer)
        self.rows = [text_ids(tokenizer, p) for p in prompts for _ in range(GROUP)]
        self.sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
        self.key = jax.random.PRNGKey(0)
        lora = init_lora(spec, jax.random.PRNGKey(1), rank=RANK, alpha=ALPHA, targets=TARGETS)
        optimizer, _ = make_optimizer(OptimConfig(lr=LR), 100)
        self.state = init_train_state(lora, optimizer)
        grpo = GrpoConfig(num_generations=GROUP, beta=BETA)
        self.train_step = compile_train_step(spec, optimizer, StepOptions(
            grpo=grpo, temperature=1.0, max_new_tokens=new_tokens))
        self.reference = jax.jit(lambda params, tokens, mask, positions, width: token_logprobs(
            params, spec, tokens, positions, mask, None, start=tokens.shape[1] - width,
            temperature=1.0, remat=False)[0], static_argnums=4)
        self.times: list[dict[str, float]] = []

    def step(self, i: int) -> None:
        import jax

        from jaxrl.rl.advantages import compute_advantages
        from jaxrl.rl.loop import make_batch
        from jaxrl.rl.rollout import Rollout
        from jaxrl.sampling.sampler import sample

        start = time.perf_counter()
        out = sample(self.params, self.spec, self.rows, jax.random.fold_in(self.key, i),
                     self.sampling, lora=self.state.lora, eos_ids=(), detokenize=self.detokenize)
        assert out.mask.all(), "EOS is ignored, so every row decodes every token"
        sampled = time.perf_counter()
        adv = compute_advantages(np.asarray(distinct_chars(out.texts), np.float32), GROUP)
        batch = make_batch(Rollout(i, [], [], out), np.asarray(adv.advantages),
                           np.asarray(adv.keep))
        ref = self.reference(self.params, batch.tokens, batch.attn_mask, batch.positions,
                             out.tokens.shape[1]).block_until_ready()
        referenced = time.perf_counter()
        self.state, metrics = self.train_step(self.state, self.params, batch.replace(ref_logp=ref))
        metrics = jax.device_get(metrics)
        assert np.isfinite(metrics["loss"]), metrics
        end = time.perf_counter()
        self.times.append({"step": end - start, "sample": sampled - start,
                           "reference": referenced - sampled, "update": end - referenced})


def trl_trainer(model_dir, tokenizer, prompts: list[str], new_tokens: int, steps: int,
                precision: str, callback, out_dir: str):
    """GRPOTrainer with the setup above; `.times` collects each step's phases."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class TimedTrainer(GRPOTrainer):
        def _generate(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._generate(*args, **kwargs)
            self.current["sample"] = time.perf_counter() - start
            return result

        def _generate_and_score_completions(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._generate_and_score_completions(*args, **kwargs)
            self.current["rollout"] = time.perf_counter() - start
            return result

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            trainer.current = {"begin": time.perf_counter()}

        def on_step_end(self, args, state, control, **kwargs):
            c = trainer.current
            step = time.perf_counter() - c["begin"]
            trainer.times.append({"step": step, "sample": c["sample"],
                                  "reference": c["rollout"] - c["sample"],
                                  "update": step - c["rollout"]})
            callback(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            trainer.lengths.append(logs.get("completions/mean_length"))

    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        max_completion_length=new_tokens, generation_kwargs={"min_new_tokens": new_tokens},
        temperature=1.0, beta=BETA, learning_rate=LR, use_vllm=False, max_steps=steps,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        bf16=precision == "bf16", disable_tqdm=True, seed=0)
    peft = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS),
                      task_type="CAUSAL_LM")
    dataset = Dataset.from_dict({"prompt": prompts * steps})
    trainer = TimedTrainer(model=str(model_dir), reward_funcs=distinct_chars, args=config,
                           train_dataset=dataset, processing_class=tokenizer, peft_config=peft,
                           callbacks=[StepTimes()])
    trainer.times, trainer.lengths, trainer.current = [], [], {}
    return trainer


def best_and_median(times: list[dict[str, float]]) -> tuple[dict[str, float], float]:
    """The fastest step (with its phases) and the median step time."""
    return min(times, key=lambda t: t["step"]), statistics.median(t["step"] for t in times)


def _cell(phases: dict[str, float]) -> str:
    return (f"{phases['step']:.1f} ({phases['sample']:.1f} + {phases['reference']:.1f} + "
            f"{phases['update']:.1f})")


def run_length(n, args, model_dir, tokenizer, prompts, params) -> list[str]:
    """One table row: TRL and every jaxrl dtype at N new tokens, interleaved."""
    runners = {}
    for dtype, (spec, p) in params.items():
        runners[dtype] = JaxrlRunner(spec, p, tokenizer, prompts, n)
        runners[dtype].step(0)  # compilation
        print(f"  jaxrl {dtype} N={n}: first step (compiles) "
              f"{runners[dtype].times[0]['step']:.1f} s", flush=True)
    loads = []

    def after_trl_step(step: int) -> None:
        loads.append(os.getloadavg()[0])
        for runner in runners.values():
            runner.step(step)
        print(f"  N={n} step {step}: TRL {_cell(trainer.times[-1])}, " + ", ".join(
            f"jaxrl {d} {_cell(r.times[-1])}" for d, r in runners.items()), flush=True)

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = trl_trainer(model_dir, tokenizer, prompts, n, args.steps + 1,
                              args.trl_precision, after_trl_step, out_dir)
        trainer.train()
    assert all(length == n for length in trainer.lengths if length is not None), trainer.lengths
    trl, trl_median = best_and_median(trainer.times[1:])
    cells = [f"{n}", f"{_cell(trl)}, {trl_median:.1f}"]
    for runner in runners.values():
        mine, median = best_and_median(runner.times[2:])
        cells += [f"{_cell(mine)}, {median:.1f}",
                  f"{trl['step'] / mine['step']:.2f}x, {trl_median / median:.2f}x"]
    cells.append(f"{statistics.mean(loads):.1f}")
    return cells


def main() -> None:
    args = _args()
    import jax.numpy as jnp
    import torch

    from jaxrl.hf.default_model import resolve_model_path
    from jaxrl.hf.load import load_params
    from jaxrl.hf.tokenizer import load_tokenizer

    model_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = prompt_texts(tokenizer)
    dtypes = args.dtypes.split(",")
    params = {d: load_params(model_dir, dtype=jnp.dtype(d)) for d in dtypes}
    print(f"model {model_dir.name}, {PROMPTS} prompts x G {GROUP}, prompt "
          f"{len(tokenizer(prompts[0], add_special_tokens=False)['input_ids'])} tokens, TRL "
          f"{args.trl_precision}, torch {torch.__version__} threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    header = ["N", f"TRL {args.trl_precision}"]
    for d in dtypes:
        header += [f"jaxrl {d}", "speed-up"]
    lines = ["| " + " | ".join(header + ["load"]) + " |",
             "| " + " | ".join(["---:"] * (len(header) + 1)) + " |"]
    for n in args.new_tokens.split(","):
        lines.append("| " + " | ".join(run_length(int(n), args, model_dir, tokenizer, prompts,
                                                 params)) + " |")
        print(lines[-1], flush=True)
    print("\nseconds per step: fastest timed step (sampling + reference + update), median step; "
          "speed-up: TRL / jaxrl of the fastest, of the medians; load: 1-minute load average\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

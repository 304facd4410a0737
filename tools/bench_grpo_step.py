"""Seconds per GRPO step: TRL's GRPOTrainer (torch, CPU) against `jaxrl bench step`, each
system in processes of its own with its own defaults, alternating round by round
(tools/peers.py).

Setup: SmolLM2-135M-Instruct, LoRA r 16 (alpha 32) on all seven projections, 4 prompts x G = 4
completions of exactly N new tokens (EOS ignored: `jaxrl bench` ignores it, TRL gets
`min_new_tokens=N`), temperature 1, beta 0.04 (a reference pass every step), one update per
rollout, no vLLM. TRL: arithmetic records under a short system line as chat prompts (58
tokens), a trivial reward (distinct characters), in each of --trl-precision (fp32; bf16, its
default autocast, which ran slower than fp32 on a Zen 3 without AVX512-BF16 and faster on a
Zen 4 with it) and its other defaults (gradient checkpointing on, torch's threads). jaxrl:
`jaxrl bench step` on the quickstart config with this setup, base weights unquantized
(quant.mode none) in each of --dtypes (bfloat16, its default, and float32), random prompts as
long as the longest chat prompt, and each --remat policy. Each jaxrl variant's speed-up is
against TRL in the like precision (bfloat16 against bf16, float32 against fp32) where that
was run, else against the first of --trl-precision.

A TRL process trains 1 + --steps steps; a step runs from its `on_step_begin` to its
`on_step_end`, its sampling is `_generate` and its reference phase the rest of
`_generate_and_score_completions` (timed by a subclass); the first step is not counted. A jaxrl
process compiles in its first step and times --steps more. Each process's figure is its median
step; speed-up = TRL / jaxrl within a round.

    python tools/bench_grpo_step.py --trl-python /tmp/trlvenv/bin/python   # TRL in its venv
    python tools/bench_grpo_step.py --remat auto,full --rounds 3
    python tools/bench_grpo_step.py --dtypes bfloat16,float32 --remat none
    python tools/bench_grpo_step.py --dtypes bfloat16,float32 --trl-precision bf16,fp32
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

SYSTEM = "You are a careful reasoner."
PROMPTS, GROUP, RANK, ALPHA, BETA, LR = 4, 4, 16, 32.0, 0.04, 1e-5
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHASES = ("rollout", "reference", "update")
LIKE = {"bfloat16": "bf16", "float32": "fp32"}  # jaxrl model.dtype -> TRL precision


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="model PATH (default: `default`)")
    parser.add_argument("--new-tokens", type=int, default=64, help="N (64)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process (3)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of alternation (2)")
    parser.add_argument("--remat", default="auto", help="jaxrl optim.remat policies, "
                        "comma-separated (auto)")
    parser.add_argument("--dtypes", default="bfloat16", help="jaxrl model.dtype values, "
                        "comma-separated (bfloat16)")
    parser.add_argument("--trl-python", default=sys.executable,
                        help="the Python of an environment with trl, peft and datasets")
    parser.add_argument("--trl-precision", default="fp32",
                        help="TRL precisions, comma-separated: fp32 and/or bf16 (GRPOConfig's "
                        "default autocast) (fp32)")
    return parser.parse_args()


def distinct_chars(completions, **_) -> list[float]:
    return [float(len(set(c))) for c in completions]


def trl_worker(spec_file: str, result_file: str) -> None:
    """Trains with GRPOTrainer as the spec says; appends {"steps": [phases per timed step]}."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(open(spec_file).read())
    n, times, current = spec["new_tokens"], [], {}

    class TimedTrainer(GRPOTrainer):
        def _generate(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._generate(*args, **kwargs)
            current["sample"] = time.perf_counter() - start
            return result

        def _generate_and_score_completions(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._generate_and_score_completions(*args, **kwargs)
            current["scored"] = time.perf_counter() - start
            return result

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current["begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - current["begin"]
            times.append({"rollout": current["sample"],
                          "reference": current["scored"] - current["sample"],
                          "update": step - current["scored"], "step": step})

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP, max_completion_length=n, generation_kwargs={"min_new_tokens": n},
        temperature=1.0, beta=BETA, learning_rate=LR, use_vllm=False,
        max_steps=spec["steps"] + 1, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, bf16=spec["precision"] == "bf16", disable_tqdm=True, seed=0)
    peft = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS),
                      task_type="CAUSAL_LM")
    trainer = TimedTrainer(model=spec["model_dir"], reward_funcs=distinct_chars, args=config,
                           train_dataset=Dataset.from_dict({"prompt": spec["prompts"] * 64}),
                           processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]),
                           peft_config=peft, callbacks=[StepTimes()])
    trainer.train()
    import torch

    with open(result_file, "a") as f:
        f.write(json.dumps({"steps": times[1:], "torch_threads": torch.get_num_threads()}) + "\n")


def _prompts(model: str) -> tuple[str, list[str], int]:
    """(model directory, chat prompt texts, the longest one's token count)."""
    from jaxrl.data.generators import generate
    from jaxrl.hf.default_model import resolve_model_path
    from jaxrl.hf.tokenizer import chat_prompt_text, load_tokenizer, text_ids

    model_dir = resolve_model_path(model)
    tokenizer = load_tokenizer(model_dir)
    texts = [chat_prompt_text(tokenizer, [{"role": "system", "content": SYSTEM},
                                          r["messages"][-1]]) + "<think>"
             for r in generate("arithmetic", PROMPTS)]
    return str(model_dir), texts, max(len(text_ids(tokenizer, t)) for t in texts)


def _jaxrl_worker(args, dtype: str, policy: str, prompt_tokens: int):
    from peers import jaxrl_bench

    overrides = [f"model.path={args.model}", f"model.dtype={dtype}", "quant.mode=none",
                 f"lora.rank={RANK}", f"lora.alpha={ALPHA}", f"data.prompts_per_step={PROMPTS}",
                 f"grpo.num_generations={GROUP}", f"grpo.beta={BETA}", "grpo.epsilon_high=0.2",
                 "sampling.temperature=1.0", f"sampling.max_new_tokens={args.new_tokens}",
                 f"optim.lr={LR}", "optim.warmup_steps=0", f"optim.remat={policy}"]
    return jaxrl_bench("step", ["--steps", str(args.steps), "--prompt-tokens",
                                str(prompt_tokens)], overrides)


def _median_phases(steps: list[dict]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in steps) for k in (*PHASES, "step")}


def _cell(p: dict[str, float]) -> str:
    return f"{p['step']:.1f} ({p['rollout']:.1f} + {p['reference']:.1f} + {p['update']:.1f})"


def main() -> None:
    args = _args()
    from peers import alternate, load_range

    precisions = args.trl_precision.split(",")
    if not precisions or any(p not in LIKE.values() for p in precisions):
        sys.exit(f"--trl-precision takes fp32 and/or bf16, not {args.trl_precision!r}")
    model_dir, prompts, prompt_tokens = _prompts(args.model)
    workers = {}
    for precision in precisions:
        spec = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"model_dir": model_dir, "prompts": prompts, "new_tokens": args.new_tokens,
                   "steps": args.steps, "precision": precision}, spec)
        spec.close()
        workers[f"TRL {precision}"] = (lambda name: lambda out: [
            args.trl_python, __file__, "trl", name, out])(spec.name)
    variants = [f"{dtype} remat {policy}" for dtype in args.dtypes.split(",")
                for policy in args.remat.split(",")]
    for name in variants:
        dtype, _, policy = name.split()
        workers[f"jaxrl {name}"] = _jaxrl_worker(args, dtype, policy, prompt_tokens)
    print(f"{model_dir}: {PROMPTS} prompts x G {GROUP}, prompt {prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens; {args.rounds} rounds", flush=True)
    rounds = alternate(workers, args.rounds)
    peer = {v: LIKE.get(v.split()[0]) if LIKE.get(v.split()[0]) in precisions else precisions[0]
            for v in variants}
    header = ["round", *(f"TRL {p}" for p in precisions)]
    for variant in variants:
        header += [f"jaxrl {variant}", f"speed-up vs TRL {peer[variant]}"]
    lines = ["| " + " | ".join(header + ["load"]) + " |", "|" + " ---: |" * (len(header) + 1)]
    ratios = {p: [] for p in variants}
    for i, r in enumerate(rounds, 1):
        trl = {p: _median_phases(r[f"TRL {p}"]["rows"][0]["steps"]) for p in precisions}
        cells = [str(i), *(_cell(trl[p]) for p in precisions)]
        for variant in variants:
            row = r[f"jaxrl {variant}"]["rows"][0]
            mine = {**row["median_s"]}
            ratios[variant].append(trl[peer[variant]]["step"] / mine["step"])
            cells += [f"{_cell(mine)} [{row['remat']}]", f"{ratios[variant][-1]:.2f}x"]
        lines.append("| " + " | ".join(cells + [load_range([r])]) + " |")
    print("\nseconds per step, median of each process's timed steps (rollout + reference + "
          "update); [the remat policy the step ran]; load: 1-minute load average range\n")
    print("\n".join(lines))
    for variant, values in ratios.items():
        print(f"jaxrl {variant}: speed-up against TRL {peer[variant]} {min(values):.2f}x-"
              f"{max(values):.2f}x over {len(values)} rounds")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "trl":
        trl_worker(sys.argv[2], sys.argv[3])
    else:
        main()

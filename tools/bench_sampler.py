"""Sampler throughput: transformers' `generate` (torch, fp32) against `jaxrl bench sample`
(fp32 and bf16 weights) on the same model and shapes, each in processes of its own with its own
defaults, alternating round by round (tools/peers.py).

Every configuration decodes --new-tokens new tokens with EOS ignored from prompts of the chat
prompt's length, repeated over the batch (transformers: the chat prompt itself; jaxrl: random
ids of its length, the same computation); tokens per second = batch * new tokens / seconds of
one call, prefill included, the median of --repeats calls after a warm-up one (which compiles
jaxrl's programs). transformers runs with torch's own thread settings.

    python tools/bench_sampler.py                        # the docs/benchmarks.md table
    python tools/bench_sampler.py --batches 1,8 --new-tokens 32 --modes greedy --rounds 1
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PROMPT = ("Explain in a few short paragraphs why the sky is blue during the day and red at "
          "sunset, and mention Rayleigh scattering.")
MODES = {"greedy": 0.0, "t0.8": 0.8}


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="model PATH (default: `default`)")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--modes", default="greedy", help=f"of {', '.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per batch (2)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of alternation (2)")
    return parser.parse_args()


def transformers_worker(model_dir: str, batches: str, new_tokens: int, temperature: float,
                        repeats: int, result_file: str) -> None:
    """generate() at each batch size; appends one JSON line per batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                        add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as jaxrl bench does
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature
                else dict(do_sample=False))
    with open(result_file, "a") as f:
        for batch in map(int, batches.split(",")):
            prompt = torch.tensor([ids] * batch)
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                         pad_token_id=0, **sampling)
                times.append(time.perf_counter() - start)
                assert out.shape[1] == prompt.shape[1] + new_tokens
            seconds = statistics.median(times[1:])
            f.write(json.dumps({"batch": batch, "prompt_tokens": len(ids), "seconds": seconds,
                                "tok_s": batch * new_tokens / seconds,
                                "torch_threads": torch.get_num_threads()}) + "\n")


def _prompt_tokens(model_dir) -> int:
    from jaxrl.hf.tokenizer import chat_prompt_ids, load_tokenizer

    return len(chat_prompt_ids(load_tokenizer(model_dir), [{"role": "user", "content": PROMPT}]))


def _workers(args, model_dir, prompt_tokens: int, mode: str) -> dict:
    from peers import jaxrl_bench

    t = MODES[mode]
    workers = {"transformers fp32": lambda out: [
        sys.executable, __file__, "transformers", str(model_dir), args.batches,
        str(args.new_tokens), str(t), str(args.repeats), out]}
    for dtype in ("float32", "bfloat16"):
        workers[f"jaxrl {dtype}"] = jaxrl_bench(
            "sample", ["--batches", args.batches, "--prompt-tokens", str(prompt_tokens),
                       "--repeats", str(args.repeats)],
            [f"model.path={args.model}", f"model.dtype={dtype}", "quant.mode=none",
             f"sampling.temperature={t}", f"sampling.max_new_tokens={args.new_tokens}"])
    return workers


def _rate(row: dict, new_tokens: int) -> float:
    """Tokens/s of a row: transformers' directly, jaxrl's over its prefill plus decode."""
    if "tok_s" in row:
        return row["tok_s"]
    return row["batch"] * new_tokens / (row["prefill_s"] + row["decode_s"])


def main() -> None:
    args = _args()
    from jaxrl.hf.default_model import resolve_model_path
    from peers import alternate, load_range

    model_dir = resolve_model_path(args.model)
    prompt_tokens = _prompt_tokens(model_dir)
    print(f"{model_dir}: prompt {prompt_tokens} tokens, {args.new_tokens} new tokens, "
          f"{args.rounds} rounds", flush=True)
    lines = ["| round | batch | mode | transformers fp32 | jaxrl fp32 | ratio | jaxrl bf16 | "
             "ratio | load |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode in args.modes.split(","):
        rounds = alternate(_workers(args, model_dir, prompt_tokens, mode), args.rounds)
        for i, r in enumerate(rounds, 1):
            rates = {name: {row["batch"]: _rate(row, args.new_tokens) for row in result["rows"]}
                     for name, result in r.items()}
            for batch in map(int, args.batches.split(",")):
                hf = rates["transformers fp32"][batch]
                r32, r16 = rates["jaxrl float32"][batch], rates["jaxrl bfloat16"][batch]
                lines.append(f"| {i} | {batch} | {mode} | {hf:.1f} | {r32:.1f} | "
                             f"{r32 / hf:.2f}x | {r16:.1f} | {r16 / hf:.2f}x | "
                             f"{load_range([r])} |")
    print("\ntokens per second (prefill included), median of the timed calls; load: 1-minute "
          "load average range over the round\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "transformers":
        transformers_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]),
                            int(sys.argv[6]), sys.argv[7])
    else:
        main()

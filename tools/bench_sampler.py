"""Sampler throughput: jaxrl (fp32 and bf16 weights) against transformers `generate` (torch,
fp32) on the same model, prompt and settings, in one run.

Every configuration decodes a fixed number of new tokens with EOS ignored from one chat prompt
repeated over the batch; tokens per second = batch * new tokens / wall time of one call, after
one warm-up call (jaxrl's warm-up compiles). For each batch and mode the three implementations run
back to back, so their ratio is measured under the same machine load; the last column is the
1-minute load average after the row (2 cores: above ~2 other jobs compete for them).

    python tools/bench_sampler.py                       # the docs/benchmarks.md table
    python tools/bench_sampler.py --batches 1,8 --new-tokens 32 --modes greedy
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

PROMPT = ("Explain in a few short paragraphs why the sky is blue during the day and red at "
          "sunset, and mention Rayleigh scattering.")
MODES = {"greedy": 0.0, "t0.8": 0.8}


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="model PATH (default: `default`)")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--modes", default="greedy,t0.8", help=f"of {', '.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls (best one counts)")
    return parser.parse_args()


def _best_rate(fn, batch, new_tokens, repeats):
    fn()  # warm-up (compilation for jaxrl)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return batch * new_tokens / best


def _jaxrl_runner(params, spec, prompt_ids, batch, temperature, new_tokens):
    import jax

    from jaxrl.config import SamplingConfig
    from jaxrl.sampling import sample

    cfg = SamplingConfig(temperature=temperature, max_new_tokens=new_tokens)

    def run():
        out = sample(params, spec, [prompt_ids] * batch, jax.random.PRNGKey(0), cfg, eos_ids=())
        assert out.mask.all(), "EOS is ignored, so every row decodes every token"
    return run


def _hf_runner(model, prompt_ids, batch, temperature, new_tokens):
    import torch

    ids = torch.tensor([prompt_ids] * batch)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)

    def run():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0, **(sampling if temperature else
                                                    dict(do_sample=False)))
        assert out.shape[1] == ids.shape[1] + new_tokens
    return run


def main() -> None:
    args = _args()
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    from jaxrl.hf.default_model import resolve_model_path
    from jaxrl.hf.load import load_params
    from jaxrl.hf.tokenizer import chat_prompt_ids, load_tokenizer

    model_dir = resolve_model_path(args.model)
    prompt_ids = chat_prompt_ids(load_tokenizer(model_dir), [{"role": "user", "content": PROMPT}])
    spec, p32 = load_params(model_dir, dtype=jnp.float32)
    _, p16 = load_params(model_dir, spec, dtype=jnp.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # EOS ignored, as for jaxrl (eos_ids=())
    print(f"model {model_dir.name}, prompt {len(prompt_ids)} tokens, {args.new_tokens} new "
          f"tokens, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print("| batch | mode | transformers fp32 | jaxrl fp32 | ratio | jaxrl bf16 | ratio | load |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in (int(b) for b in args.batches.split(",")):
        for mode in args.modes.split(","):
            t = MODES[mode]
            rate = lambda run: _best_rate(run, batch, args.new_tokens, args.repeats)
            hf_rate = rate(_hf_runner(hf, prompt_ids, batch, t, args.new_tokens))
            r32 = rate(_jaxrl_runner(p32, spec, prompt_ids, batch, t, args.new_tokens))
            r16 = rate(_jaxrl_runner(p16, spec, prompt_ids, batch, t, args.new_tokens))
            print(f"| {batch} | {mode} | {hf_rate:.1f} | {r32:.1f} | {r32 / hf_rate:.2f}x | "
                  f"{r16:.1f} | {r16 / hf_rate:.2f}x | {os.getloadavg()[0]:.1f} |", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

"""Decode-step time of `jaxrl.sampling.sample` on the default model, split from the per-call
fixed cost: a call of 128 new tokens and one of 16 (EOS ignored, best of 2 after a warm-up),
step = (t128 - t16) / 112 and fixed = t16 - 16 * step (prefill, copies, transfers).
bf16 weights (or --dtype float32).

    python tools/bench_decode_step.py                         # batches 1, 8, 32
    python tools/bench_decode_step.py --batches 32 --dtype float32
"""
from __future__ import annotations

import argparse
import os
import time

from bench_sampler import PROMPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    from jaxrl.config import SamplingConfig
    from jaxrl.hf.default_model import resolve_model_path
    from jaxrl.hf.load import load_params
    from jaxrl.hf.tokenizer import chat_prompt_ids, load_tokenizer
    from jaxrl.sampling import sample

    model_dir = resolve_model_path("default")
    ids = chat_prompt_ids(load_tokenizer(model_dir), [{"role": "user", "content": PROMPT}])
    spec, params = load_params(model_dir, dtype=getattr(jnp, args.dtype))

    def best(batch, new_tokens):
        cfg = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens)
        run = lambda: sample(params, spec, [ids] * batch, jax.random.PRNGKey(0), cfg,
                             eos_ids=())
        run()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    print("| batch | step (ms) | fixed per call (ms) | load |")
    print("| ---: | ---: | ---: | ---: |")
    for batch in (int(b) for b in args.batches.split(",")):
        short, long = best(batch, 16), best(batch, 128)
        step = (long - short) / 112
        print(f"| {batch} | {step * 1e3:.1f} | {(short - 16 * step) * 1e3:.0f} | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()

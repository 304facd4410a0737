"""Continuous batching against static batches on a long-tailed workload: useful tokens per
second of the decode engine (all requests queued, `--slots` slots refilled as requests finish)
and of `jaxrl.sampling.sample` called on static batches of `--slots` requests, each batch
decoding to its longest request.

Workload: `--requests` chat prompts from the arithmetic generator, each with its own number of
new tokens drawn from a geometric distribution (mean `--mean`, capped at `--cap`, seeded) and
EOS ignored, so both modes decode exactly the same useful tokens; a static batch decodes
max(lengths) tokens for every row and only the requested ones count. Default model, bf16
weights, temperature 0.7. Each mode runs after a warm-up pass of the same workload (compiles).

`--mode static` uses only `sample`'s public signature, so it can time an older checkout of the
package in its own process:

    python tools/bench_engine.py --mode engine
    python tools/bench_engine.py --mode static
    PYTHONPATH=/path/to/old/checkout python tools/bench_engine.py --mode static
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["engine", "static"], required=True)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--mean", type=float, default=48.0, help="mean new tokens per request")
    parser.add_argument("--cap", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=16, help="engine steps per generate call")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def workload(args, tokenizer):
    """(prompt ids per request, new tokens per request)."""
    from jaxrl.data.generators import generate as generate_records
    from jaxrl.hf.tokenizer import chat_prompt_ids

    records = generate_records("arithmetic", args.requests, seed=args.seed)
    prompts = [chat_prompt_ids(tokenizer, r["messages"]) for r in records]
    rng = np.random.default_rng(args.seed)
    lengths = np.minimum(rng.geometric(1.0 / args.mean, args.requests), args.cap)
    return prompts, [int(n) for n in lengths]


def run_engine(params, spec, prompts, lengths, args):
    import jax

    from jaxrl.sampling import Decoding, Engine, Request
    from jaxrl.sampling.buckets import bucket
    from jaxrl.sampling.requests import row_keys

    capacity = bucket(max(len(p) for p in prompts)) + bucket(args.cap)
    engine = Engine(params, spec, slots=args.slots, capacity=capacity, chunk=args.chunk)
    keys = row_keys(jax.random.PRNGKey(0), range(len(prompts)))
    requests = [engine.submit(Request(p, Decoding(0.7), n, keys[i]))
                for i, (p, n) in enumerate(zip(prompts, lengths))]
    engine.run()
    assert [len(r.tokens) for r in requests] == lengths
    return engine.stats.utilization(args.slots)


def run_static(params, spec, prompts, lengths, args):
    import jax

    from jaxrl.config import SamplingConfig
    from jaxrl.sampling import sample

    live = total = 0
    for start in range(0, len(prompts), args.slots):
        batch, n = prompts[start:start + args.slots], lengths[start:start + args.slots]
        cfg = SamplingConfig(temperature=0.7, max_new_tokens=max(n))
        out = sample(params, spec, batch, jax.random.PRNGKey(start), cfg, eos_ids=())
        assert out.mask.all()
        live, total = live + sum(n), total + max(n) * len(batch)
    return live / total


def main() -> None:
    args = _args()
    import jax
    import jax.numpy as jnp

    from jaxrl.hf.default_model import resolve_model_path
    from jaxrl.hf.load import load_params
    from jaxrl.hf.tokenizer import load_tokenizer

    model_dir = resolve_model_path("default")
    spec, params = load_params(model_dir, dtype=jnp.bfloat16)
    prompts, lengths = workload(args, load_tokenizer(model_dir))
    run = run_engine if args.mode == "engine" else run_static
    run(params, spec, prompts, lengths, args)  # warm-up: compiles
    start = time.perf_counter()
    utilization = run(params, spec, prompts, lengths, args)
    wall = time.perf_counter() - start
    useful = sum(lengths)
    print(f"| {args.mode} | {args.requests} | {args.slots} | {useful} | {wall:.1f} | "
          f"{useful / wall:.1f} | {utilization:.2f} | {os.getloadavg()[0]:.1f} | "
          f"{jax.default_backend()} |")


if __name__ == "__main__":
    main()

"""A lower bound for one decode step on this backend: the matmuls of the default model's shapes
alone (30 layers of q/k/v, o, gate/up and down kernels, then the tied LM head), no attention,
no sampling, in a `fori_loop` of 64 steps inside one program; milliseconds per step, best of 3.
Random weights; `jaxrl.sampling` does this work plus attention, norms, RoPE and sampling.

    python tools/bench_decode_floor.py                       # fp32 and bf16 at batch 1, 8, 32
    python tools/bench_decode_floor.py --cases bfloat16:2
"""
from __future__ import annotations

import argparse
import os
import time

LAYERS, HIDDEN, MLP, KV, VOCAB, STEPS = 30, 576, 1536, 192, 49152, 64


def step_ms(dtype_name: str, batch: int, head: bool) -> float:
    import jax
    import jax.numpy as jnp

    dtype = getattr(jnp, dtype_name)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 8 * LAYERS + 2))
    w = lambda *shape: (0.02 * jax.random.normal(next(keys), shape)).astype(dtype)
    layers = [dict(q=w(HIDDEN, HIDDEN), k=w(HIDDEN, KV), v=w(HIDDEN, KV), o=w(HIDDEN, HIDDEN),
                   gate=w(HIDDEN, MLP), up=w(HIDDEN, MLP), down=w(MLP, HIDDEN))
              for _ in range(LAYERS)]
    embedding = w(VOCAB, HIDDEN)

    def mm(x, kernel):  # as `jaxrl.model.transformer.linear`: float32 accumulation
        return jnp.dot(x, kernel, preferred_element_type=jnp.float32).astype(x.dtype)

    @jax.jit
    def run(layers, embedding, x):
        def one(_, h):
            for p in layers:
                kv = jnp.sum(mm(h, p["k"])) + jnp.sum(mm(h, p["v"]))  # keep k, v alive
                h = h + mm(mm(h, p["q"]) + kv.astype(h.dtype), p["o"])
                h = h + mm(jax.nn.silu(mm(h, p["gate"])) * mm(h, p["up"]), p["down"])
                h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1,
                                               keepdims=True) + 1e-5).astype(h.dtype)
            if head:
                logits = jnp.einsum("be,ve->bv", h, embedding,
                                    preferred_element_type=jnp.float32)
                h = h + 1e-3 * logits[:, :HIDDEN].astype(h.dtype)
            return h
        return jax.lax.fori_loop(0, STEPS, one, x)

    x = w(batch, HIDDEN)
    jax.block_until_ready(run(layers, embedding, x))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(run(layers, embedding, x))
        best = min(best, time.perf_counter() - start)
    return best / STEPS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="float32:1,bfloat16:1,float32:8,bfloat16:8,"
                        "float32:32,bfloat16:32", help="DTYPE:BATCH, ...")
    args = parser.parse_args()
    print("| weights | batch | layers' matmuls (ms/step) | + LM head (ms/step) | tok/s bound |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for case in args.cases.split(","):
        dtype, batch = case.split(":")
        layers = step_ms(dtype, int(batch), False)
        full = step_ms(dtype, int(batch), True)
        print(f"| {dtype} | {batch} | {layers:.1f} | {full:.1f} | {int(batch) * 1e3 / full:.0f} |",
              flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""The backward of one layer's seven LoRA pairs: jaxrl's hand-written VJP (`lora_delta`) against
automatic differentiation of the same expression, at SmolLM2-135M's shapes (hidden 576, KV 192,
MLP 1536, r 16) and 16 rows x 192 tokens, in one run, alternating the two.

    python tools/bench_lora_backward.py
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxrl.lora.lora import lora_delta

D, KV, F, R, ROWS, TOKENS, SCALE = 576, 192, 1536, 16, 16, 192, 2.0
SHAPES = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]  # q k v o gate up down


def automatic(x, ab, scale):
    xa = jnp.einsum("...i,ir->...r", x, ab["a"].astype(x.dtype), preferred_element_type=jnp.float32)
    y = jnp.einsum("...r,ro->...o", xa.astype(x.dtype), ab["b"].astype(x.dtype),
                   preferred_element_type=jnp.float32)
    return (scale * y).astype(x.dtype)


def layer_loss(pairs, x, h, delta):
    total = 0.0
    for ab in pairs:
        inputs = x if ab["a"].shape[0] == D else h
        total = total + jnp.sum(delta(inputs, ab, SCALE).astype(jnp.float32) ** 2)
    return total


def main() -> None:
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * len(SHAPES) + 2)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(keys[0], (ROWS, TOKENS, D), dtype)
        h = jax.random.normal(keys[1], (ROWS, TOKENS, F), dtype)
        pairs = [{"a": 0.05 * jax.random.normal(keys[2 + 2 * i], (i_, R)),
                  "b": 0.05 * jax.random.normal(keys[3 + 2 * i], (R, o))}
                 for i, (i_, o) in enumerate(SHAPES)]
        ours = jax.jit(jax.grad(lambda p, x, h: layer_loss(p, x, h, lora_delta)))
        auto = jax.jit(jax.grad(lambda p, x, h: layer_loss(p, x, h, automatic)))
        got, want = ours(pairs, x, h), auto(pairs, x, h)
        worst = max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
                    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
        times = {"hand-written": [], "automatic": []}
        for _ in range(5):
            for name, fn in (("hand-written", ours), ("automatic", auto)):
                start = time.perf_counter()
                jax.block_until_ready(fn(pairs, x, h))
                times[name].append(time.perf_counter() - start)
        print(f"{jnp.dtype(dtype).name}: hand-written {min(times['hand-written']) * 1e3:.1f} ms, "
              f"automatic {min(times['automatic']) * 1e3:.1f} ms (fastest of 5); largest "
              f"gradient difference {worst:.2e} of the largest gradient")


if __name__ == "__main__":
    main()

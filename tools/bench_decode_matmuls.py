"""The linears of a decode step at few rows: XLA (jaxrl's backend) against torch, each in a
process of its own with its own defaults (tools/peers.py), alternating.

A decode step multiplies a few rows (the batch) by every weight of every layer. This times that
alone: for each of the default model's linear shapes, `--layers` different weights of --dtype
applied in turn to the same [rows, in] input (XLA: a `lax.scan` over the stacked weights, as
the model runs, bfloat16 ones as their uint16 bits, converted once, with float32 sums, as
jaxrl/model/transformer.py runs them on the CPU; torch: a Python loop over separate tensors),
fastest of 5 repeats of 5 calls, at each row count of `--rows`. FLOP/s = 2 * rows * in * out *
layers / time.

    python tools/bench_decode_matmuls.py --torch-python /tmp/trlvenv/bin/python
    python tools/bench_decode_matmuls.py --torch-python /tmp/trlvenv/bin/python --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192)]  # SmolLM2-135M's linears


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,64,1024", help="row counts (16,64,1024)")
    parser.add_argument("--layers", type=int, default=30, help="weights per shape (30)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of alternation (2)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights and inputs (float32)")
    parser.add_argument("--torch-python", default=sys.executable,
                        help="the Python of an environment with torch")
    parser.add_argument("--worker", nargs=2, metavar=("SYSTEM", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def _best(call, sync) -> float:
    sync(call())
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(5):
            out = call()
        sync(out)
        best = min(best, (time.perf_counter() - start) / 5)
    return best


def _xla(rows: list[int], layers: int, dtype: str):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.backends.numerics import dense, numerics_of

    numerics = numerics_of(None)  # the default device's forms, weights held as it holds them

    def run(x, w):  # w as the numerics holds a stacked layer weight
        return jax.lax.scan(lambda acc, wl: (acc + numerics.product(x, dense(wl)), None),
                            jnp.zeros((x.shape[0], w.shape[2]), jnp.float32), w)[0]

    run = jax.jit(run)
    rng = np.random.default_rng(0)
    for m in rows:
        for fan_in, fan_out in SHAPES:
            x = jnp.asarray(rng.standard_normal((m, fan_in)), dtype)
            w = jnp.asarray(rng.standard_normal((layers, fan_in, fan_out)), dtype)
            w = numerics.hold({"layers": w})["layers"]
            yield m, (fan_in, fan_out), _best(lambda: run(x, w), jax.block_until_ready)


def _torch(rows: list[int], layers: int, dtype: str):
    import torch

    torch.set_grad_enabled(False)
    gen = torch.Generator().manual_seed(0)
    kind = getattr(torch, dtype)
    for m in rows:
        for fan_in, fan_out in SHAPES:
            x = torch.randn(m, fan_in, generator=gen).to(kind)
            ws = [torch.randn(fan_in, fan_out, generator=gen).to(kind) for _ in range(layers)]
            yield m, (fan_in, fan_out), _best(lambda: sum(x @ w for w in ws), lambda out: out)


def worker(system: str, out: str, rows: list[int], layers: int, dtype: str) -> None:
    timings = (_xla if system == "xla" else _torch)(rows, layers, dtype)
    with open(out, "a") as f:
        for m, (fan_in, fan_out), seconds in timings:
            f.write(json.dumps({"rows": m, "in": fan_in, "out": fan_out, "ms": 1e3 * seconds,
                                "gflops": 2 * m * fan_in * fan_out * layers / seconds / 1e9})
                    + "\n")


def main() -> None:
    args = _args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.worker:
        return worker(*args.worker, rows, args.layers, args.dtype)
    from tools.peers import alternate, load_range

    script = str(Path(__file__).resolve())
    common = ["--rows", args.rows, "--layers", str(args.layers), "--dtype", args.dtype]
    workers = {"torch": lambda out: [args.torch_python, script, *common, "--worker", "torch", out],
               "xla": lambda out: [sys.executable, script, *common, "--worker", "xla", out]}
    rounds = alternate(workers, args.rounds)
    print(f"\n{args.layers} {args.dtype} weights per shape; ms per pass (GFLOP/s); load "
          f"{load_range(rounds)}\n")
    print("| round | rows | in x out | torch | XLA | XLA / torch time |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for i, result in enumerate(rounds, 1):
        for t, x in zip(result["torch"]["rows"], result["xla"]["rows"]):
            print(f"| {i} | {t['rows']} | {t['in']} x {t['out']} | {t['ms']:.2f} "
                  f"({t['gflops']:.0f}) | {x['ms']:.2f} ({x['gflops']:.0f}) | "
                  f"{x['ms'] / t['ms']:.2f} |")


if __name__ == "__main__":
    main()

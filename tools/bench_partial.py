"""GRPO rollouts with and without partial rollouts (`sampling.partial`) on a long-tailed mix of
completion lengths: slot utilization and useful tokens per second per step.

Each step decodes --prompts groups of --group rows, each group of its own arithmetic chat
prompt, with the model (default: the embedded SmolLM2-135M-Instruct, float32). Completion lengths are set, not left to EOS: each
row's budget is drawn from the mix and EOS is ignored, so both modes decode the same lengths.
  whole    the rollout as `jaxrl train` runs it without sampling.partial (`sample`'s engine:
           a slot per row, each rollout until its longest row has finished)
  partial  jaxrl/rl/partial.py: one engine across steps, a rollout ends once --prompts groups
           have finished, freed slots take the next groups at once, unfinished rows go on at
           the next step (sampling.max_carry 1, carry_overflow finish)
Mixes:
  synthetic   90% of rows --short tokens, 10% the budget (--max-new-tokens)
  quickstart  lengths drawn from those the model gives the quickstart's prompts (arithmetic,
              temperature 1, sampling.max_new_tokens --max-new-tokens, EOS ends a row),
              measured by sampling --measure-rows rows once at the start
Slot utilization = tokens the decode steps emitted / (decode steps x slots), over the timed
steps; useful tokens per second = tokens of the rows that train / the rollouts' seconds, over
the timed steps. Each mode runs in a
process of its own, one after the other, --steps timed steps after --warmup untimed ones (which
compile); the same seed draws the same lengths for both.

    python tools/bench_partial.py                       # both mixes, both modes
    python tools/bench_partial.py --mixes synthetic --steps 6
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--mixes", default="synthetic,quickstart")
    parser.add_argument("--prompts", type=int, default=4, help="groups per step (4)")
    parser.add_argument("--group", type=int, default=4, help="rows per group (4)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--short", type=int, default=8, help="synthetic short rows' length (8)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    parser.add_argument("--measure-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=None,
                        help="partial: decode steps between refills (default: Partial's)")
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "LENGTHS", "OUT"),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _model(args):
    from jaxrl.hf.pretrained import load_pretrained

    return load_pretrained(args.model, dtype="float32")


def _prompt_ids(model, n: int = 64) -> list[list[int]]:
    """Chat prompts of n arithmetic records: group i takes prompt i % n in both modes."""
    from jaxrl.data.generators import generate

    return [model.chat_ids(r["messages"]) for r in generate("arithmetic", n, seed=1)]


def measure_quickstart(args) -> list[int]:
    """Completion lengths of the model on the quickstart's prompts (EOS ends a row)."""
    import jax

    from jaxrl.config import SamplingConfig
    from jaxrl.data.generators import generate
    from jaxrl.sampling.sampler import sample

    model = _model(args)
    records = generate("arithmetic", args.measure_rows // args.group, seed=args.seed)
    prompts = [model.chat_ids(r["messages"]) for r in records for _ in range(args.group)]
    out = sample(model.params, model.spec, prompts, jax.random.PRNGKey(args.seed),
                 SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens),
                 eos_ids=model.eos_ids)
    return [int(n) for n in out.mask.sum(axis=1)]


def draw_lengths(args, mix: str, measured: list[int] | None, rows: int) -> list[int]:
    import numpy as np

    rng = np.random.RandomState(args.seed)
    if mix == "synthetic":
        return [args.max_new_tokens if rng.rand() < 0.1 else args.short for _ in range(rows)]
    return [int(measured[i]) for i in rng.randint(0, len(measured), rows)]


def worker(args, mode: str, lengths: list[int], out: Path) -> None:
    """Run --warmup + --steps rollouts in one mode; writes one JSON line per timed step."""
    import jax

    from jaxrl.config import SamplingConfig
    from jaxrl.rl.partial import Partial
    from jaxrl.sampling.buckets import bucket
    from jaxrl.sampling.engine import Engine
    from jaxrl.sampling.requests import Request, row_keys
    from jaxrl.sampling.sampling_fns import Decoding

    model = _model(args)
    prompts = _prompt_ids(model)
    width = max(map(len, prompts))
    g, rows = args.group, args.prompts * args.group
    n = args.max_new_tokens
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=n)
    key = jax.random.PRNGKey(args.seed)
    drawn = iter(lengths)
    partial = None
    if mode == "partial":
        partial = Partial(model.params, model.spec, cfg, groups=args.prompts, group_size=g,
                          prompt_width=width, key=key, eos_ids=(),
                          **({} if args.chunk is None else {"chunk": args.chunk}))
        pulled = [0]

        def pull():
            items = []
            for _ in range(args.prompts):
                items.append(({}, "", prompts[pulled[0] % len(prompts)],
                              [next(drawn) for _ in range(g)]))
                pulled[0] += 1
            return items
    results = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        if partial is not None:
            stats = partial.engine.stats
            before = (stats.steps, stats.tokens)
            ready, metrics = partial.rollout(step, step, None, pull)
            useful = sum(len(row.tokens) for grp in ready for row in grp.rows)
            slots, engine = partial.slots, partial.engine
        else:  # as `sample` lays out a rollout: a slot per row, one chunk of the bucket
            engine = Engine(model.params, model.spec, eos_ids=(), slots=rows,
                            capacity=bucket(width) + bucket(n), chunk=bucket(n))
            before = (0, 0)
            keys = row_keys(jax.random.fold_in(key, step), range(rows))
            first = step * args.prompts
            requests = [engine.submit(Request(prompts[(first + i // g) % len(prompts)],
                                              Decoding.from_config(cfg), next(drawn), keys[i]))
                        for i in range(rows)]
            engine.run()
            useful = sum(len(r.tokens) for r in requests)
            slots = rows
        seconds = time.perf_counter() - start
        steps, tokens = engine.stats.steps - before[0], engine.stats.tokens - before[1]
        if step >= args.warmup:
            results.append({"mode": mode, "step": step, "seconds": seconds, "useful": useful,
                            "utilization": tokens / max(steps * slots, 1),
                            "useful_per_s": useful / seconds, "decode_steps": steps})
    with open(out, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")


def main(argv=None) -> None:
    args = _args(argv)
    if args.worker:
        mode, lengths, out = args.worker
        return worker(args, mode, json.loads(Path(lengths).read_text()), Path(out))
    import platform
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    rows = (args.warmup + args.steps + 4) * args.prompts * args.group * 4  # enough for both
    measured = None
    if "quickstart" in args.mixes.split(","):
        measured = measure_quickstart(args)
        print(f"quickstart lengths ({len(measured)} rows): mean "
              f"{statistics.mean(measured):.1f}, median {statistics.median(measured)}, at the "
              f"budget {sum(m == args.max_new_tokens for m in measured)}", file=sys.stderr)
    table = []
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    for mix in args.mixes.split(","):
        lengths = tmp / f"{mix}.json"
        lengths.write_text(json.dumps(draw_lengths(args, mix, measured, rows)))
        summary = {}
        for mode in ("whole", "partial"):
            out = tmp / f"{mix}-{mode}.jsonl"
            subprocess.run([sys.executable, __file__, *passthrough, "--worker", mode,
                            str(lengths), str(out)], check=True, cwd=ROOT)
            steps = [json.loads(line) for line in out.read_text().splitlines()]
            summary[mode] = {k: statistics.mean(s[k] for s in steps)
                             for k in ("utilization", "seconds", "useful")}
            summary[mode]["useful_per_s"] = (sum(s["useful"] for s in steps)
                                             / sum(s["seconds"] for s in steps))
            summary[mode]["utilization"] = (sum(s["utilization"] * s["decode_steps"]
                                                for s in steps)
                                            / max(sum(s["decode_steps"] for s in steps), 1))
            table.append((mix, mode, summary[mode]))
        summary["ratio"] = summary["partial"]["useful_per_s"] / summary["whole"]["useful_per_s"]
        table.append((mix, "partial / whole", {"useful_per_s": summary["ratio"]}))
    print(f"CPU: {platform.processor() or platform.machine()}; model {args.model}; "
          f"{args.prompts} x {args.group} rows a step, max_new_tokens {args.max_new_tokens}, "
          f"{args.steps} timed steps after {args.warmup}")
    print("| mix | mode | slot utilization | useful tokens/s | s/step | useful tokens/step |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for mix, mode, s in table:
        if mode == "partial / whole":
            print(f"| {mix} | {mode} | | {s['useful_per_s']:.2f}x | | |")
        else:
            print(f"| {mix} | {mode} | {s['utilization']:.1%} | {s['useful_per_s']:.1f} | "
                  f"{s['seconds']:.2f} | {s['useful']:.0f} |")


if __name__ == "__main__":
    main()

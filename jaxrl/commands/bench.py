"""`jaxrl bench sample|step|engine [--config FILE] [--out FILE] [key=value ...]`: time the
programs `jaxrl train` runs on the hardware at hand and set the figures beside its limits.

The model is model.path: a local checkpoint (or `default`) is loaded as a run loads it; a
directory holding only a config.json, or an embedded preset (qwen3-4b, qwen3-8b, qwen3-32b, also
as a hub id such as Qwen/Qwen3-4B), gets random weights in the run's layout (NF4 codes and
scales, LoRA), so nothing is downloaded. Prompts are random token ids and EOS is ignored, so
rows decode their full length.

  sample  prefill and decode of each --batches size (default: one step's rows) with
          data.max_prompt_tokens prompts (or --prompt-tokens) and sampling.max_new_tokens new
          tokens, through the decode engine's programs: compile time, median seconds of
          --repeats calls, tokens/s, and for a decode step its bytes read (weights as stored,
          adapter, KV cache) and FLOPs per second as shares of the device's peak bandwidth and
          compute; for the prefill its share of peak compute. --group G: the rows come in
          groups of G sharing a prompt (GRPO's), prefilled once and decoded in blocks of G
          slots that read the prompt's cache once per step, as a rollout decodes them
          (default 1: every row its own prompt)
  step    seconds per GRPO step (data.prompts_per_step x grpo.num_generations rows) split into
          rollout, reference and update, each with tokens/s; the first (compiling) step apart,
          then the median of --steps; the update's optim.remat policy; with
          --compare-remat none,dots,full, the last step's update under each policy in turn
  engine  useful tokens/s of the slot engine (sampling.slots slots, 16 if unset) on --requests
          requests of mixed prompt and completion lengths; --static adds the same workload on
          static batches for comparison

--profile DIR traces the last timed call (of each batch for sample, the last step for step)
with jax.profiler into DIR (read it with TensorBoard's profile plugin, XProf or Perfetto) and
prints the device's time in it by program and operation, the most costly first.

Peaks are the published figures of known accelerators (H100, H200, A100, L4, RTX 4090, TPU v4,
v5e, v5p, v6e) or, on a CPU, a streaming read and a matmul measured on the spot. Peak memory is
each compiled program's (XLA's memory analysis: arguments + outputs - donated + temporaries)
and, where the backend reports it, the device's peak bytes in use so far. Each result is a
table row and, with --out, a JSON line with the device kind, jax version, config hash and
compile times.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import sys
from pathlib import Path

from jaxrl.config import UsageError
from jaxrl.devices import GIB


def register(sub) -> None:
    bench = sub.add_parser(
        "bench", help="time sampling, the GRPO step or the slot engine on this hardware, "
        "beside its limits", description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = bench.add_subparsers(dest="mode", metavar="MODE", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="YAML run config (default: the "
                        "quickstart)")
    common.add_argument("--prompt-tokens", type=int, metavar="N",
                        help="prompt length in tokens (default: data.max_prompt_tokens)")
    common.add_argument("--out", metavar="FILE", help="append one JSON line per result")
    common.add_argument("--profile", metavar="DIR",
                        help="trace the last timed call (sample: of each batch, into DIR/"
                        "batch-B; step: the last step) with jax.profiler and print the "
                        "device's time by program and operation (not for engine)")
    common.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    sample = modes.add_parser("sample", parents=[common], help="prefill and decode tokens/s")
    sample.add_argument("--batches", metavar="B,B,...",
                        help="rows to decode (default: data.prompts_per_step x "
                        "grpo.num_generations)")
    sample.add_argument("--repeats", type=int, default=3, help="timed calls per batch (3)")
    sample.add_argument("--group", type=int, default=1, metavar="G",
                        help="rows per prompt, decoded in blocks sharing its cache as GRPO's "
                        "groups are (1: a prompt per row)")
    step = modes.add_parser("step", parents=[common], help="seconds per GRPO step by phase")
    step.add_argument("--steps", type=int, default=3, help="timed steps after the first (3)")
    step.add_argument("--compare-remat", metavar="P,P,...",
                      help="then time the last step's update under each of these optim.remat "
                      "policies (none, dots, full), taking turns, --steps times each")
    engine = modes.add_parser("engine", parents=[common], help="slot engine throughput")
    engine.add_argument("--requests", type=int, default=64, help="requests (64)")
    engine.add_argument("--mean-new-tokens", type=float, metavar="M",
                        help="mean new tokens per request, capped at sampling.max_new_tokens "
                        "(default: a quarter of it)")
    engine.add_argument("--static", action="store_true",
                        help="also time the workload on static batches of as many rows")
    bench.set_defaults(func=_bench)


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{name} must be at least 1; got {value}")


def _batches(args, cfg) -> list[int]:
    if args.batches is None:
        return [cfg.data.prompts_per_step * cfg.grpo.num_generations]
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise UsageError(f"--batches {args.batches!r} must be comma-separated row counts, "
                         "e.g. 1,8,32") from None
    for b in batches:
        _positive("each of --batches", b)
    return batches


def _policies(args) -> list[str]:
    from jaxrl.rl.remat import POLICIES

    policies = [] if not args.compare_remat else args.compare_remat.split(",")
    for policy in policies:
        if policy not in POLICIES:
            raise UsageError(f"--compare-remat takes policies of {', '.join(POLICIES)}; got "
                             f"{policy!r}")
    if len(set(policies)) < len(policies):
        raise UsageError(f"--compare-remat names each policy once; got {args.compare_remat}")
    return policies


def _check(args, cfg) -> None:
    """Usage errors before anything is loaded."""
    _positive("--prompt-tokens", args.prompt_tokens)
    for name in ("repeats", "steps", "requests", "mean_new_tokens"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name, None))
    if args.mode == "sample":
        _positive("--group", args.group)
        for b in _batches(args, cfg):
            if b % args.group:
                raise UsageError(f"--batches {b} does not split into groups of --group "
                                 f"{args.group}")
    if args.mode == "step":
        _policies(args)
    if args.mode == "engine" and args.profile:
        raise UsageError("--profile traces jaxrl bench sample and step, not engine")
    if args.mode == "sample" and cfg.sampling.max_new_tokens < 2:
        raise UsageError("jaxrl bench sample times decode steps after the first token: set "
                         f"sampling.max_new_tokens to at least 2; got "
                         f"{cfg.sampling.max_new_tokens}")


def _bench(args) -> int:
    import jax

    from jaxrl import __version__
    from jaxrl.bench import runs
    from jaxrl.bench.subject import config_hash, load_subject
    from jaxrl.commands.train import run_config
    from jaxrl.devices import device_peaks

    cfg = run_config(args)
    _check(args, cfg)
    prompt_tokens = args.prompt_tokens or cfg.data.max_prompt_tokens
    subject = load_subject(cfg, log=lambda m: print(m, file=sys.stderr))
    device = jax.devices()[0]
    peaks = device_peaks(device)
    info = {"mode": args.mode, "device_kind": device.device_kind, "platform": device.platform,
            "devices": jax.device_count(), "jax": jax.__version__, "jaxrl": __version__,
            "config_hash": config_hash(cfg), "model": cfg.model.path, "weights": subject.weights,
            "quant": cfg.quant.mode, "dequantize": cfg.quant.dequantize,
            "lora_rank": cfg.lora.rank, "dtype": cfg.model.dtype,
            "peaks": None if peaks is None else vars(peaks)}
    print(_header(info, subject.spec))
    if args.mode == "sample":
        rows = [runs.sample_batch(subject, b, prompt_tokens, args.repeats, peaks, args.group,
                                  _trace(args, b))
                for b in _batches(args, cfg)]
    elif args.mode == "step":
        rows = [runs.grpo_step(subject, args.steps, prompt_tokens, _policies(args),
                               _trace(args))]
    else:
        mean = args.mean_new_tokens or max(1.0, cfg.sampling.max_new_tokens / 4)
        rows = runs.engine(subject, args.requests, mean, prompt_tokens, args.static)
    print(TABLES[args.mode](rows))
    if args.profile:
        _print_profiles(args, rows)
    if args.out:
        when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(args.out, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({**info, "time": when, **row}) + "\n")
    return 0


def _profile_dir(args, batch: int) -> Path:
    """Where the traced call of a result goes: --profile/batch-B (sample) or --profile/step."""
    return Path(args.profile) / (f"batch-{batch}" if args.mode == "sample" else "step")


def _trace(args, batch: int = 0):
    """The context a timed call runs in: a profile into `_profile_dir`, or nothing."""
    if not args.profile:
        return contextlib.nullcontext
    from jaxrl.bench.profile import traced

    return functools.partial(traced, _profile_dir(args, batch))


def _print_profiles(args, rows: list[dict]) -> None:
    """Each traced call's device time by program and op, also into its result row."""
    from jaxrl.bench.profile import op_table, op_times

    for row in rows:
        directory = _profile_dir(args, row.get("batch", 0))
        row["profile"] = {"dir": str(directory), "ops": op_times(directory)}
        print(f"\ndevice time of the traced call ({directory}):")
        print(op_table(row["profile"]["ops"]))


def _header(info: dict, spec) -> str:
    peaks = info["peaks"]
    limits = ("no known peaks for this device" if peaks is None else
              f"peaks ({peaks['source']}): {peaks['bandwidth'] / 1e9:.0f} GB/s, "
              f"{peaks['flops'] / 1e12:.3g} TFLOP/s")
    return (f"{info['devices']} x {info['device_kind']} ({info['platform']}), jax {info['jax']}, "
            f"jaxrl {info['jaxrl']}, config {info['config_hash']}; {info['model']}: "
            f"{spec.family}, {spec.num_layers} layers, {spec.hidden_size} hidden, "
            f"{info['weights']}, {info['quant']} ({info['dequantize']}) + LoRA "
            f"r{info['lora_rank']}, {info['dtype']}; {limits}")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def sample_table(rows: list[dict]) -> str:
    lines = ["| batch | group | prompt | new | compile (s) | prefill tok/s | decode tok/s | ms/step | "
             "decode GB/s | of peak BW | decode TFLOP/s | of peak | prefill of peak FLOP/s | "
             "peak GiB admit / generate | device peak GiB |",
             "| ---: " * 15 + "|"]
    for r in rows:
        d, p = r["decode_limits"], r["prefill_limits"]
        lines.append(
            f"| {r['batch']} | {r['group']} | {r['prompt_tokens']} | {r['new_tokens']} | "
            f"{sum(r['compile_s'].values()):.1f} | {r['prefill_tok_s']:.1f} | "
            f"{r['decode_tok_s']:.1f} | {r['decode_step_ms']:.2f} | {d['bandwidth'] / 1e9:.1f} | "
            f"{_share(d['bandwidth_share'])} | {d['flop_rate'] / 1e12:.3g} | "
            f"{_share(d['flops_share'])} | {_share(p['flops_share'])} | "
            f"{_gib(r['peak_bytes']['admit'])} / {_gib(r['peak_bytes']['generate'])} | "
            f"{_gib(r['device_peak_bytes'])} |")
    return "\n".join(lines)


def step_table(rows: list[dict]) -> str:
    (r,) = rows
    lines = [f"{r['rows']} rows, {r['prompt_tokens']} prompt + {r['new_tokens']} new tokens "
             f"(width {r['width']}); optim.remat: {r['remat']}; peak GiB: reference "
             f"{_gib(r['peak_bytes']['reference'])}, update {_gib(r['peak_bytes']['update'])}, "
             f"device {_gib(r['device_peak_bytes'])}",
             f"| phase | first step (s, compiles) | median of {len(r['runs_s'])} (s) | tokens/s |",
             "| --- | ---: | ---: | ---: |"]
    for phase in ("rollout", "reference", "update", "step"):
        rate = r["tok_s"].get(phase)
        lines.append(f"| {phase} | {r['first_step_s'][phase]:.2f} | {r['median_s'][phase]:.2f} | "
                     f"{'-' if rate is None else f'{rate:.1f}'} |")
    if r["remat_compare"]:
        lines += ["", f"| optim.remat | compile (s) | update (s, median of {len(r['runs_s'])}) | "
                  "update peak GiB |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {c['policy']} | {c['compile_s']:.1f} | {c['update_s']:.2f} | "
                  f"{_gib(c['peak_bytes'])} |" for c in r["remat_compare"]]
    return "\n".join(lines)


def engine_table(rows: list[dict]) -> str:
    lines = ["| batching | requests | slots | useful tokens | first pass (s, compiles) | "
             "wall (s) | useful tok/s | utilization |", "| --- " + "| ---: " * 7 + "|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['requests']} | {r['slots']} | {r['useful_tokens']} | "
                     f"{r['first_pass_s']:.1f} | {r['wall_s']:.2f} | {r['useful_tok_s']:.1f} | "
                     f"{r['utilization']:.2f} |")
    return "\n".join(lines)


TABLES = {"sample": sample_table, "step": step_table, "engine": engine_table}

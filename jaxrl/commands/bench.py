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
  decode  ms per decode step at a set cache fill, without a prefill: for each --batches size
          (default: one step's rows) and each of --capacities (default: the run's prompt plus
          new-token buckets), slots holding --fill of their columns (0.5) decode --steps tokens
          per call (16); each of --forms runs in turn, --repeats times after a warm-up call:
          block and split (the XLA NF4 forms over XLA attention, the chunk stopping early),
          kernels (the Pallas NF4 and attention kernels, a fixed chunk; where this tree's
          numerics has them), dense (the platform's numerics with dense kernels); default: the
          platform's numerics on the run's layout. Each row has the bytes a step must move
          (weights as stored, adapter, filled cache columns: jaxrl/bench/decode_forms.py) and their
          share of peak bandwidth; --structure adds the program's structural counts (dots,
          custom calls and fusions per layer, loops, conditionals, host transfers). A case whose
          cache and params need more than the device's memory is skipped. One device.

--profile DIR traces the last timed call (of each batch for sample, the last step for step;
for decode one more call of each form and case, into DIR/bB-cC-FORM) with jax.profiler into DIR
(read it with TensorBoard's profile plugin, XProf or Perfetto) and prints the device's time in
it by program and operation, the most costly first; for decode also the device events per
layer and step and the share of the call's span in which none ran (idle).

--numerics key=value (repeatable) overrides a field of the numerics value the programs take
(jaxrl/backends/numerics.py), e.g. --numerics nf4_decode=block or attention=pallas_gpu, for
sample, engine and decode (for decode, after each form's own fields); fields that fix how the
weights are loaded (hold_bits, dequantize_auto) are not overridden here (quant.dequantize is).

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
    common.add_argument("--numerics", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a numerics field for the programs timed (sample, "
                        "engine, decode), e.g. nf4_decode=block; repeatable")
    common.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    sample = modes.add_parser("sample", parents=[common], help="prefill and decode tokens/s")
    sample.add_argument("--batches", metavar="B,B,...",
                        help="rows to decode (default: data.prompts_per_step x "
                        "grpo.num_generations)")
    sample.add_argument("--repeats", type=int, default=3, help="timed calls per batch (3)")
    sample.add_argument("--group", type=int, default=1, metavar="G",
                        help="rows per prompt, decoded in blocks sharing its cache as GRPO's "
                        "groups are (1: a prompt per row)")
    sample.add_argument("--adapters", type=int, default=0, metavar="N",
                        help="decode rows of N adapters in one batch (row i: adapter i mod N), "
                        "as a server or a local judge mixes them (0: one adapter, the "
                        "rollout's form)")
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
    decode = modes.add_parser("decode", parents=[common],
                              help="ms per decode step at a set cache fill, by form")
    decode.add_argument("--batches", metavar="B,B,...",
                        help="slots to decode (default: data.prompts_per_step x "
                        "grpo.num_generations)")
    decode.add_argument("--capacities", metavar="C,C,...",
                        help="cache columns per slot (default: the prompt plus new-token "
                        "buckets)")
    decode.add_argument("--fill", type=float, default=0.5,
                        help="share of each slot's columns filled (0.5)")
    decode.add_argument("--steps", type=int, default=16, help="decode steps per call (16)")
    decode.add_argument("--repeats", type=int, default=3, help="timed calls per form (3)")
    decode.add_argument("--forms", metavar="F,F,...",
                        help="forms taking turns: block, split, kernels, dense (default: the "
                        "platform's numerics on the run's layout)")
    decode.add_argument("--structure", action="store_true",
                        help="add each program's structural counts to its rows")
    bench.set_defaults(func=_bench)


# numerics fields that decide how the weights are loaded and held, so not overridable here
_LOAD_FIELDS = ("name", "hold_bits", "dequantize_auto")


def numerics_overrides(items: list[str]) -> dict:
    """--numerics FIELD=VALUE items as {field: value}, each value parsed as its field's type
    (bool: true/false/1/0/yes/no; int; str) and the whole checked by building a numerics value
    with them (which rejects unknown forms); UsageError on any that is not."""
    import dataclasses

    from jaxrl.backends.numerics import REFERENCE, Numerics

    fields = {f.name: getattr(REFERENCE, f.name) for f in dataclasses.fields(Numerics)}
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise UsageError(f"--numerics {item!r} is not FIELD=VALUE, e.g. nf4_decode=block")
        if name not in fields or name in _LOAD_FIELDS:
            allowed = ", ".join(f for f in fields if f not in _LOAD_FIELDS)
            why = ("fixes how the weights are loaded" if name in _LOAD_FIELDS
                   else "is not a numerics field")
            raise UsageError(f"--numerics {name} {why}; fields: {allowed}")
        default = fields[name]
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise UsageError(f"--numerics {name} takes true or false; got {text!r}")
            out[name] = text.lower() in ("true", "1", "yes")
        elif isinstance(default, int):
            try:
                out[name] = int(text)
            except ValueError:
                raise UsageError(f"--numerics {name} takes an integer; got {text!r}") from None
        elif isinstance(default, str):
            out[name] = text
        else:
            raise UsageError(f"--numerics {name} cannot be set from the command line")
    try:
        dataclasses.replace(REFERENCE, **out)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--numerics: {e}") from None
    return out


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{name} must be at least 1; got {value}")


def _batches(args, cfg) -> list[int]:
    if args.batches is None:
        return [cfg.data.prompts_per_step * cfg.grpo.num_generations]
    return _counts("--batches", args.batches, "row counts, e.g. 1,8,32")


def _counts(option: str, text: str, what: str) -> list[int]:
    try:
        counts = [int(b) for b in text.split(",")]
    except ValueError:
        raise UsageError(f"{option} {text!r} must be comma-separated {what}") from None
    for b in counts:
        _positive(f"each of {option}", b)
    return counts


def _capacities(args, cfg) -> list[int]:
    if args.capacities is None:
        from jaxrl.sampling.buckets import bucket

        return [bucket(cfg.data.max_prompt_tokens) + bucket(cfg.sampling.max_new_tokens)]
    return _counts("--capacities", args.capacities, "cache column counts, e.g. 2048,8192")


def _forms(args) -> list[str] | None:
    if args.forms is None:
        return None
    from jaxrl.bench.decode_forms import FORMS

    forms = args.forms.split(",")
    for form in forms:
        if form not in FORMS:
            raise UsageError(f"--forms takes forms of {', '.join(FORMS)}; got {form!r}")
    if len(set(forms)) < len(forms):
        raise UsageError(f"--forms names each form once; got {args.forms}")
    return forms


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
        if args.numerics:
            raise UsageError("--numerics applies to jaxrl bench sample, engine and decode; "
                             "step runs the numerics a run takes")
    numerics_overrides(args.numerics)
    if args.mode == "decode":
        _batches(args, cfg)
        for c in _capacities(args, cfg):
            if c < args.steps + 2:
                raise UsageError(f"--capacities {c} must exceed --steps {args.steps} + 1: the "
                                 "slots hold filled columns and decode --steps more")
        _positive("--steps", args.steps)
        if not 0 < args.fill < 1:
            raise UsageError(f"--fill must be in (0, 1); got {args.fill}")
        forms = _forms(args)
        if forms and any(f != "dense" for f in forms) and cfg.quant.mode == "none":
            raise UsageError("--forms block, split and kernels run NF4 kernels: quant.mode "
                             "must not be none")
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
    device = jax.devices()[0]
    peaks = device_peaks(device)
    info = {"mode": args.mode, "device_kind": device.device_kind, "platform": device.platform,
            "devices": jax.device_count(), "jax": jax.__version__, "jaxrl": __version__,
            "config_hash": config_hash(cfg), "model": cfg.model.path,
            "quant": cfg.quant.mode, "dequantize": cfg.quant.dequantize,
            "lora_rank": cfg.lora.rank, "dtype": cfg.model.dtype,
            "peaks": None if peaks is None else vars(peaks)}
    overrides = numerics_overrides(args.numerics)
    if overrides:
        info["numerics_overrides"] = overrides
    if args.mode == "decode":
        return _finish(args, info, _decode(args, cfg, info, peaks))
    subject = load_subject(cfg, log=lambda m: print(m, file=sys.stderr))
    if overrides:
        import dataclasses

        subject.numerics = dataclasses.replace(subject.numerics, **overrides)
    info["weights"] = subject.weights
    print(_header(info, subject.spec))
    if args.mode == "sample":
        rows = [runs.sample_batch(subject, b, prompt_tokens, args.repeats, peaks, args.group,
                                  _trace(args, b), args.adapters)
                for b in _batches(args, cfg)]
    elif args.mode == "step":
        rows = [runs.grpo_step(subject, args.steps, prompt_tokens, _policies(args),
                               _trace(args))]
    else:
        mean = args.mean_new_tokens or max(1.0, cfg.sampling.max_new_tokens / 4)
        rows = runs.engine(subject, args.requests, mean, prompt_tokens, args.static)
    return _finish(args, info, rows)


def _finish(args, info: dict, rows: list[dict]) -> int:
    """Prints the table (and profiles), appends the JSON lines; 1 if a decode row failed."""
    print(TABLES[args.mode](rows))
    if args.profile:
        _print_profiles(args, rows)
    if args.out:
        when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(args.out, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({**info, "time": when, **row}, default=str) + "\n")
    failed = [r for r in rows if str(r.get("status", "ok")).startswith("failed")]
    if failed:
        print(f"jaxrl bench decode: {len(failed)} of {len(rows)} rows failed", file=sys.stderr)
    return 1 if failed else 0


def _decode(args, cfg, info: dict, peaks) -> list[dict]:
    """`jaxrl bench decode`: the forms' params loaded (random or a checkpoint's, as
    `load_subject` loads them), then `jaxrl.bench.decode_forms.time_forms`."""
    import dataclasses

    import jax

    from jaxrl.backends.numerics import numerics_of
    from jaxrl.bench import decode_forms
    from jaxrl.bench.subject import is_checkpoint
    from jaxrl.devices import device_memory
    from jaxrl.hf.loader import load_model
    from jaxrl.hf.peft_io import start_lora

    log = functools.partial(print, file=sys.stderr)
    overrides = numerics_overrides(args.numerics)
    base = numerics_of(None)
    names = _forms(args)
    key = jax.random.PRNGKey(cfg.run.seed)
    checkpoint = is_checkpoint(cfg.model.path)
    weights = "checkpoint" if checkpoint else "random"
    info["weights"] = (f"checkpoint {cfg.model.path}" if checkpoint
                       else f"random weights (architecture of {cfg.model.path})")
    params = {}

    def load(quant):
        return load_model(cfg.model.path, dtype=cfg.model.dtype, quant=quant, numerics=base,
                          weights=weights, key=key, log=log)

    if names is None:  # the run's layout and the platform's numerics
        model = load(cfg.quant)
        quantized = cfg.quant.mode != "none" and base.dequantize_strategy(cfg.quant) != "once"
        form = decode_forms.Form("platform", dataclasses.replace(base, **overrides),
                            "nf4" if quantized else "dense")
        forms, params[form.quant] = [form], model.params
    else:
        forms = decode_forms.decode_forms(base, names, overrides)
        for quant in {f.quant for f in forms}:
            strategy = "per_layer" if quant == "nf4" else "once"
            model = load(dataclasses.replace(cfg.quant, dequantize=strategy)
                         if cfg.quant.mode != "none" else None)
            params[quant] = model.params
        left_out = [n for n in names if n not in {f.name for f in forms}]
        if left_out:
            log(f"forms left out (this tree's numerics has no such fields): {left_out}")
    spec = model.spec
    print(_header(info, spec))
    lora = start_lora(cfg.lora, spec, jax.random.fold_in(key, 1 << 20))
    capacity = device_memory(jax.local_devices()[:1])[0]

    def command(batch, columns, form):
        parts = ["jaxrl bench decode", f"--batches {batch}", f"--capacities {columns}",
                 f"--fill {args.fill}", f"--steps {args.steps}"]
        parts += [f"--forms {form}"] if names is not None else []
        parts += [f"--config {args.config}"] if args.config else []
        parts += [f"--numerics {n}" for n in args.numerics]
        return " ".join(parts + list(args.overrides))

    def trace(batch, columns, form):
        return decode_forms.traced_into(Path(args.profile) / f"b{batch}-c{columns}-{form}")

    return decode_forms.time_forms(
        spec, forms, params, lora, batches=_batches(args, cfg),
        capacities=_capacities(args, cfg), fill=args.fill, steps=args.steps,
        repeats=args.repeats, seed=cfg.run.seed, device_memory=capacity, peaks=peaks,
        structure_counts=args.structure, trace=trace if args.profile else None,
        command=command, log=log)


def _profile_dir(args, row: dict) -> Path:
    """Where the traced call of a result goes: --profile/batch-B (sample), --profile/step, or
    --profile/bB-cC-FORM (decode)."""
    if args.mode == "decode":
        return Path(args.profile) / f"b{row['batch']}-c{row['capacity']}-{row['form']}"
    return Path(args.profile) / (f"batch-{row.get('batch', 0)}" if args.mode == "sample"
                                 else "step")


def _trace(args, batch: int = 0):
    """The context a timed call runs in: a profile into `_profile_dir`, or nothing."""
    if not args.profile:
        return contextlib.nullcontext
    from jaxrl.bench.profile import traced

    return functools.partial(traced, _profile_dir(args, {"batch": batch}))


def _print_profiles(args, rows: list[dict]) -> None:
    """Each traced call's device time by program and op, also into its result row."""
    from jaxrl.bench.profile import op_table, op_times

    for row in rows:
        if args.mode == "decode" and "profile" not in row:
            continue  # not run: skipped or failed
        directory = _profile_dir(args, row)
        row["profile"] = {**row.get("profile", {}), "dir": str(directory),
                          "ops": op_times(directory)}
        print(f"\ndevice time of the traced call ({directory}):")
        if args.mode == "decode":
            p = row["profile"]
            print(f"{p.get('events', 0)} device events, "
                  f"{p.get('per_layer_step', 0):.1f} per layer and step, idle "
                  f"{100 * p.get('idle_share', 0):.1f}% of the call's span")
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


def decode_table(rows: list[dict]) -> str:
    lines = ["| form | batch | capacity | filled | compile (s) | ms/step | tok/s | "
             "GB moved/step | GB/s | of peak BW | per layer: dots / custom calls / launches |",
             "| --- " + "| ---: " * 9 + "| --- |"]
    for r in rows:
        ok = r.get("status") == "ok"
        layer = ((r.get("structure") or {}).get("layer") or {})
        compiled = (((r.get("structure") or {}).get("compiled") or {}).get("layer") or {})
        shape = "-" if not layer else (f"{layer['dots']} / {sum(layer['custom_calls'].values())}"
                                       f" / {compiled.get('launches', '-')}")
        figures = (f"{r['step_ms']:.3f} | {r['tok_s']:.1f} | {r['bytes']['total'] / 1e9:.4f} | "
                   f"{r['bandwidth'] / 1e9:.1f} | {_share(r['bandwidth_share'])}" if ok
                   else f"{r.get('status', '')} | - | - | - | -")
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        lines.append(f"| {r['form']} | {r['batch']} | {r['capacity']} | {r['filled']} | "
                     f"{compile_s} | {figures} | {shape} |")
    return "\n".join(lines)


def engine_table(rows: list[dict]) -> str:
    lines = ["| batching | requests | slots | useful tokens | first pass (s, compiles) | "
             "wall (s) | useful tok/s | utilization |", "| --- " + "| ---: " * 7 + "|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['requests']} | {r['slots']} | {r['useful_tokens']} | "
                     f"{r['first_pass_s']:.1f} | {r['wall_s']:.2f} | {r['useful_tok_s']:.1f} | "
                     f"{r['utilization']:.2f} |")
    return "\n".join(lines)


TABLES = {"sample": sample_table, "step": step_table, "engine": engine_table,
          "decode": decode_table}

"""The decode program run in each form: the bytes a decode step must move, the forms
`jaxrl bench decode` compares, and the decode chunk timed at a set cache fill.

Bytes (`step_bytes`): what a decode step must move whatever program runs it: the weights as
stored (NF4 codes and scales, or dense kernels; the embedding only when it is the tied LM
head, else the fed rows, left out), the adapter in the compute dtype, the filled cache columns
read (slots x filled columns x layers x 2 x KV heads x head dim x the cache dtype's bytes) and
the step's own column written. `jaxrl.bench.limits.decode_cost` counts what today's XLA
attention reads instead: every column of the capacity.

Forms (`decode_forms`): the ways to run the decode program that `jaxrl bench decode` compares:
block and split (the XLA NF4 forms over XLA attention, the chunk stopping early), kernels (the
Pallas NF4 and attention kernels and the fixed chunk, where this tree's numerics has them) and
dense (the platform's numerics over dense kernels).

Timing (`time_forms`): each (slots, capacity) case's slots are set to hold `filled` columns
(zeros: no prefill) and every slot live; each form's `generate` is compiled, then the forms take
turns, each call starting from the same fill. `check_report` gathers tools/accelerator_check.sh's
figures into one JSON value and Markdown tables.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.backends.numerics import Numerics
from jaxrl.devices import GIB, published_peaks
from jaxrl.model.families import ModelSpec

from jaxrl.bench.lowered import DecodeCase, count, numerics_fields, static_arguments


# -- bytes a decode step must move ---------------------------------------------------------------
def _leaf_bytes(tree) -> int:
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step must move (module docstring)."""

    weights: int
    adapter: int
    cache_read: int
    cache_write: int

    @property
    def total(self) -> int:
        return self.weights + self.adapter + self.cache_read + self.cache_write

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}


def step_bytes(spec: ModelSpec, params, lora, *, slots: int, filled: int,
               cache_dtype) -> StepBytes:
    """What one decode step of `slots` slots, each holding `filled` cache columns, must move
    (module docstring). params: as held (arrays or ShapeDtypeStructs, NF4 QTensors, held bits);
    lora: a `Lora` (concrete or abstract) or None."""
    weights = _leaf_bytes(params)
    if not spec.tie_word_embeddings:
        weights -= _leaf_bytes(params["embed_tokens"])
    compute = jnp.dtype(jax.tree_util.tree_leaves(params["embed_tokens"])[0].dtype)
    if compute == jnp.uint16:  # a bfloat16 table held as its bits
        compute = jnp.dtype(jnp.bfloat16)
    adapter = 0 if lora is None else sum(
        math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(lora.weights)
    ) * compute.itemsize
    column = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * jnp.dtype(
        cache_dtype).itemsize
    return StepBytes(weights=weights, adapter=adapter, cache_read=slots * filled * column,
                     cache_write=slots * column)


def bandwidth_share(nbytes: float, seconds: float, device_kind: str) -> float | None:
    """Achieved bandwidth (nbytes / seconds) as a share of the device's published peak
    (`jaxrl.devices.published_peaks`, by device_kind), None for a device without one."""
    peaks = published_peaks(device_kind)
    return None if peaks is None else nbytes / seconds / peaks.bandwidth


# -- the forms compared --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Form:
    """A way to run the decode program: its numerics and whether its weights are NF4 or
    dense."""

    name: str
    numerics: Numerics
    quant: str


# A form's numerics fields (those the Numerics of this tree has): the XLA forms of the NF4
# product over XLA attention with the early-stopping chunk, and the Pallas kernels; values a
# Numerics rejects leave the form out.
FORM_FIELDS = {
    "block": ({"nf4_decode": "block", "attention": "xla", "fixed_chunk": False},),
    "split": ({"nf4_decode": "split", "attention": "xla", "fixed_chunk": False},),
    "kernels": ({"nf4_decode": "kernel"},
                {"attention": "pallas_gpu"}, {"fixed_chunk": True}),
}
FORMS = ("block", "split", "kernels", "dense")


def _replace(numerics: Numerics, fields: dict) -> Numerics | None:
    known = {f.name for f in dataclasses.fields(numerics)}
    fields = {k: v for k, v in fields.items() if k in known}
    if not fields:
        return None
    try:
        return dataclasses.replace(numerics, **fields)
    except (ValueError, TypeError):
        return None


def decode_forms(base: Numerics, names=FORMS, overrides: dict | None = None,
                 interpret: bool | None = None) -> list[Form]:
    """The forms `names` over the platform's numerics `base`, each with `overrides` applied
    last: "dense" is `base` with dense weights; an NF4 form sets its FORM_FIELDS (every group
    of them this tree's Numerics accepts; a form none of whose groups it accepts is left out).
    interpret: the Pallas kernels in interpret mode (default: where jax's backend is the
    CPU)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    out = []
    for name in names:
        if name not in FORMS:
            raise ValueError(f"form {name!r} is not one of {FORMS}")
        numerics, quant = base, "dense" if name == "dense" else "nf4"
        if name != "dense":
            applied = 0
            for group in FORM_FIELDS[name]:
                changed = _replace(numerics, group)
                if changed is not None:
                    numerics, applied = changed, applied + 1
            if not applied:
                continue
            if name == "kernels" and interpret:
                numerics = _replace(numerics, {"interpret": True}) or numerics
        if overrides:
            numerics = dataclasses.replace(numerics, **overrides)
        out.append(Form(name, numerics, quant))
    return out


# -- timing ----------------------------------------------------------------------------------------
def _filled_state(spec, params, numerics, slots: int, capacity: int, filled: int, seed: int):
    """Slots each holding `filled` columns of zeros, live, with a budget past any chunk, random
    last tokens and keys, default decoding."""
    from jaxrl.sampling.programs import init_slots

    state = init_slots(params, spec=spec, slots=slots, capacity=capacity, numerics=numerics)
    rng = np.random.default_rng(seed)
    return _refill(state, filled).replace(
        last=jnp.asarray(rng.integers(0, spec.vocab_size, slots), jnp.int32),
        keys=jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(
            jnp.arange(slots)),
        budget=jnp.full((slots,), 1 << 30, jnp.int32))


def _refill(state, filled: int):
    """state with every slot back at `filled` columns, live, nothing generated."""
    s = state.last.shape[0]
    return state.replace(cache=state.cache.replace(index=jnp.full((s,), filled, jnp.int32)),
                         live=jnp.ones((s,), bool), count=jnp.zeros((s,), jnp.int32))


def memory_needed(spec: ModelSpec, params_bytes: int, slots: int, capacity: int,
                  cache_dtype) -> int:
    """Bytes a timing case holds: the params of its forms and one full cache."""
    column = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * jnp.dtype(
        cache_dtype).itemsize
    return params_bytes + slots * capacity * column


def time_forms(spec: ModelSpec, forms: list[Form], params: dict[str, Any], lora, *,
               batches, capacities, fill: float = 0.5, steps: int = 16, repeats: int = 3,
               seed: int = 0, device_memory: int | None = None, peaks=None,
               structure_counts: bool = False, trace=None, command=None,
               log=lambda message: None) -> list[dict]:
    """Rows of ms per decode step for each (batch, capacity, form): slots holding
    fill x capacity columns (module docstring), `steps` steps per call, the median of `repeats`
    calls after a warm-up one, the forms taking turns. params: by quant ("nf4", "dense"), as
    held for the forms' numerics. Each row has the bytes a step must move and their share of
    `peaks` (`jaxrl.devices.Peaks`); a case whose cache and params need more than
    `device_memory` bytes is a skipped row, a form that fails a failed one. structure_counts:
    each row also holds `count` of its program; trace(batch, capacity, form): a context
    (a profile) one more call of each form runs inside, or None; command(batch, capacity,
    form): the command that gives the row alone."""
    rows = []
    held = sum(_leaf_bytes(params[q]) for q in {f.quant for f in forms})
    dtype = jnp.dtype(jax.tree_util.tree_leaves(params[forms[0].quant]["embed_tokens"])[0].dtype)
    if dtype == jnp.uint16:
        dtype = jnp.dtype(jnp.bfloat16)
    for capacity in capacities:
        filled = max(1, min(capacity - steps - 1, round(fill * capacity)))
        for batch in batches:
            base = {"batch": batch, "capacity": capacity, "filled": filled, "steps": steps}
            row_of = {f.name: {**base, "form": f.name, "quant": f.quant,
                               "numerics": numerics_fields(f.numerics),
                               "command": None if command is None else command(
                                   batch, capacity, f.name)} for f in forms}
            cache_dtypes = {f.numerics.cache_dtype(dtype) for f in forms}
            need = max(memory_needed(spec, held, batch, capacity, c) for c in cache_dtypes)
            if device_memory is not None and need > 0.9 * device_memory:
                why = (f"skipped: needs {need / GIB:.1f} GiB (params and a full cache) of "
                       f"{device_memory / GIB:.1f} GiB")
                rows += [{**r, "status": why} for r in row_of.values()]
                log(f"batch {batch}, capacity {capacity}: {why}")
                continue
            rows += _time_case(spec, forms, params, lora, batch, capacity, filled, steps,
                               repeats, seed, peaks, structure_counts, trace, row_of, log)
    return rows


def _failure(e: Exception) -> str:
    """A row's status for an exception: out of memory is a skip, anything else a failure."""
    if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
        return f"skipped: out of memory ({str(e)[:300]})"
    return f"failed: {type(e).__name__}: {str(e)[:500]}"


def _time_case(spec, forms, params, lora, batch, capacity, filled, steps, repeats, seed, peaks,
               structure_counts, trace, row_of, log) -> list[dict]:
    """Lowers each form's program in turn, compiles them at once (threads: XLA compiles
    without the interpreter lock), then times them taking turns (`time_forms`)."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxrl.sampling.programs import generate

    states, makers, lowered, compiled = {}, {}, {}, {}
    for form in forms:
        p = params[form.quant]
        try:
            key = jnp.dtype(form.numerics.cache_dtype(
                jax.tree_util.tree_leaves(p["embed_tokens"])[0].dtype)).name
            if key not in states:
                makers[key] = functools.partial(_filled_state, spec, p, form.numerics, batch,
                                                capacity, filled, seed)
                states[key] = makers[key]()
            case = DecodeCase(spec, form.numerics, batch, capacity, form.quant, steps=steps)
            start = time.perf_counter()
            lowered[form.name] = (generate.lower(states[key], p, lora, **static_arguments(case)), key,
                                  time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001  (a form that fails is a result)
            row_of[form.name]["status"] = _failure(e)
            log(f"batch {batch}, capacity {capacity}, {form.name}: {row_of[form.name]['status']}")

    def build(name):
        start = time.perf_counter()
        return lowered[name][0].compile(), time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=max(1, len(lowered))) as pool:
        futures = {name: pool.submit(build, name) for name in lowered}
    for name, future in futures.items():
        row = row_of[name]
        try:
            program, seconds = future.result()
            compiled[name] = (program, lowered[name][1])
            row["compile_s"] = lowered[name][2] + seconds
            if structure_counts:
                row["structure"] = count(lowered[name][0].as_text(), spec.num_layers,
                                         program.as_text())
        except Exception as e:  # noqa: BLE001
            row["status"] = _failure(e)
            log(f"batch {batch}, capacity {capacity}, {name}: {row['status']}")
    runs = {name: [] for name in compiled}

    def call(name):
        program, key = compiled[name]
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(states[key])):
            states[key] = makers[key]()  # a failed call consumed the donated state
        states[key] = jax.block_until_ready(_refill(states[key], filled))
        start = time.perf_counter()
        states[key], chunk = program(states[key], params[row_of[name]["quant"]], lora)
        jax.block_until_ready(chunk)
        return time.perf_counter() - start

    for i in range(repeats + 1):
        for name in list(runs):
            try:
                seconds = call(name)
            except Exception as e:  # noqa: BLE001
                row_of[name]["status"] = _failure(e)
                del runs[name]
                continue
            if i:
                runs[name].append(seconds)
    if trace is not None:
        for name in runs:
            with trace(batch, capacity, name) as directory:
                call(name)
            row_of[name]["profile"] = trace_summary(directory, steps, spec.num_layers)
    out = []
    for form in forms:
        row = row_of[form.name]
        if runs.get(form.name):
            seconds = statistics.median(runs[form.name]) / steps
            key = compiled[form.name][1]
            moved = step_bytes(spec, params[form.quant], lora, slots=batch, filled=filled,
                               cache_dtype=key)
            bandwidth = moved.total / seconds
            row.update(status="ok", step_ms=1e3 * seconds,
                       runs_ms=[1e3 * s / steps for s in runs[form.name]],
                       tok_s=batch / seconds, bytes=moved.as_dict(), bandwidth=bandwidth,
                       bandwidth_share=None if peaks is None else bandwidth / peaks.bandwidth)
            log(f"batch {batch}, capacity {capacity}, {form.name}: {1e3 * seconds:.3f} ms/step")
        out.append(row)
    return out


# -- profiles ------------------------------------------------------------------------------------
_CONTROL = ("while", "conditional", "cond", "call")


def trace_summary(directory, steps: int, layers: int) -> dict:
    """Of the newest trace under `directory` (`jaxrl.bench.profile.traced`), the decode
    program's device events: how many ran per step and per layer-step, and the share of their
    span (first start to last end) in which none ran (idle)."""
    from jaxrl.bench.profile import _events

    events = []
    for event in _events(directory):
        args = event.get("args") or {}
        if event.get("ph") != "X" or "hlo_module" not in args or "hlo_op" not in args:
            continue
        if "generate" not in args["hlo_module"] or args["hlo_op"].split(".")[0] in _CONTROL:
            continue
        start = float(event.get("ts", 0.0))
        events.append((start, start + float(event.get("dur", 0.0))))
    if not events:
        return {"events": 0}
    events.sort()
    busy, (lo, hi) = 0.0, events[0]
    first, last = events[0][0], max(e for _, e in events)
    for s, e in events[1:]:
        if s > hi:
            busy, (lo, hi) = busy + hi - lo, (s, e)
        else:
            hi = max(hi, e)
    busy += hi - lo
    span = last - first
    return {"events": len(events), "per_step": len(events) / steps,
            "per_layer_step": len(events) / (steps * layers), "span_us": span,
            "busy_us": busy, "idle_share": 1 - busy / span if span > 0 else 0.0}


@contextlib.contextmanager
def traced_into(directory):
    """A profile of what runs inside into `directory`, which it yields."""
    from jaxrl.bench.profile import traced

    with traced(directory):
        yield directory


# -- the Markdown table ----------------------------------------------------------------------------
def markdown_rows(rows: list[dict], device: str, jax_version: str) -> str:
    """A Markdown table of decode rows (`time_forms`): device, jax version, the command, the
    form, batch, capacity and fill, ms per step, and the share of peak HBM bandwidth by the
    bytes a step must move."""
    lines = ["| device | jax | command | form | batch | capacity | filled | ms/step | "
             "MB moved/step | share of peak HBM BW |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ok = r.get("status") == "ok"
        share = r.get("bandwidth_share")
        ms = f"{r['step_ms']:.3f}" if ok else r.get("status", "")
        moved = f"{r['bytes']['total'] / 1e6:.1f}" if ok else "-"
        of_peak = "-" if not ok or share is None else f"{100 * share:.1f}%"
        lines.append(f"| {device} | {jax_version} | `{r.get('command') or ''}` | {r['form']} | "
                     f"{r['batch']} | {r['capacity']} | {r['filled']} | {ms} | {moved} | "
                     f"{of_peak} |")
    return "\n".join(lines)


# -- the accelerator check's report -------------------------------------------------------------
def _json_lines(path) -> list[dict]:
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_report(directory) -> tuple[dict, str]:
    """The JSON and Markdown of tools/accelerator_check.sh from what its steps wrote into
    `directory`: decode.jsonl and profile.jsonl (`jaxrl bench decode`), step.jsonl (`jaxrl
    bench step`), structure.json (tools/decode_structure.py) and commands.tsv (step name, tab,
    command). Missing files leave their parts empty."""
    import json
    from pathlib import Path

    directory = Path(directory)
    decode, profile = _json_lines(directory / "decode.jsonl"), _json_lines(
        directory / "profile.jsonl")
    step = _json_lines(directory / "step.jsonl")
    structure_path = directory / "structure.json"
    structure = json.loads(structure_path.read_text()) if structure_path.is_file() else {}
    commands = {}
    if (directory / "commands.tsv").is_file():
        for line in (directory / "commands.tsv").read_text().splitlines():
            name, _, command = line.partition("\t")
            commands[name] = command
    first = (decode or step or profile or [{}])[0]
    device = f"{first.get('devices', '?')} x {first.get('device_kind', '?')}"
    version = first.get("jax") or structure.get("jax", "?")
    report = {"device": device, "jax": version, "jaxrl": first.get("jaxrl"),
              "decode": decode, "step": step, "profile": profile, "structure": structure,
              "commands": commands}
    lines = [f"Accelerator check on {device}, jax {version} (tools/accelerator_check.sh).", "",
             "Decode steps at a set fill (random weights, LoRA; bytes a step must move: weights "
             "as stored, adapter, filled cache columns):", "",
             markdown_rows(decode, device, version)]
    if step:
        lines += ["", "| device | jax | command | rollout (s) | reference (s) | update (s) | "
                  "step (s) | first step (s) |", "| --- | --- | --- | ---: | ---: | ---: | "
                  "---: | ---: |"]
        for r in step:
            m, f = r["median_s"], r["first_step_s"]
            lines.append(f"| {device} | {version} | `{commands.get('bench_step', '')}` | "
                         f"{m['rollout']:.2f} | {m['reference']:.2f} | {m['update']:.2f} | "
                         f"{m['step']:.2f} | {f['step']:.2f} |")
    traced = [r for r in profile if r.get("profile")]
    if traced:
        lines += ["", "| device | jax | command | form | ms/step | device events per layer "
                  "and step | idle share of the call |", "| --- | --- | --- | --- | ---: | ---: "
                  "| ---: |"]
        for r in traced:
            p = r["profile"]
            ms = f"{r['step_ms']:.3f}" if r.get("status") == "ok" else r.get("status", "")
            lines.append(f"| {device} | {version} | `{r.get('command') or ''} --profile DIR` | "
                         f"{r['form']} | {ms} | {p.get('per_layer_step', 0):.1f} | "
                         f"{100 * p.get('idle_share', 0):.1f}% |")
    results = structure.get("results", {})
    if results:
        lines += ["", f"Structure of the decode program (`{commands.get('structure', '')}`), "
                  "per layer of a decode step and per chunk:", "",
                  "| target | form | dots / layer | custom calls / layer | compiled launches / "
                  "layer | data-dependent loops | conditionals | host transfers |",
                  "| --- | --- | ---: | --- | ---: | ---: | ---: | --- |"]
        for target, forms in results.items():
            for form, r in forms.items():
                if "error" in r:
                    lines.append(f"| {target} | {form} | {r['error'][:120]} | | | | | |")
                    continue
                layer, chunk = r["layer"] or {}, r["chunk"]
                launches = ((r.get("compiled") or {}).get("layer") or {}).get("launches", "-")
                calls = ", ".join(f"{k} {v}" for k, v in layer.get("custom_calls", {}).items())
                lines.append(f"| {target} | {form} | {layer.get('dots', '-')} | {calls or '-'} | "
                             f"{launches} | {chunk['while_loops']['data_dependent']} | "
                             f"{chunk['conditionals']} | {chunk['host_transfers'] or '-'} |")
    return report, "\n".join(lines) + "\n"


def write_check_report(directory) -> None:
    """`check_report` of `directory` into accelerator_check.json and accelerator_check.md
    there; prints the Markdown."""
    import json
    from pathlib import Path

    report, markdown = check_report(directory)
    Path(directory, "accelerator_check.json").write_text(json.dumps(report, indent=1,
                                                                    default=str))
    Path(directory, "accelerator_check.md").write_text(markdown)
    print(markdown)

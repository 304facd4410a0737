"""`jaxrl investigate --case FILE | --generate N --model URL_OR_PATH [--baseline cot] ...`:
Graph of States investigations of diagnosis cases, with reports, graphs, traces and metrics."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxrl.config import DTYPES, QUANT_MODES, UsageError

_BUDGET_FLAGS = (("gap_delta", float, 0.3, "confidence lead of the top hypothesis to drill down"),
                 ("min_support", int, 3, "supporting evidence the top hypothesis needs"),
                 ("max_steps_per_level", int, 2, "steps at one level before drilling down"),
                 ("max_steps", int, 3, "investigation steps per case"),
                 ("retrieval_steps", int, 3, "tool requests per expert call"))
_LIMIT_FLAGS = (("max_tokens", int, 256, "completion tokens per model reply"),
                ("token_budget", int, 4096, "completion tokens per case (the baseline's too)"),
                ("retries", int, 1, "extra attempts after an invalid JSON reply"),
                ("experts_per_step", int, 2, "expert calls the plan may make per step"))


def register(sub) -> None:
    p = sub.add_parser(
        "investigate", help="diagnose cases with Graph of States agents (and a baseline)",
        description="Run Graph of States investigations (a causal-graph belief state and a "
        "state machine over hypothesis levels, with central and expert agents asking the "
        "model for JSON) on diagnosis cases whose evidence is revealed only on request. "
        "Writes per case a report, the graph (JSON and PNG) and the step trace, plus "
        "results.jsonl and metrics.json (Match, Relevant, evidence-fabrication rate, "
        "backtracks, steps, tokens, cost) under --out.")
    cases = p.add_mutually_exclusive_group(required=True)
    cases.add_argument("--case", metavar="FILE", help="cases as JSON (one or a list) or JSONL")
    cases.add_argument("--generate", type=int, metavar="N", help="generate N offline cases")
    p.add_argument("--seed", type=int, default=0, help="generation and sampling seed (0)")
    p.add_argument("--model", required=True, metavar="URL_OR_PATH",
                   help="an OpenAI-compatible base URL (http[s]://.../v1), a local HF "
                   "directory, a hub id, or `default`")
    p.add_argument("--model-name", default=None, help="model name at the URL (default: the "
                   "server's first model)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the URL's API key (never logged)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request at the URL")
    p.add_argument("--max-retries", type=int, default=2,
                   help="retries of a failed request at the URL (connection errors, 5xx)")
    p.add_argument("--adapter", default=None, metavar="DIR", help="PEFT adapter (local model)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="local model dtype")
    p.add_argument("--quant", choices=QUANT_MODES, default="none", help="local model quant")
    p.add_argument("--temperature", type=float, default=0.0, help="local sampling (0 = greedy)")
    p.add_argument("--roles", default=None, metavar="DOMAIN_OR_FILE",
                   help="roles and prompts: a built-in domain or a YAML file (default: the "
                   "cases' domain)")
    p.add_argument("--baseline", choices=("cot",), default=None,
                   help="also run the chain-of-thought baseline on the same cases")
    for name, kind, default, text in _BUDGET_FLAGS + _LIMIT_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default,
                       help=f"{text} ({default})")
    p.add_argument("--price-in", type=float, default=0.0, help="USD per 1M prompt tokens")
    p.add_argument("--price-out", type=float, default=0.0, help="USD per 1M completion tokens")
    p.add_argument("--out", default="runs/investigate", metavar="DIR", help="output directory")
    p.set_defaults(func=_investigate)


def _settings(args):
    from jaxrl.agents.agents import Limits
    from jaxrl.agents.state import Budget

    for name, _, _, _ in _LIMIT_FLAGS:
        if getattr(args, name) < (0 if name == "retries" else 1):
            raise UsageError(f"--{name.replace('_', '-')} must be >= "
                             f"{0 if name == 'retries' else 1}; got {getattr(args, name)}")
    try:
        budget = Budget(**{n: getattr(args, n) for n, *_ in _BUDGET_FLAGS})
    except ValueError as e:
        raise UsageError(f"--{str(e).replace('_', '-')}") from None
    return budget, Limits(**{n: getattr(args, n) for n, *_ in _LIMIT_FLAGS})


def _cases(args):
    from jaxrl.envs.base import CaseError, load_cases
    from jaxrl.envs.diagnosis import generate_cases

    if args.generate is not None:
        if args.generate < 1:
            raise UsageError(f"--generate must be >= 1; got {args.generate}")
        return generate_cases(args.generate, args.seed)
    try:
        return load_cases(args.case)
    except CaseError as e:
        raise UsageError(str(e)) from None


def _roles(args, cases):
    from jaxrl.agents.roles import RolesError, load_roles

    domains = sorted({c.domain for c in cases})
    if args.roles is None and len(domains) > 1:
        raise UsageError(f"the cases span domains {domains}; run one domain at a time or "
                         "pass --roles")
    tools = set.intersection(*(set(c.tools) for c in cases))
    try:
        return load_roles(args.roles or domains[0], tools)
    except RolesError as e:
        raise UsageError(str(e)) from None


def _client(args):
    from jaxrl.agents.chat import LocalChat, OpenAIChat

    if args.model.startswith(("http://", "https://")):
        return OpenAIChat(args.model, args.model_name, args.api_key_env, args.timeout_s,
                          args.max_retries)
    from jaxrl.hf.pretrained import load_pretrained

    model = load_pretrained(args.model, args.adapter, dtype=args.dtype, quant=args.quant)
    return LocalChat(model, name=str(args.model), temperature=args.temperature, seed=args.seed)


def _write_case(folder: Path, outcome) -> None:
    from jaxrl.agents.render import render

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(outcome.report, indent=2) + "\n")
    with open(folder / "trace.jsonl", "w") as f:
        f.writelines(json.dumps(event) + "\n" for event in outcome.trace)
    if outcome.graph["nodes"]:
        (folder / "graph.json").write_text(json.dumps(outcome.graph, indent=2) + "\n")
        render(outcome.graph, [p["id"] for p in outcome.report["path"]], folder / "graph.png",
               title=f"{outcome.report['case']}: {outcome.report['root_cause']}")


def run_cases(cases, client, roles, budget, limits, methods, out: Path,
              prices=(0.0, 0.0)) -> dict:
    """Runs every method on every case, writing as it goes; returns the summary per method."""
    from jaxrl.agents.baseline import chain_of_thought
    from jaxrl.agents.gos import investigate
    from jaxrl.agents.metrics import case_metrics, summarize

    run = {"gos": lambda c: investigate(c, client, roles, budget, limits),
           "cot": lambda c: chain_of_thought(c, client, roles, limits)}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "cases.jsonl", "w") as f:
        f.writelines(json.dumps(c.to_json()) + "\n" for c in cases)
    rows: dict[str, list] = {m: [] for m in methods}
    with open(out / "results.jsonl", "w") as results:
        for case in cases:
            for method in methods:
                outcome = run[method](case)
                _write_case(out / method / case.id, outcome)
                row = case_metrics(case, outcome, *prices)
                rows[method].append(row)
                results.write(json.dumps(row) + "\n")
                results.flush()
                print(f"{method} {case.id}: match {int(row['match'])} relevant "
                      f"{int(row['relevant'])} answer {row['answer']!r} (gold {row['gold']!r}, "
                      f"{row['reason']})", file=sys.stderr)
    summary = {m: summarize(r) for m, r in rows.items()}
    (out / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _table(summary: dict) -> str:
    keys = ("cases", "match", "relevant", "fabrication_rate", "backtracks", "steps", "calls",
            "invalid_replies", "tokens", "cost_usd")
    lines = [f"{'method':8}" + "".join(f"{k:>17}" for k in keys)]
    for method, s in summary.items():
        lines.append(f"{method:8}" + "".join(
            f"{s[k]:>17}" if isinstance(s[k], int) else f"{s[k]:>17.3f}" for k in keys))
    return "\n".join(lines)


def _investigate(args: argparse.Namespace) -> int:
    import openai

    budget, limits = _settings(args)
    cases = _cases(args)
    roles = _roles(args, cases)
    out = Path(args.out)
    methods = ("gos",) + ((args.baseline,) if args.baseline else ())
    try:
        client = _client(args)
        summary = run_cases(cases, client, roles, budget, limits, methods, out,
                            (args.price_in, args.price_out))
    except openai.APIError as e:
        print(f"jaxrl investigate: error: the model at {args.model} failed ({type(e).__name__}"
              f"); the finished cases are kept in {out}/results.jsonl", file=sys.stderr)
        return 1
    print(_table(summary))
    print(f"jaxrl investigate: {len(cases)} case(s); reports, graphs and traces in {out}",
          file=sys.stderr)
    return 0

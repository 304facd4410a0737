"""`jaxrl rationale extract | filter | sft-data`: RATIONALYST's data pipeline."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from jaxrl.commands import read_input_objects
from jaxrl.config import DTYPES, QUANT_MODES, UsageError


def register(sub) -> None:
    parser = sub.add_parser(
        "rationale", help="extract, filter and prepare implicit rationales (RATIONALYST)",
        description="extract: a generator at an OpenAI-compatible endpoint inserts rationales "
        "into texts; filter: keep rationales that make the following text more predictable; "
        "sft-data: kept rationales as chat records for `jaxrl sft`.")
    verbs = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    _extract_args(verbs.add_parser(
        "extract", help="insert <BOT>rationale<EOT> into texts with a generator model",
        description="Each input line is a document ({\"text\"}) or a reasoning item "
        "({\"question\", and the solution under --text-field}). Outputs whose text without "
        "rationales differs from the input (edit similarity below --min-similarity) are "
        "dropped. Each output line: id, source, preceding, rationale, following."))
    _filter_args(verbs.add_parser(
        "filter", help="score rationales by the future text they explain; keep by threshold",
        description="For each {preceding, rationale, following} line: S = sum_i 0.9^i log p("
        "following token i | preceding [+ rationale]) with and without the rationale; output "
        "adds score_with, score_without, gain = with - without, and kept = gain >= tau of the "
        "record's source."))
    data = verbs.add_parser("sft-data", help="kept rationales as chat records for jaxrl sft",
                            description="Each kept record of `filter` output becomes "
                            "{\"messages\": [system, user: preceding, assistant: rationale]}.")
    data.add_argument("--input", required=True, metavar="FILE.jsonl", help="filter output")
    data.add_argument("--out", required=True, metavar="FILE.jsonl")
    data.set_defaults(func=_sft_data)


def _extract_args(p) -> None:
    p.add_argument("--input", required=True, metavar="FILE.jsonl")
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    p.add_argument("--base-url", required=True, help="OpenAI-compatible API, e.g. "
                   "http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the generator's model name at that API")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the API key (default OPENAI_API_KEY)")
    p.add_argument("--text-field", default="text", help="field of the text (default text)")
    p.add_argument("--question-field", default="question",
                   help="field whose presence makes a line a reasoning item (default question)")
    p.add_argument("--source", default="", help="records' source (default: each line's own)")
    p.add_argument("--max-chars", type=int, default=6000, help="characters per request")
    p.add_argument("--min-similarity", type=float, default=0.9)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=4096, help="per reply")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    p.add_argument("--max-retries", type=int, default=3)
    p.set_defaults(func=_extract)


def _filter_args(p) -> None:
    p.add_argument("--model", required=True, metavar="PATH", help="HF directory, hub id or "
                   "`default`: the probability model")
    p.add_argument("--adapter", default=None, metavar="DIR", help="PEFT LoRA adapter")
    p.add_argument("--input", required=True, metavar="FILE.jsonl")
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    p.add_argument("--tau", type=float, default=0.0, help="threshold on gain (default 0)")
    p.add_argument("--tau-for", action="append", default=[], metavar="SOURCE=T",
                   help="threshold of one source, e.g. gsm8k=1.2 (repeatable)")
    p.add_argument("--source-field", default="source")
    p.add_argument("--template", default=" {rationale}",
                   help="how the rationale is inserted after `preceding` (default ' {rationale}')")
    p.add_argument("--decay", type=float, default=0.9)
    p.add_argument("--max-following-tokens", type=int, default=128)
    p.add_argument("--tokens-per-batch", type=int, default=8192)
    p.add_argument("--kept-only", action="store_true", help="write only kept records")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--quant", choices=QUANT_MODES, default="none")
    p.set_defaults(func=_filter)


def write_objects(path: str, objects) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for value in objects:
            f.write(json.dumps(value, ensure_ascii=False) + "\n")


def _checked(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def _extract(args) -> int:
    from jaxrl.config import JudgeConfig
    from jaxrl.rationale.extract import ExtractSettings, extract
    from jaxrl.rewards.judge import Judge

    _checked(args.concurrency >= 1, f"--concurrency must be >= 1; got {args.concurrency}")
    _checked(0 < args.min_similarity <= 1,
             f"--min-similarity must be in (0, 1]; got {args.min_similarity}")
    _checked(args.max_chars >= 1, f"--max-chars must be >= 1; got {args.max_chars}")
    judge = Judge(JudgeConfig(base_url=args.base_url, model=args.model,
                              api_key_env=args.api_key_env, timeout_s=args.timeout_s,
                              max_retries=args.max_retries, concurrency=args.concurrency,
                              temperature=args.temperature, max_tokens=args.max_tokens,
                              cache=False))
    settings = ExtractSettings(text_field=args.text_field, question_field=args.question_field,
                               source=args.source, max_chars=args.max_chars,
                               min_similarity=args.min_similarity)
    records, counts = asyncio.run(extract(judge, read_input_objects(args.input), settings))
    write_objects(args.out, records)
    print("jaxrl rationale extract: " + ", ".join(f"{k} {v}" for k, v in counts.items()),
          file=sys.stderr)
    return 0


def _taus(items: list[str]) -> dict[str, float]:
    taus = {}
    for item in items:
        source, sep, value = item.partition("=")
        try:
            taus[source] = float(value)
        except ValueError:
            sep = ""
        _checked(bool(sep and source), f"--tau-for takes SOURCE=NUMBER (e.g. gsm8k=1.2); "
                 f"got {item!r}")
    return taus


def _filter(args) -> int:
    from jaxrl.hf.pretrained import load_pretrained
    from jaxrl.rationale.filter import FilterSettings, filter_records
    from jaxrl.rationale.scoring import ScoreOptions

    _checked("{rationale}" in args.template,
             f"--template must contain {{rationale}}; got {args.template!r}")
    _checked(0 < args.decay <= 1, f"--decay must be in (0, 1]; got {args.decay}")
    _checked(args.max_following_tokens >= 1 and args.tokens_per_batch >= 1,
             "--max-following-tokens and --tokens-per-batch must be >= 1")
    settings = FilterSettings(
        tau=args.tau, tau_by_source=_taus(args.tau_for), source_field=args.source_field,
        template=args.template, max_following_tokens=args.max_following_tokens,
        score=ScoreOptions(decay=args.decay, tokens_per_batch=args.tokens_per_batch))
    records = read_input_objects(args.input)
    model = load_pretrained(args.model, args.adapter, dtype=args.dtype, quant=args.quant)
    start = time.perf_counter()
    scored = filter_records(model, records, settings)
    seconds = time.perf_counter() - start
    write_objects(args.out, [r for r in scored if r["kept"] or not args.kept_only])
    kept = sum(r["kept"] for r in scored)
    errors = sum("error" in r for r in scored)
    print(f"jaxrl rationale filter: {len(scored)} records, {kept} kept, {errors} unscorable; "
          f"{len(scored) / max(seconds, 1e-9):.1f} records/s (compilation included)",
          file=sys.stderr)
    return 0


def _sft_data(args) -> int:
    from jaxrl.rationale.prompts import rationale_chat

    records = read_input_objects(args.input)
    _checked(all("kept" in r for r in records),
             f"--input {args.input!r} has lines without `kept`; run jaxrl rationale filter first")
    chats = [{"id": r.get("id"), "source": r.get("source"),
              "messages": rationale_chat(r["preceding"], r["rationale"])}
             for r in records if r["kept"]]
    write_objects(args.out, chats)
    print(f"jaxrl rationale sft-data: {len(chats)} chat records from {len(records)} lines",
          file=sys.stderr)
    return 0

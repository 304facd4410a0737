"""`jaxrl data --task NAME --n N [--seed S] --out FILE.jsonl` and `jaxrl data --list`;
`--gold-traces` writes knk / zebra puzzles as SFT chat records with their gold formal traces."""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = """Write task records as JSONL, one per line: generated tasks are made from the seed
(the same seed always gives the same records); loaded tasks are read from DATA_DIR/NAME/ and a
seeded sample of N is written. --list names every task and whether it is generated or loaded.
--split writes only the train or validation part of the records, split exactly as `jaxrl train`
splits data.tasks=[NAME:N] with data.seed=S and data.validation_fraction=F. --gold-traces
(knk, zebra) writes each puzzle as a chat record for `jaxrl sft` whose assistant reply is its
gold trace in the formal block format: the clues as (assert ...) premises, the solution's atoms
that a solver calls novel as (step K ...), then the answer."""


def register(sub) -> None:
    parser = sub.add_parser("data", help="write generated or loaded task records; list tasks",
                            description=DESCRIPTION)
    parser.add_argument("--list", action="store_true", help="list every task and exit")
    parser.add_argument("--task", metavar="NAME", help="the task to write (see --list)")
    parser.add_argument("--n", type=int, metavar="N", help="how many records")
    parser.add_argument("--seed", type=int, default=0, help="generation / sampling seed (0)")
    parser.add_argument("--difficulty", type=int, choices=(1, 2, 3), default=1,
                        help="difficulty of a generated task (1)")
    parser.add_argument("--out", metavar="FILE.jsonl", help="where to write the records")
    parser.add_argument("--split", choices=("all", "train", "validation"), default="all",
                        help="which part of the records to write (all)")
    parser.add_argument("--validation-fraction", type=float, default=0.2, metavar="F",
                        help="the validation share that --split uses, as data.validation_"
                        "fraction (0.2)")
    parser.add_argument("--gold-traces", action="store_true",
                        help="write knk / zebra puzzles as SFT chat records whose reply is the "
                        "gold formal trace")
    parser.add_argument("--data-dir", default="data",
                        help="where loaded tasks are read from: DATA_DIR/NAME/ (data)")
    parser.add_argument("--from-hub", action="store_true",
                        help="download a loaded task missing under DATA_DIR from the HF hub")
    parser.set_defaults(func=lambda args: _run(args, parser))


def task_table() -> str:
    """One line per task: its name, where its records come from, what it is."""
    from jaxrl.data.generators import GENERATORS, PLANNED
    from jaxrl.data.sources import SOURCES

    rows = [(g.name, "generated", f"{g.description} [verifier {g.verifier_kind}]")
            for g in GENERATORS.values()]
    rows += [(name, "generated (not yet available)", text) for name, text in PLANNED.items()]
    for s in SOURCES.values():
        kind = "loaded" if s.verified else "loaded (format assumed)"
        suite = f"{s.paper} {'training' if s.role == 'train' else 'evaluation'}"
        rows.append((s.name, kind, f"{s.title} [{suite}]"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {kind:<29}  {text}" for name, kind, text in rows)


def _records(args, parser) -> list[dict]:
    from jaxrl.data.generators import GENERATORS, PLANNED, GeneratorError, generate
    from jaxrl.data.loaders import load_source, sample_records
    from jaxrl.data.sources import SOURCES

    if args.task in GENERATORS:
        try:
            return generate(args.task, args.n, seed=args.seed, difficulty=args.difficulty)
        except GeneratorError as e:
            parser.error(str(e))
    if args.task in SOURCES:
        records = load_source(args.task, args.data_dir, args.from_hub)
        if args.n > len(records):
            parser.error(f"--n {args.n} is more than the {len(records)} {args.task} records")
        return sample_records(records, args.n, args.seed, args.task)
    planned = f" ({PLANNED[args.task]})" if args.task in PLANNED else ""
    parser.error(f"task {args.task!r} is not available{planned}; generated tasks: "
                 f"{', '.join(sorted(GENERATORS))}; loaded tasks: {', '.join(sorted(SOURCES))}")


def _selected(args, parser) -> list[dict]:
    """The records of --split."""
    from jaxrl.data.pipeline import split_records

    if not 0 <= args.validation_fraction < 1:
        parser.error(f"--validation-fraction must be in [0, 1); got {args.validation_fraction}")
    records = _records(args, parser)
    if args.split != "all":
        train, validation = split_records(records, args.validation_fraction, args.seed,
                                          args.task)
        records = train if args.split == "train" else validation
    return records


def _run(args, parser: argparse.ArgumentParser) -> int:
    from jaxrl.data.records import RecordError, write_jsonl
    from jaxrl.data.traces import TraceError, write_traces

    if args.list:
        print(task_table())
        return 0
    missing = [flag for flag, value in (("--task", args.task), ("--n", args.n),
                                        ("--out", args.out)) if value is None]
    if missing:
        parser.error(f"needs {', '.join(missing)} (or --list)")
    if args.n < 1:
        parser.error(f"--n must be >= 1; got {args.n}")
    try:
        write = write_traces if args.gold_traces else write_jsonl
        count = write(_selected(args, parser), args.out)
    except TraceError as e:
        parser.error(str(e))
    except RecordError as e:
        print(f"jaxrl data: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {count} {args.task} records to {args.out}", file=sys.stderr)
    return 0

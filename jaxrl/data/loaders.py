"""Loaders: the CEDAR datasets from your own copies (JSON, JSONL, Parquet or CSV files read
through `datasets`) or from the Hugging Face hub when asked and the network allows, mapped to
validated records with their verifiers. The sources and their formats are in jaxrl.data.sources.

A source NAME is read from every data file under DATA_DIR/NAME/ (searched recursively, in sorted
order), or from one file DATA_DIR/NAME.{jsonl,json,parquet,csv}. A missing dataset is a
DatasetMissingError that says where to put the file and which fields its rows need.
`sample_records` draws a seeded sample, evenly across a dataset's variants or levels.
"""
from __future__ import annotations

import os
import random
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from jaxrl.data.prompts import build_messages
from jaxrl.data.records import RecordError, make_record
from jaxrl.data.sources import SOURCES, RowError, Source

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetMissingError(FileNotFoundError):
    """A loaded task whose files are not where they should be; the message says where."""


class UnknownSourceError(ValueError):
    """A source name that no loader knows; the message lists the known ones."""


def get_source(name: str) -> Source:
    if name not in SOURCES:
        raise UnknownSourceError(f"unknown dataset {name!r}; loadable datasets: "
                                 f"{', '.join(sorted(SOURCES))}")
    return SOURCES[name]


def data_files(source: Source, data_dir: str | os.PathLike) -> list[Path]:
    """The files of `source` under data_dir (empty when there are none)."""
    base = Path(data_dir) / (source.directory or source.name)
    if base.is_dir():
        return sorted(p for p in base.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    return [base.with_name(base.name + s) for s in SUFFIXES
            if base.with_name(base.name + s).is_file()]


def _quiet(read):
    """read() without datasets' progress bars."""
    import datasets

    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        return read()
    finally:
        if not quiet:
            datasets.enable_progress_bars()


def read_rows(path: Path, json_field: str | None = None) -> list[dict]:
    """The rows of one data file, read by `datasets` in memory (its cache in a throwaway
    directory); an unreadable file is a RecordError naming it."""
    from datasets import Dataset
    from datasets.exceptions import DatasetsError

    builder = SUFFIXES[path.suffix]
    reader = {"json": Dataset.from_json, "parquet": Dataset.from_parquet,
              "csv": Dataset.from_csv}[builder]
    extra = {"field": json_field} if builder == "json" and json_field else {}
    try:
        with tempfile.TemporaryDirectory(prefix="jaxrl-datasets-") as cache:
            return _quiet(lambda: reader(str(path), cache_dir=cache, keep_in_memory=True,
                                         **extra).to_list())
    except DatasetsError as e:
        raise RecordError(f"file '{path}' cannot be read as {builder}: {e.__cause__ or e}") \
            from None


def _hub_rows(source: Source) -> list[dict]:
    import datasets

    hub_id, config, split = source.hub
    try:
        return _quiet(lambda: datasets.load_dataset(hub_id, config, split=split).to_list())
    except (OSError, ValueError) as e:
        raise DatasetMissingError(f"could not download {source.name!r} from the hub "
                                  f"({hub_id}, split {split}): {e}; put its files under the "
                                  f"data directory instead") from None


def _missing(source: Source, data_dir, from_hub: bool) -> DatasetMissingError:
    folder = Path(data_dir) / (source.directory or source.name)
    hub = ""
    if source.hub and not from_hub:
        hub = (f", or download {source.hub[0]} from the hub (needs network): data.from_hub=true "
               "in a run config, --from-hub for jaxrl data")
    elif not source.hub:
        hub = " (it is not on the Hugging Face hub)"
    return DatasetMissingError(
        f"dataset {source.name!r} ({source.title}) not found: put its JSONL, JSON, Parquet or "
        f"CSV file(s) in '{folder}/' or at '{folder}.jsonl', rows with fields {source.fields}; "
        f"get it from {source.origin}{hub}")


def _file_rows(source: Source, data_dir, from_hub: bool) -> list[tuple[str, list[dict]]]:
    files = data_files(source, data_dir)
    if files:
        return [(str(f), read_rows(f, source.json_field)) for f in files]
    if from_hub and source.hub:
        return [(f"hub:{source.hub[0]}", _hub_rows(source))]
    raise _missing(source, data_dir, from_hub)


def load_source(name: str, data_dir: str | os.PathLike = "data",
                from_hub: bool = False) -> list[dict]:
    """Every record of dataset `name`: split 'train' for CEDAR training sources, 'test' for
    evaluation sources; metadata names the file each came from."""
    source = get_source(name)
    split = "train" if source.role == "train" else "test"
    records = []
    for origin, rows in _file_rows(source, data_dir, from_hub):
        try:
            problems = source.map_rows(rows, origin)
        except RowError as e:
            sep = " " if str(e).startswith("row ") else ": "
            raise RecordError(f"file '{origin}'{sep}{e} (a {source.title} row has "
                              f"{source.fields})") from None
        for problem in problems:
            messages = problem.fields.get("messages") or build_messages(
                name, problem.verifier, **problem.fields)
            records.append(make_record(name, len(records), messages, problem.answer,
                                       problem.verifier, {**problem.metadata, "file": origin},
                                       split=split))
    return records


def sample_records(records: Sequence[dict], count: int, seed: int, name: str = "") -> list[dict]:
    """count of the records, drawn (seeded by seed and name) evenly across metadata['group'] (a
    loader's variants or levels) while a group has records left."""
    if count > len(records):
        raise ValueError(f"cannot sample {count} {name} records from {len(records)}")
    rng = random.Random(f"sample:{name}:{seed}")
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[str(record["metadata"].get("group", ""))].append(record)
    for members in groups.values():
        rng.shuffle(members)
    chosen: list[dict] = []
    order = sorted(groups)
    while len(chosen) < count:
        for key in order:
            if groups[key] and len(chosen) < count:
                chosen.append(groups[key].pop())
    return chosen

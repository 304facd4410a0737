"""Pipeline: the task pool of a run and a checkpointable grain iterator over batches of prompts.

`build_pool(cfg.data)` makes every source of `data.tasks` (generated, or loaded and sampled to
its count, stratified by the group a loader records), splits each source into train and
validation by `data.validation_fraction`, and fixes the mixture weights. `PromptIterator` mixes
the train splits on grain: each source shuffled with a seed of its own and repeated, the sources
interleaved in proportion to their weights, a seeded window shuffle over the mixture, batches of
`data.prompts_per_step` records. `get_state()` is a small JSON-serializable dict;
`set_state()` restores it exactly, also in a new process, and refuses a state saved for a
different pool.
"""
from __future__ import annotations

import copy
import hashlib
import json
import random
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grain

from jaxrl.config import ConfigError, DataConfig
from jaxrl.data.generators import GENERATORS, PLANNED, generate
from jaxrl.data.loaders import load_source, sample_records
from jaxrl.data.records import read_jsonl
from jaxrl.data.sources import SOURCES

STATE_VERSION = 1
WINDOW = 1024  # the mixture is shuffled within windows of this many prompts


@dataclass(frozen=True)
class SourceSpec:
    name: str
    count: int
    weight: float


@dataclass(frozen=True)
class Pool:
    """Train records per task, validation records, and the mixture weight of each task."""
    train: dict[str, list[dict]]
    validation: list[dict]
    weights: dict[str, float]


def task_kind(name: str) -> str:
    """'generated' or 'loaded'; a ConfigError naming every task for any other name."""
    if name in GENERATORS:
        return "generated"
    if name in SOURCES:
        return "loaded"
    planned = f"; {name!r} is planned: {PLANNED[name]}" if name in PLANNED else ""
    raise ConfigError(f"config key 'data.tasks' has unknown task {name!r}{planned}; generated: "
                      f"{', '.join(sorted(GENERATORS))}; loaded: {', '.join(sorted(SOURCES))}")


def _spec_count(entry: str, default: int) -> tuple[str, int]:
    name, sep, count = entry.partition(":")
    if not sep:
        return name.strip(), default
    if not count.strip().isdigit() or int(count) < 1:
        raise ConfigError(f"config key 'data.tasks' entry {entry!r} must be NAME or NAME:COUNT "
                          "with COUNT a whole number >= 1 (e.g. crypto:200)")
    return name.strip(), int(count)


def parse_tasks(cfg: DataConfig) -> list[SourceSpec]:
    """The sources of cfg.tasks with their counts and weights (checked against each other)."""
    entries = [_spec_count(entry, cfg.samples_per_task) for entry in cfg.tasks]
    names = [name for name, _ in entries]
    for name in names:
        task_kind(name)
    if len(set(names)) != len(names):
        raise ConfigError(f"config key 'data.tasks' names a task twice: {', '.join(names)}")
    if cfg.weights and len(cfg.weights) != len(entries):
        raise ConfigError(f"config key 'data.weights' has {len(cfg.weights)} entries but "
                          f"'data.tasks' has {len(entries)} ({', '.join(names)}); give one "
                          "weight per task or none (proportional to the counts)")
    weights = cfg.weights or [float(count) for _, count in entries]
    return [SourceSpec(name, count, float(w)) for (name, count), w in zip(entries, weights)]


def _distinct(records: Iterable[dict]) -> list[dict]:
    """The first record of each prompt, so that no prompt lands in both train and validation."""
    seen: dict[str, dict] = {}
    for record in records:
        seen.setdefault(json.dumps(record["messages"]), record)
    return list(seen.values())


def source_records(spec: SourceSpec, cfg: DataConfig,
                   keep: Callable[[dict], bool] | None = None) -> list[dict]:
    """The spec.count records of one source; `keep` (e.g. a prompt-length check) filters them
    before sampling, and a loaded dataset's repeated prompts count once."""
    keep = keep or (lambda record: True)
    if task_kind(spec.name) == "generated":
        records = generate(spec.name, spec.count, seed=cfg.seed, difficulty=cfg.difficulty)
        kept = [r for r in records if keep(r)]
        if len(kept) < spec.count:
            raise ConfigError(f"{spec.count - len(kept)} of {spec.count} generated "
                              f"{spec.name!r} prompts are longer than data.max_prompt_tokens="
                              f"{cfg.max_prompt_tokens}; raise it or lower data.difficulty")
        return kept
    available = _distinct(r for r in load_source(spec.name, cfg.data_dir, cfg.from_hub)
                          if keep(r))
    if len(available) < spec.count:
        raise ConfigError(f"config key 'data.tasks' asks for {spec.count} {spec.name!r} records "
                          f"but {len(available)} are available (distinct prompts within "
                          f"data.max_prompt_tokens); ask for {spec.name}:{len(available)}")
    return sample_records(available, spec.count, cfg.seed, spec.name)


def split_records(records: Sequence[dict], fraction: float, seed: int,
                  name: str = "") -> tuple[list[dict], list[dict]]:
    """(train, validation): a shuffle seeded by (seed, name), the first round(fraction * n)
    for validation; the copies carry their split. Generators of one family (knk, knk-brief)
    split their shared problems alike."""
    order = list(records)
    family = GENERATORS[name].family if name in GENERATORS else name
    random.Random(f"split:{family}:{seed}").shuffle(order)
    n_validation = round(fraction * len(order))
    train = [{**r, "split": "train"} for r in order[n_validation:]]
    validation = [{**r, "split": "validation"} for r in order[:n_validation]]
    return train, validation


def _by_task(records: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        grouped[record["task"]].append(record)
    return dict(grouped)


def _file_pool(cfg: DataConfig, keep: Callable[[dict], bool]) -> Pool:
    if cfg.weights:
        raise ConfigError("config key 'data.weights' applies to 'data.tasks'; with "
                          "'data.train_file' the file's tasks are mixed in proportion to their "
                          "counts, so leave data.weights empty")
    train = _by_task([r for r in read_jsonl(cfg.train_file) if keep(r)])
    if not train:
        raise ConfigError(f"config key 'data.train_file' {cfg.train_file!r} has no record "
                          f"within data.max_prompt_tokens={cfg.max_prompt_tokens}")
    validation = read_jsonl(cfg.eval_file) if cfg.eval_file else []
    return Pool(train, validation, {name: float(len(rs)) for name, rs in train.items()})


def build_pool(cfg: DataConfig, keep: Callable[[dict], bool] | None = None) -> Pool:
    """The run's records: from data.train_file (and data.eval_file) when set, otherwise from
    data.tasks, each source split by data.validation_fraction. `keep` (see
    jaxrl.data.prompts.prompt_fits) drops loaded and file records whose prompt is too long; a
    generated task with such prompts is an error."""
    if cfg.train_file:
        return _file_pool(cfg, keep or (lambda record: True))
    train, validation, weights = {}, [], {}
    for spec in parse_tasks(cfg):
        source_train, source_validation = split_records(
            source_records(spec, cfg, keep), cfg.validation_fraction, cfg.seed, spec.name)
        if not source_train:
            raise ConfigError(f"task {spec.name!r} with {spec.count} records leaves none for "
                              f"training at data.validation_fraction={cfg.validation_fraction}")
        train[spec.name], weights[spec.name] = source_train, spec.weight
        validation += source_validation
    if cfg.eval_file:
        validation = read_jsonl(cfg.eval_file)
    return Pool(train, validation, weights)


def _fingerprint(sources: Mapping[str, Sequence[dict]], weights: Mapping[str, float],
                 batch_size: int, seed: int) -> str:
    digest = hashlib.sha256(json.dumps([sorted(weights.items()), batch_size, seed],
                                       sort_keys=True).encode())
    for name in sorted(sources):
        for record in sources[name]:
            digest.update(json.dumps(record, sort_keys=True).encode())
    return digest.hexdigest()


class PromptIterator:
    """Endless batches (lists) of `batch_size` records mixed from `sources` by `weights`."""

    def __init__(self, sources: Mapping[str, Sequence[dict]], weights: Mapping[str, float],
                 batch_size: int, seed: int):
        names = sorted(sources)
        if not names or any(not sources[n] for n in names):
            raise ValueError("every source of a PromptIterator needs records; got sizes "
                             f"{ {n: len(sources[n]) for n in names} }")
        parts = [grain.MapDataset.source(list(sources[n]))
                 .shuffle(seed=zlib.crc32(f"{seed}:{n}".encode())).repeat() for n in names]
        mixed = grain.MapDataset.mix(parts, weights=[weights[n] for n in names])
        window = min(WINDOW, sum(len(sources[n]) for n in names))
        shuffled = grain.experimental.WindowShuffleMapDataset(mixed, window_size=window,
                                                              seed=seed)
        batches = shuffled.batch(batch_size, batch_fn=copy.deepcopy)
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._iterator = iter(batches.to_iter_dataset(options))
        self._fingerprint = _fingerprint(sources, weights, batch_size, seed)

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> list[dict]:
        return next(self._iterator)

    def get_state(self) -> dict:
        """JSON-serializable position in the stream, tied to this pool and mixture."""
        return {"version": STATE_VERSION, "pool": self._fingerprint,
                "grain": self._iterator.get_state()}

    def set_state(self, state: Mapping) -> None:
        """Continue exactly where the iterator that produced `state` was."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"data iterator state must be a dict with version {STATE_VERSION} "
                             f"from PromptIterator.get_state(); got {state!r:.100}")
        if state["pool"] != self._fingerprint:
            raise ValueError("data iterator state was saved for a different pool or mixture "
                             "(records, weights, batch size or seed changed); restore it with "
                             "the data config of the run that saved it")
        self._iterator.set_state(dict(state["grain"]))


def train_iterator(pool: Pool, cfg: DataConfig) -> PromptIterator:
    """Batches of cfg.prompts_per_step train records of `pool`, seeded by cfg.seed."""
    return PromptIterator(pool.train, pool.weights, cfg.prompts_per_step, cfg.seed)

"""Task records: one plain-dict schema for every task, validated on load, stored as JSONL.

A record is what generators write, loaders produce and verifiers read:

    {"id": "arithmetic-00017", "task": "arithmetic", "split": "train",
     "messages": [{"role": "system", "content": ...}, {"role": "user", "content": ...}],
     "answer": "12",                       the gold answer exactly as the <answer> span holds it
     "verifier": {"kind": "numeric", "tolerance": 1e-06},
     "metadata": {...}}

`VERIFIER_FIELDS` names each verifier kind and the fields of its data, each with its JSON type and
whether it is required; kinds added by later tasks (knk, zebra) register theirs with
`register_verifier_kind`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

SPLITS = ("train", "validation", "test")
ROLES = ("system", "user")
KEYS = ("id", "task", "split", "messages", "answer", "verifier", "metadata")

_NUMBER = (int, float)
# kind -> {field: (the JSON type its value must have, whether the field is required)}
VERIFIER_FIELDS: dict[str, dict[str, tuple[type | tuple[type, ...], bool]]] = {
    "exact": {},
    "label": {"labels": (list, True)},
    "set": {},
    "numeric": {"tolerance": (_NUMBER, False)},  # relative; the verifier's default is 1e-6
    "mcq": {"choices": (list, True)},
    "python": {"entry_point": (str, True), "tests": (list, True)},
}
_TYPE_NAMES = {str: "a string", list: "a list", dict: "an object", _NUMBER: "a number"}


class RecordError(ValueError):
    """A malformed task record; the message names the file and line (or the record's origin)."""


@dataclass(frozen=True)
class Problem:
    """One task instance before it becomes a record: the fields of its prompt template, the gold
    answer as the <answer> span should hold it, the verifier data, and metadata."""
    fields: dict
    answer: str
    verifier: dict
    metadata: dict = field(default_factory=dict)


def register_verifier_kind(kind: str,
                           fields: Mapping[str, tuple[type | tuple[type, ...], bool]]) -> None:
    """Declare a verifier kind for records to use: {field: (JSON type, required)}."""
    if kind in VERIFIER_FIELDS and VERIFIER_FIELDS[kind] != dict(fields):
        raise ValueError(f"verifier kind {kind!r} is already registered with other fields "
                         f"({sorted(VERIFIER_FIELDS[kind])})")
    VERIFIER_FIELDS[kind] = dict(fields)


def make_record(task: str, index: int, messages: list[dict], answer: str, verifier: dict,
                metadata: dict | None = None, split: str = "train") -> dict:
    """A validated record with id `{task}-{index:05d}`."""
    record = {"id": f"{task}-{index:05d}", "task": task, "split": split, "messages": messages,
              "answer": answer, "verifier": verifier, "metadata": dict(metadata or {})}
    return validate_record(record, where=f"record {record['id']}")


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise RecordError(f"{where}: {message}")


def _check_messages(messages, where: str) -> None:
    _require(isinstance(messages, list) and len(messages) > 0, where,
             f"'messages' must be a non-empty list of {{role, content}}; got {messages!r:.80}")
    for i, message in enumerate(messages):
        ok = (isinstance(message, dict) and set(message) == {"role", "content"}
              and message["role"] in ROLES and isinstance(message["content"], str))
        _require(ok, where, f"messages[{i}] must be {{'role': one of {', '.join(ROLES)}, "
                            f"'content': str}}; got {message!r:.80}")
    _require(messages[-1]["role"] == "user", where,
             "the last message must have role 'user' (the prompt the model answers)")


def _check_verifier(verifier, where: str) -> None:
    _require(isinstance(verifier, dict) and isinstance(verifier.get("kind"), str), where,
             f"'verifier' must be an object with a string 'kind'; got {verifier!r:.80}")
    kind = verifier["kind"]
    _require(kind in VERIFIER_FIELDS, where, f"unknown verifier kind {kind!r}; known kinds: "
                                             f"{', '.join(sorted(VERIFIER_FIELDS))}")
    for name, (typ, required) in VERIFIER_FIELDS[kind].items():
        if name not in verifier and not required:
            continue
        value = verifier.get(name)
        ok = isinstance(value, typ) and not isinstance(value, bool)
        wanted = _TYPE_NAMES.get(typ, typ)
        _require(ok, where, f"verifier kind {kind!r} needs {name!r} as {wanted}; "
                            f"got {value!r:.80}")
    if kind == "python":
        for i, case in enumerate(verifier["tests"]):
            _require(isinstance(case, dict) and set(case) == {"input", "output"}, where,
                     f"verifier tests[{i}] must be {{'input': ..., 'output': ...}}; "
                     f"got {case!r:.80}")


def validate_record(record, where: str = "record") -> dict:
    """record itself when it follows the schema; otherwise RecordError naming `where` and the
    first problem found."""
    _require(isinstance(record, dict), where, f"a record must be a JSON object; got "
                                              f"{type(record).__name__}")
    missing = [key for key in KEYS if key not in record]
    extra = sorted(set(record) - set(KEYS))
    _require(not missing, where, f"missing key(s) {', '.join(missing)}; a record has "
                                 f"{', '.join(KEYS)}")
    _require(not extra, where, f"unknown key(s) {', '.join(extra)}; a record has only "
                               f"{', '.join(KEYS)}")
    for key in ("id", "task", "answer"):
        _require(isinstance(record[key], str) and (key == "answer" or record[key]), where,
                 f"{key!r} must be a{' non-empty' if key != 'answer' else ''} string; "
                 f"got {record[key]!r:.80}")
    _require(record["split"] in SPLITS, where,
             f"'split' must be one of {', '.join(SPLITS)}; got {record['split']!r}")
    _check_messages(record["messages"], where)
    _check_verifier(record["verifier"], where)
    _require(isinstance(record["metadata"], dict), where,
             f"'metadata' must be an object; got {record['metadata']!r:.80}")
    return record


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Validated records of a JSONL file; blank lines are skipped. A malformed line is a
    RecordError naming the file and the line number; a missing file is FileNotFoundError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"records file '{path}' does not exist")
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"file '{path}' line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") \
                    from None
            records.append(validate_record(record, where))
    return records


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> int:
    """Validate and write records one per line (creating parent directories); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            validate_record(record, f"record {count} written to '{path}'")
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count

"""Rationale extraction: a generator copies a text with `<BOT>rationale<EOT>` inserted after
sentences; each rationale becomes a record {preceding, rationale, following}.

A document is annotated in chunks of whole sentences; a reasoning-dataset item (a question and
its worked solution) has its solution annotated, and its records' `preceding` starts with the
question (the layout of `prompts.reasoning_context`). The generator is any OpenAI-compatible
server, asked through `jaxrl.rewards.judge.Judge` (retries, backoff, concurrency limit). An
output is dropped when it is malformed (a `<BOT>` without its `<EOT>`) or when its text with
the rationales removed is not the input: whitespace-normalized edit similarity below
`min_similarity` (0.9). A failed request or a dropped output is counted, never fatal.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.rationale.prompts import BOT, EOT, extraction_messages, reasoning_context
from jaxrl.rewards.judge import Judge, JudgeFailure

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_MARKED = re.compile(re.escape(BOT) + r"(.*?)" + re.escape(EOT), re.S)


@dataclasses.dataclass(frozen=True)
class ExtractSettings:
    text_field: str = "text"
    question_field: str = "question"  # present: a reasoning item whose text is the solution
    source: str = ""  # the records' `source`; empty: each input's own `source` field
    max_chars: int = 6000  # per generator request; documents are cut between sentences
    min_similarity: float = 0.9


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance, one vectorized row per character of the shorter string."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    longer = np.frombuffer(a.encode("utf-32-le"), np.uint32)
    index = np.arange(len(a) + 1)
    prev = index.copy()
    for i, ch in enumerate(b, 1):
        best = np.minimum(prev[:-1] + (longer != ord(ch)), prev[1:] + 1)  # substitute, delete
        row = np.concatenate(([i], best))
        # insertions: cur[j] = min_k<=j row[k] + (j - k), a running minimum of row[k] - k
        prev = np.minimum.accumulate(row - index) + index
    return int(prev[-1])


def similarity(a: str, b: str) -> float:
    """1 - edit distance / longer length, after collapsing whitespace runs to one space."""
    a, b = (" ".join(s.split()) for s in (a, b))
    return 1.0 if not a and not b else 1.0 - edit_distance(a, b) / max(len(a), len(b))


def sentence_chunks(text: str, max_chars: int) -> list[str]:
    """text cut between sentences into chunks of at most max_chars (a longer sentence alone)."""
    chunks, current = [], ""
    for sentence in _SENTENCE_END.split(text.strip()):
        if current and len(current) + 1 + len(sentence) > max_chars:
            chunks.append(current)
            current = ""
        current = f"{current} {sentence}" if current else sentence
    return chunks + [current] if current else chunks


def parse_annotated(output: str) -> tuple[str, list[tuple[int, str]]] | None:
    """(text without rationales, [(offset in that text, rationale)]), or None when a marker
    is unbalanced. The whitespace around a removed rationale is kept once."""
    pieces = _MARKED.split(output)  # text, rationale, text, ...
    if any(BOT in p or EOT in p for p in pieces[::2]):
        return None
    clean, found = pieces[0], []
    for rationale, text in zip(pieces[1::2], pieces[2::2]):
        stripped = clean.rstrip()
        gap = text[:len(text) - len(text.lstrip())] or clean[len(stripped):]
        clean = stripped
        if rationale.strip():
            found.append((len(clean), " ".join(rationale.split())))
        clean += gap + text.lstrip()
    return clean, found


def annotation_records(output: str, original: str, question: str | None,
                       min_similarity: float) -> tuple[list[dict], str | None]:
    """(records, why the output was dropped or None) of one generator output."""
    parsed = parse_annotated(output)
    if parsed is None:
        return [], "malformed"
    clean, found = parsed
    if similarity(clean, original) < min_similarity:
        return [], "changed_text"
    records = []
    for offset, rationale in found:
        preceding, following = clean[:offset], clean[offset:]
        if question is not None:
            preceding = reasoning_context(question, preceding)
        if preceding.strip() and following.strip():
            records.append({"preceding": preceding, "rationale": rationale,
                            "following": following})
    return records, None


def _requests(items: Sequence[Mapping[str, Any]], settings: ExtractSettings):
    """[(item index, text, question)] with documents cut into chunks."""
    out = []
    for i, item in enumerate(items):
        text = item.get(settings.text_field)
        question = item.get(settings.question_field)
        if not isinstance(text, str) or not text.strip():
            continue
        question = question if isinstance(question, str) and question.strip() else None
        chunks = [text.strip()] if question else sentence_chunks(text, settings.max_chars)
        out += [(i, chunk, question) for chunk in chunks]
    return out


async def extract(judge: Judge, items: Sequence[Mapping[str, Any]],
                  settings: ExtractSettings = ExtractSettings()):
    """(records in input order, counts): each record has id, source, preceding, rationale,
    following. Counts: items, requests, records and each kind of loss (request failures by
    kind, malformed, changed_text, no_text)."""
    requests = _requests(items, settings)
    counts = collections.Counter(items=len(items), requests=len(requests))
    counts["no_text"] = len(items) - len({i for i, _, _ in requests})

    async def one(text: str, question: str | None):
        try:
            reply = await judge.ask(extraction_messages(text, question))
        except JudgeFailure as failure:
            return [], failure.kind
        return annotation_records(reply.text, text, question, settings.min_similarity)

    results = await asyncio.gather(*(one(text, q) for _, text, q in requests))
    records, serial = [], collections.Counter()
    for (i, _, _), (found, dropped) in zip(requests, results):
        if dropped is not None:
            counts[dropped] += 1
        item = items[i]
        source = settings.source or str(item.get("source", ""))
        for record in found:
            doc = str(item.get("id", i))
            records.append({"id": f"{doc}-{serial[doc]}", "source": source, **record})
            serial[doc] += 1
    counts["records"] = len(records)
    await judge.aclose()
    return records, dict(counts)

"""Loaders for Spring's public evaluation sets, from files you already have.

ar_lsat     AR-LSAT (https://github.com/zhongwanjun/AR-LSAT, data/AR_*Data.json): a JSON list of
            passages {"id", "passage", "questions": [{"id", "question", "options": [...],
            "answer": "C"}]}; one `mcq` record per question, its answer the letter.
zebralogic  ZebraLogicBench grid mode (https://huggingface.co/datasets/allenai/ZebraLogicBench,
            grid_mode; solutions are in the gated ZebraLogicBench-private): rows {"id", "size",
            "puzzle", "solution": {"header": ["House", attribute, ...], "rows": [["1", value,
            ...], ...]}} as JSON (a list, or one under "rows" / "data"), JSONL or Parquet; one
            `zebra` record per puzzle, with the formal vocabulary and Gamma_dom built from the
            solution's header and values (listed sorted, so the listing tells nothing) and the
            gold grid as answer. The puzzle text is the dataset's own.
`load_ar_lsat(path)` / `load_zebralogic(path)` read one JSON, JSONL or Parquet file; a missing
file is a FileNotFoundError that says where the data comes from, a malformed row a RecordError
naming the file and the row. `ar_lsat_problems` / `zebralogic_problems` map rows already read
(the shape of a jaxrl.data.sources mapping); each Problem carries its prompt in
fields["messages"].
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from jaxrl.data.generators.zebra import (
    grid_answer,
    log10_space,
    zebra_messages,
    zebra_verifier,
)
from jaxrl.data.prompts import answer_instruction, lettered, system_prompt
from jaxrl.data.records import Problem, RecordError, make_record

ORIGINS = {
    "ar_lsat": "https://github.com/zhongwanjun/AR-LSAT (data/AR_TestData.json and siblings)",
    "zebralogic": "https://huggingface.co/datasets/allenai/ZebraLogicBench-private "
                  "(grid_mode; the public allenai/ZebraLogicBench hides the solutions)",
}


def _rows(path: str | os.PathLike, task: str) -> list:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{task} file '{path}' does not exist; get it from "
                                f"{ORIGINS[task]}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except ValueError as error:
        raise RecordError(f"file '{path}' is not valid JSON: {error}") from None
    if isinstance(data, dict):
        data = data.get("rows", data.get("data"))
    if not isinstance(data, list):
        raise RecordError(f"file '{path}' must hold a JSON list of rows (or one under 'rows' "
                          f"or 'data')")
    return data


def _option(text: str) -> str:
    """An AR-LSAT option without a leading letter label such as "A) " or "(B)"."""
    return re.sub(r"^\s*\(?[A-E][).:]\s*", "", str(text)).strip()


def _lsat_question(passage: str, question: dict) -> Problem:
    options = [_option(o) for o in question["options"]]
    listing, letters = lettered(options)
    answer = str(question["answer"]).strip().upper()
    if answer not in letters:
        raise ValueError(f"answer {answer!r} is not one of {', '.join(letters)}")
    verifier = {"kind": "mcq", "choices": letters}
    user = (f"{passage.strip()}\n\nQuestion: {question['question'].strip()}\n{listing}\n\n"
            f"{answer_instruction('ar_lsat', verifier)}")
    messages = [{"role": "system", "content": system_prompt("ar_lsat")},
                {"role": "user", "content": user}]
    metadata = {"source_id": str(question.get("id", "")), "tags": question.get("tags", [])}
    return Problem({"messages": messages}, answer, verifier, metadata)


def ar_lsat_problems(rows: list, origin: str) -> list[Problem]:
    """One mcq Problem per question of the AR-LSAT passages `rows` (fields["messages"] is the
    prompt); RecordError naming `origin` and the passage for a malformed one."""
    problems = []
    for number, passage in enumerate(rows, start=1):
        try:
            problems += [_lsat_question(passage["passage"], q) for q in passage["questions"]]
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            raise RecordError(f"file '{origin}' passage {number}: an AR-LSAT passage has "
                              "'passage' and 'questions' [{'question', 'options', 'answer': "
                              f"letter}}]; {type(error).__name__}: {error}") from None
    return problems


def _grid(row: dict, where: str) -> tuple[dict[str, list[str]], int]:
    """The solution as {attribute: [value of house 1, 2, ...]} and the house count."""
    solution = row.get("solution")
    header = solution.get("header") if isinstance(solution, dict) else None
    rows = solution.get("rows") if isinstance(solution, dict) else None
    if not isinstance(header, list) or not isinstance(rows, list) or not rows:
        raise RecordError(f"{where}: no 'solution' {{'header', 'rows'}} (the public "
                          f"ZebraLogicBench hides them; use {ORIGINS['zebralogic']})")
    ordered = sorted(rows, key=lambda r: int(re.sub(r"\D", "", str(r[0])) or 0))
    grid = {str(attr): [str(r[i]).strip() for r in ordered]
            for i, attr in enumerate(header) if i > 0}
    if any(not v or set(v) <= {"_"} for values in grid.values() for v in values):
        raise RecordError(f"{where}: the solution has blank or hidden cells")
    return grid, len(ordered)


def zebralogic_problems(rows: list, origin: str) -> list[Problem]:
    """One zebra Problem per ZebraLogicBench grid puzzle (fields["messages"] is the prompt);
    RecordError naming `origin` and the row for a malformed one."""
    problems = []
    for number, row in enumerate(rows, start=1):
        where = f"file '{origin}' row {number}"
        if not isinstance(row, dict) or not isinstance(row.get("puzzle"), str):
            raise RecordError(f"{where}: a ZebraLogicBench row has 'puzzle' and 'solution'")
        solution, houses = _grid(row, where)
        attributes = {attr: sorted(values) for attr, values in solution.items()}
        metadata = {"source_id": str(row.get("id", "")), "size": str(row.get("size", "")),
                    "houses": houses, "attributes": len(attributes),
                    "log10_space": round(log10_space(houses, len(attributes)), 3)}
        messages = zebra_messages(row["puzzle"], houses, attributes)
        problems.append(Problem({"messages": messages}, grid_answer(solution),
                                zebra_verifier(houses, attributes), metadata))
    return problems


def _records(task: str, problems: list[Problem]) -> list[dict]:
    return [make_record(task, i, p.fields["messages"], p.answer, p.verifier, p.metadata,
                        split="test") for i, p in enumerate(problems)]


def load_ar_lsat(path: str | os.PathLike) -> list[dict]:
    """mcq records, one per AR-LSAT question in the file at `path` (see the module doc)."""
    return _records("ar_lsat", ar_lsat_problems(_rows(path, "ar_lsat"), str(path)))


def load_zebralogic(path: str | os.PathLike) -> list[dict]:
    """zebra records, one per ZebraLogicBench grid puzzle in the file at `path`."""
    return _records("zebralogic", zebralogic_problems(_rows(path, "zebralogic"), str(path)))

"""Answer formats and verifiers of the logic puzzles (`knk`, `zebra`), and the final answer as
formal expressions for Spring's consistency check.

knk    verifier {"kind": "knk", "people": [...], "theory": {...}}. The answer names each
       person's role: "Alice is a knight, Bob is a knave" ("Alice: knight" and "(1) Alice is a
       knight" read too). value = puzzle accuracy (every person right); component
       person_accuracy = the share of people whose one stated role is right (a person given
       both roles is wrong).
zebra  verifier {"kind": "zebra", "attributes": {"Name": [values], ...}, "symbols": {"Name":
       [formal symbol of each value], ...}, "theory": {...}}. The answer is a JSON grid,
       {"House 1": {"Name": "Alice", "Pet": "dog"}, "House 2": {...}} (a "solution" wrapper,
       ```json fences and ZebraLogic's {"header": [...], "rows": [[...]]} read too); values and
       attribute names match case-insensitively. value = puzzle accuracy (every cell right);
       component cell_accuracy = right cells / (houses x attributes).
The theory is the task's vocabulary and Gamma_dom (jaxrl.logic.z3_theory); these verifiers do
not need it, Spring does.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping

from jaxrl.rewards.base import RewardConfigError, RewardResult
from jaxrl.rewards.correctness import Verifier, VerifySettings, normalize, strip_fences

MAX_ANSWER_CHARS = 50_000


def _data_error(record: Mapping, problem: str) -> RewardConfigError:
    return RewardConfigError(f"task record {record.get('id', '?')!r} ({record.get('task', '?')}): "
                             f"{problem}")


def _result(accuracy: float, total: bool, name: str, read: bool) -> RewardResult:
    info = {} if total else {"error": "wrong_answer" if read else "unreadable_answer"}
    return RewardResult(float(total), {name: accuracy}, info)


def _people(record: Mapping) -> list[str]:
    people = record.get("verifier", {}).get("people")
    if not isinstance(people, list) or not people or not all(
            isinstance(p, str) and p.strip() for p in people):
        raise _data_error(record, "a 'knk' verifier needs a non-empty list of names 'people'")
    return people


def knk_roles(text: str, people: list[str]) -> dict[str, str | None]:
    """Each named person's stated role ("knight" / "knave"; None when both are stated)."""
    roles: dict[str, str | None] = {}
    text = text[:MAX_ANSWER_CHARS]
    for person in people:
        pattern = (rf"\b{re.escape(person)}\b\s*(?:is\s+(?:a\s+)?|:\s*|=\s*|-\s*|\(\s*)?"
                   r"(knight|knave)s?\b")
        found = {m.lower() for m in re.findall(pattern, text, re.IGNORECASE)}
        if found:
            roles[person] = found.pop() if len(found) == 1 else None
    return roles


def _check_knk(record: Mapping) -> None:
    people = _people(record)
    gold = knk_roles(str(record.get("answer", "")), people)
    if any(gold.get(p) is None for p in people):
        raise _data_error(record, f"gold answer {record.get('answer')!r:.80} does not give "
                          "every person exactly one role")


def _verify_knk(answer: str, record: Mapping, settings: VerifySettings) -> RewardResult:
    people = _people(record)
    gold, given = knk_roles(record["answer"], people), knk_roles(answer, people)
    right = sum(given.get(p) == gold[p] for p in people)
    return _result(right / len(people), right == len(people), "person_accuracy", bool(given))


def knk_answer_exprs(answer: str, record: Mapping) -> list[tuple]:
    """The stated roles as formulas: (knight Alice), (knave Bob), ..."""
    return [(role, person) for person, role in knk_roles(answer, _people(record)).items()
            if role is not None]


def _attributes(record: Mapping) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    spec = record.get("verifier", {})
    attributes, symbols = spec.get("attributes"), spec.get("symbols")
    ok = (isinstance(attributes, dict) and attributes and isinstance(symbols, dict)
          and symbols.keys() == attributes.keys()
          and len({len(v) for v in attributes.values() if isinstance(v, list)}) == 1
          and all(isinstance(v, list) and isinstance(symbols[k], list)
                  and len(symbols[k]) == len(v) for k, v in attributes.items()))
    if not ok:
        raise _data_error(record, "a 'zebra' verifier needs 'attributes' {name: [values]} with "
                          "as many values per attribute as houses, and 'symbols' of the same shape")
    return attributes, symbols


def _json_object(text: str):
    text = strip_fences(text[:MAX_ANSWER_CHARS])
    try:
        value = json.loads(text[text.find("{"):text.rfind("}") + 1])
    except ValueError:
        return None
    if isinstance(value, dict) and isinstance(value.get("solution"), dict):
        value = value["solution"]
    return value if isinstance(value, dict) else None


def _rows_grid(value: dict) -> dict:
    """ZebraLogic's {"header": [House, A, ...], "rows": [[1, a, ...]]} as {house: {A: a}}."""
    header, rows = value.get("header"), value.get("rows")
    if not isinstance(header, list) or not isinstance(rows, list):
        return {}
    return {str(row[0]): dict(zip(map(str, header[1:]), row[1:])) for row in rows
            if isinstance(row, list) and row}


def zebra_grid(text: str, attributes: Mapping[str, list[str]]) -> dict[tuple[int, str], str]:
    """{(house, attribute): value} read from a JSON grid answer (empty when it does not read)."""
    value = _json_object(text)
    if value is None:
        return {}
    houses = _rows_grid(value) if "rows" in value else value
    names = {normalize(a): a for a in attributes}
    grid = {}
    for key, row in houses.items():
        number = re.search(r"\d+", str(key))
        if number is None or not isinstance(row, dict):
            continue
        for attr, cell in row.items():
            name = names.get(normalize(str(attr)))
            if name is not None and isinstance(cell, (str, int)):
                grid[(int(number.group()), name)] = str(cell)
    return grid


def _check_zebra(record: Mapping) -> None:
    attributes, _ = _attributes(record)
    houses = len(next(iter(attributes.values())))
    grid = zebra_grid(str(record.get("answer", "")), attributes)
    if len(grid) != houses * len(attributes):
        raise _data_error(record, f"gold answer {record.get('answer')!r:.80} is not a full "
                          f"{houses} x {len(attributes)} grid")


def _verify_zebra(answer: str, record: Mapping, settings: VerifySettings) -> RewardResult:
    attributes, _ = _attributes(record)
    gold, given = zebra_grid(record["answer"], attributes), zebra_grid(answer, attributes)
    right = sum(normalize(given.get(cell, "")) == normalize(value) for cell, value in gold.items())
    return _result(right / len(gold), right == len(gold), "cell_accuracy", bool(given))


def zebra_answer_exprs(answer: str, record: Mapping) -> list[tuple]:
    """Each answered cell as a formula (= symbol house); unknown values are left out."""
    attributes, symbols = _attributes(record)
    lookup = {(attr, normalize(v)): s for attr in attributes
              for v, s in zip(attributes[attr], symbols[attr])}
    return [("=", lookup[(attr, normalize(value))], house)
            for (house, attr), value in zebra_grid(answer, attributes).items()
            if (attr, normalize(value)) in lookup]


KNK = Verifier(_verify_knk, _check_knk)
ZEBRA = Verifier(_verify_zebra, _check_zebra)
ANSWER_EXPRS = {"knk": knk_answer_exprs, "zebra": zebra_answer_exprs}

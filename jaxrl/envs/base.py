"""The case interface: signals are shown up front, everything else is revealed by a tool request.

A case is plain data (JSON-serializable) so generated cases can be saved, edited and replayed
with `jaxrl investigate --case FILE`. The gold root cause has two granularities: `coarse` (the
fault category, what the paper's Relevant metric checks) and `fine` (the actionable cause on a
named component, what Match checks); each comes with the phrasings that count as naming it.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class CaseError(ValueError):
    """A case file or a tool request that does not fit the case."""


@dataclasses.dataclass(frozen=True)
class Gold:
    coarse: str
    fine: str
    component: str  # the primary faulty component
    components: tuple[str, ...]  # the components whose naming counts (e.g. a host and its service)
    coarse_aliases: tuple[str, ...]
    fine_aliases: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Case:
    """One investigation. `outputs[tool][target]` is the text a request reveals."""
    id: str
    domain: str
    context: str  # what the investigators know before any request (e.g. the system's layout)
    signals: tuple[str, ...]
    tools: Mapping[str, str]  # tool name -> what it shows and which targets it takes
    targets: Mapping[str, str]  # target name -> kind (host, service, database)
    outputs: Mapping[str, Mapping[str, str]]
    gold: Gold

    def request(self, tool: str, target: str) -> str:
        """What running `tool` on `target` shows. An unknown tool is a CaseError (agents check
        tool names before asking); an unknown or unsuitable target is an observation saying so,
        since choosing it is the agent's move, not a fault of the case."""
        if tool not in self.tools:
            raise CaseError(f"unknown tool {tool!r}; tools: {', '.join(sorted(self.tools))}")
        per_target = self.outputs.get(tool, {})
        if target in per_target:
            return per_target[target]
        if target not in self.targets:
            return (f"{tool} {target}: no such target; targets: "
                    f"{', '.join(sorted(self.targets))}")
        return (f"{tool} {target}: not applicable to a {self.targets[target]}; it applies to: "
                f"{', '.join(sorted(per_target))}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def case_from_json(data: Mapping[str, Any]) -> Case:
    """A Case from its JSON form; a missing or mistyped field is a CaseError naming it."""
    fields = [f.name for f in dataclasses.fields(Case)]
    missing = [f for f in fields if f not in data]
    if missing:
        raise CaseError(f"case {data.get('id', '?')!r} lacks {missing}; a case has {fields}")
    gold = data["gold"]
    gold_fields = [f.name for f in dataclasses.fields(Gold)]
    if not isinstance(gold, Mapping) or any(f not in gold for f in gold_fields):
        raise CaseError(f"case {data['id']!r}: gold must be an object with {gold_fields}")
    if not all(isinstance(s, str) for s in data["signals"]):
        raise CaseError(f"case {data['id']!r}: signals must be a list of strings")
    return Case(id=str(data["id"]), domain=str(data["domain"]), context=str(data["context"]),
                signals=tuple(data["signals"]), tools=dict(data["tools"]),
                targets=dict(data["targets"]),
                outputs={t: dict(v) for t, v in data["outputs"].items()},
                gold=Gold(**{**{f: gold[f] for f in gold_fields},
                             "components": tuple(gold["components"]),
                             "coarse_aliases": tuple(gold["coarse_aliases"]),
                             "fine_aliases": tuple(gold["fine_aliases"])}))


def load_cases(path: str | Path) -> list[Case]:
    """Cases from a JSON file (one case or a list) or a JSONL file (one case a line)."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        if str(path).endswith(".jsonl"):
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            loaded = json.loads(text)
            items = loaded if isinstance(loaded, list) else [loaded]
    except json.JSONDecodeError as e:
        raise CaseError(f"{path}: not valid JSON ({e})") from None
    if not items:
        raise CaseError(f"{path}: holds no case")
    return [case_from_json(item) for item in items]

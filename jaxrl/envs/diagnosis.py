"""Offline incident cases: a hidden fault in a generated system of hosts, services and a database;
and the diagnosis environment (`Diagnosis`) that plays them for multi-turn training.

The system has three application hosts, one service on each, and a database on its own host.
One fault from `diagnosis.yaml` is placed on it; the fault's alerts become the signals (with, in
some cases, a benign distractor), and its evidence replaces the healthy output of the tools that
would show it. Every other (tool, target) pair shows a healthy output with drawn numbers, so the
evidence is only found by asking the right tool about the right component.

Deterministic: case i of `generate_cases(n, seed)` depends only on (seed, i).
"""
from __future__ import annotations

import random
import re
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from jaxrl.agents.grounding import grounded, judge
from jaxrl.config import EnvConfig
from jaxrl.envs.base import Case, Gold, case_from_json
from jaxrl.envs.protocol import Demonstration, Environment, EpisodeError, ToolError, function
from jaxrl.rewards.base import answer_span

DOMAIN = "distributed-systems"
_SERVICES = ("checkout", "payments", "search", "catalog", "auth", "cart", "billing", "inventory")
_DATABASES = ("orders-db", "users-db", "ledger-db")
_KIND_OF_ROLE = {"host": "host", "svc": "service", "db": "database"}


@lru_cache(maxsize=1)
def catalog() -> dict[str, Any]:
    """The tools, healthy outputs and faults of diagnosis.yaml."""
    text = resources.files("jaxrl.envs").joinpath("diagnosis.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _draw(rng: random.Random, params: dict[str, list[int]]) -> dict[str, int]:
    return {name: rng.randint(lo, hi) for name, (lo, hi) in sorted(params.items())}


def _topology(rng: random.Random) -> dict[str, Any]:
    hosts = [f"node-{n:02d}" for n in rng.sample(range(10, 99), 3)]
    services = rng.sample(_SERVICES, 3)
    db = rng.choice(_DATABASES)
    db_host = f"db-{rng.randint(1, 9)}"
    return {"hosts": hosts + [db_host], "service_host": dict(zip(services, hosts)), "db": db,
            "db_host": db_host}


def _targets(topo: dict[str, Any]) -> dict[str, str]:
    targets = {h: "host" for h in topo["hosts"]}
    targets.update({s: "service" for s in topo["service_host"]})
    targets[topo["db"]] = "database"
    return targets


def _layout(topo: dict[str, Any]) -> str:
    placed = ", ".join(f"{s} on {h}" for s, h in topo["service_host"].items())
    return (f"Hosts: {', '.join(topo['hosts'])}. Services: {placed}; all use the database "
            f"{topo['db']} on {topo['db_host']}.")


def _healthy_outputs(rng: random.Random, targets: dict[str, str], context: dict[str, Any]
                     ) -> dict[str, dict[str, str]]:
    data = catalog()
    outputs: dict[str, dict[str, str]] = {tool: {} for tool in data["tools"]}
    for kind, tools in data["applies"].items():
        for tool in tools:
            spec = data["healthy"][tool]
            for name in (t for t, k in targets.items() if k == kind):
                values = {**context, "name": name, **_draw(rng, spec["params"])}
                outputs[tool][name] = spec["text"].format(**values)
    return outputs


def _place_fault(rng: random.Random, fault: dict[str, Any], topo: dict[str, Any]
                 ) -> dict[str, str]:
    """The component in each role (host, svc, db) for this fault."""
    if fault["at"] == "database":
        return {"host": topo["db_host"], "svc": rng.choice(sorted(topo["service_host"])),
                "db": topo["db"]}
    svc = rng.choice(sorted(topo["service_host"]))
    return {"host": topo["service_host"][svc], "svc": svc, "db": topo["db"]}


def _signals(rng: random.Random, fault: dict[str, Any], values: dict[str, Any],
             hosts: list[str]) -> tuple[str, ...]:
    signals = [s.format(**values) for s in fault["signals"]]
    if rng.random() < 0.5:
        other = rng.choice([h for h in hosts if h != values["host"]])
        signals.insert(rng.randint(0, len(signals)),
                       rng.choice(catalog()["distractors"]).format(other=other))
    return tuple(signals)


def generate_case(seed: int, index: int, fault_index: int | None = None) -> Case:
    """Case `index` of the stream `seed`; `fault_index` picks the fault (default: drawn)."""
    faults = catalog()["faults"]
    rng = random.Random(f"diagnosis:{seed}:{index}")
    fault = faults[rng.randrange(len(faults)) if fault_index is None else fault_index]
    topo = _topology(rng)
    targets = _targets(topo)
    time = f"2025-03-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}Z"
    roles = _place_fault(rng, fault, topo)
    outputs = _healthy_outputs(rng, targets, {"time": time, "db": topo["db"]})
    values = {**roles, "time": time, **_draw(rng, fault["params"])}
    for key, template in fault["evidence"].items():
        tool, role = key.split("@")
        outputs[tool][roles[role]] = template.format(**values)
    gold = Gold(coarse=fault["coarse"], fine=fault["fine"],
                component=roles["db" if fault["at"] == "database" else "host"],
                components=tuple(roles[r] for r in fault["blame"]),
                coarse_aliases=tuple(fault["coarse_aliases"]),
                fine_aliases=tuple(fault["fine_aliases"]))
    return Case(id=f"diag-{seed}-{index:04d}", domain=DOMAIN, context=_layout(topo),
                signals=_signals(rng, fault, values, topo["hosts"]),
                tools=dict(catalog()["tools"]), targets=targets, outputs=outputs, gold=gold)


def generate_cases(n: int, seed: int = 0) -> list[Case]:
    """n cases; the faults cycle through the catalog in an order drawn from `seed`, so any ten
    consecutive cases cover ten different faults."""
    if n < 1:
        raise ValueError(f"the number of cases must be >= 1; got {n}")
    order = list(range(len(catalog()["faults"])))
    random.Random(f"diagnosis-order:{seed}").shuffle(order)
    return [generate_case(seed, i, order[i % len(order)]) for i in range(n)]


INSTRUCTIONS = (
    "You are the on-call operator investigating an incident. Request evidence with the tools; "
    "each takes a target: a host, service or database named in the layout. When the evidence "
    "shows the root cause, reply without a tool call, in this form:\n<answer>\n"
    "category: <fault category, e.g. disk, memory, cpu, network, database>\n"
    "root cause: <the fault> on <component>\n"
    'evidence: "<a line quoted exactly from a tool output>"\n</answer>')
DEMO_SEED = -1  # the demonstration's case (generated cases use seeds >= 0)
_DISK_FULL = 1  # its fault: catalog()["faults"][1], whose evidence is df on the host
_FIELD = r"^\s*{}\s*:\s*(.*)$"
_QUOTE = re.compile(r'"([^"\n]{1,400})"')


def task_text(case: Case) -> str:
    """The user message of a case: its layout, its alerts and what to find."""
    alerts = "\n".join(f"- {signal}" for signal in case.signals)
    return (f"{case.context}\n\nAlerts:\n{alerts}\n\nFind the root cause: the fault and the "
            "component it is on.")


def _field(text: str, name: str) -> str:
    match = re.search(_FIELD.format(name), text, flags=re.IGNORECASE | re.MULTILINE)
    return "" if match is None else match.group(1).strip()


def read_conclusion(text: str) -> dict:
    """The category, root cause and quoted evidence of a concluding reply (its <answer> span,
    else all of it; a reply without the `root cause:` line is read whole as the cause)."""
    span = answer_span(text)
    body = text if span is None else span
    return {"text": text, "category": _field(body, "category"),
            "root_cause": _field(body, "root cause") or body.strip(),
            "quotes": _QUOTE.findall(body)}


def _case_of(record: Mapping[str, Any]) -> Case:
    case = record.get("metadata", {}).get("case")
    if not isinstance(case, Mapping):
        raise EpisodeError(f"the diagnosis environment plays records with a case in "
                           f"metadata['case'] (jaxrl data --task diagnosis); record "
                           f"{record.get('id')!r} has none")
    return case_from_json(case)


class Diagnosis(Environment):
    """An incident case (module docstring): each case tool is a function of one `target`; the
    conclusion states the category, the root cause and quoted evidence.

    Reward (`score`): Match 1, else Relevant `env.relevant_credit` (agents/grounding.py judges
    both), plus `env.evidence_bonus` when tool output was retrieved before concluding, minus
    `env.fabrication_penalty` per quote found in no text the agent saw (context, alerts,
    retrieved output), minus `env.turn_cost` per reply."""

    name = "diagnosis"
    outcome = "match"  # the score component that is the episode's accuracy
    example = {"name": "logs", "arguments": {"target": "checkout"}}
    case: Case

    @property
    def tools(self) -> list[dict]:
        return [function(tool, text, {"target": "the component to inspect"})
                for tool, text in self.case.tools.items()]

    def opening(self, record: Mapping[str, Any]) -> tuple[str, list[dict]]:
        self.case = _case_of(record)
        return INSTRUCTIONS, [m for m in record["messages"] if m["role"] != "system"]

    def demonstration(self) -> Demonstration:
        """A disk-full case: df on the full host, quoted in the conclusion."""
        case = generate_case(seed=DEMO_SEED, index=0, fault_index=_DISK_FULL)
        host = case.gold.component
        output = case.request("df", host)
        quote = output.splitlines()[-1]
        return Demonstration(task_text(case), {"name": "df", "arguments": {"target": host}},
                             output, f"<answer>\ncategory: {case.gold.coarse}\nroot cause: "
                             f"{case.gold.fine} on {host}\nevidence: \"{quote}\"\n</answer>")

    def run(self, name: str, arguments: Mapping[str, Any]) -> str:
        target = arguments.get("target")
        if name not in self.case.tools:
            raise ToolError(f"unknown tool {name!r}; tools: {', '.join(sorted(self.case.tools))}")
        if not isinstance(target, str) or not target.strip():
            raise ToolError(f'{name} takes {{"target": "<host, service or database>"}}')
        return self.case.request(name, target.strip())

    def conclude(self, text: str) -> dict:
        return read_conclusion(text)

    @staticmethod
    def score(record: Mapping[str, Any], episode: Mapping[str, Any],
              cfg: EnvConfig) -> tuple[float, dict[str, float], dict[str, Any]]:
        """(value, components, info) of an episode (class docstring)."""
        case, conclusion = _case_of(record), episode.get("conclusion")
        calls = episode.get("calls", [])
        retrieved = [c["output"] for c in calls if c["valid"]]
        if conclusion is None:
            verdict, quotes = {"match": False, "relevant": False}, []
        else:
            fine = conclusion["root_cause"]
            verdict = judge(fine, f"{conclusion['category']} {fine}", case.gold)
            quotes = conclusion["quotes"]
        seen = [case.context, *case.signals, *retrieved]
        fabricated = sum(not grounded(q, seen) for q in quotes)
        evidence = float(bool(retrieved) and conclusion is not None)
        outcome = 1.0 if verdict["match"] else cfg.relevant_credit * verdict["relevant"]
        turns = float(episode.get("turns", 0))
        value = (outcome + cfg.evidence_bonus * evidence - cfg.fabrication_penalty * fabricated
                 - cfg.turn_cost * turns)
        components = {"match": float(verdict["match"]), "relevant": float(verdict["relevant"]),
                      "evidence": evidence, "quotes": float(len(quotes)),
                      "fabricated": float(fabricated), "turns": turns,
                      "calls": float(len(calls)), "valid_calls": float(len(retrieved))}
        info = {"finish": episode.get("finish")}
        if conclusion is None:
            info["error"] = "no_conclusion"
        return value, components, info

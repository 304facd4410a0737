"""Offline incident cases: a hidden fault in a generated system of hosts, services and a database.

The system has three application hosts, one service on each, and a database on its own host.
One fault from `diagnosis.yaml` is placed on it; the fault's alerts become the signals (with, in
some cases, a benign distractor), and its evidence replaces the healthy output of the tools that
would show it. Every other (tool, target) pair shows a healthy output with drawn numbers, so the
evidence is only found by asking the right tool about the right component.

Deterministic: case i of `generate_cases(n, seed)` depends only on (seed, i).
"""
from __future__ import annotations

import random
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from jaxrl.envs.base import Case, Gold

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

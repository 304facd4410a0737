"""Roles and prompts of a domain, read from a YAML file (see roles/*.yaml for the format)."""
from __future__ import annotations

import dataclasses
import string
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

PROMPTS = ("ingest", "plan", "retrieve", "analyze", "update", "refine", "baseline")


class RolesError(ValueError):
    """A roles file that lacks a field or names an unknown prompt or tool."""


@dataclasses.dataclass(frozen=True)
class Role:
    name: str
    system: str
    tools: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Roles:
    domain: str
    levels: tuple[str, ...]  # the name of each hypothesis level, coarsest first
    central: Role
    experts: tuple[Role, ...]
    prompts: dict[str, str]

    def expert(self, name: str) -> Role:
        return next(e for e in self.experts if e.name == name)

    def messages(self, role: Role, prompt: str, **values: Any) -> list[dict[str, str]]:
        """The chat for `prompt` filled with values, under role's system message."""
        text = string.Template(self.prompts[prompt]).substitute(
            {k: str(v) for k, v in values.items()})
        return [{"role": "system", "content": role.system}, {"role": "user", "content": text}]


def builtin_domains() -> list[str]:
    folder = resources.files("jaxrl.agents").joinpath("roles")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_roles(domain_or_path: str, tools: set[str] | None = None) -> Roles:
    """Roles of a built-in domain (by name) or of a YAML file; with `tools`, every expert's
    tools must be among them."""
    if domain_or_path in builtin_domains():
        text = resources.files("jaxrl.agents").joinpath(
            "roles", f"{domain_or_path}.yaml").read_text(encoding="utf-8")
    elif Path(domain_or_path).is_file():
        text = Path(domain_or_path).read_text(encoding="utf-8")
    else:
        raise RolesError(f"no roles for {domain_or_path!r}: not a built-in domain "
                         f"({', '.join(builtin_domains())}) nor a YAML file")
    return _roles(yaml.safe_load(text), domain_or_path, tools)


def _roles(data: Any, where: str, tools: set[str] | None) -> Roles:
    needed = ("domain", "levels", "central", "experts", "prompts")
    if not isinstance(data, dict) or any(k not in data for k in needed):
        raise RolesError(f"{where}: a roles file is a mapping with {', '.join(needed)}")
    missing = [p for p in PROMPTS if p not in data["prompts"]]
    if missing:
        raise RolesError(f"{where}: prompts lack {missing}; needed: {', '.join(PROMPTS)}")
    experts = tuple(Role(e["name"], e["system"], tuple(e["tools"])) for e in data["experts"])
    if not experts:
        raise RolesError(f"{where}: experts is empty; at least one expert is needed")
    for expert in experts:
        unknown = sorted(set(expert.tools) - tools) if tools is not None else []
        if unknown:
            raise RolesError(f"{where}: expert {expert.name} names unknown tools {unknown}; "
                             f"tools: {', '.join(sorted(tools))}")
    central = data["central"]
    return Roles(domain=data["domain"], levels=tuple(data["levels"]),
                 central=Role(central["name"], central["system"]), experts=experts,
                 prompts=dict(data["prompts"]))

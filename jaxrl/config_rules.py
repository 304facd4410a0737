"""How a config key is declared and checked: the error type, the YAML dialect, `setting` (a
field whose bounds and choices live in its metadata) and the one rule checker that reads them.
jaxrl/config.py declares the groups with these; nothing here knows a group."""
import re
from dataclasses import field, fields

import yaml

STRS = tuple[str, ...]
FLOATS = tuple[float, ...]
TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str",
              STRS: "list[str]", FLOATS: "list[float]"}
_BOUNDS = (("gt", ">", float.__gt__), ("ge", ">=", float.__ge__),
           ("lt", "<", float.__lt__), ("le", "<=", float.__le__))


class ConfigError(ValueError):
    """A user-facing configuration problem; the message names the dotted key."""

    exit_code = 2


class Loader(yaml.SafeLoader):
    """safe_load, except that `1e-5` is a float (YAML 1.1 demands a dot: `1.0e-5`)."""


class Dumper(yaml.SafeDumper):
    """safe_dump that quotes strings such as '1e5' which Loader would read back as floats."""


for _cls in (Loader, Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float",
                               re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                               list("-+0123456789"))


def setting(default, **rules):
    """A field whose rules live in its metadata: choices, gt/ge/lt/le, even, also (extra allowed
    values), nonempty, secret (dropped from to_dict/dump_yaml and from repr)."""
    return field(default=default, metadata=rules, repr=not rules.get("secret", False))


class Group:
    """Base of every group: lists given on input are stored as tuples."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))


def scalar(typ: type, value):
    """value as typ, or None when it has another type (a bool is never taken for a number)."""
    if isinstance(value, bool) != (typ is bool):
        return None
    if typ is float and isinstance(value, int):
        return float(value)
    return value if isinstance(value, typ) else None


def check_rules(key: str, value, rules) -> None:
    """Apply a field's declared choices and bounds (to each entry when the value is a list)."""
    if rules.get("nonempty") and value == ():
        raise ConfigError(f"config key {key!r} must not be empty; got []")
    items = value if isinstance(value, tuple) else (value,)
    must = f"config key {key!r} {'entries ' if isinstance(value, tuple) else ''}must be"
    for item in items:
        choices = rules.get("choices")
        if choices is not None and item not in choices:
            raise ConfigError(f"{must} one of {', '.join(map(str, choices))}; got {item!r}")
        if item in rules.get("also", ()):
            continue
        bounds = [(sym, rules[name], op) for name, sym, op in _BOUNDS if name in rules]
        ok = all(op(float(item), float(limit)) for _, limit, op in bounds)
        parts = [f"{sym} {limit}" for sym, limit, _ in bounds]
        if rules.get("even"):
            ok, parts = ok and item % 2 == 0, parts + ["even"]
        if not ok:
            also = "".join(f" or {extra}" for extra in rules.get("also", ()))
            raise ConfigError(f"{must} {' and '.join(parts)}{also}; got {item!r}")

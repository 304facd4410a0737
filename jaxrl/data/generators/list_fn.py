"""List Functions: a clean-room set of list transformations. The prompt shows input/output pairs
of one hidden transformation of small-integer lists; the answer is a Python function
`transform(lst)`, checked on held-out pairs (`python` verifier).

Each family is one Python expression in `lst` (with integer parameters). Difficulty 1 uses the
basic families, 2 adds index- and aggregate-based ones, 3 composes two families. The expected
outputs are computed by running the gold source itself, so the gold answer passes its tests by
construction; every problem shows at least one pair whose output differs from its input.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from string import Template

from jaxrl.data.generators.registry import register
from jaxrl.data.records import Problem


@dataclass(frozen=True)
class Family:
    name: str
    expression: str  # a Python expression in `lst`; $k, $a, $b are integer parameters
    params: tuple[tuple[str, int, int], ...] = ()  # (name, low, high), inclusive
    level: int = 1  # the lowest difficulty that uses it


FAMILIES = (
    Family("reverse", "lst[::-1]"),
    Family("sort", "sorted(lst)"),
    Family("sort_descending", "sorted(lst, reverse=True)"),
    Family("add", "[x + $k for x in lst]", (("k", 1, 9),)),
    Family("multiply", "[x * $k for x in lst]", (("k", 2, 5),)),
    Family("keep_greater", "[x for x in lst if x > $k]", (("k", 2, 7),)),
    Family("remove_value", "[x for x in lst if x != $k]", (("k", 0, 9),)),
    Family("keep_even", "[x for x in lst if x % 2 == 0]"),
    Family("keep_odd", "[x for x in lst if x % 2 == 1]"),
    Family("square", "[x * x for x in lst]"),
    Family("length", "[len(lst)]"),
    Family("total", "[sum(lst)]"),
    Family("append", "lst + [$k]", (("k", 0, 9),)),
    Family("prepend", "[$k] + lst", (("k", 0, 9),)),
    Family("take", "lst[:$k]", (("k", 1, 4),), level=2),
    Family("drop", "lst[$k:]", (("k", 1, 3),), level=2),
    Family("rotate_left", "lst[$k:] + lst[:$k]", (("k", 1, 3),), level=2),
    Family("unique", "list(dict.fromkeys(lst))", level=2),
    Family("running_total", "[sum(lst[:i + 1]) for i in range(len(lst))]", level=2),
    Family("maximum", "[max(lst)] if lst else []", level=2),
    Family("minimum", "[min(lst)] if lst else []", level=2),
    Family("repeat_each", "[y for x in lst for y in (x, x)]", level=2),
    Family("replace", "[$b if x == $a else x for x in lst]", (("a", 0, 9), ("b", 0, 9)), level=2),
    Family("swap_ends", "lst[-1:] + lst[1:-1] + lst[:1] if len(lst) > 1 else lst", level=2),
    Family("adjacent_sums", "[a + b for a, b in zip(lst, lst[1:])]", level=2),
    Family("count_value", "[lst.count($k)]", (("k", 0, 9),), level=2),
    Family("modulo", "[x % $k for x in lst]", (("k", 2, 5),), level=2),
)
SHOWN = {1: 6, 2: 5, 3: 5}
HELD_OUT = 5
MAX_LENGTH, MAX_VALUE = 7, 9


def _instantiate(rng: random.Random, family: Family) -> str:
    values = {name: rng.randint(low, high) for name, low, high in family.params}
    if family.name == "replace" and values["a"] == values["b"]:
        values["b"] = (values["a"] + 1) % (MAX_VALUE + 1)
    return Template(family.expression).substitute(values)


def _source(rng: random.Random, difficulty: int) -> tuple[str, list[str]]:
    """A gold source for a random family (two composed families at difficulty 3)."""
    pool = [f for f in FAMILIES if f.level <= min(difficulty, 2)]
    families = rng.sample(pool, 2 if difficulty == 3 else 1)
    expressions = [_instantiate(rng, f) for f in families]
    body = "".join(f"    lst = {e}\n" for e in expressions[:-1])
    return (f"def transform(lst):\n{body}    return {expressions[-1]}\n",
            [f.name for f in families])


def _compile(source: str):
    namespace: dict = {}
    exec(compile(source, "<list_fn gold>", "exec"), namespace)  # our own template, not input
    return namespace["transform"]


def _inputs(rng: random.Random, count: int) -> list[list[int]]:
    inputs: list[list[int]] = []
    while len(inputs) < count:
        lst = [rng.randint(0, MAX_VALUE) for _ in range(rng.randint(1, MAX_LENGTH))]
        if lst not in inputs:
            inputs.append(lst)
    return inputs


@register("list_fn", "list transformations from examples; answer is a Python transform(lst)",
          "python")
def make(rng: random.Random, difficulty: int) -> Problem:
    shown = SHOWN[difficulty]
    while True:
        source, names = _source(rng, difficulty)
        transform = _compile(source)
        inputs = _inputs(rng, shown + HELD_OUT)
        pairs = [(x, transform(list(x))) for x in inputs]
        if any(out != x for x, out in pairs[:shown]):
            break
    examples = "\n".join(f"{x} -> {out}" for x, out in pairs[:shown])
    tests = [{"input": x, "output": out} for x, out in pairs[shown:]]
    return Problem(fields={"examples": examples}, answer=source,
                   verifier={"kind": "python", "entry_point": "transform", "tests": tests},
                   metadata={"families": names, "shown": shown})

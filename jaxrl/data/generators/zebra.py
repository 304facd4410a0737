"""Zebra (ZebraLogic-style) grid puzzles: N houses x M attributes with a unique solution.

A random solution (one permutation of values per attribute) is drawn. Clues true in it are
added, each one false in a second solution that Z3 still finds, until the solution is unique;
then clues are removed one at a time, in random order, while it stays unique (ZebraLogic's
procedure). Difficulty is log10 of the search space, M log10(N!). Levels: 1 = 2-3 houses x 2-3
attributes, 2 = 3-4 x 3-4, 3 = 5-6 x 4-6.

Formal vocabulary: every attribute value is an Int constant, the number of its house; the sorts
House (1..N) and one per attribute (its values) can be quantified. Gamma_dom: each value lies in
1..N and the values of one attribute are distinct. A record carries the puzzle text, the
vocabulary and Gamma_dom (verifier "theory"), the gold grid (answer) and the gold formal clues
(metadata "clues_formal").
"""
from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass

import z3

from jaxrl.data.generators.registry import register
from jaxrl.data.prompts import system_prompt
from jaxrl.data.records import Problem, register_verifier_kind
from jaxrl.logic.sexpr import GUIDE, parse
from jaxrl.logic.z3_theory import Theory

register_verifier_kind("zebra", {"attributes": (dict, True), "symbols": (dict, True),
                                 "theory": (dict, True)})

# attribute -> (value pool, how a clue names the person with value {v})
ATTRIBUTES = {
    "Name": (("Alice", "Bob", "Carol", "David", "Eric", "Frank"), "{v}"),
    "Pet": (("cat", "dog", "fish", "bird", "horse", "rabbit"), "the person who keeps the {v}"),
    "Drink": (("tea", "coffee", "juice", "milk", "water", "soda"), "the person who drinks {v}"),
    "Color": (("red", "green", "blue", "white", "yellow", "purple"),
              "the person who lives in the {v} house"),
    "Food": (("pizza", "pasta", "sushi", "tacos", "soup", "curry"), "the person who likes {v}"),
    "Sport": (("tennis", "soccer", "golf", "chess", "rugby", "hockey"),
              "the person who plays {v}"),
}
LEVELS = {1: ((2, 3), (2, 3)), 2: ((3, 4), (3, 4)), 3: ((5, 6), (4, 6))}
# clue kind -> (formal template over symbols a, b or house h, sentence template)
CLUES = {
    "at": ("(= {a} {h})", "{A} lives in house {h}."),
    "not_at": ("(distinct {a} {h})", "{A} does not live in house {h}."),
    "same": ("(= {a} {b})", "{A} is {b}."),
    "differ": ("(distinct {a} {b})", "{A} is not {b}."),
    "left": ("(< {a} {b})", "{A} lives somewhere to the left of {b}."),
    "right": ("(> {a} {b})", "{A} lives somewhere to the right of {b}."),
    "just_left": ("(= (+ {a} 1) {b})", "{A} lives directly left of {b}."),
    "next_to": ("(or (= (+ {a} 1) {b}) (= (+ {b} 1) {a}))", "{A} and {b} live next to each "
                "other."),
    "one_between": ("(or (= (+ {a} 2) {b}) (= (+ {b} 2) {a}))", "There is one house between "
                    "{a} and {b}."),
}
_HOLDS = {"at": lambda d: d == 0, "not_at": lambda d: d != 0, "same": lambda d: d == 0,
          "differ": lambda d: d != 0, "left": lambda d: d > 0, "right": lambda d: d < 0,
          "just_left": lambda d: d == 1, "next_to": lambda d: abs(d) == 1,
          "one_between": lambda d: abs(d) == 2}


@dataclass(frozen=True)
class Clue:
    kind: str
    a: tuple[str, str]  # (attribute, value)
    b: tuple[str, str] | int  # another (attribute, value), or a house for at / not_at

    def holds(self, where: dict[tuple[str, str], int]) -> bool:
        """Whether the clue is true where each (attribute, value) lives in house where[...]."""
        other = self.b if isinstance(self.b, int) else where[self.b]
        return _HOLDS[self.kind](other - where[self.a])


@dataclass(frozen=True)
class ZebraPuzzle:
    attributes: dict[str, list[str]]  # attribute -> its values, sorted (the listing order)
    solution: dict[str, list[str]]  # attribute -> value of house 1, 2, ...
    clues: tuple[Clue, ...]

    @property
    def houses(self) -> int:
        return len(next(iter(self.solution.values())))

    @property
    def where(self) -> dict[tuple[str, str], int]:
        return {(attr, v): h for attr, values in self.solution.items()
                for h, v in enumerate(values, start=1)}


def symbol_table(attributes: dict[str, list[str]]) -> dict[str, list[str]]:
    """The formal constant of each value: the value as an ASCII identifier, prefixed with its
    attribute where two values would share a name (and numbered if they still would)."""
    def base(text: str) -> str:
        name = re.sub(r"[^A-Za-z0-9]+", "_", str(text)).strip("_") or "v"
        return name if name[0].isalpha() else f"v_{name}"
    bases = [base(v).lower() for values in attributes.values() for v in values]
    table, seen = {}, set()
    for attr, values in attributes.items():
        table[attr] = []
        for value in values:
            name = base(value)
            if bases.count(name.lower()) > 1:
                name = f"{base(attr)}_{name}"
            while name.lower() in seen:
                name += "_"
            seen.add(name.lower())
            table[attr].append(name)
    return table


def sort_name(attribute: str) -> str:
    name = re.sub(r"[^A-Za-z0-9]+", "", str(attribute).title())
    return name if name[:1].isalpha() and name != "House" else f"Attr{name}"


def theory_spec(houses: int, attributes: dict[str, list[str]]) -> dict:
    """The Zebra vocabulary and Gamma_dom for `houses` houses and these attribute values."""
    symbols = symbol_table(attributes)
    sorts, domain = {"House": list(range(1, houses + 1))}, []
    for attr, names in symbols.items():
        sorts[sort_name(attr)] = names
        domain += [f"(forall ((x {sort_name(attr)})) (<= 1 x {houses}))",
                   f"(distinct {' '.join(names)})"]
    consts = {name: "Int" for names in symbols.values() for name in names}
    return {"sorts": sorts, "consts": consts, "preds": {}, "domain": domain}


def clue_formal(clue: Clue, attributes: dict[str, list[str]]) -> str:
    symbols = symbol_table(attributes)

    def sym(item: tuple[str, str]) -> str:
        return symbols[item[0]][attributes[item[0]].index(item[1])]
    b = clue.b if isinstance(clue.b, int) else sym(clue.b)
    return CLUES[clue.kind][0].format(a=sym(clue.a), b=b, h=b)


def clue_text(clue: Clue) -> str:
    def person(item: tuple[str, str]) -> str:
        return ATTRIBUTES[item[0]][1].format(v=item[1])
    subject = person(clue.a)
    b = clue.b if isinstance(clue.b, int) else person(clue.b)
    text = CLUES[clue.kind][1].format(A=subject[0].upper() + subject[1:], a=subject, b=b, h=b)
    return text[0].upper() + text[1:]


def _random_clue(rng: random.Random, where: dict, houses: int) -> Clue:
    """A random clue true in the solution `where` (it may say little)."""
    items = sorted(where)
    kind, a = rng.choice(tuple(CLUES)), rng.choice(items)
    if kind in ("at", "not_at"):
        return Clue(kind, a, rng.choice([h for h in range(1, houses + 1)
                                         if _HOLDS[kind](h - where[a])]))
    others = [i for i in items if i != a and (i[0] != a[0] or kind not in ("same", "differ"))]
    truths = [b for b in others if _HOLDS[kind](where[b] - where[a])]
    return Clue(kind, a, rng.choice(truths)) if truths else Clue("at", a, where[a])


def _ruling_out(rng: random.Random, where: dict, other: dict, houses: int) -> Clue:
    """A clue true in `where` and false in the other solution `other`."""
    for _ in range(50):
        clue = _random_clue(rng, where, houses)
        if not clue.holds(other):
            return clue
    moved = sorted(item for item in where if where[item] != other[item])
    item = rng.choice(moved)
    return Clue("at", item, where[item])


class _Uniqueness:
    """Z3 over the puzzle's theory with the gold solution excluded: a set of clues leaves the
    solution unique exactly when it makes this unsatisfiable. Clues are switched on and off
    through assumption literals, so one solver serves every check."""

    def __init__(self, attributes: dict[str, list[str]], where: dict, houses: int):
        self.theory = Theory(theory_spec(houses, attributes))
        self.attributes = attributes
        symbols = symbol_table(attributes)
        self.consts = {(attr, v): self.theory.consts[s] for attr in attributes
                       for v, s in zip(attributes[attr], symbols[attr])}
        self.solver = z3.Solver(ctx=self.theory.ctx)
        self.solver.add(*self.theory.domain)
        self.solver.add(z3.Not(z3.And([c == where[item] for item, c in self.consts.items()])))
        self.flags: list = []

    def add(self, clue: Clue) -> None:
        flag = z3.Bool(f"clue{len(self.flags)}", self.theory.ctx)
        formula = self.theory.formula(parse(clue_formal(clue, self.attributes)))
        self.solver.add(z3.Implies(flag, formula))
        self.flags.append(flag)

    def other_solution(self, keep: list[int]) -> dict | None:
        """A second solution under the clues `keep`, or None when the gold one is unique."""
        if self.solver.check(*(self.flags[i] for i in keep)) == z3.unsat:
            return None
        model = self.solver.model()
        return {item: model.eval(c, model_completion=True).as_long()
                for item, c in self.consts.items()}


def make_puzzle(rng: random.Random, houses: int, n_attributes: int) -> ZebraPuzzle:
    """A puzzle with a unique solution (see the module doc)."""
    chosen = ["Name"] + rng.sample(sorted(set(ATTRIBUTES) - {"Name"}), n_attributes - 1)
    solution = {attr: rng.sample(ATTRIBUTES[attr][0], houses) for attr in chosen}
    attributes = {attr: sorted(values) for attr, values in solution.items()}
    where = ZebraPuzzle(attributes, solution, ()).where
    check = _Uniqueness(attributes, where, houses)
    clues: list[Clue] = []
    while (other := check.other_solution(list(range(len(clues))))) is not None:
        clues.append(_ruling_out(rng, where, other, houses))
        check.add(clues[-1])
    keep = list(range(len(clues)))
    for index in rng.sample(range(len(clues)), len(clues)):
        trial = [i for i in keep if i != index]
        if check.other_solution(trial) is None:
            keep = trial
    return ZebraPuzzle(attributes, solution, tuple(clues[i] for i in keep))


def log10_space(houses: int, n_attributes: int) -> float:
    """log10 of the search space (N!)^M."""
    return n_attributes * math.log10(math.factorial(houses))


def grid_answer(solution: dict[str, list[str]]) -> str:
    """The gold answer: {"House 1": {attribute: value, ...}, ...} as one line of JSON."""
    houses = len(next(iter(solution.values())))
    return json.dumps({f"House {h}": {attr: values[h - 1] for attr, values in solution.items()}
                       for h in range(1, houses + 1)})


def puzzle_text(puzzle: ZebraPuzzle) -> str:
    n = puzzle.houses
    lines = [f"There are {n} houses, numbered 1 to {n} from left to right. Each house has one "
             "person, and each attribute below takes a different value in every house:"]
    lines += [f" - {attr}: {', '.join(values)}" for attr, values in puzzle.attributes.items()]
    lines += ["", "Clues:"] + [f"{i}. {clue_text(c)}" for i, c in enumerate(puzzle.clues, 1)]
    return "\n".join(lines)


def vocabulary_text(houses: int, attributes: dict[str, list[str]]) -> str:
    """The formal symbols of a Zebra puzzle and the answer format, for the prompt."""
    symbols = symbol_table(attributes)
    listing = "; ".join(f"{sort_name(a)}: {', '.join(symbols[a])}" for a in attributes)
    named = [f"{s} = {v}" for a in attributes for v, s in zip(attributes[a], symbols[a]) if s != v]
    first, second = (symbols[a][0] for a in list(attributes)[:2])
    example = {f"House {h}": {a: "..." for a in attributes} for h in (1, 2)}
    return "\n".join([
        f"Symbols: every value is an integer constant, the number of the house (1 to {houses}) "
        f"where it is found. {listing}." + (f" ({'; '.join(named)})" if named else ""),
        f"Sorts for quantifiers: House (1 to {houses}) and " + ", ".join(map(sort_name, attributes))
        + " (their values).",
        "The rules already hold: every value is in exactly one house, and no two values of one "
        "attribute share a house.",
        f"For example, a clue saying {first} and {second} belong to the same house is "
        f"(assert (= {first} {second})), and a deduction that {first} lives in house 1 is "
        f"(step 1 (= {first} 1)).",
        "Inside <answer></answer> write the solution as JSON with one object per house, e.g. "
        f"<answer>{json.dumps(example)[:-1]}, ...}}</answer>."])


def zebra_messages(puzzle: str, houses: int, attributes: dict[str, list[str]]) -> list[dict]:
    """[system, user]: the puzzle, the formal block format, its symbols, the answer format."""
    user = "\n\n".join([puzzle.strip(), GUIDE, vocabulary_text(houses, attributes)])
    return [{"role": "system", "content": system_prompt("zebra")},
            {"role": "user", "content": user}]


def zebra_verifier(houses: int, attributes: dict[str, list[str]]) -> dict:
    return {"kind": "zebra", "attributes": attributes, "symbols": symbol_table(attributes),
            "theory": theory_spec(houses, attributes)}


def problem(puzzle: ZebraPuzzle) -> Problem:
    """The puzzle as a Problem; fields["messages"] is its prompt."""
    n, m = puzzle.houses, len(puzzle.attributes)
    messages = zebra_messages(puzzle_text(puzzle), n, puzzle.attributes)
    metadata = {"houses": n, "attributes": m, "size": f"{n}*{m}",
                "log10_space": round(log10_space(n, m), 3),
                "clues": [clue_text(c) for c in puzzle.clues],
                "clues_formal": [clue_formal(c, puzzle.attributes) for c in puzzle.clues]}
    return Problem({"messages": messages}, grid_answer(puzzle.solution),
                   zebra_verifier(n, puzzle.attributes), metadata)


@register("zebra", "ZebraLogic-style grid puzzles, N houses x M attributes, a unique solution "
          "(Spring, formal steps)", "zebra")
def make(rng: random.Random, difficulty: int) -> Problem:
    """A random puzzle at `difficulty` (1, 2 or 3; see LEVELS)."""
    houses, attrs = LEVELS[difficulty]
    return problem(make_puzzle(rng, rng.randint(*houses), rng.randint(*attrs)))

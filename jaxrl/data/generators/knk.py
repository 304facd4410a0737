"""Knights and Knaves: knights always tell the truth, knaves always lie; who is which?

Each of the 2 to 8 inhabitants makes one statement, built from telling-truth / lying leaves
("Bob is a knight", "Bob is a knave") with not, and, or, implies and iff. A random role
assignment is drawn and every statement is drawn consistent with it; while Z3 finds a second
solution, one inhabitant's statement is redrawn so that it rules that solution out, so every
puzzle has exactly one solution. Levels: 1 = 2-3 people and one connective at most, 2 = 4-5
people, 3 = 6-8 people, statements nested two deep.

Formal vocabulary: the sort Person (the inhabitants) and the predicates knight and knave over
it. Gamma_dom: every person is exactly one of the two. "X says S" is (= (knight X) S).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import z3

from jaxrl.data.generators.registry import register
from jaxrl.data.prompts import system_prompt
from jaxrl.data.records import Problem, register_verifier_kind
from jaxrl.logic.sexpr import GUIDE, parse
from jaxrl.logic.z3_theory import Theory

register_verifier_kind("knk", {"people": (list, True), "theory": (dict, True)})

NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Iris", "Jack",
         "Kate", "Liam", "Mia", "Noah", "Olivia", "Paul", "Quinn", "Ruby", "Sam", "Tara")
LEVELS = {1: ((2, 3), 1), 2: ((4, 5), 2), 3: ((6, 8), 2)}  # (people range, statement depth)
CONNECTIVES = ("not", "and", "or", "=>", "iff")
DOMAIN = "(forall ((p Person)) (distinct (knight p) (knave p)))"
_WORDS = {"and": "{a} and {b}", "or": "{a} or {b}", "=>": "if {a} then {b}",
          "iff": "{a} if and only if {b}"}

Statement = tuple  # ("knight" | "knave", name) or (connective, statement, ...)


def evaluate(statement: Statement, knights: dict[str, bool]) -> bool:
    """The truth of a statement when knights[p] says whether p is a knight."""
    head, *args = statement
    if head in ("knight", "knave"):
        return knights[args[0]] == (head == "knight")
    values = [evaluate(a, knights) for a in args]
    return {"not": lambda v: not v[0], "and": all, "or": any,
            "=>": lambda v: not v[0] or v[1], "iff": lambda v: v[0] == v[1]}[head](values)


def formal(statement: Statement) -> str:
    head, *args = statement
    if head in ("knight", "knave"):
        return f"({head} {args[0]})"
    op = "=" if head == "iff" else head
    return f"({op} {' '.join(formal(a) for a in args)})"


def text(statement: Statement, nested: bool = False) -> str:
    head, *args = statement
    if head in ("knight", "knave"):
        return f"{args[0]} is a {head}"
    if head == "not":
        inner = args[0]
        if inner[0] in ("knight", "knave"):
            return f"{inner[1]} is not a {inner[0]}"
        return f"it is not the case that ({text(inner)})"
    said = _WORDS[head].format(a=text(args[0], True), b=text(args[1], True))
    return f"({said})" if nested else said


def random_statement(rng: random.Random, speaker: str, people: list[str],
                     depth: int) -> Statement:
    others = [p for p in people if p != speaker]
    if depth == 0 or rng.random() < 0.3:
        return (rng.choice(("knight", "knave")), rng.choice(others))
    head = rng.choice(CONNECTIVES)
    arity = 1 if head == "not" else 2
    return (head, *(random_statement(rng, speaker, people, depth - 1) for _ in range(arity)))


def _statement(rng: random.Random, speaker: str, people: list[str], depth: int,
               knights: dict, other: dict | None = None) -> Statement | None:
    """A statement `speaker` can make under `knights` (true iff a knight) that, when `other`
    is given, the speaker could not make under `other`; None when 100 draws find none."""
    for _ in range(100):
        s = random_statement(rng, speaker, people, depth)
        if evaluate(s, knights) == knights[speaker] and (
                other is None or evaluate(s, other) != other[speaker]):
            return s
    if other is not None:
        return None
    about = rng.choice([p for p in people if p != speaker])
    said_knight = knights[about] == knights[speaker]  # a knight tells the truth, a knave lies
    return ("knight" if said_knight else "knave", about)


def theory_spec(people: list[str]) -> dict:
    return {"sorts": {"Person": list(people)}, "consts": {},
            "preds": {"knight": ["Person"], "knave": ["Person"]}, "domain": [DOMAIN]}


def clue_formal(speaker: str, statement: Statement) -> str:
    return f"(= (knight {speaker}) {formal(statement)})"


def other_solution(people: list[str], statements: dict, knights: dict) -> dict | None:
    """A role assignment other than `knights` under which every statement can be made (Z3),
    or None when `knights` is the only one."""
    theory = Theory(theory_spec(people))
    solver = z3.Solver(ctx=theory.ctx)
    solver.add(*theory.domain)
    solver.add(*(theory.formula(parse(clue_formal(p, s))) for p, s in statements.items()))
    atoms = {p: theory.atoms[("knight", (p,))] for p in people}
    solver.add(z3.Not(z3.And([a == knights[p] for p, a in atoms.items()])))
    if solver.check() == z3.unsat:
        return None
    model = solver.model()
    return {p: z3.is_true(model.eval(a, model_completion=True)) for p, a in atoms.items()}


@dataclass(frozen=True)
class KnkPuzzle:
    people: list[str]
    knights: dict[str, bool]
    statements: dict[str, Statement]


def make_puzzle(rng: random.Random, n: int, depth: int) -> KnkPuzzle:
    """A puzzle of n people with exactly one solution (see the module doc)."""
    people = rng.sample(NAMES, n)
    while True:
        knights = {p: rng.random() < 0.5 for p in people}
        statements = {p: _statement(rng, p, people, depth, knights) for p in people}
        for _ in range(10 * n):
            other = other_solution(people, statements, knights)
            if other is None:
                return KnkPuzzle(people, knights, statements)
            speaker = rng.choice(people)
            statements[speaker] = (_statement(rng, speaker, people, depth, knights, other)
                                   or statements[speaker])


def answer_text(people: list[str], knights: dict[str, bool]) -> str:
    return ", ".join(f"{p} is a {'knight' if knights[p] else 'knave'}" for p in people)


def puzzle_text(puzzle: KnkPuzzle) -> str:
    people = puzzle.people
    listed = ", ".join(people[:-1]) + f" and {people[-1]}"
    said = [f'{p} says: "{text(s)[0].upper() + text(s)[1:]}."'
            for p, s in puzzle.statements.items()]
    return "\n".join([
        "A very special island is inhabited only by knights and knaves. Knights always tell "
        f"the truth, and knaves always lie. You meet {len(people)} inhabitants: {listed}.",
        *said, "Who is a knight and who is a knave?"])


def vocabulary_text(people: list[str]) -> str:
    first, second = people[0], people[1]
    return "\n".join([
        f"Symbols: (knight X) and (knave X) for each inhabitant X: {', '.join(people)}. "
        "Sort for quantifiers: Person (the inhabitants).",
        "The rules already hold: every inhabitant is exactly one of knight and knave.",
        "A statement S made by X is the premise (assert (= (knight X) S)): X is a knight exactly "
        f"when S is true. For example, if {first} says \"{second} is a knave\", write "
        f"(assert (= (knight {first}) (knave {second}))); a deduction that {second} is a knight "
        f"is (step 1 (knight {second})).",
        "Inside <answer></answer> name every inhabitant's role, in this form (the roles here "
        f"are only an example): <answer>{first} is a knight, {second} is a knave, ...</answer>."])


def brief_guide(people: list[str]) -> str:
    """The block format in three lines, for a policy that has learned it (knk-brief)."""
    first, second = people[0], people[1]
    return "\n".join([
        "Inside <think></think>, write each statement S made by X as (assert (= (knight X) S)), "
        "one per line, then each new deduction as (step K FORMULA), K = 1, 2, ...",
        f"Symbols: (knight X), (knave X) for X in {', '.join(people)}; (and ...) (or ...) "
        "(not F) (=> F G) (= F G).",
        f"Answer form: <answer>{first} is a knight, {second} is a knave, ...</answer>"])


def knk_messages(puzzle: KnkPuzzle, brief: bool = False) -> list[dict]:
    """[system, user]: the puzzle, the formal block format, its symbols, the answer format
    (`brief`: the three lines of brief_guide)."""
    parts = ([brief_guide(puzzle.people)] if brief
             else [GUIDE, vocabulary_text(puzzle.people)])
    user = "\n\n".join([puzzle_text(puzzle), *parts])
    return [{"role": "system", "content": system_prompt("knk")}, {"role": "user", "content": user}]


def problem(puzzle: KnkPuzzle, brief: bool = False) -> Problem:
    """The puzzle as a Problem; fields["messages"] is its prompt."""
    verifier = {"kind": "knk", "people": puzzle.people, "theory": theory_spec(puzzle.people)}
    metadata = {"people": len(puzzle.people),
                "clues_formal": [clue_formal(p, s) for p, s in puzzle.statements.items()]}
    return Problem({"messages": knk_messages(puzzle, brief)},
                   answer_text(puzzle.people, puzzle.knights), verifier, metadata)


@register("knk", "Knights and Knaves, 2-8 people, a unique solution (Spring, formal steps)", "knk")
def make(rng: random.Random, difficulty: int) -> Problem:
    """A random puzzle at `difficulty` (1, 2 or 3; see LEVELS)."""
    (least, most), depth = LEVELS[difficulty]
    return problem(make_puzzle(rng, rng.randint(least, most), depth))


@register("knk-brief", "the knk puzzles of the same seed, with a three-line format guide "
          "(prompts ~60% shorter; for a policy warmed up on gold traces)", "knk", family="knk")
def make_brief(rng: random.Random, difficulty: int) -> Problem:
    """The puzzle make() draws from the same rng, prompted with brief_guide."""
    (least, most), depth = LEVELS[difficulty]
    return problem(make_puzzle(rng, rng.randint(least, most), depth), brief=True)

"""The registry of procedural task generators: deterministic by seed, open to new tasks.

A generator module defines `make(rng, difficulty) -> Problem` and registers it with
`@register(name, description, verifier_kind)`; `generate(name, n, seed)` turns problems into
validated records (prompts from jaxrl.data.prompts, or ready-made in the Problem's
fields["messages"] as knk and zebra make them; duplicates of a prompt dropped). Tasks that a
later issue will add are listed in PLANNED so that `jaxrl data --list` can name them.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from jaxrl.data.prompts import build_messages
from jaxrl.data.records import Problem, make_record

DIFFICULTIES = (1, 2, 3)
PLANNED: dict[str, str] = {}


class GeneratorError(ValueError):
    """A generator asked for something it cannot produce (unknown task, too many problems)."""


@dataclass(frozen=True)
class Generator:
    name: str
    make: Callable[[random.Random, int], Problem]
    description: str
    verifier_kind: str
    family: str = ""  # generators of one family draw the same problems for the same seed


GENERATORS: dict[str, Generator] = {}


def register(name: str, description: str, verifier_kind: str, family: str | None = None):
    """Decorator that registers `make(rng, difficulty) -> Problem` as generator `name`. A
    generator of `family` (another generator's name) draws that generator's problems for the
    same seed and difficulty, worded its own way."""
    def decorate(make: Callable[[random.Random, int], Problem]):
        if name in GENERATORS:
            raise GeneratorError(f"generator {name!r} is registered twice")
        GENERATORS[name] = Generator(name, make, description, verifier_kind, family or name)
        return make
    return decorate


def get_generator(name: str) -> Generator:
    if name in GENERATORS:
        return GENERATORS[name]
    available = ", ".join(sorted(GENERATORS))
    if name in PLANNED:
        raise GeneratorError(f"generated task {name!r} is not available yet: {PLANNED[name]}; "
                             f"available generated tasks: {available}")
    raise GeneratorError(f"unknown generated task {name!r}; available: {available}")


def generate(name: str, n: int, seed: int = 0, difficulty: int = 1) -> list[dict]:
    """n distinct records of task `name`; the same (name, seed, difficulty) always gives the same
    records, and a smaller n gives a prefix of a larger one."""
    generator = get_generator(name)
    if difficulty not in DIFFICULTIES:
        raise GeneratorError(f"difficulty must be one of {DIFFICULTIES}; got {difficulty!r}")
    if n < 0:
        raise GeneratorError(f"the number of records must be >= 0; got {n}")
    rng = random.Random(f"{generator.family}:{seed}:{difficulty}")
    records, seen, budget = [], set(), 50 * n + 100
    for _ in range(budget):
        if len(records) == n:
            break
        problem = generator.make(rng, difficulty)
        messages = problem.fields.get("messages") or build_messages(name, problem.verifier,
                                                                    **problem.fields)
        if messages[-1]["content"] in seen:
            continue
        seen.add(messages[-1]["content"])
        metadata = {**problem.metadata, "seed": seed, "difficulty": difficulty}
        records.append(make_record(name, len(records), messages, problem.answer,
                                   problem.verifier, metadata))
    if len(records) < n:
        raise GeneratorError(f"{name} at difficulty {difficulty} gave only {len(records)} "
                             f"distinct problems in {budget} tries; ask for fewer than {n}")
    return records

"""Abduction rules: template-based missing-fact generation. The context holds facts and rules;
the observation follows from them only if one more fact about one entity is added (a premise of
the rule that concludes the observation, left out of the facts). The answer is that fact,
checked by the `exact` verifier after normalization.

Difficulty 1: one rule of one or two premises; 2: two or three premises, negated conclusions and
more distractors; 3: one of the given premises is itself derived by another rule, so the
observation is two rule applications away. Every problem is checked by
forward chaining: the observation is not provable as given, and exactly one added fact about any
entity (among all entity-attribute pairs) makes it provable.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from jaxrl.data.generators.registry import register
from jaxrl.data.records import Problem

PEOPLE = ("Anne", "Bob", "Carol", "Dave", "Erin", "Fiona", "Gary", "Harry", "Ivy", "Jack")
ANIMALS = ("the bear", "the cat", "the dog", "the lion", "the mouse", "the rabbit", "the tiger",
           "the fox", "the owl", "the wolf")
ATTRIBUTES = ("big", "kind", "quiet", "red", "round", "smart", "young", "cold", "green", "rough",
              "nice", "blue", "furry", "white", "strong", "tired", "calm", "brave", "shy", "old")
# difficulty -> (premises of the key rule, chained, negated conclusions allowed, distractor rules)
LEVELS = {1: ((1, 2), False, False, 1), 2: ((2, 3), False, True, 2), 3: ((2, 3), True, True, 3)}

Literal = tuple[str, str, bool]  # (entity, attribute, holds)


@dataclass(frozen=True)
class Rule:
    premises: tuple[str, ...]  # attributes the subject must have
    conclusion: str
    holds: bool = True  # False: the rule concludes the subject is NOT `conclusion`


def _closure(facts: set[Literal], rules: list[Rule], entities: list[str]) -> set[Literal]:
    known = set(facts)
    changed = True
    while changed:
        changed = False
        for entity in entities:
            for rule in rules:
                head = (entity, rule.conclusion, rule.holds)
                if head not in known and all((entity, p, True) in known for p in rule.premises):
                    known.add(head)
                    changed = True
    return known


def _sentence(entity: str, attribute: str, holds: bool = True) -> str:
    text = f"{entity} is {'' if holds else 'not '}{attribute}."
    return text[0].upper() + text[1:]


def _rule_text(rule: Rule, animals: bool) -> str:
    premises = " and ".join(rule.premises)
    subject, pronoun = ("something", "it is") if animals else ("someone", "they are")
    negation = "" if rule.holds else "not "
    return f"If {subject} is {premises}, then {pronoun} {negation}{rule.conclusion}."


def _world(rng: random.Random, difficulty: int):
    """Entities, rules, facts, the observation and the one fact that explains it."""
    (low, high), chained, negations, n_distractors = LEVELS[difficulty]
    animals = rng.random() < 0.5
    entities = rng.sample(ANIMALS if animals else PEOPLE, 3)
    attrs = rng.sample(ATTRIBUTES, 12)
    target, premises = entities[0], attrs[:rng.randint(low, high)]
    missing = rng.choice(premises)
    key = Rule(tuple(premises), attrs[5], not (negations and rng.random() < 0.3))
    given = [p for p in premises if p != missing]
    rules = [key]
    if chained:  # one given premise is not a fact but derived from two others by a first rule
        derived = given.pop(0)
        rules.append(Rule((attrs[8], attrs[9]), derived))
        given += [attrs[8], attrs[9]]
    facts = {(target, p, True) for p in given}
    free = [a for a in attrs if a not in (missing, key.conclusion)]
    for _ in range(n_distractors):
        rules.append(Rule(tuple(rng.sample(free, 2)), rng.choice(free)))
    for entity in entities:
        facts |= {(entity, a, True) for a in rng.sample(free, 2)}
    query = (target, key.conclusion, key.holds)
    return animals, entities, rules, facts, query, (target, missing, True)


def _unique_answer(entities, rules, facts, query, answer) -> bool:
    """The query is unprovable as given and provable after adding exactly one fact (other than
    the query itself): the answer."""
    if query in _closure(facts, rules, entities):
        return False
    attributes = {a for r in rules for a in (*r.premises, r.conclusion)} | {a for _, a, _ in facts}
    candidates = [(e, a, True) for e in entities for a in sorted(attributes)
                  if (e, a, True) not in facts and (e, a, True) != query]
    explaining = [c for c in candidates if query in _closure(facts | {c}, rules, entities)]
    return explaining == [answer]


@register("abduction_rules", "missing-fact abduction over template facts and rules", "exact")
def make(rng: random.Random, difficulty: int) -> Problem:
    while True:
        animals, entities, rules, facts, query, answer = _world(rng, difficulty)
        if _unique_answer(entities, rules, facts, query, answer):
            break
    lines = [_sentence(*f) for f in sorted(facts)] + [_rule_text(r, animals) for r in rules]
    rng.shuffle(lines)
    return Problem(fields={"context": "\n".join(lines), "observation": _sentence(*query)},
                   answer=_sentence(*answer), verifier={"kind": "exact"},
                   metadata={"domain": "animal" if animals else "person",
                             "rules": len(rules), "chained": LEVELS[difficulty][1]})

"""Arithmetic: small integer expressions for the quickstart ("What is 7 + 5?").

Difficulty sets how many operations (+, -, *) an expression has and how large its operands are.
Difficulty 1 (one operation, operands below 10; 300 distinct problems) is within reach of a
135M-parameter model: SmolLM2-135M-Instruct answers 28% of them at temperature 0.7 with the
worked example and the <think> prefix, so GRPO on it has signal from the first step on a CPU.
The answer is the exact integer value, checked by the `numeric` verifier.
"""
from __future__ import annotations

import random

from jaxrl.data.generators.registry import register
from jaxrl.data.records import Problem

# difficulty -> (fewest operations, most operations, operands are below this)
LEVELS = {1: (1, 1, 10), 2: (1, 2, 20), 3: (2, 4, 50)}
OPERATORS = ("+", "-", "*")


def evaluate(numbers: list[int], operators: list[str]) -> int:
    """The value of numbers[0] op numbers[1] op …, with * binding tighter than + and -."""
    total, sign, term = 0, 1, numbers[0]
    for op, number in zip(operators, numbers[1:]):
        if op == "*":
            term *= number
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), number
    return total + sign * term


@register("arithmetic", "integer expressions with + - * (the quickstart task)", "numeric")
def make(rng: random.Random, difficulty: int) -> Problem:
    fewest, most, bound = LEVELS[difficulty]
    count = rng.randint(fewest, most)
    numbers = [rng.randrange(bound) for _ in range(count + 1)]
    operators = [rng.choice(OPERATORS) for _ in range(count)]
    expression = " ".join([str(numbers[0])] + [f"{op} {n}" for op, n in
                                                zip(operators, numbers[1:])])
    value = evaluate(numbers, operators)
    return Problem(fields={"expression": expression}, answer=str(value),
                   verifier={"kind": "numeric", "tolerance": 1e-6},
                   metadata={"expression": expression, "operations": count})

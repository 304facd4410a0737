"""Calculator word problems: everyday quantities whose answer is a product of two-digit numbers
(difficulty 1), with a third number added or taken away (2), or a sum of two products (3). The
numbers are beyond a small model's mental arithmetic, so the calculator environment
(jaxrl/envs/calculator.py) pays for calling its tool correctly. The answer is the exact integer,
checked by the `numeric` verifier."""
from __future__ import annotations

import random

from jaxrl.data.generators.arithmetic import evaluate
from jaxrl.data.generators.registry import register
from jaxrl.data.records import Problem

# (what there is, with {a} per group and {b} groups; the things counted)
SETTINGS = (
    ("There are {b} boxes with {a} pencils in each box.", "pencils"),
    ("A train travels {a} km every hour for {b} hours.", "km"),
    ("A farmer plants {b} rows with {a} trees in each row.", "trees"),
    ("Each of {b} tickets costs {a} dollars.", "dollars"),
    ("Each of {b} classes has {a} students.", "students"),
    ("There are {b} crates with {a} bottles in each crate.", "bottles"),
)


@register("calculator", "word problems needing a calculator (the calculator environment)",
          "numeric")
def make(rng: random.Random, difficulty: int) -> Problem:
    setting, things = rng.choice(SETTINGS)
    numbers = [rng.randint(12, 99), rng.randint(12, 99)]
    operators, text = ["*"], [setting.format(a=numbers[0], b=numbers[1])]
    if difficulty == 2:
        numbers.append(rng.randint(12, 99))
        operators.append(rng.choice(("+", "-")))
        text.append(f"Then {numbers[2]} {things} are "
                    f"{'added' if operators[1] == '+' else 'taken away'}.")
    elif difficulty == 3:
        numbers += [rng.randint(12, 99), rng.randint(12, 99)]
        operators += ["+", "*"]
        text.append(f"Another {numbers[3]} groups have {numbers[2]} {things} each.")
    text.append(f"How many {things} are there in all?")
    expression = " ".join([str(numbers[0])] + [f"{op} {n}" for op, n in
                                                zip(operators, numbers[1:])])
    return Problem(fields={"messages": [{"role": "user", "content": " ".join(text)}]},
                   answer=str(evaluate(numbers, operators)),
                   verifier={"kind": "numeric", "tolerance": 1e-9},
                   metadata={"expression": expression})

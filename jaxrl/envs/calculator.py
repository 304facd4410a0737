"""The calculator environment: a word problem, a `calculator` tool, an answer in <answer></answer>.

It plays any record with a numeric gold answer (the `calculator` word problems, whose products
of two-digit numbers are beyond a small model's mental arithmetic, or `arithmetic`). The policy
calls the calculator on an expression, reads the result, and concludes with a reply without a
call, whose <answer> span is its answer.

Reward (`score`, the `episode` reward function): 1 for a correct answer, plus `env.evidence_bonus`
when a calculator call returned a result before the answer (evidence requested before
concluding), minus `env.turn_cost` per reply. Components: correct, evidence, turns, calls,
valid_calls.
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping
from typing import Any

from jaxrl.config import EnvConfig
from jaxrl.envs.protocol import Demonstration, Environment, EpisodeError, ToolError, function
from jaxrl.rewards.base import answer_span
from jaxrl.rewards.correctness import parse_number

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # a ** b with larger b is refused (a tiny expression, an enormous number)

INSTRUCTIONS = ("Call the calculator on the expression that gives the answer, then reply with "
                "<answer>number</answer>.")


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); a
    ToolError names what is not allowed."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise ToolError(f"cannot read {expression!r} as an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponents above {MAX_EXPONENT} are not allowed")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
    raise ToolError("only numbers, + - * / // % ** and parentheses are allowed")


def show(value: float) -> str:
    """A result as the calculator prints it: integers exactly, other values to 10 digits."""
    if isinstance(value, int) or (math.isfinite(value) and float(value).is_integer()):
        return str(int(value))
    return f"{value:.10g}"


class Calculator(Environment):
    name = "calculator"
    outcome = "correct"  # the score component that is the episode's accuracy
    example = {"name": "calculator", "arguments": {"expression": "12 * 34"}}

    @property
    def tools(self) -> list[dict]:
        return [function("calculator", "evaluate an arithmetic expression",
                         {"expression": "numbers, + - * / and parentheses"})]

    def opening(self, record: Mapping[str, Any]) -> tuple[str, list[dict]]:
        if parse_number(str(record.get("answer", ""))) is None:
            raise EpisodeError(f"the calculator environment plays records with a numeric "
                               f"answer; record {record.get('id')!r} has {record.get('answer')!r}")
        task = [m for m in record["messages"] if m["role"] != "system"]
        return INSTRUCTIONS, task

    def demonstration(self) -> Demonstration:
        return Demonstration("12 bags hold 34 marbles each. How many marbles are there?",
                             self.example, "408", "<answer>408</answer>")

    def run(self, name: str, arguments: Mapping[str, Any]) -> str:
        if name != "calculator":
            raise ToolError(f"unknown tool {name!r}; the tool is calculator")
        expression = arguments.get("expression")
        if not isinstance(expression, (str, int, float)) or isinstance(expression, bool):
            raise ToolError('calculator takes {"expression": "<arithmetic expression>"}')
        return show(evaluate(str(expression)))

    def conclude(self, text: str) -> dict:
        return {"text": text, "answer": answer_span(text)}

    @staticmethod
    def score(record: Mapping[str, Any], episode: Mapping[str, Any],
              cfg: EnvConfig) -> tuple[float, dict[str, float], dict[str, Any]]:
        """(value, components, info) of an episode (module docstring)."""
        conclusion = episode.get("conclusion") or {}
        answer = conclusion.get("answer")
        value = None if answer is None else parse_number(answer)
        gold = parse_number(str(record["answer"]))
        correct = value is not None and math.isclose(value, gold, rel_tol=1e-9, abs_tol=1e-9)
        calls = episode.get("calls", [])
        valid = sum(bool(c["valid"]) for c in calls)
        evidence = float(valid > 0 and episode.get("finish") == "answer")
        turns = float(episode.get("turns", 0))
        total = float(correct) + cfg.evidence_bonus * evidence - cfg.turn_cost * turns
        info = {"finish": episode.get("finish")}
        if not correct:
            info["error"] = ("no_answer" if answer is None else
                             "not_a_number" if value is None else "wrong_answer")
        return total, {"correct": float(correct), "evidence": evidence, "turns": turns,
                       "calls": float(len(calls)), "valid_calls": float(valid)}, info

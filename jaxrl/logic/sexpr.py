"""The formal-step language: a hand-written s-expression reader with hard limits, and the block
format in which a completion writes its premises and steps.

Block format (inside <think>...</think>; without a think span, the text before the last
<answer>). A formal form opens with "(assert" or "(step", anywhere in the text (one per line
reads best), and may continue over several lines until its parentheses balance. Everything else
is prose and ignored:

    The clues, formalized:
    (assert (= Bob tea))                    ; premise: a clue as the model reads it
    (assert (= tea 2))
    Bob drinks tea and tea is in house 2, so Bob lives in house 2.
    (step 1 (= Bob 2))                      ; step k: one formal deduction
    (step 2 (not (= Alice 3)))

Every `(assert F)` is a premise (in text order); every `(step K F)` is a step, K a positive
integer label. `;` starts a comment that runs to the end of the line.

Syntax: parentheses, integers (optional leading "-", at most `max_int_digits` digits) and symbols
([A-Za-z0-9_.+*/<>=!?~%^&$@:#-], not starting with a digit). Anything else (quotes, |, non-ASCII,
control bytes) is a syntax error. The reader is iterative, reads at most `max_form_chars` of one
form and stops at `max_depth` nesting or `max_nodes` atoms and lists, so no input can make it
recurse, allocate much, or run long. It builds plain data: tuples of symbols (str) and ints;
meaning is given only by jaxrl.logic.z3_theory, through a whitelist. `GUIDE` teaches the format
in prompts (the task adds its symbols and answer format).
"""
from __future__ import annotations

import re
from dataclasses import dataclass


class FormalSyntaxError(ValueError):
    """Text that is not a well-formed form of the formal language (or exceeds a limit)."""


@dataclass(frozen=True)
class Limits:
    """Hard bounds on model-written formal text (see the module doc)."""
    max_form_chars: int = 4000
    max_depth: int = 40
    max_nodes: int = 1500
    max_int_digits: int = 6
    max_symbol_chars: int = 64
    max_premises: int = 64
    max_steps: int = 128
    max_scan_chars: int = 200_000  # of the reasoning text searched for formal lines


_TOKEN = re.compile(r"[ \t\r\n]+|;[^\n]*|\(|\)|-?[0-9]+(?![A-Za-z0-9_.+*/<>=!?~%^&$@:#-])"
                    r"|[A-Za-z_.+*/<>=!?~%^&$@:#-][A-Za-z0-9_.+*/<>=!?~%^&$@:#-]*")
_HEAD = re.compile(r"(\((?:assert|step))(?![A-Za-z0-9_.+*/<>=!?~%^&$@:#-])")


_INTEGER = re.compile(r"-?[0-9]+")


def _atom(token: str, limits: Limits) -> str | int:
    if token[0].isdigit() or (token[0] == "-" and len(token) > 1 and token[1].isdigit()):
        if not _INTEGER.fullmatch(token):  # e.g. "-0=": neither a number nor a symbol
            raise FormalSyntaxError(f"token {token[:12]!r} starts like a number but is not one")
        if len(token.lstrip("-")) > limits.max_int_digits:
            raise FormalSyntaxError(f"integer {token[:12]}... has more than "
                                    f"{limits.max_int_digits} digits")
        return int(token)
    if len(token) > limits.max_symbol_chars:
        raise FormalSyntaxError(f"symbol {token[:12]}... is longer than "
                                f"{limits.max_symbol_chars} characters")
    return token


def read_form(text: str, start: int, limits: Limits = Limits()) -> tuple[tuple, int]:
    """The list form that opens at text[start] == "(", and the index just past its ")"."""
    end_limit = min(len(text), start + limits.max_form_chars)
    stack: list[list] = []
    pos, nodes = start, 0
    while pos < end_limit:
        match = _TOKEN.match(text, pos, end_limit)
        if match is None:
            raise FormalSyntaxError(f"unexpected character {text[pos]!r} at offset {pos - start}")
        token, pos = match.group(), match.end()
        if token == "(":
            if len(stack) >= limits.max_depth:
                raise FormalSyntaxError(f"nesting deeper than {limits.max_depth}")
            stack.append([])
        elif token == ")":
            if not stack:
                raise FormalSyntaxError("unbalanced ')'")
            done = tuple(stack.pop())
            if not stack:
                return done, pos
            stack[-1].append(done)
        elif token[0] in " \t\r\n;":
            continue
        elif not stack:
            raise FormalSyntaxError("a form must start with '('")
        else:
            stack[-1].append(_atom(token, limits))
        nodes += 1
        if nodes > limits.max_nodes:
            raise FormalSyntaxError(f"more than {limits.max_nodes} atoms and lists in one form")
    raise FormalSyntaxError(f"unbalanced '(': the form does not close within "
                            f"{limits.max_form_chars} characters")


def parse(text: str, limits: Limits = Limits()) -> tuple:
    """One list form that is the whole of `text` (as task axioms are written); text around it
    other than whitespace and comments is an error."""
    start = len(text) - len(text.lstrip())
    if not text[start:].startswith("("):
        raise FormalSyntaxError(f"an axiom must be one list form '(...)'; got {text[:40]!r}")
    form, end = read_form(text, start, limits)
    rest = re.sub(r";[^\n]*", "", text[end:]).strip()
    if rest:
        raise FormalSyntaxError(f"unexpected text after the expression: {rest[:40]!r}")
    return form


@dataclass(frozen=True)
class Form:
    """One formal line: kind "premise" or "step", its label ("3" for (step 3 ...), the premise's
    index for asserts), and either its expression or the reason it did not read."""
    kind: str
    label: str
    expr: tuple | str | int | None
    error: str = ""


@dataclass(frozen=True)
class FormalTrace:
    """The forms of a completion; `dropped` counts those past the caps, never read."""
    premises: tuple[Form, ...]
    steps: tuple[Form, ...]
    dropped: int = 0

    @property
    def forms(self) -> int:
        return len(self.premises) + len(self.steps) + self.dropped


def _shape(form: tuple, index: int) -> Form:
    """A read form checked for the (assert F) / (step K F) shape; premises are labelled by
    their 1-based position."""
    label = str(index + 1)
    if form[0] == "assert":
        if len(form) != 2:
            return Form("premise", label, None, "(assert F) takes exactly one formula")
        return Form("premise", label, form[1])
    if len(form) != 3 or not isinstance(form[1], int) or form[1] < 1:
        return Form("step", "?", None, "a step is (step K F) with K a positive integer")
    return Form("step", str(form[1]), form[2])


def _one(text: str, match: re.Match, index: int, limits: Limits) -> tuple[Form, int]:
    kind = "premise" if match.group(1) == "(assert" else "step"
    try:
        expr, end = read_form(text, match.start(1), limits)
    except FormalSyntaxError as error:
        return Form(kind, "?", None, str(error)), match.end()
    return _shape(expr, index), end


def extract(text: str, limits: Limits = Limits()) -> FormalTrace:
    """The premises and steps written in `text` (see the module doc). Forms beyond
    `max_premises` / `max_steps` are not read, only counted (`dropped`), so they count against
    the parse rate without costing time."""
    text = text[:limits.max_scan_chars]
    found: dict[str, list[Form]] = {"premise": [], "step": []}
    pos, dropped = 0, 0
    while (match := _HEAD.search(text, pos)) is not None:
        kind = "premise" if match.group(1) == "(assert" else "step"
        cap = limits.max_premises if kind == "premise" else limits.max_steps
        if len(found[kind]) >= cap:
            dropped, pos = dropped + 1, match.end()
            continue
        form, pos = _one(text, match, len(found[kind]), limits)
        found[kind].append(form)
    return FormalTrace(tuple(found["premise"]), tuple(found["step"]), dropped)


GUIDE = "\n".join([
    "Reason inside <think></think> in this formal block format:",
    "1. First write every clue as a premise, one per line: (assert FORMULA)",
    "2. Then reason step by step. After each deduction, write it on a line of its own as "
    "(step K FORMULA), with K = 1, 2, 3, ...",
    "A solver checks every step. A step that follows from the clues and says something new is "
    "rewarded; restating a clue, stating what the rules alone guarantee, or writing something "
    "false is not.",
    "Formulas are s-expressions: (and F ...) (or F ...) (not F) (=> F G) (= a b) "
    "(distinct a b ...) (< a b) (<= a b) (> a b) (>= a b) (+ a b) (- a b) (ite F a b), and "
    "(forall ((x Sort)) F) or (exists ((x Sort)) F) over the sorts listed below."])


def write(expr: tuple | str | int) -> str:
    """The text of a read expression, so that parse(write(e)) == e."""
    if isinstance(expr, tuple):
        return "(" + " ".join(write(part) for part in expr) + ")"
    return str(expr)

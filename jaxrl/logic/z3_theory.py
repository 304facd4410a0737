"""Task theories in z3: the vocabulary a task declares, its domain axioms (Gamma_dom), and the
whitelisted translation of formal expressions (jaxrl.logic.sexpr) into z3 terms.

A theory spec is plain JSON, carried by a record's verifier under "theory":

    {"sorts":  {"House": [1, 2, 3], "Name": ["Alice", "Bob", "Carol"]},  finite enumerations
     "consts": {"Alice": "Int", "Bob": "Int", "Carol": "Int"},          "Int" or "Bool"
     "preds":  {"knight": ["Person"]},                                   Boolean, over sorts
     "domain": ["(distinct Alice Bob Carol)", ...]}                      Gamma_dom, formal text

The language, head by head (any other head, symbol or shape is a FormalError):
    true, false, integers, declared constants
    (P e ...)                 a predicate applied to literal elements of its sorts (a bound
                              variable counts: it stands for an element)
    (and F ...) (or F ...) (not F) (=> F ... G)   right-associative implication
    (= t t ...) (distinct t t ...)                  Booleans or integers, all the same kind
    (< a b ...) (<= ...) (> ...) (>= ...)           chained, as in SMT-LIB
    (+ a ...) (- a) (- a b ...) (ite F t t)
    (forall ((x S) ...) F) (exists ((x S) ...) F)   S a declared sort or Bool; expanded into a
                                                    conjunction / disjunction over S's elements
Inside a quantifier, x stands for each element of S in turn: an integer element is that integer,
a symbol element is the constant of that name (or, as a predicate argument, the element itself).
Terms are built with z3's Python constructors in a context of the theory's own; nothing from a
completion is evaluated as code or given to an SMT-LIB parser.
"""
from __future__ import annotations

import functools
import itertools
import json
import operator
from collections.abc import Callable, Mapping, Sequence

import z3

from jaxrl.logic.sexpr import FormalSyntaxError, Limits, parse

QUANTIFIERS = ("forall", "exists")
MAX_ELEMENTS = 64  # per sort
MAX_ATOMS = 4096  # ground predicate atoms per theory
MAX_BUILT_NODES = 20_000  # per expression, after quantifier expansion


class TheoryError(ValueError):
    """A task theory spec that is malformed (a data error, not the completion's fault)."""


class FormalError(ValueError):
    """A formal expression that has no meaning in the task's theory (the completion's fault)."""


def _chain(op: Callable, terms: list) -> z3.BoolRef:
    pairs = [op(a, b) for a, b in zip(terms, terms[1:])]
    return pairs[0] if len(pairs) == 1 else z3.And(pairs)


def _implies(terms: list) -> z3.BoolRef:
    result = terms[-1]
    for premise in reversed(terms[:-1]):
        result = z3.Implies(premise, result)
    return result


def _minus(terms: list) -> z3.ArithRef:
    return -terms[0] if len(terms) == 1 else functools.reduce(operator.sub, terms)


# head -> (fewest arguments, most (None: any), argument kinds, constructor)
OPERATORS: dict[str, tuple[int, int | None, str, Callable]] = {
    "and": (1, None, "bool", z3.And),
    "or": (1, None, "bool", z3.Or),
    "not": (1, 1, "bool", lambda ts: z3.Not(ts[0])),
    "=>": (2, None, "bool", _implies),
    "=": (2, None, "same", lambda ts: _chain(operator.eq, ts)),
    "distinct": (2, None, "same", lambda ts: z3.Distinct(*ts)),
    "<": (2, None, "int", lambda ts: _chain(operator.lt, ts)),
    "<=": (2, None, "int", lambda ts: _chain(operator.le, ts)),
    ">": (2, None, "int", lambda ts: _chain(operator.gt, ts)),
    ">=": (2, None, "int", lambda ts: _chain(operator.ge, ts)),
    "+": (1, None, "int", lambda ts: z3.Sum(ts)),
    "-": (1, None, "int", _minus),
    "ite": (3, 3, "ite", lambda ts: z3.If(*ts)),
}
RESERVED = frozenset(OPERATORS) | frozenset(QUANTIFIERS) | {"true", "false", "Bool", "Int",
                                                            "assert", "step"}


def _kind(term) -> str:
    return "bool" if z3.is_bool(term) else "int"


def _check_kinds(head: str, kinds: str, terms: list) -> None:
    found = [_kind(t) for t in terms]
    if kinds in ("bool", "int") and any(k != kinds for k in found):
        want = "formulas" if kinds == "bool" else "integer terms"
        raise FormalError(f"({head} ...) takes {want}; got {', '.join(found)}")
    if kinds == "same" and len(set(found)) > 1:
        raise FormalError(f"({head} ...) compares terms of one kind; got {', '.join(found)}")
    if kinds == "ite" and (found[0] != "bool" or found[1] != found[2]):
        raise FormalError("(ite F a b) needs a formula F and two terms of one kind")


class _Builder:
    """Translates one expression; `budget` bounds the nodes built after expansion."""

    def __init__(self, theory: Theory):
        self.theory = theory
        self.budget = MAX_BUILT_NODES

    def formula(self, expr) -> z3.BoolRef:
        term = self.term(expr, {})
        if not z3.is_bool(term):
            raise FormalError("a premise or step must be a formula; got an integer term")
        return term

    def term(self, expr, env: Mapping):
        self.budget -= 1
        if self.budget < 0:
            raise FormalError(f"the expression expands to more than {MAX_BUILT_NODES} nodes")
        if isinstance(expr, int):
            return z3.IntVal(expr, self.theory.ctx)
        if isinstance(expr, str):
            return self.atom(expr, env)
        if not expr or not isinstance(expr[0], str):
            raise FormalError("a list must start with an operator symbol")
        head, args = expr[0], expr[1:]
        if head in env:
            raise FormalError(f"bound variable {head!r} used as an operator")
        if head in QUANTIFIERS:
            return self.quantifier(head, args, env)
        if head in self.theory.preds:
            return self.apply(head, args, env)
        if head not in OPERATORS:
            raise FormalError(f"unknown operator {head!r}; allowed: "
                              f"{' '.join(OPERATORS)} forall exists and the task's predicates")
        least, most, kinds, build = OPERATORS[head]
        if len(args) < least or (most is not None and len(args) > most):
            count = str(least) if least == most else f"at least {least}"
            raise FormalError(f"({head} ...) takes {count} argument(s); got {len(args)}")
        terms = [self.term(arg, env) for arg in args]
        _check_kinds(head, kinds, terms)
        return build(terms)

    def atom(self, name: str, env: Mapping):
        if name in env:
            name = env[name]
            if isinstance(name, int):
                return z3.IntVal(name, self.theory.ctx)
        if name in ("true", "false"):
            return z3.BoolVal(name == "true", self.theory.ctx)
        if name in self.theory.consts:
            return self.theory.consts[name]
        for sort, elements in self.theory.sorts.items():
            if name in elements:
                raise FormalError(f"{name!r} is an element of sort {sort}, usable only as a "
                                  f"predicate argument")
        raise FormalError(f"undeclared symbol {name!r}")

    def quantifier(self, head: str, args: tuple, env: Mapping) -> z3.BoolRef:
        if len(args) != 2 or not isinstance(args[0], tuple) or not args[0]:
            raise FormalError(f"({head} ((x Sort) ...) F) needs a binding list and a formula")
        names, domains = [], []
        for binding in args[0]:
            if (not isinstance(binding, tuple) or len(binding) != 2
                    or not all(isinstance(b, str) for b in binding)):
                raise FormalError(f"a {head} binding is (name Sort); got {binding!r:.40}")
            name, sort = binding
            if name in RESERVED or self.theory.declares(name):
                raise FormalError(f"bound variable {name!r} reuses a declared or reserved name")
            names.append(name)
            domains.append(self.theory.elements(sort))
        if functools.reduce(operator.mul, map(len, domains), 1) > self.budget:
            raise FormalError(f"the {head} expands to more than {MAX_BUILT_NODES} cases")
        bodies = [self.term(args[1], {**env, **dict(zip(names, combo))})
                  for combo in itertools.product(*domains)]
        _check_kinds(head, "bool", bodies)
        return z3.And(bodies) if head == "forall" else z3.Or(bodies)

    def apply(self, pred: str, args: tuple, env: Mapping) -> z3.BoolRef:
        sorts = self.theory.preds[pred]
        if len(args) != len(sorts):
            raise FormalError(f"({pred} ...) takes {len(sorts)} argument(s); got {len(args)}")
        values = []
        for arg, sort in zip(args, sorts):
            value = env.get(arg, arg) if isinstance(arg, str) else arg
            if isinstance(value, tuple) or value not in self.theory.sorts[sort]:
                raise FormalError(f"an argument of {pred} must be an element of sort {sort} "
                                  f"({', '.join(map(str, self.theory.sorts[sort][:8]))}...)")
            values.append(value)
        return self.theory.atoms[(pred, tuple(values))]


def _names(spec: Mapping, key: str) -> dict:
    value = spec.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TheoryError(f"theory {key!r} must be an object keyed by names; got {value!r:.60}")
    for name in value:
        if name in RESERVED or not name.isidentifier():
            raise TheoryError(f"theory {key} name {name!r} must be an identifier other than "
                              f"{', '.join(sorted(RESERVED))}")
    return value


def _sorts(spec: Mapping) -> dict[str, tuple]:
    sorts = {}
    for name, elements in _names(spec, "sorts").items():
        ok = (isinstance(elements, list) and 0 < len(elements) <= MAX_ELEMENTS
              and len(set(map(str, elements))) == len(elements)
              and all(isinstance(e, int) and not isinstance(e, bool)
                      or isinstance(e, str) and e.isidentifier() for e in elements))
        if not ok:
            raise TheoryError(f"sort {name!r} must list 1 to {MAX_ELEMENTS} distinct integers "
                              f"or identifiers; got {elements!r:.60}")
        sorts[name] = tuple(elements)
    return sorts


class Theory:
    """A task's vocabulary built in a z3 context of its own: `consts` (name -> z3 constant),
    `atoms` ((pred, elements) -> z3 Bool), `domain` (Gamma_dom as z3 formulas), and `symbols`
    (every constant and atom: what "a unique solution" is unique over)."""

    def __init__(self, spec: Mapping, limits: Limits = Limits()):
        if not isinstance(spec, Mapping):
            raise TheoryError(f"a theory must be an object; got {type(spec).__name__}")
        self.limits = limits
        self.ctx = z3.Context()
        self.sorts = _sorts(spec)
        self.consts = self._consts(_names(spec, "consts"))
        self.preds = self._preds(_names(spec, "preds"))
        self.atoms = self._atoms()
        self.symbols = tuple(self.consts.values()) + tuple(self.atoms.values())
        domain = spec.get("domain", [])
        if not isinstance(domain, list) or not all(isinstance(a, str) for a in domain):
            raise TheoryError(f"theory 'domain' must be a list of formulas; got {domain!r:.60}")
        self.domain = tuple(self._axiom(text) for text in domain)

    def _consts(self, consts: Mapping) -> dict:
        made = {}
        for name, sort in consts.items():
            if sort not in ("Int", "Bool"):
                raise TheoryError(f"constant {name!r} must have sort Int or Bool; got {sort!r}")
            make = z3.Int if sort == "Int" else z3.Bool
            made[name] = make(name, self.ctx)
        return made

    def _preds(self, preds: Mapping) -> dict[str, tuple[str, ...]]:
        for name, sorts in preds.items():
            if (not isinstance(sorts, list) or not sorts
                    or not all(s in self.sorts for s in sorts)):
                raise TheoryError(f"predicate {name!r} needs a non-empty list of declared "
                                  f"sorts ({', '.join(self.sorts)}); got {sorts!r:.60}")
            if name in self.consts or name in self.sorts:
                raise TheoryError(f"predicate {name!r} reuses the name of a constant or sort")
        return {name: tuple(sorts) for name, sorts in preds.items()}

    def _atoms(self) -> dict:
        atoms = {}
        for pred, sorts in self.preds.items():
            for values in itertools.product(*(self.sorts[s] for s in sorts)):
                if len(atoms) >= MAX_ATOMS:
                    raise TheoryError(f"the predicates have more than {MAX_ATOMS} ground atoms")
                label = f"{pred}({','.join(map(str, values))})"
                atoms[(pred, values)] = z3.Bool(label, self.ctx)
        return atoms

    def _axiom(self, text: str) -> z3.BoolRef:
        try:
            return self.formula(parse(text, self.limits))
        except (FormalSyntaxError, FormalError) as error:
            raise TheoryError(f"domain axiom {text[:80]!r} does not read: {error}") from None

    def declares(self, name: str) -> bool:
        return name in self.consts or name in self.preds or name in self.sorts

    def elements(self, sort: str) -> Sequence:
        """The elements a quantifier over `sort` ranges over."""
        if sort == "Bool":
            return ("true", "false")
        if sort not in self.sorts:
            raise FormalError(f"quantifier over sort {sort!r}: only the task's finite sorts "
                              f"({', '.join(self.sorts) or 'none'}) and Bool can be quantified")
        return self.sorts[sort]

    def formula(self, expr) -> z3.BoolRef:
        """The z3 formula of a read expression; FormalError when it has no meaning here."""
        return _Builder(self).formula(expr)


@functools.lru_cache(maxsize=16)
def _cached(spec_json: str) -> Theory:
    return Theory(json.loads(spec_json))


def theory_for(spec: Mapping) -> Theory:
    """The Theory of `spec`, built once per distinct spec in this process (a GRPO group's
    completions share their record's theory)."""
    return _cached(json.dumps(spec, sort_keys=True))

"""Theories: the whitelist, kinds, quantifier expansion over finite sorts, and spec errors."""
import pytest
import z3

from jaxrl.logic.sexpr import parse
from jaxrl.logic.z3_theory import MAX_BUILT_NODES, FormalError, Theory, TheoryError, theory_for
from tests.logic.worked_example import THEORY

KNK = {"sorts": {"Person": ["A", "B"]}, "consts": {"flag": "Bool"},
       "preds": {"knight": ["Person"], "knave": ["Person"]},
       "domain": ["(forall ((p Person)) (distinct (knight p) (knave p)))"]}


def _valid(theory, text):
    """Whether the formula is true in every model of the theory's domain."""
    solver = z3.Solver(ctx=theory.ctx)
    solver.add(*theory.domain, z3.Not(theory.formula(parse(text))))
    return solver.check() == z3.unsat


@pytest.mark.parametrize("text", [
    "(or (knight A) (knave A))",
    "(forall ((p Person)) (= (knight p) (not (knave p))))",
    "(exists ((b Bool)) (= b flag))",
    "(=> (knight A) (knight B) (knight A))",
    "(= (ite (knight A) 1 2) (- 3 (ite (knave A) 1 2)))",
])
def test_knk_formulas_mean_what_they_say(text):
    assert _valid(Theory(KNK), text)


def test_zebra_quantifiers_expand_over_elements_and_chains_compare():
    theory = Theory(THEORY)
    assert _valid(theory, "(forall ((x Pet)) (and (>= x 1) (< x 4)))")
    assert _valid(theory, "(exists ((h House)) (= Alice h))")
    assert _valid(theory, "(<= 1 Bob 3)") and not _valid(theory, "(< 1 Bob 3)")
    assert _valid(theory, "(= (+ Alice Bob Carol) 6)") and _valid(theory, "(distinct (- cat) 0)")


@pytest.mark.parametrize("text,message", [
    ("(= Dave 1)", "undeclared symbol 'Dave'"),
    ("(knight C)", "must be an element of sort Person"),
    ("(= A 1)", "element of sort Person"),
    ("(forall ((x Int)) (knight A))", "quantifier over sort 'Int'"),
    ("(forall ((knight Person)) true)", "reuses a declared or reserved name"),
    ("(exists (x Person) (knight x))", "binding is"),
    ("(and (knight A) 3)", "takes formulas"),
    ("(+ 1 (knight A))", "takes integer terms"),
    ("(= 1 (knight A))", "one kind"),
    ("(not (knight A) (knight B))", "takes 1 argument"),
    ("(* 2 3)", "unknown operator '\\*'"),
    ("(eval 1)", "unknown operator 'eval'"),
    ("((knight A) 1)", "must start with an operator"),
    ("(+ 1 2)", "must be a formula"),
    ("(ite 1 2 3)", "ite F a b"),
])
def test_meaningless_expressions_are_formal_errors(text, message):
    with pytest.raises(FormalError, match=message):
        Theory(KNK).formula(parse(text))


def test_expansion_is_bounded():
    theory = Theory(THEORY)
    deep = "(forall ((a Name) (b Name) (c Name) (d Name) (e Name) (f Name) (g Name) (h Name) " \
           "(i Name) (j Name)) (distinct a b))"
    with pytest.raises(FormalError, match=str(MAX_BUILT_NODES)):
        theory.formula(parse(deep))


@pytest.mark.parametrize("spec,message", [
    ({"sorts": {"S": []}}, "must list 1 to"),
    ({"sorts": {"and": [1]}}, "identifier other than"),
    ({"consts": {"x": "Real"}}, "sort Int or Bool"),
    ({"preds": {"p": ["Nope"]}}, "declared sorts"),
    ({"domain": ["(= x 1)"]}, "undeclared symbol"),
    ({"domain": "(= 1 1)"}, "list of formulas"),
    ([], "must be an object"),
])
def test_bad_specs_are_theory_errors(spec, message):
    with pytest.raises(TheoryError, match=message):
        Theory(spec)


def test_theory_for_caches_by_content():
    assert theory_for(dict(KNK)) is theory_for(dict(reversed(list(KNK.items()))))

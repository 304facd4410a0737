"""The s-expression reader and block extractor: shapes, labels, limits, garbage."""
import pytest

from jaxrl.logic.sexpr import FormalSyntaxError, Limits, extract, parse, read_form


def test_reads_nested_forms_ints_and_symbols():
    form, end = read_form("(=> (< a -3) (= b c)) tail", 0)
    assert form == ("=>", ("<", "a", -3), ("=", "b", "c")) and end == 21
    assert parse(" (distinct x y) ; comment\n") == ("distinct", "x", "y")


@pytest.mark.parametrize("text,message", [
    ("(a (b)", "does not close"),
    ("(a \"b\")", "unexpected character"),
    ("(a |b|)", "unexpected character"),
    ("(a \u00e9)", "unexpected character"),
    ("(a \x00)", "unexpected character"),
    ("(+ 1 1234567)", "more than 6 digits"),
    ("(" * 100 + ")" * 100, "nesting deeper than 40"),
    ("(f " + "x " * 2000 + ")", "more than 1500"),
    ("(f " + "x" * 100 + ")", "longer than 64"),
    ("(f 12abc)", "unexpected character"),
])
def test_rejects_malformed_and_oversized(text, message):
    with pytest.raises(FormalSyntaxError, match=message):
        read_form(text, 0)


def test_parse_requires_one_whole_form():
    with pytest.raises(FormalSyntaxError, match="one list form"):
        parse("x")
    with pytest.raises(FormalSyntaxError, match="after the expression"):
        parse("(a) (b)")


def test_extract_premises_and_steps_in_text_order():
    text = """Some prose (not formal).
    (assert (= Bob tea))  (assert
       (= tea 2))
    so (step 1 (= Bob 2))
    (step 2 x y)
    (step 0 (= Bob 2))
    (assert (a"))
    <answer>(step 9 (= Bob 3))</answer>"""
    trace = extract(text)
    assert [(p.label, p.expr) for p in trace.premises[:2]] == [
        ("1", ("=", "Bob", "tea")), ("2", ("=", "tea", 2))]
    assert trace.premises[2].expr is None and "unexpected" in trace.premises[2].error
    assert [s.label for s in trace.steps] == ["1", "?", "?", "9"]
    assert trace.steps[1].error.startswith("a step is (step K F)")
    assert trace.forms == 7


def test_caps_count_extra_forms_without_reading_them():
    limits = Limits(max_premises=2, max_steps=1)
    trace = extract("(assert a) (assert b) (assert c) (step 1 a) (step 2 (((", limits)
    assert [p.expr for p in trace.premises] == ["a", "b"] and len(trace.steps) == 1
    assert trace.dropped == 2 and trace.forms == 5


def test_token_that_starts_like_a_number_is_a_syntax_error():
    with pytest.raises(FormalSyntaxError, match="starts like a number"):
        read_form("(assert -0=)", 0)
    assert read_form("(assert (= x -12))", 0)[0] == ("assert", ("=", "x", -12))

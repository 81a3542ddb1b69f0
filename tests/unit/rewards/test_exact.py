"""Exact values of numeric answers (dapo_megatron.rewards.exact): what parses, what
is declined, how values compare. Expected values are computed here with Python
integers and fractions, independently of the parser."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.rewards.exact import (
    APPROXIMATION_REL_TOL,
    MAX_EXACT_BITS,
    ExactNumber,
    compare,
    equal_values,
    parse_exact,
    relative_error,
)


@pytest.mark.parametrize(
    "text,value",
    [
        ("033", Fraction(33)),
        ("+033", Fraction(33)),
        ("-0", Fraction(0)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\dfrac{1}{2}", Fraction(1, 2)),
        ("\\frac12", Fraction(1, 2)),  # TeX single-token arguments
        ("\\left(\\frac{1}{2}\\right)", Fraction(1, 2)),
        ("9{,}500", Fraction(9500)),
        ("8,000", Fraction(8000)),
        ("1 000", Fraction(1000)),  # SI thousands (issue 23.12)
        ("1\\,000", Fraction(1000)),
        ("1\u2009000 000", Fraction(1000000)),
        ("-12 345.5", Fraction(-123455, 10)),
        ("1,000.25", Fraction(400100, 400)),
        ("2^{10}", Fraction(1024)),
        ("2^{-99}", Fraction(1, 2**99)),
        ("10!", Fraction(math.factorial(10))),
        ("\\frac{1}{2004!}", Fraction(1, math.factorial(2004))),
        ("\\frac{2^{2005}+1}{3 \\cdot 2^{2006}}", Fraction(2**2005 + 1, 3 * 2**2006)),
        ("2.5\\times10^{3}", Fraction(2500)),
        ("8^{2/3}", Fraction(4)),
        ("\\sqrt{\\frac{9}{4}}", Fraction(3, 2)),
        ("\\sqrt[3]{27}", Fraction(3)),
        ("(1+2)(3)", Fraction(9)),
        ("7 \\div 2", Fraction(7, 2)),
        ("x = 5", Fraction(5)),
        ("x_{1} = 2 + 3 = 5", Fraction(5)),
        ("5\\text{ cm}", Fraction(5)),
        ("\\frac{1}{3}\\text{ meters}", Fraction(1, 3)),
        ("5 \\text{square meters}", Fraction(5)),
        ("\\$18", Fraction(18)),
        ("42.", Fraction(42)),
        ("\u22123", Fraction(-3)),  # unicode minus
    ],
)
def test_parses_exact_rationals(text, value):
    number = parse_exact(text)
    assert number is not None and number.is_rational and number.value == value


def test_radicals_are_exact_algebraic_numbers():
    import sympy

    assert parse_exact("2\\sqrt{2}").value == 2 * sympy.sqrt(2)
    assert parse_exact("\\sqrt{8}").value == 2 * sympy.sqrt(2)  # sympy extracts the square
    assert parse_exact("\\sqrt[3]{16}").value == 2 * sympy.cbrt(2)
    assert not parse_exact("\\sqrt{2}").is_rational
    assert parse_exact("\\sqrt{2}\\sqrt{2}").value == Fraction(2)  # back to a Fraction


@pytest.mark.parametrize(
    "text",
    [
        "", "+", "foo", "33a", "--33", "1,2", "(1,4.5)", "\\{1,2\\}", "[0,1)",
        "5 \\text{ or more}", "5\\text{ or 6}", "5\\text{ apples or 6}",  # only unit words are dropped
        "\\pi", "e^{16}", "2\\mathrm{e}", "\\text{i}", "28\\%", "30^\\circ", "\\infty", "\\pm 2021",
        "2^10",  # TeX reads 2^1 0
        "\\frac123",  # \frac{1}{2}3
        "2\\frac{1}{2}",  # a mixed number or 2 * 1/2
        "1/2\\sqrt{3}",  # 1/(2 sqrt 3) or sqrt(3)/2
        "100 0", "5 6", "1 0000", "10 00",  # digits split by spaces that do not group thousands
        "4\\sqrt(2)", "3!!", "(-8)^{1/3}", "\\sqrt{-4}", "0^{-1}", "\\frac{1}{0}", "2^{\\sqrt{2}}",
        "x = 5 = y", "2 + 3 = 5", "\\boxed{5}", "a+b",
        "{" * 200 + "1" + "}" * 200,  # nesting beyond MAX_DEPTH
        "9" * 2000,  # more digits than MAX_NUMBER_DIGITS
    ],
)
def test_declines_what_is_not_a_plain_exact_number(text):
    assert parse_exact(text) is None


@pytest.mark.parametrize("text", ["9^{9^{9^{9^{9}}}}", "10^{10^{6}}", "100000!", "(10^{5000})^{30}", "2^{2^{20}}"])
def test_huge_values_are_declined_before_they_are_computed(text):
    """A result over MAX_EXACT_BITS is refused from a size estimate, so the parser
    returns at once instead of building the integer (the grader then falls back to
    math-verify inside its killable worker)."""
    assert parse_exact(text) is None


def test_largest_accepted_power():
    assert parse_exact(f"2^{{{MAX_EXACT_BITS - 1}}}").value == 2 ** (MAX_EXACT_BITS - 1)


def test_decimal_flag_and_termination():
    assert parse_exact("0.5").has_decimal and parse_exact("0.5").terminates
    assert not parse_exact("\\frac{1}{2}").has_decimal and parse_exact("\\frac{1}{2}").terminates
    assert not parse_exact("\\frac{1}{12}").terminates
    assert not parse_exact("\\sqrt{2}").terminates
    assert parse_exact("x = 5").variable == "x" and parse_exact("5").variable is None


@pytest.mark.parametrize(
    "pred,gold,verdict",
    [
        ("\\frac{1}{2006!}", "\\frac{1}{2004!}", False),  # Math-Verify issue #14 (math-verify: equal)
        ("\\frac{1}{2^{98}}", "\\frac{1}{2^{99}}", False),
        ("0.0000002", "0.0000001", False),  # Math-Verify issue #21 (math-verify: equal)
        ("72.0000001", "72", False),  # both terminate: the decimal is read exactly
        ("0.5", "\\frac{1}{2}", True),
        ("2^{-99}", "\\frac{1}{2^{99}}", True),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
        ("\\sqrt{5+2\\sqrt{6}}", "\\sqrt{2}+\\sqrt{3}", True),  # decided by the minimal polynomial
        ("\\sqrt{2}+\\sqrt{3}", "\\sqrt{5}", False),
        ("0.0833333333333333", "\\frac{1}{12}", None),  # a decimal for 1/12: the tolerant path decides
        ("1.414214", "\\sqrt{2}", None),
        ("0.0", "\\frac{1}{2004!}", None),
        ("0.333", "0.3333", False),
    ],
)
def test_compare(pred, gold, verdict):
    assert compare(parse_exact(pred), parse_exact(gold)) is verdict


def test_relative_error_guards_the_tolerant_path():
    one_12 = parse_exact("\\frac{1}{12}")
    assert relative_error(parse_exact("0.0833333333333333"), one_12) < 1e-14
    assert relative_error(parse_exact("1.414214"), parse_exact("\\sqrt{2}")) == pytest.approx((1.414214 - math.sqrt(2)) / 1.414214)
    # math-verify's 6-decimal rounding pays 0.0 for 1/2004!; the relative error is 1
    assert relative_error(parse_exact("0.0"), parse_exact("\\frac{1}{2004!}")) == 1.0
    assert relative_error(parse_exact("0.000143"), parse_exact("\\frac{1}{7000}")) < APPROXIMATION_REL_TOL
    assert relative_error(parse_exact("0"), parse_exact("0")) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**12, 10**12), st.integers(1, 10**9))
def test_fractions_round_trip(p, q):
    assert parse_exact(f"\\frac{{{p}}}{{{q}}}").value == Fraction(p, q)
    assert parse_exact(f"{p}/{q}").value == Fraction(p, q)
    assert parse_exact(f"{p:,}").value == p


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.integers(0, 40), st.integers(0, 60), st.integers(1, 9))
def test_integer_expressions(a, k, n, d):
    """a^{k} \\cdot n! / d against the same value written as one integer fraction."""
    value = Fraction(a**k * math.factorial(n), d)
    text = f"\\frac{{{a}^{{{k}}} \\cdot {n}!}}{{{d}}}"
    assert parse_exact(text).value == value
    assert compare(parse_exact(text), parse_exact(f"\\frac{{{value.numerator}}}{{{value.denominator}}}")) is True
    assert compare(parse_exact(text), parse_exact(f"\\frac{{{value.numerator + 1}}}{{{value.denominator}}}")) is False


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10**6), st.integers(2, 5))
def test_perfect_powers_come_back_rational(r, n):
    assert parse_exact(f"\\sqrt[{n}]{{{r ** n}}}").value == Fraction(r)


@given(st.text(alphabet="0123456789+-*/^!(){}[].,\\frac sqrt cdot", max_size=40))
def test_arbitrary_text_never_raises(text):
    number = parse_exact(text)
    assert number is None or isinstance(number, ExactNumber)


def test_equal_values_mixes_fractions_and_radicals():
    import sympy

    assert equal_values(Fraction(2), sympy.sqrt(2) ** 2)
    assert not equal_values(Fraction(1, 2), sympy.sqrt(2) / 2)


def test_perfect_powers_beyond_float_precision():
    big = 2**400 + 1  # its square has 801 bits: a float root is off by ~2^347
    assert parse_exact(f"\\sqrt{{{big**2}}}").value == big
    assert parse_exact(f"\\sqrt[3]{{{big**3}}}").value == big
    assert not parse_exact(f"\\sqrt{{{big**2 + 1}}}").is_rational

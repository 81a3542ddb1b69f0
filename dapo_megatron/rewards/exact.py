"""Exact values of numeric answers, parsed from LaTeX without evaluating text.

:func:`parse_exact` reads a numeric LaTeX answer (``033``, ``-\\frac{3}{4}``,
``9{,}500``, ``1 000``, ``2^{10}``, ``\\frac{1}{2004!}``, ``2\\sqrt{2}``, ``\\sqrt[3]{16}``,
``2.5 \\times 10^{3}``, ``x = 5``) into an :class:`ExactNumber`: a
:class:`fractions.Fraction` when the value is rational, otherwise an exact sympy
algebraic number (radicals of rationals). Anything else (symbols, ``\\pi``,
percent, degrees, sets, intervals, text, ambiguous TeX such as ``2^10`` or the
mixed number ``2\\frac{1}{2}``) gives None, and the caller falls back to its
tolerant comparison.

:func:`compare` decides equality exactly. Why this exists: math-verify
(0.9.0, ``math_verify/grader.py::sympy_numeric_eq``, reached from ``verify``
with ``float_rounding=6, numeric_precision=15``) compares two unevaluated sympy
expressions with ``(a - b).evalf(chop=True, n=15) == 0`` and a float against a
number after ``round(6)`` on both sides, so answers that differ only far below
that precision grade as equal (HF Math-Verify issue #14: ``\\frac{1}{2004!}``
vs ``\\frac{1}{2006!}``, issue #21: ``0.0000001`` vs ``0.0000002``). Here such
values are compared as exact rationals.

A decimal is read as the exact number it writes (``0.5`` is 1/2). When one side
writes a decimal and the value of one side has no finite decimal form
(``\\frac{1}{12}``, ``\\sqrt{2}``), the decimal can only be an approximation:
:func:`compare` returns None and the caller applies its tolerant comparison,
which should also require :func:`relative_error` to be small (math-verify's
6-decimal rounding alone pays ``0.0`` for any value below 5e-7).

Cost: a recursive-descent parse over at most ``MAX_TOKENS`` tokens, then
integer arithmetic. Every integer the evaluator would build is bounded by
``MAX_EXACT_BITS`` *before* it is computed (powers, factorials, products), so a
power tower or a huge factorial is declined (None) in microseconds rather than
computed (the grader then falls back to math-verify, which runs inside the
pool's killable worker under its timeout and memory limit). sympy is imported only for radicals that are not rational. Nothing
here calls ``eval``/``sympify``/``parse_expr``: sympy objects are built from
Python ints only.

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from dapo_megatron.rewards.text import MAX_NUMBER_DIGITS, join_space_thousands, strip_latex_command_groups, strip_text_unit

# Largest integer (numerator or denominator) the evaluator builds: 2004! has
# 19,000 bits, 2^{2006} 2,007. Fraction arithmetic on 2^17-bit integers takes
# milliseconds; gcd is quadratic, so far larger ones would not.
MAX_EXACT_BITS = 1 << 17
# sympy extracts perfect powers from a radicand by trial factoring: keep it small.
MAX_RADICAND_BITS = 1024
MAX_ROOT_INDEX = 64
MAX_RADICAL_POWER = 64  # integer powers of irrational values ((sqrt 2 + sqrt 3)^k)
MAX_TOKENS = 400
MAX_DEPTH = 60

# tolerance of a decimal written for a value with no finite decimal form
APPROXIMATION_REL_TOL = Fraction(1, 1000)


@dataclass(frozen=True)
class ExactNumber:
    """An exactly known real number parsed from an answer.

    Attributes:
        value: ``Fraction`` when rational, else an exact sympy expression
            (an algebraic number built from radicals of rationals).
        has_decimal: the text wrote a decimal literal (``0.5``, ``2.50``).
        variable: the name in an ``x = ...`` answer, else None.
    """

    value: object
    has_decimal: bool = False
    variable: str | None = None

    @property
    def is_rational(self) -> bool:
        return isinstance(self.value, Fraction)

    @property
    def terminates(self) -> bool:
        """The value has a finite decimal expansion (a rational whose reduced
        denominator has no prime factors other than 2 and 5)."""
        if not isinstance(self.value, Fraction):
            return False
        den = self.value.denominator
        for p in (2, 5):
            while den % p == 0:
                den //= p
        return den == 1


class _Decline(Exception):
    """The text is not an exact number this parser reads (or it is too large)."""


_SPACING = ("\\left", "\\right", "\\bigl", "\\bigr", "\\Bigl", "\\Bigr", "\\big", "\\Big", "\\displaystyle",
            "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\$", "$", "\\(", "\\)", "\\[", "\\]")
# thin spaces group thousands ("1\u2009000") like a space: text.join_space_thousands decides
_UNICODE = {"\u2212": "-", "\u00d7": "\\times ", "\u00b7": "\\cdot ", "\u22c5": "\\cdot ", "\u2009": " ", "\u202f": " ",
            "\u00a0": " "}
_FRAC_ALIASES = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_LATEX_THOUSANDS = re.compile(r"(?<=\d)\{,\}(?=\d{3})")
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])")
_ASSIGNMENT = re.compile(r"^\s*([A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?)\s*=(.*)$", re.S)
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\\[a-zA-Z]+)|([-+*/^!(){}\[\]]))")


def parse_exact(text: str) -> ExactNumber | None:
    """Exact value of a numeric LaTeX answer, or None when the text is not one
    (or its exact value would exceed ``MAX_EXACT_BITS``). Never raises on any str."""
    if not isinstance(text, str) or len(text) > 4 * MAX_TOKENS:
        return None
    s = text
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    variable = None
    m = _ASSIGNMENT.match(s)
    if m:  # "x = 5", "x = 2 + 3 = 5": the value after the last "=" (math-verify's rule)
        variable, s = m.group(1).replace("{", "").replace("}", ""), m.group(2).rsplit("=", 1)[-1]
    elif "=" in s:
        return None
    for token in _SPACING:
        s = s.replace(token, " ")
    # unit words after the number ("5\text{ cm}", text.UNIT_WORDS); "5\text{ or more}" is not 5
    s = strip_text_unit(s).strip().rstrip(".").strip()
    s = strip_latex_command_groups(s, ("text", "mathrm", "mbox"))  # "\text{12}" -> "12"
    s = _FRAC_ALIASES.sub("\\\\frac", s)
    s = _LATEX_THOUSANDS.sub(",", s)
    s = _THOUSANDS.sub(lambda t: t.group(0).replace(",", ""), s)
    s = join_space_thousands(s)  # "1 000" (also "1\\,000": spacing is a space here); "100 0" stays two numbers
    if not s or sum(ch.isdigit() for ch in s) > MAX_NUMBER_DIGITS:
        return None
    try:
        tokens = _tokenize(s)
        parser = _Parser(tokens)
        value = parser.parse()
    except (_Decline, RecursionError, ZeroDivisionError, OverflowError, ValueError, TypeError, ArithmeticError):
        return None
    return ExactNumber(value=value, has_decimal=parser.has_decimal, variable=variable)


def compare(pred: ExactNumber, gold: ExactNumber) -> bool | None:
    """True/False when exact comparison decides; None when one side writes a
    decimal and a value has no finite decimal form (a rounded answer: the
    caller's tolerant comparison decides, see :func:`relative_error`)."""
    if equal_values(pred.value, gold.value):
        return True
    if (pred.has_decimal or gold.has_decimal) and not (pred.terminates and gold.terminates):
        return None
    return False


def equal_values(a, b) -> bool:
    """Exact equality of two values from :func:`parse_exact` (Fraction or sympy).

    Rationals compare as fractions. With radicals, sympy's automatic
    simplification decides most cases (``\\sqrt{8} - 2\\sqrt{2}`` is 0); a
    30-digit evaluation proves a clear difference; otherwise the minimal
    polynomial of ``a - b`` decides (it is ``x`` iff ``a == b``), which is exact
    for algebraic numbers (where sympy cannot build it, a 60-digit evaluation)."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    sympy = _sympy()
    diff = _to_sympy(a) - _to_sympy(b)
    if diff == 0:
        return True
    if diff.is_Rational:
        return False
    scale = max(abs(_to_sympy(a).evalf(30)), abs(_to_sympy(b).evalf(30)))
    if abs(diff.evalf(30)) > scale * sympy.Float("1e-20"):
        return False
    x = sympy.Dummy("x")
    try:
        return sympy.minimal_polynomial(diff, x) == x
    except Exception:  # sympy could not build it (NotImplementedError, ...): 60 digits decide
        return bool(abs(diff.evalf(60)) <= scale * sympy.Float("1e-50"))


def relative_error(approx: ExactNumber, exact: ExactNumber) -> float:
    """``|approx - exact| / max(|approx|, |exact|)`` as a float (0.0 when both are 0)."""
    a, b = approx.value, exact.value
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        scale = max(abs(a), abs(b))
        return 0.0 if scale == 0 else float(abs(a - b) / scale)
    sa, sb = _to_sympy(a), _to_sympy(b)
    scale = max(abs(sa.evalf(30)), abs(sb.evalf(30)))
    return 0.0 if scale == 0 else float(abs((sa - sb).evalf(30)) / scale)


# --------------------------------------------------------------------------- parser
def _tokenize(s: str) -> list[str]:
    tokens: list[str] = []
    pos = 0
    s = s.rstrip()
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if m is None:  # ",", letters, "%", "\{", ... : not a plain number
            raise _Decline
        tokens.append(m.group(1) or m.group(2) or m.group(3))
        pos = m.end()
        if len(tokens) > MAX_TOKENS:
            raise _Decline
    return tokens


class _Parser:
    """Recursive descent over the token list; values are Fraction or sympy numbers.

    expr   := sign? term (('+'|'-') term)*
    term   := power ((\\cdot|\\times|*|/|\\div) power | implicit power)*
    power  := postfix ('^' (group | digit))?
    postfix:= primary '!'?
    primary:= number | '{' expr '}' | '(' expr ')' | \\frac A B | \\sqrt['[' n ']'] A

    Implicit multiplication only before ``(`` or ``\\sqrt`` (``2\\sqrt{2}``,
    ``3(4)``), or before ``\\frac`` when the left factor is not a bare number
    (``2\\frac{1}{2}`` may mean two and a half); never after a ``/`` in the same
    term (``1/2\\sqrt{3}`` is ambiguous). TeX single-token arguments
    (``\\frac12``, ``\\sqrt2``, ``x^2``) take one digit; a digit right after
    them (``2^10``) is declined.
    """

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.has_decimal = False

    # -- helpers
    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, expected: str | None = None) -> str:
        token = self._peek()
        if token is None or (expected is not None and token != expected):
            raise _Decline
        self.pos += 1
        return token

    def parse(self):
        value = self._expr()
        if self.pos != len(self.tokens):
            raise _Decline
        return value

    def _enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Decline

    # -- grammar
    def _expr(self):
        self._enter()
        sign = 1
        if self._peek() in ("+", "-"):
            sign = -1 if self._take() == "-" else 1
            if self._peek() in ("+", "-"):  # "--33": a malformed sign, not a number (verl keeps it as text)
                raise _Decline
        value = self._term()
        if sign < 0:
            value = _neg(value)
        while self._peek() in ("+", "-"):
            op = self._take()
            if self._peek() in ("+", "-"):
                raise _Decline
            rhs = self._term()
            value = _add(value, _neg(rhs) if op == "-" else rhs)
        self.depth -= 1
        return value

    def _term(self):
        value, bare_number = self._power()
        divided = False
        while True:
            token = self._peek()
            if token in ("\\cdot", "\\times", "*"):
                self._take()
                rhs, bare_number = self._power()
                value = _mul(value, rhs)
            elif token in ("/", "\\div"):
                self._take()
                rhs, bare_number = self._power()
                value = _div(value, rhs)
                divided = True
            elif token in ("(", "\\sqrt") or (token == "\\frac" and not bare_number):
                if divided:
                    raise _Decline
                rhs, bare_number = self._power()
                value = _mul(value, rhs)
            else:
                return value

    def _power(self):
        """A factor and whether it is a bare number literal (for the mixed-number rule)."""
        start = self.pos
        base = self._postfix()
        bare_number = self.pos == start + 1 and _is_number_token(self.tokens[start])
        if self._peek() == "^":
            self._take()
            if self._peek() == "{":
                self._take()
                exponent = self._expr()
                self._take("}")
            else:
                exponent = self._single_digit()
            if self._peek() == "^" or _is_number_token(self._peek()):  # x^{a}^{b}, 2^10
                raise _Decline
            return _pow(base, exponent), False
        return base, bare_number

    def _postfix(self):
        value = self._primary()
        if self._peek() == "!":
            self._take()
            if self._peek() == "!":  # n!! is a double factorial
                raise _Decline
            value = _factorial(value)
        return value

    def _primary(self):
        token = self._peek()
        if token is None:
            raise _Decline
        if _is_number_token(token):
            self._take()
            return self._number(token)
        if token in ("{", "("):
            self._take()
            value = self._expr()
            self._take("}" if token == "{" else ")")
            return value
        if token == "\\frac":
            self._take()
            num = self._argument()
            den = self._argument()
            return _div(num, den)
        if token == "\\sqrt":
            self._take()
            index = Fraction(2)
            if self._peek() == "[":
                self._take()
                index = self._expr()
                self._take("]")
            radicand = self._argument()
            return _root(radicand, index)
        raise _Decline

    def _argument(self):
        """A TeX macro argument: ``{expr}`` or a single digit (``\\frac12``)."""
        if self._peek() == "{":
            self._take()
            value = self._expr()
            self._take("}")
            return value
        return self._single_digit()

    def _single_digit(self):
        token = self._peek()
        if not _is_number_token(token) or not token[0].isdigit():
            raise _Decline
        if len(token) == 1:
            self._take()
        else:  # "\frac12": the argument is "1", "2" stays for the next one
            self.tokens[self.pos] = token[1:]
        return Fraction(int(token[0]))

    def _number(self, token: str) -> Fraction:
        if "." in token:
            self.has_decimal = True
        return Fraction(token)


def _is_number_token(token: str | None) -> bool:
    return token is not None and (token[0].isdigit() or (token[0] == "." and len(token) > 1))


# --------------------------------------------------------------------------- arithmetic
def _sympy():
    # sympy (0.3 s) only for irrational radicals: grader workers start without it
    import sympy

    return sympy


def _to_sympy(v):
    if isinstance(v, Fraction):
        return _sympy().Rational(v.numerator, v.denominator)
    return v


def _from_sympy(v):
    """Back to Fraction when sympy's simplification made the value rational."""
    if getattr(v, "is_Rational", False):
        return _checked(Fraction(int(v.p), int(v.q)))
    if getattr(v, "is_real", None) is not True:  # complex (a root of a negative) or undecided
        raise _Decline
    return v


def _checked(v: Fraction) -> Fraction:
    if v.numerator.bit_length() > MAX_EXACT_BITS or v.denominator.bit_length() > MAX_EXACT_BITS:
        raise _Decline
    return v


def _bits(v: Fraction) -> int:
    return max(v.numerator.bit_length(), v.denominator.bit_length())


def _neg(a):
    return -a


def _add(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return _checked(a + b)
    return _from_sympy(_to_sympy(a) + _to_sympy(b))


def _mul(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if _bits(a) + _bits(b) > MAX_EXACT_BITS + 1:
            raise _Decline
        return _checked(a * b)
    return _from_sympy(_to_sympy(a) * _to_sympy(b))


def _div(a, b):
    if b == 0:
        raise _Decline
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if _bits(a) + _bits(b) > MAX_EXACT_BITS + 1:
            raise _Decline
        return _checked(a / b)
    return _from_sympy(_to_sympy(a) / _to_sympy(b))


def _pow(base, exponent):
    if not isinstance(exponent, Fraction):  # 2^{\sqrt{2}}: transcendental, not decided here
        raise _Decline
    if exponent.denominator != 1:
        p, q = exponent.numerator, exponent.denominator
        return _pow(_root(base, Fraction(q)), Fraction(p))
    k = exponent.numerator
    if isinstance(base, Fraction):
        if base == 0:
            if k < 0:
                raise _Decline
            return Fraction(0 if k > 0 else 1)
        # decided before computing: bits of the result ~ |k| log2 max(|num|, den)
        if abs(base) != 1 and abs(k) * math.log2(max(abs(base.numerator), base.denominator)) > MAX_EXACT_BITS:
            raise _Decline
        return _checked(base**k)
    if abs(k) > MAX_RADICAL_POWER:
        raise _Decline
    return _from_sympy(base**k)


def _root(radicand, index):
    """Principal ``index``-th root of a non-negative real; rational when it is a perfect power."""
    if not isinstance(index, Fraction) or index.denominator != 1 or not 2 <= index <= MAX_ROOT_INDEX:
        raise _Decline
    n = int(index)
    if isinstance(radicand, Fraction):
        if radicand < 0:  # complex principal root, or a real odd root: the convention is ambiguous
            raise _Decline
        num, den = _integer_root(radicand.numerator, n), _integer_root(radicand.denominator, n)
        if num is not None and den is not None:
            return Fraction(num, den)
        if _bits(radicand) > MAX_RADICAND_BITS:
            raise _Decline
        sympy = _sympy()
        return _from_sympy(sympy.Rational(radicand.numerator, radicand.denominator) ** sympy.Rational(1, n))
    sympy = _sympy()
    if radicand.is_nonnegative is not True and not radicand.evalf(30) > 0:
        raise _Decline
    return _from_sympy(radicand ** sympy.Rational(1, n))


def _integer_root(x: int, n: int) -> int | None:
    """Exact integer ``n``-th root of ``x >= 0``, or None when ``x`` is not a perfect power."""
    if x < 2:
        return x
    r = math.isqrt(x) if n == 2 else _newton_root(x, n)
    return r if r**n == x else None


def _newton_root(x: int, n: int) -> int:
    """floor(x ** (1/n)) in integers (a float root is off by more than 1 beyond 2^53)."""
    r = 1 << ((x.bit_length() + n - 1) // n)  # >= the root: Newton then decreases to it
    while True:
        s = ((n - 1) * r + x // r ** (n - 1)) // n
        if s >= r:
            return r
        r = s


def _factorial(v):
    if not isinstance(v, Fraction) or v.denominator != 1 or v < 0:
        raise _Decline
    n = int(v)
    if n > 1 and math.lgamma(n + 1) / math.log(2) > MAX_EXACT_BITS:  # decided before computing
        raise _Decline
    return Fraction(math.factorial(n))

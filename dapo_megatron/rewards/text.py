"""Text helpers shared by the graders: sanitising model text, brace-balanced
``\\boxed{}`` extraction and exact number parsing.

Nothing here evaluates text: numbers are parsed with strict regular expressions
into :class:`fractions.Fraction`, never with ``eval``/``sympify``/``parse_expr``.

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

import re
from fractions import Fraction

# Python refuses int(str) beyond 4300 digits by default; stay far below to keep
# parsing cheap on adversarial text.
MAX_NUMBER_DIGITS = 1000

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def sanitize_text(text: str | bytes, field: str = "solution_str") -> str:
    """Return ``text`` as a valid UTF-8 ``str``.

    ``bytes`` are decoded as UTF-8 with invalid sequences replaced by U+FFFD; a
    ``str`` with lone surrogates (e.g. from ``surrogateescape``) has them replaced
    by ``?``; NUL characters are dropped. Raises ``TypeError`` naming ``field`` for
    any other type.
    """
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        raise TypeError(f"{field} must be str or bytes, got {type(text).__name__}")
    else:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", errors="replace").decode("utf-8")
    return text.replace("\x00", "")


def _balanced_group(text: str, start: int) -> tuple[str, int] | None:
    """Content of the ``{...}`` group opening at ``text[start] == '{'`` and the index
    after its closing brace; escaped ``\\{``/``\\}`` do not count. None if unbalanced."""
    depth = 0
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    """The last non-overlapping match of ``pattern`` in ``text`` (``finditer`` order), or None."""
    last = None
    for last in pattern.finditer(text):
        pass
    return last


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

    Brace-balanced (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``, not ``\\frac{1``),
    also accepts the ``\\boxed 5`` form (content up to the next space or ``$``).
    Returns None when there is no box or the last box is unbalanced (the answer was
    cut off): never falls back to an earlier box or to other text.
    """
    return last_box(text)[1]


def last_box(text: str) -> tuple[int, str | None]:
    """``(start, content)`` of the last ``\\boxed`` / ``\\fbox`` command in ``text``:
    the index of its backslash (-1 without a box) and its content as
    :func:`last_boxed_content` reads it (None when the box has no balanced argument)."""
    best = -1
    best_cmd = ""
    for cmd in _BOX_COMMANDS:
        pos = text.rfind(cmd)
        while pos != -1:
            after = pos + len(cmd)
            # "\boxed" must not be a prefix of a longer command name such as "\boxedx"
            if after >= len(text) or not text[after].isalpha():
                break
            pos = text.rfind(cmd, 0, pos)
        if pos > best:
            best, best_cmd = pos, cmd
    if best < 0:
        return -1, None
    i = best + len(best_cmd)
    if i < len(text) and text[i] == "{":
        group = _balanced_group(text, i)
        return best, None if group is None else group[0]
    if i < len(text) and text[i] == " ":
        m = re.match(r" +([^\s$]+)", text[i:])
        return best, m.group(1) if m else None
    return best, None


def strip_latex_command_groups(text: str, commands: tuple[str, ...]) -> str:
    """Replace every ``\\cmd{X}`` (brace-balanced) by ``X`` for the given command names."""
    for cmd in commands:
        token = "\\" + cmd + "{"
        pos = text.find(token)
        while pos != -1:
            group = _balanced_group(text, pos + len(token) - 1)
            if group is None:
                break
            inner, end = group
            text = text[:pos] + inner + text[end:]
            pos = text.find(token, pos)
    return text


_DECIMAL_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_FRACTION_RE = re.compile(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}")
_SLASH_RE = re.compile(r"([+-]?\d+)/([+-]?\d+)")


def parse_exact_number(text: str) -> Fraction | None:
    """Exact value of a plain numeric literal, or None.

    Accepts integers and decimals (``-12``, ``3.50``, ``.5``), ``a/b`` and
    ``\\frac{a}{b}`` with integer ``a``, ``b`` (``b != 0``). Anything else (symbols,
    expressions, more than ``MAX_NUMBER_DIGITS`` digits) gives None. Pure regex +
    ``Fraction``: safe on model text.
    """
    s = text.strip()
    if not s or sum(ch.isdigit() for ch in s) > MAX_NUMBER_DIGITS:
        return None
    try:
        if _DECIMAL_RE.fullmatch(s):
            return Fraction(s)
        m = _FRACTION_RE.fullmatch(s) or None
        if m:
            den = int(m.group(3))
            if den == 0:
                return None
            value = Fraction(int(m.group(2)), den)
            return -value if m.group(1) == "-" else value
        m = _SLASH_RE.fullmatch(s)
        if m:
            den = int(m.group(2))
            return None if den == 0 else Fraction(int(m.group(1)), den)
    except (ValueError, ZeroDivisionError):
        return None
    return None


# horizontal spaces that may group thousands: space, tab, no-break, thin, narrow no-break
HSPACE = "[ \t\u00a0\u2009\u202f]"
_DIGIT_RUN_RE = re.compile(r"(?<![\d.,])\d+(?:%s+\d+)+" % HSPACE)
_SPACE_THOUSANDS_RE = re.compile(r"\d{1,3}(?:%s+\d{3})+" % HSPACE)


def join_space_thousands(text: str) -> str:
    """``"1 000 000"`` -> ``"1000000"``: a run of digit groups separated by horizontal
    spaces is one number when it groups thousands (SI, ISO 80000-1: a first group of
    1-3 digits, then groups of exactly three; ``1 000.5`` too). Any other run
    (``"100 0"``, ``"5 6"``, ``"1 0000"``) is left as it is, so that no caller reads
    it as one number. Callers map LaTeX spacing (``\\,``, ``~``) to a space first."""

    def join(m: re.Match) -> str:
        run = m.group(0)
        return re.sub(HSPACE, "", run) if _SPACE_THOUSANDS_RE.fullmatch(run) else run

    return _DIGIT_RUN_RE.sub(join, text)


# Unit words dropped after a numeric answer: verl's REMOVED_EXPRESSIONS units
# (reward_score/math_dapo.py, from Minerva) and common SI / US units. Only whole words,
# and only words that never change a value (no "percent", no "times").
UNIT_WORDS = (
    "square", "cubic", "sq", "ways", "integers", "dollars", "dollar", "mph", "inches", "inch", "hours", "hour", "km",
    "units", "unit", "sue", "points", "feet", "foot", "ft", "yards", "yard", "yd", "minutes", "minute", "digits",
    "cents", "cent", "degrees", "degree", "cm", "mm", "gm", "pounds", "meters", "meter", "metres", "metre",
    "centimeters", "centimeter", "millimeters", "millimeter", "kilometers", "kilometer", "meals", "edges", "students",
    "childrentickets", "multiples", "seconds", "second", "days", "day", "weeks", "week", "months", "month", "years",
    "year", "miles", "mile", "grams", "gram", "kilograms", "kilogram", "liters", "liter", "litres", "litre", "ml",
    "m", "s", "kg", "g",
)
# one or more unit words ("square meters"); a single letter ("m") only after a space, as in
# "5\text{ m}": "\text{i}" or "\text{e}" may be a constant
_UNIT_WORD = "(?:%s)" % "|".join(sorted(UNIT_WORDS, key=len, reverse=True))
_MULTI_LETTER_UNIT = "(?:%s)" % "|".join(sorted((u for u in UNIT_WORDS if len(u) > 1), key=len, reverse=True))
_TEXT_UNIT_RE = re.compile(
    r"(?:\\[,;:! ]|~|\s)*\\(?:text|textrm|mbox|mathrm)\{(?:\s+%s|\s*%s)(?:\s+%s)*\s*\.?\s*\}"
    r"(?:\^\{?[23]\}?)?\s*\.?\s*$" % (_UNIT_WORD, _MULTI_LETTER_UNIT, _UNIT_WORD),
    re.IGNORECASE,
)


def strip_text_unit(text: str) -> str:
    """Drop a trailing ``\\text{...}`` (``\\textrm``, ``\\mbox``, ``\\mathrm``) that holds only
    unit words: ``"\\frac{1}{3} \\text{meters}"`` -> ``"\\frac{1}{3}"``, ``"2\\sqrt{2}\\text{ cm}^2"``
    -> ``"2\\sqrt{2}"``. Any other text is kept (``"5 \\text{ or more}"`` is not 5)."""
    return _TEXT_UNIT_RE.sub("", text)


_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def remove_thousands_separators(text: str) -> str:
    """``"8,000"`` -> ``"8000"`` when the whole string is a comma-grouped number
    (groups of exactly three digits); anything else (``"1,2"`` a list) is unchanged."""
    s = text.strip()
    if _THOUSANDS_RE.fullmatch(s):
        return s.replace(",", "")
    return text

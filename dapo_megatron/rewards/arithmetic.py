"""Grader of the embedded arithmetic task ("Compute a + b. Reply with just the number.").

This task defines "final integer" grading: the prediction is the last number in
the response, compared with the integer ground truth. A number is a run of
digits with an optional sign (``-``, ``+``, a Unicode minus, hyphen or en dash) and
thousands grouped by commas (``1,234``) or spaces (``1 234``, SI; also a LaTeX
``1\\,234``), in groups of exactly three.

The last number is the prediction even when it is not a plain integer; then the
response is wrong (it is never graded on an earlier number, which would reward
guessing):

- a decimal such as ``12.5`` (``pred`` is the decimal);
- a number whose notation gives it another value or makes it part of something
  else (``pred`` is the number with that notation, e.g. ``"5!"``):

  * glued to letters, digits or a point: ``0x5`` (hexadecimal), ``x5``, ``5x``,
    ``5e3``, ``5th``, ``5²``, ``.5``;
  * a postfix operator after it, spaces and closing brackets allowed between:
    ``5!`` (120), ``5%``, ``5^2``, ``5°``, ``5'``, ``5\\%``, ``5\\pi``, ``5\\sqrt{2}``
    (any LaTeX command other than text, layout and closing ones);
  * an operand: after ``+ - * / × ÷ · ^ _ ± ∓``, ``\\times``, ``\\cdot``,
    ``\\div``, ``\\pm``, a spaced ``x`` after a digit (``3 x 5``) or ``**``
    after an operand (``3**5``); a sign right after an operand is binary
    (``5-3``, ``5 -3``);
  * a bound, not a value: after ``≤ ≥ ≠``, ``\\le``, ``\\ge``, ``\\ne``, ``\\lt``,
    ``\\gt``, or a ``<`` / ``>`` with a space or ``=`` (``x > 5``; ``<b>5`` stays
    a tag);
  * one element of a list, a ratio or a decimal comma: after ``digit,``
    (``5, 5``, ``\\boxed{5, 5}``, ``4, 5, 6``, ``12,5``), ``digit;`` or ``digit:``
    (``3:5``, ``12:05``), or after another number separated by spaces only
    (``100 0``, ``12 13``: not one number, since the grouping is not thousands);
  * inside a LaTeX argument other than a box or text: ``\\frac{1}{5}``,
    ``\\sqrt{25}``, ``\\sqrt[3]{8}``, ``2^{5}``, ``x_{5}``, ``\\overline{5}``, or
    the first argument of a two-argument command (``\\frac{5}{x}``);
  * a function argument or factor: ``f(5)``, ``2(5)``, ``\\sqrt(4)``; a set ``\\{5\\}``.

Accepted around the number: prose (``The answer is 12.``), ``= 12``,
``Answer: 12``, ``**12**``, ``$12$``, ``\\boxed{12}``, ``\\text{12}``, ``(12)``,
``12 apples``, ``12 \\text{ apples}``, ``<answer>12</answer>``.

Every rule reads a fixed window of text around the last number, so grading is
linear in the response length.

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

import re

from dapo_megatron.rewards.text import HSPACE, MAX_NUMBER_DIGITS, last_match

# horizontal spaces that may group thousands (space, tab, no-break, thin, narrow no-break)
_HSPACE = HSPACE
# minus signs, hyphens and the en dash mean "-" in front of a number ("\u22127" is -7, never 7);
# the em dash is punctuation ("the answer\u201412")
_DASHES = dict.fromkeys(map(ord, "\u2010\u2011\u2012\u2013\u2212\ufe63\uff0d"), "-")

# LaTeX spacing between two digits ("1\\,000") is a space, so only a thousands grouping joins it
_DIGIT_SPACING_RE = re.compile(r"(?<=\d)(?:\\[,;: ]|~)(?=\d)")

_NUMBER_RE = re.compile(
    # comma thousands: "1,234", not the "1,2" of "1,2345"
    r"(?<![\d.,])[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d|,\d)"
    # space thousands: "1 234 567", not the "1 000" of "1 000 0"; one space between groups, and a
    # match starts only at the start of a run of groups (linear time on "123 123 123 ...")
    rf"|(?<![\d.,])(?<!\d{_HSPACE})[-+]?\d{{1,3}}(?:{_HSPACE}\d{{3}})+(?:\.\d+)?(?!\d|{_HSPACE}\d)"
    r"|[-+]?\d+(?:\.\d+)?"
)

# characters of context read on each side of the last number
_CONTEXT = 64

# commands that wrap or display an answer: a number inside their argument stands alone
_DISPLAY_COMMANDS = "boxed|fbox|text|textbf|textrm|textit|textnormal|mathrm|mathbf|mathit|mbox|bf|emph|underline"
# commands that may follow an answer (text, layout, closing)
_TRAILING_COMMANDS = "text|textbf|textrm|textit|textnormal|mathrm|mbox|quad|qquad|end|right|hfill|newline|hspace|label|tag"
_OPERATORS = r"[-+/^_×÷·⋅±∓≤≥≠]|\\(?:times|cdot|div|pm|mp|ast|leq?|geq?|lt|gt|neq?)(?![A-Za-z])"

# rules on the text before the number (anchored at its end by \Z: "$" would also match before a
# final newline); group(0) is shown in pred
# a sign after an operand is binary: 5-3, 5 -3, x-3, (2)-3; after a spaced word it is a sign: "is -5"
_BEFORE_SIGNED = re.compile(r"\S*(?:[\w.)\]}]|[\d)\]}]" + _HSPACE + r"+)\Z")
_BEFORE_RULES = [
    re.compile(r"[\w.]+\Z"),  # glued: 0x5, x5, .5
    re.compile(r"\S*[\d)\]}]" + _HSPACE + r"*[,;]" + _HSPACE + r"*\Z"),  # a list, a decimal comma: 5, 5 / 12,5
    re.compile(r"\S*\d:\Z"),  # a ratio or a time: 3:5, 12:05
    re.compile(r"\S*\d" + _HSPACE + r"+\Z"),  # another number before it: 100 0, 12 13
    re.compile(r"\S*(?:" + _OPERATORS + r")" + _HSPACE + r"*\Z"),  # an operand: 2^5, 10/2, 5 - 3, \times 5
    # an operand of "*": 3 * 5, 3*5, x * 5, x*5 (markdown *5* and **5** are emphasis)
    re.compile(r"\S*(?:[\d)\]}]" + _HSPACE + r"*\*|(?<!\*)\*" + _HSPACE + r"+|[A-Za-z]\*)\Z"),
    re.compile(r"\S*[\w)\]}]" + _HSPACE + r"*\*\*" + _HSPACE + r"*\Z"),  # Python power: 3**5
    re.compile(r"\S*\d" + _HSPACE + r"*[xX]" + _HSPACE + r"+\Z"),  # 3 x 5
    re.compile(r"\S*(?:" + _HSPACE + r"[<>]=?|[<>]=?" + _HSPACE + r"+|[<>]=)" + _HSPACE + r"*\Z"),  # a bound: x > 5
    re.compile(r"\\(?!(?:" + _DISPLAY_COMMANDS + r")\b)[A-Za-z]+\*?(?:\[[^\]]*\])?" + _HSPACE + r"*\{" + _HSPACE + r"*\Z"),
    re.compile(r"\S*[}\]^_]" + _HSPACE + r"*\{" + _HSPACE + r"*\Z"),  # \frac{1}{5}, \sqrt[3]{8}, 2^{5}, x_{5}
    re.compile(r"\S*[\w)\]}](?<!\\left)\(\Z"),  # f(5), 2(5), \sqrt(4); \left(5\right) is a bracket
    re.compile(r"\\\{" + _HSPACE + r"*\Z"),  # a set: \{5\}
]
# rules on the text after the number (anchored at its start)
_AFTER_RULES = [
    re.compile(r"^[\w(\['′]+"),  # glued: 5x, 5e3, 5th, 5², 5(2), 5'
    re.compile(r"^\s*\}\s*\{"),  # first argument of a two-argument command: \frac{5}{x}
    re.compile(r"^[\s)\]}]*(?:[!%^_/+×÷·⋅±∓°]|\\%)"),  # a postfix or binary operator: 5!, 5 %, (5)^2
    re.compile(r"^[\s)\]}]*\\(?!(?:" + _TRAILING_COMMANDS + r")(?![A-Za-z]))[A-Za-z]+"),  # 5\pi, 5 \cdot, 5\sqrt{2}
]


def _canonical_int(token: str) -> str | None:
    digits = re.sub(_HSPACE + "|,", "", token)
    if not re.fullmatch(r"[-+]?\d+", digits) or len(digits) > MAX_NUMBER_DIGITS:
        return None
    return str(int(digits))


def _notation(text: str, start: int, end: int, token: str) -> str | None:
    """The number ``token`` at ``text[start:end]`` with the notation around it that
    keeps it from being a plain integer answer (module docstring), or None when it
    stands alone."""
    before = text[max(0, start - _CONTEXT) : start]
    after = text[end : end + _CONTEXT]
    rules = ([_BEFORE_SIGNED] if token[0] in "+-" else []) + _BEFORE_RULES
    for rule in rules:
        m = rule.search(before)
        if m:
            return (m.group(0) + token).strip()
    for rule in _AFTER_RULES:
        m = rule.search(after)
        if m:
            return (token + m.group(0)).strip()
    return None


def extract_last_integer(text: str) -> str | None:
    """Canonical string (``"-1234"``) of the last number in ``text`` when it is a
    plain integer; the number with its notation (``"5!"``, ``"0x5"``, ``"5, 5"``)
    or the decimal (``"12.5"``) when it is not; None without numbers."""
    text = _DIGIT_SPACING_RE.sub(" ", text.translate(_DASHES))
    last = last_match(_NUMBER_RE, text)
    if last is None:
        return None
    token = last.group(0)
    notation = _notation(text, last.start(), last.end(), token)
    if notation is not None:
        return notation
    canonical = _canonical_int(token)
    return canonical if canonical is not None else re.sub(_HSPACE + "|,", "", token)


def gold_integer(ground_truth: str) -> str:
    """Canonical integer string of the ground truth; ValueError if it is not an integer."""
    canonical = _canonical_int(ground_truth.strip())
    if canonical is None:
        raise ValueError(f"ground_truth={ground_truth!r} must be an integer string for data_source 'arithmetic'")
    return canonical


def grade(solution_str: str, ground_truth: str) -> dict:
    """Grade one response in this process. Returns
    ``{"score": +1.0/-1.0, "acc": bool, "pred": canonical integer string, the last
    number with its notation, or None}``."""
    gold = gold_integer(ground_truth)
    pred = extract_last_integer(solution_str)
    acc = pred is not None and pred == gold
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}

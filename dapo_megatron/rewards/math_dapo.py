"""DAPO-Math grader: the last ``Answer:`` line, normalised, compared exactly.

Follows the reward of the DAPO paper (arXiv 2503.14476, Sec. 4.1, "+1 if
correct, -1 otherwise") and verl's ``reward_score/math_dapo.py``
(``normalize_final_answer``, Minerva-style, Lewkowycz et al. 2022), with these
deliberate differences from verl:

- the whole response is searched (verl keeps only the last 300 characters, which
  can cut the answer line off);
- ``\\boxed{}`` is unwrapped brace-balanced; thousands separators ``8,000``,
  ``9{,}500``, ``1 000`` and ``1\\,000`` are removed, in groups of three only: verl
  removes every space and every ``{,}``, so it reads ``100 0`` as 1000, ``5 6`` as 56
  and ``1{,}2`` as 12, which here stay wrong;
- unit words are dropped after a number (``5 cm``), and after a closing brace when
  they are written in ``\\text{}`` or have several letters (``\\frac{1}{3} \\text{meters}``,
  ``2\\sqrt{2}\\text{ cm}``, ``\\frac{1}{3} meters``; a bare ``m`` may be a variable);
- two answers that are both exact numbers (``0.5``, ``1/2``, ``\\frac{1}{2}``,
  ``2^{10}``, ``10!``, ``2\\sqrt{2}``; :func:`~dapo_megatron.rewards.exact.parse_exact`)
  are compared by exact value as well as by string. A decimal never matches a
  value it can only approximate (``0.333`` is not ``\\frac{1}{3}``): this grader
  has no tolerance, as the paper's rule-based reward.

Runs in the calling process without a timeout; grade model text through
:func:`dapo_megatron.rewards.compute_score` or :class:`~dapo_megatron.rewards.RewardPool`.

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

import re

from dapo_megatron.rewards import exact
from dapo_megatron.rewards.text import (
    UNIT_WORDS,
    join_space_thousands,
    last_boxed_content,
    parse_exact_number,
    remove_thousands_separators,
    strip_latex_command_groups,
    strip_text_unit,
)

ANSWER_PATTERN = re.compile(r"(?i)answer\s*:[ \t*]*([^\n]*)")

# a unit word after a number ("5 cm"), or a unit of several letters after a closing brace
# ("\\frac{1}{3} meters"; "\\frac{1}{3} m" keeps its "m", which may be a variable)
_UNITS = "|".join(sorted(UNIT_WORDS, key=len, reverse=True))
_MULTI_LETTER_UNITS = "|".join(sorted((u for u in UNIT_WORDS if len(u) > 1), key=len, reverse=True))
_TRAILING_UNIT_RE = re.compile(r"^(.*?\d)\s*(?:(?:%s)\b(?:\^\{?[23]\}?)?\.?\s*)+$" % _UNITS, re.IGNORECASE)
_BRACE_UNIT_RE = re.compile(r"^(.*\})\s+(?:(?:%s)\b(?:\^\{?[23]\}?)?\.?\s*)+$" % _MULTI_LETTER_UNITS, re.IGNORECASE)
# LaTeX spacing between two digits ("1\\,000", "5\\,6") becomes a space, which only a
# thousands grouping removes (text.join_space_thousands)
_DIGIT_SPACING_RE = re.compile(r"(?<=\d)(?:\\[,;:! ]|~)+(?=\d)")
# whitespace is dropped except between two digits: "5 6" is not 56, "100 0" is not 1000
_SPACE_NOT_BETWEEN_DIGITS_RE = re.compile(r"(?<!\d)\s+|\s+(?!\d)")

_REMOVED = (
    "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "^{\\circ}", "^\\circ", "\\circ",
    "\\%", "%", "\\$", "\\displaystyle", "\\ldots", "\\dots",
)


def extract_answer_line(solution_str: str) -> str | None:
    """Text after the last ``Answer:`` (case-insensitive) up to the end of its line,
    or None when there is no such line or it is empty."""
    matches = ANSWER_PATTERN.findall(solution_str)
    if not matches:
        return None
    answer = matches[-1].strip()
    return answer or None


def normalize_final_answer(answer: str) -> str:
    """Canonical string of a final answer (verl/Minerva ``normalize_final_answer`` rules).

    ``"$\\boxed{9{,}500}$ dollars."`` -> ``"9500"``, ``"x = \\dfrac{1}{2}"`` -> ``"\\frac{1}{2}"``.
    """
    s = answer.strip()
    # the first $...$ math span holds the answer ("$5$ apples" -> "5"), as in verl
    m = re.search(r"\$+([^$]+)\$+", s)
    if m:
        s = m.group(1)
    s = s.replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    boxed = last_boxed_content(s)
    if boxed is not None:
        s = boxed
    s = s.strip().strip("*").strip()
    s = s.rstrip(".").strip()
    s = strip_text_unit(s)  # "\\frac{1}{3} \\text{meters}", "2\\sqrt{2}\\text{ cm}"
    s = strip_latex_command_groups(s, ("text", "textbf", "textrm", "mathrm", "mbox", "mathbf", "overline"))
    s = _DIGIT_SPACING_RE.sub(" ", s)
    s = join_space_thousands(s)
    s = s.replace("{,}", ",")  # "9{,}500" -> "9,500" (read below), "1{,}2" -> "1,2" (not 12)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = s.replace("$", "")
    s = s.split("=")[-1]
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    # shorthand TeX: \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}, \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)
    s = s.strip().rstrip(".").strip()
    unit = _TRAILING_UNIT_RE.match(s) or _BRACE_UNIT_RE.match(s)
    if unit:
        s = unit.group(1)
    s = _SPACE_NOT_BETWEEN_DIGITS_RE.sub("", s)
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _outer_braces_wrap(s):
        s = s[1:-1]
    s = remove_thousands_separators(s)
    return s


def _outer_braces_wrap(s: str) -> bool:
    depth = 0
    for i, c in enumerate(s):
        depth += c == "{"
        depth -= c == "}"
        if depth == 0 and i < len(s) - 1:
            return False
    return depth == 0


def answers_match(pred: str, gold: str) -> bool:
    """Normalised strings equal, or both exact numbers with the same value."""
    if pred == gold:
        return True
    a, b = parse_exact_number(pred), parse_exact_number(gold)
    if a is not None and b is not None:  # plain literals (AIME integers): regex + Fraction, no parser
        return a == b
    a, b = exact.parse_exact(pred), exact.parse_exact(gold)
    return a is not None and b is not None and exact.compare(a, b) is True


def grade(solution_str: str, ground_truth: str) -> dict:
    """Grade one response in this process (no timeout). Returns
    ``{"score": +1.0/-1.0, "acc": bool, "pred": normalised answer or None}``."""
    gold = normalize_final_answer(ground_truth)
    if not gold:
        raise ValueError(f"ground_truth={ground_truth!r} normalises to an empty answer")
    answer = extract_answer_line(solution_str)
    pred = normalize_final_answer(answer) if answer is not None else None
    acc = bool(pred) and answers_match(pred, gold)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred or None}

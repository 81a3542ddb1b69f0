"""Boxed-answer math grader (MATH / lighteval/MATH style): exact where the answer
is a number, math-verify equivalence otherwise.

The prediction is the content of the last ``\\boxed{}`` or ``\\fbox{}`` of the
response, extracted brace-balanced (:func:`~dapo_megatron.rewards.text.last_boxed_content`).
No box, or an unbalanced last box, is wrong: there is no fallback to "any number
in the text" (that rewards guessing).

Equivalence, in order:

1. Both answers are exact numbers (:func:`~dapo_megatron.rewards.exact.parse_exact`:
   integers, decimals, fractions, powers, factorials, radicals): compared exactly
   (``\\frac{1}{2004!}`` is not ``\\frac{1}{2006!}``, ``72.0000001`` is not ``72``).
2. One side is a decimal written for a value with no finite decimal form
   (``0.0833333333333333`` for ``\\frac{1}{12}``, ``1.414214`` for ``\\sqrt{2}``):
   math-verify's tolerant comparison (6 decimals) *and* a relative error of at
   most 1e-3, so a tiny value rounded to ``0.0`` is not paid.
3. Anything else (symbols, sets, intervals, matrices, percent, units): math-verify
   (``math_verify.parse`` + ``math_verify.verify``, HF Math-Verify 0.8+, read at
   0.9.0) with only its LaTeX extractor, which parses through an ANTLR grammar; its
   expression extractor (``ExprExtractionConfig``, which calls sympy ``parse_expr``,
   i.e. ``eval``) is never used on model text. math-verify's own signal-based
   timeouts are disabled: the caller's worker process enforces the wall-clock limit.

   A relation answers a set (gold ``x \\in [-2,7]`` or ``[-2,7]``, response
   ``-2 \\le x \\le 7``; ``x > 3`` for ``(3, \\infty)``) through ``verify``'s
   ``allow_set_relation_comp=True`` (``math_verify/grader.py::sympy_expr_eq`` then
   converts the relation with sympy ``as_set``), but only when the relation is in
   solved form: every comparison puts one variable alone against a constant, and it
   is the gold's variable when the gold names one. ``as_set`` solves any
   inequality, so the restated problem ``x^2 - 5x + 6 < 0`` would otherwise be paid
   as its solution ``(2, 3)``; and ``-2 \\le y \\le 7`` is not ``x \\in [-2,7]``.

Before any comparison, three response forms that math-verify would pay for the
wrong reason are refused (the gold is trusted):

- digits split by spaces that do not group thousands (``100 0``, ``5 6``), and a
  hexadecimal literal (``0x5``): math-verify reads ``100 0`` as ``100 \\cdot 0``,
  ``5 6`` as 11 and ``0x5`` as 0; ``1 000`` and ``1\\,000`` are read as 1000 (rule 1);
- a trailing ``\\text{...}`` that is more than words, or holds a word that
  changes the claim (``5 \\text{ or more}``, ``5 \\text{ or 6}``,
  ``2 \\text{ m} \\times 3 \\text{ m}``): math-verify's normaliser drops every
  trailing text group as a unit (``latex2sympy2_extended/math_normalization.py``,
  ``unit_superscript_regex``); ``5 \\text{ apples}`` is still 5;
- a list that repeats an element when the gold lists fewer (``5, 5`` for ``5``,
  ``1, 2, 2`` for ``1, 2``): math-verify compares them as sets. A set written as a set
  (``\\{(1,2),(1,2),(3,4)\\}``) against a gold written as a set is not refused: a set
  that names a member twice is the same set (Math-Verify compares sets as sets too).

Before parsing, the upright Euler number ``\\mathrm{e}`` (ISO 80000-2 typesetting) is
read as ``e`` in both answers: math-verify's normaliser turns ``\\mathrm`` into
``\\text`` and its unit rule then deletes ``\\text{e}}`` and everything after it
(``1 - \\frac{1}{\\mathrm{e}}`` parses as ``1 - \\frac{1}{``), so an answer
identical to its gold was graded wrong.

Runs in the calling process without a timeout; grade model text through
:func:`dapo_megatron.rewards.compute_score` or :class:`~dapo_megatron.rewards.RewardPool`.

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

import logging
import re

from dapo_megatron.rewards import exact
from dapo_megatron.rewards.text import HSPACE, join_space_thousands, last_boxed_content

_MV = None


def _math_verify():
    """Lazily import math-verify (sympy import costs ~0.3 s) with LaTeX-only extraction: the
    config (data sources name their graders) and every grader worker load this module, and
    only math answers need it."""
    global _MV
    if _MV is None:
        # math-verify (0.4 s with sympy) only for math answers: the config and grader workers start without it
        from math_verify import LatexExtractionConfig, parse, verify

        # we disable its timeouts on purpose; silence the warning it logs about that
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        _MV = (parse, verify, [LatexExtractionConfig(boxed_match_priority=0)])
    return _MV


def _parse_boxed(content: str):
    parse, _, config = _math_verify()
    return parse("\\boxed{" + content + "}", extraction_config=config, parsing_timeout=None)


def gold_content(ground_truth: str) -> str:
    """The gold answer: the last box of ``ground_truth`` if it has one (a full MATH
    solution), else the ground truth itself (an answer string)."""
    boxed = last_boxed_content(ground_truth)
    gold = boxed if boxed is not None else ground_truth.strip()
    if not gold:
        raise ValueError(f"ground_truth={ground_truth!r} has no answer")
    return gold


def grade(solution_str: str, ground_truth: str) -> dict:
    """Grade one response in this process (no timeout). Returns
    ``{"score": +1.0/-1.0, "acc": bool, "pred": boxed content or None}``."""
    gold = gold_content(ground_truth)
    pred = last_boxed_content(solution_str)
    if pred is None or not pred.strip():
        return {"score": -1.0, "acc": False, "pred": None}
    acc = answers_equivalent(pred, gold)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# \mathrm{e}: the upright Euler number. latex2sympy2_extended 1.11 (math_normalization.py::
# normalize_latex) rewrites \mathrm{...} to \text{...}, then unit_superscript_regex
# r"(\\(?:text|mbox){.*?})(\^\d|\{\^\d\})?$" deletes from "\text{e}}" to the end of the answer.
# Only the letter e: \mathrm{m} is a unit (dropped on purpose, "5 \mathrm{m}" is 5), and
# latex2sympy2 reads a plain "e" as sympy's E.
_UPRIGHT_E_RE = re.compile(r"\\mathrm\s*\{\s*e\s*\}")


def upright_e_as_e(answer: str) -> str:
    """``answer`` with every ``\\mathrm{e}`` written ``e`` (module docstring)."""
    return _UPRIGHT_E_RE.sub("e", answer)


def answers_equivalent(pred: str, gold: str) -> bool:
    """Whether the boxed contents ``pred`` and ``gold`` are the same answer (the
    rules of the module docstring)."""
    pred, gold = upright_e_as_e(pred), upright_e_as_e(gold)
    if splits_a_number(pred) or drops_meaningful_text(pred):
        return False
    pred_number, gold_number = exact.parse_exact(pred), exact.parse_exact(gold)
    approximate = False
    both_numbers = pred_number is not None and gold_number is not None
    # "x = 5" and "y = 5" are different assignments: math-verify keeps them apart
    if both_numbers and (None in (pred_number.variable, gold_number.variable) or pred_number.variable == gold_number.variable):
        verdict = exact.compare(pred_number, gold_number)
        if verdict is not None:
            return verdict
        approximate = True
    _, verify, _ = _math_verify()
    gold_parsed = _parse_boxed(gold)
    pred_parsed = _parse_boxed(pred)
    if not gold_parsed or not pred_parsed or _repeats_elements(pred_parsed, gold_parsed):
        return False
    allow_relation = _solved_relation(pred_parsed[0], gold_parsed[0])
    acc = bool(verify(gold_parsed, pred_parsed, timeout_seconds=None, allow_set_relation_comp=allow_relation))
    if acc and approximate:
        acc = exact.relative_error(pred_number, gold_number) <= exact.APPROXIMATION_REL_TOL
    return acc


# LaTeX spacing between two digits ("1\\,000", "5\\,6") is a space for the thousands rule
_DIGIT_SPACING_RE = re.compile(r"(?<=\d)(?:\s|\\[,;:! ]|~)+(?=\d)")
_SPLIT_DIGITS_RE = re.compile(r"\d%s+\d" % HSPACE)


# a hexadecimal literal: math-verify reads "0x5" as 0 * x * 5 = 0
_HEX_LITERAL_RE = re.compile(r"(?<![\w.])0[xX][0-9A-Fa-f]+(?![\w.])")


def splits_a_number(answer: str) -> bool:
    """Whether ``answer`` has digits split by spaces that do not group thousands
    (``"100 0"``, ``"5\\,6"``; not ``"1 000"``, :func:`~dapo_megatron.rewards.text.join_space_thousands`),
    or writes a hexadecimal literal (``"0x5"``), which is no number of the other notation."""
    if _HEX_LITERAL_RE.search(answer):
        return True
    return bool(_SPLIT_DIGITS_RE.search(join_space_thousands(_DIGIT_SPACING_RE.sub(" ", answer))))


# math-verify 0.9.0 normalises with latex2sympy2_extended (math_normalization.py::normalize_latex):
# \textbf, \textrm, \textit, \textnormal, \mathrm, \mathit, \mathbf become \text, "\text{ and }" /
# "\text{ or }" become ",", then (units=True) unit_superscript_regex
# r"(\\(?:text|mbox){.*?})(\^\d|\{\^\d\})?$" deletes everything from the first text group that
# reaches the end: "5 \text{ or more}" and "2 \text{ m} \times 3 \text{ m}" both read as their first number.
_TEXT_COMMAND_RE = re.compile(r"\\(?:text(?:normal|bf|it|rm)?|math(?:rm|it|bf)|mbox)(?![A-Za-z])")
_AND_OR_TEXT_RE = re.compile(r",?\s*\\text\{\s*(?:and|or)\s*\}")
_DROPPED_SUFFIX_RE = re.compile(r"\\text\{.*?\}(?:\^\d|\{\^\d\})?$", re.S)
_WORDS_ONLY_TEXT_RE = re.compile(r"\\text\{([A-Za-z .'\-]*)\}(?:\^\d|\{\^\d\})?")
# words that change what a number claims; a unit or a noun ("apples", "square units") does not
_CLAIM_WORDS = frozenset(
    "or nor and not no never none nothing more less fewer greater larger smaller bigger higher lower than least most "
    "over under above below wrong incorrect false invalid maybe possibly perhaps probably likely unlikely either "
    "neither except unless if otherwise else approximately approx about around roughly nearly almost between to from "
    "plus minus times divided up until till other another guess unsure undefined impossible".split()
)


def drops_meaningful_text(answer: str) -> bool:
    """Whether math-verify would silently drop a trailing text part of ``answer`` that
    is more than a unit or a noun: anything but one ``\\text{words}`` group (an
    optional ``^2``), or a group holding a word of :data:`_CLAIM_WORDS`. An answer
    that is all text (``\\text{(C)}``) is kept whole by math-verify and is not refused."""
    s = _AND_OR_TEXT_RE.sub(",", _TEXT_COMMAND_RE.sub(r"\\text", answer.strip()))
    suffix = _DROPPED_SUFFIX_RE.search(s)
    if suffix is None or not s[: suffix.start()].strip():
        return False
    words = _WORDS_ONLY_TEXT_RE.fullmatch(suffix.group(0))
    if words is None:
        return True
    return any(word in _CLAIM_WORDS for word in re.findall(r"[a-z]+", words.group(1).lower()))


def _written_items(normalized: str) -> int:
    """Top-level comma-separated items of math-verify's normalised answer string
    (inside one outer ``\\{ \\}``, ``{ }`` or ``[ ]``; thousands commas do not count)."""
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", normalized.strip())
    s = s.replace("\\left", "").replace("\\right", "").replace("\\{", "{").replace("\\}", "}")
    if len(s) >= 2 and (s[0], s[-1]) in (("{", "}"), ("[", "]")):
        s = s[1:-1]
    depth, items = 0, 1
    for c in s:
        depth += c in "([{"
        depth -= c in ")]}"
        items += c == "," and depth == 0
    return items


_SET_BRACES_RE = re.compile(r"^\s*(?:\\left\s*)?\\\{.*(?:\\right\s*)?\\\}\s*$", re.S)


def _written_as_set(normalized: str) -> bool:
    """Whether math-verify's normalised answer string is one ``\\{ ... \\}`` (a set literal)."""
    s = normalized.strip()
    if not _SET_BRACES_RE.match(s):
        return False
    # the outer \{ must close at the very end: "\{1\} \cup \{2\}" is no single literal
    depth = 0
    for i in range(len(s)):
        if s.startswith("\\{", i):
            depth += 1
        elif s.startswith("\\}", i):
            depth -= 1
            if depth == 0 and s[i + 2:].strip():
                return False
    return True


def _repeats_elements(pred_parsed: list, gold_parsed: list) -> bool:
    """The response lists more items than its set holds (a repeated element, ``5, 5``)
    and more than the gold lists, unless both are written as sets (``\\{...\\}``): a set
    literal that names a member twice is that set (``\\{(1,2),(1,2)\\} = \\{(1,2)\\}``)."""
    from sympy import FiniteSet  # only once math-verify parsed (see _math_verify)

    pred_expr = pred_parsed[0]
    if not isinstance(pred_expr, FiniteSet) or len(pred_parsed) < 2 or not isinstance(pred_parsed[1], str):
        return False
    gold_text = gold_parsed[1] if len(gold_parsed) > 1 and isinstance(gold_parsed[1], str) else None
    if gold_text is not None and _written_as_set(gold_text) and _written_as_set(pred_parsed[1]):
        return False
    written = _written_items(pred_parsed[1])
    gold_written = _written_items(gold_text) if gold_text is not None else 1
    return written > len(pred_expr) and written > gold_written


def _solved_relation(pred_expr, gold_expr) -> bool:
    """Whether ``pred_expr`` is a relation in solved form (every comparison is one
    variable against a constant, the same variable throughout), naming the gold's
    variable when the gold has free symbols: then it may be compared with a gold set
    (``verify(..., allow_set_relation_comp=True)``, module docstring)."""
    from sympy import And, Symbol  # only once math-verify parsed (see _math_verify)
    from sympy.core.relational import Relational

    if isinstance(pred_expr, Relational):
        comparisons = [pred_expr]
    elif isinstance(pred_expr, And) and pred_expr.args and all(isinstance(a, Relational) for a in pred_expr.args):
        comparisons = list(pred_expr.args)
    else:
        return False
    variables = set()
    for comparison in comparisons:
        lhs, rhs = comparison.lhs, comparison.rhs
        if isinstance(lhs, Symbol) and not rhs.free_symbols:
            variables.add(lhs)
        elif isinstance(rhs, Symbol) and not lhs.free_symbols:
            variables.add(rhs)
        else:
            return False
    gold_variables = getattr(gold_expr, "free_symbols", set())
    return len(variables) == 1 and (not gold_variables or variables <= gold_variables)


def warmup() -> None:
    """Import math-verify and sympy and run each comparison rule once, so the first
    real call is not slow."""
    for pred, gold in (("x+1", "1+x"), ("2\\sqrt{2}", "\\sqrt{8}"), ("0.3333333", "\\frac{1}{3}")):
        answers_equivalent(pred, gold)

"""GSM8K grader: the number after the last ``####`` (Cobbe et al. 2021 answer format;
verl ``reward_score/gsm8k.py`` strict mode).

Only the ``#### N`` marker counts; a response without it is wrong (no fallback to
the last number in the text), and the whole response is searched (verl's
last-300-characters window drops an answer followed by more text, verl PR #7274).
Thousands separators (``1,200``, LaTeX ``9{,}500``, a space or thin space ``1 200``,
``1\\,200``: groups of exactly three) and a ``$`` / ``\\$`` sign are removed and the
values are compared exactly as fractions (``72``, ``72.0``, ``72.00`` are equal;
``72.0000001`` is not). A number that runs on into more digits is not an answer:
``#### 1,2`` (a decimal comma or a list), ``#### 3, 4``, ``#### 100 0`` give no
prediction, where verl reads 1, 3 and 100; an earlier ``####`` does not stand in.

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

import re

from dapo_megatron.rewards.text import HSPACE, join_space_thousands, last_match, parse_exact_number

# a comma, TeX "{,}", a space or TeX thin space only separates thousands between groups of
# exactly three digits; the number must end there (no digit, ",digit", ", digit" or
# " digit" after it): "#### 1,2", "#### 3, 4" and "#### 100 0" are not answers
_SEPARATOR = r"(?:,|\{,\}|%s|\\,|~)" % HSPACE
_ANSWER_RE = re.compile(
    r"####\s*(?:\\?\$)?\s*(-?(?:\d{1,3}(?:%s\d{3})+|\d+)(?:\.\d+)?|-?\.\d+)" % _SEPARATOR
    + r"(?!\d|[.,]\d|\s*,\s*\d|%s+\d)" % HSPACE
)
_SEPARATOR_RE = re.compile(_SEPARATOR)


# a "####" that a number follows; one that words follow is a Markdown heading
_MARKER_RE = re.compile(r"####\s*(?:\\?\$)?\s*-?\.?\d")


def extract_hash_answer(text: str) -> str | None:
    """The number after the last ``####`` that a number follows (separators removed),
    or None; when that number is malformed (``#### 1,2``) an earlier ``####`` does not
    stand in for it."""
    last = last_match(_MARKER_RE, text)
    m = _ANSWER_RE.match(text, last.start()) if last is not None else None
    return None if m is None else _SEPARATOR_RE.sub("", m.group(1))


def gold_answer(ground_truth: str) -> str:
    """Gold number from a bare number (``"72"``, ``"1,200"``) or a full GSM8K answer text
    ending in ``#### N``. Raises ValueError when neither form is found."""
    if "####" in ground_truth:
        gold = extract_hash_answer(ground_truth)
    else:
        gold = join_space_thousands(ground_truth.strip().lstrip("$")).replace(",", "")
    if gold is None or parse_exact_number(gold) is None:
        raise ValueError(f"ground_truth={ground_truth[:80]!r} is neither a number nor a GSM8K answer with '#### N'")
    return gold


def grade(solution_str: str, ground_truth: str) -> dict:
    """Grade one response in this process. Returns
    ``{"score": +1.0/-1.0, "acc": bool, "pred": number string or None}``."""
    gold = parse_exact_number(gold_answer(ground_truth))
    pred = extract_hash_answer(solution_str)
    value = parse_exact_number(pred) if pred is not None else None
    acc = value is not None and value == gold
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}

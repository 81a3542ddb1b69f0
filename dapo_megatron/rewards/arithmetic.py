"""Grader of the embedded arithmetic task ("Compute a + b. Reply with just the number.").

This task defines "final integer" grading: the prediction is the last integer in
the response (a leading minus and comma thousands separators allowed), compared
with the integer ground truth. A decimal such as ``12.5`` is a number but not an
integer: when it comes last, it is the prediction and it is wrong.
"""

from __future__ import annotations

import re

from dapo_megatron.rewards.text import MAX_NUMBER_DIGITS

# a minus only counts as a sign when it does not follow a word character ("5-3" -> 3)
_NUMBER_RE = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,]*\d)|(?<![\w.])-?\d+(?:\.\d+)?|\d+(?:\.\d+)?")


def _canonical_int(token: str) -> str | None:
    digits = token.replace(",", "")
    if not re.fullmatch(r"-?\d+", digits) or len(digits) > MAX_NUMBER_DIGITS:
        return None
    return str(int(digits))


def extract_last_integer(text: str) -> str | None:
    """Canonical string (``"-1234"``) of the last number in ``text`` when it is an
    integer; the raw token when the last number is a decimal; None without numbers."""
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    token = matches[-1]
    canonical = _canonical_int(token)
    return canonical if canonical is not None else token.replace(",", "")


def gold_integer(ground_truth: str) -> str:
    """Canonical integer string of the ground truth; ValueError if it is not an integer."""
    canonical = _canonical_int(ground_truth.strip())
    if canonical is None:
        raise ValueError(f"ground_truth={ground_truth!r} must be an integer string for data_source 'arithmetic'")
    return canonical


def grade(solution_str: str, ground_truth: str) -> dict:
    """Grade one response in this process. Returns
    ``{"score": +1.0/-1.0, "acc": bool, "pred": canonical integer string or None}``."""
    gold = gold_integer(ground_truth)
    pred = extract_last_integer(solution_str)
    acc = pred is not None and pred == gold
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}

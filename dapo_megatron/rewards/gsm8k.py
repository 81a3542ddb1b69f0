"""GSM8K grader: the number after the last ``####`` (Cobbe et al. 2021 answer format;
verl ``reward_score/gsm8k.py`` strict mode).

Only the ``#### N`` marker counts; a response without it is wrong (no fallback to
the last number in the text), and the whole response is searched (verl's
last-300-characters window drops an answer followed by more text, verl PR #7274).
Thousands separators (``1,200``, LaTeX ``9{,}500``) and a ``$`` / ``\\$`` sign are
removed and the values are compared exactly as fractions (``72``, ``72.0``,
``72.00`` are equal; ``72.0000001`` is not).
"""

from __future__ import annotations

import re

from dapo_megatron.rewards.text import parse_exact_number

# a comma (or TeX "{,}") only separates thousands between groups of exactly three digits:
# "#### 1,2" reads 1, not 12
_ANSWER_RE = re.compile(r"####\s*(?:\\?\$)?\s*(-?(?:\d{1,3}(?:(?:,|\{,\})\d{3})+(?!\d)|\d+)(?:\.\d+)?|-?\.\d+)")


def extract_hash_answer(text: str) -> str | None:
    """The number after the last ``####`` (separators removed), or None."""
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    return matches[-1].replace("{,}", "").replace(",", "")


def gold_answer(ground_truth: str) -> str:
    """Gold number from a bare number (``"72"``, ``"1,200"``) or a full GSM8K answer text
    ending in ``#### N``. Raises ValueError when neither form is found."""
    if "####" in ground_truth:
        gold = extract_hash_answer(ground_truth)
    else:
        gold = ground_truth.strip().lstrip("$").replace(",", "")
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

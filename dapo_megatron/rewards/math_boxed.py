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
   (``math_verify.parse`` + ``math_verify.verify``, HF Math-Verify 0.8+) with only
   its LaTeX extractor, which parses through an ANTLR grammar; its expression
   extractor (``ExprExtractionConfig``, which calls sympy ``parse_expr``, i.e.
   ``eval``) is never used on model text. math-verify's own signal-based
   timeouts are disabled: the caller's worker process enforces the wall-clock limit.

Runs in the calling process without a timeout; grade model text through
:func:`dapo_megatron.rewards.compute_score` or :class:`~dapo_megatron.rewards.RewardPool`.
"""

from __future__ import annotations

import logging

from dapo_megatron.rewards import exact
from dapo_megatron.rewards.text import last_boxed_content

_MV = None


def _math_verify():
    """Lazily import math-verify (sympy import costs ~0.3 s) with LaTeX-only extraction."""
    global _MV
    if _MV is None:
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


def answers_equivalent(pred: str, gold: str) -> bool:
    """Whether the boxed contents ``pred`` and ``gold`` are the same answer (the
    three rules of the module docstring)."""
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
    acc = bool(gold_parsed) and bool(pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    if acc and approximate:
        acc = exact.relative_error(pred_number, gold_number) <= exact.APPROXIMATION_REL_TOL
    return acc


def warmup() -> None:
    """Import math-verify and sympy and run each comparison rule once, so the first
    real call is not slow."""
    for pred, gold in (("x+1", "1+x"), ("2\\sqrt{2}", "\\sqrt{8}"), ("0.3333333", "\\frac{1}{3}")):
        answers_equivalent(pred, gold)

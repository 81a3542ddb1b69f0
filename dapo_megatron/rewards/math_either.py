"""Grader of the ``math`` data source: the final answer in either form, a
``\\boxed{}`` or an ``Answer:`` line.

verl routes ``data_source == "math"`` to its DAPO grader (the last ``Answer:``
line; ``verl/utils/reward_score/__init__.py::default_compute_score``), while MATH
solutions and most prompts box the answer. This grader reads both, and grades
exactly one candidate, so writing both forms never gives a second chance:

1. The candidates are the last box of the response (the last ``\\boxed`` or
   ``\\fbox``, :func:`~dapo_megatron.rewards.text.last_box`) and the last
   ``Answer:`` marker (:data:`~dapo_megatron.rewards.math_dapo.ANSWER_PATTERN`,
   case-insensitive, anywhere in a line, as in verl).
2. The one that starts later is the final answer; the other is ignored, as an
   earlier box is ignored by the boxed grader (a model that corrects itself
   writes the correction last). So ``\\boxed{3} ... Answer: 5`` answers 5,
   ``the answer: 3 is wrong, so \\boxed{5}`` answers 5, ``Answer: \\boxed{5}``
   answers the box's 5, and ``Answer: 5 \\boxed{3}`` answers 3.
3. The final candidate must be complete: a box cut off before its closing brace,
   or an ``Answer:`` with nothing after it on its line, is wrong; the earlier
   candidate does not stand in for it. No candidate at all is wrong (no fallback
   to numbers in the text).
4. A box is compared as the boxed grader compares it
   (:func:`~dapo_megatron.rewards.math_boxed.answers_equivalent`). An ``Answer:``
   line is right when the DAPO grader's normalised strings or exact values match
   (:func:`~dapo_megatron.rewards.math_dapo.answers_match`, verl's rule for
   ``math``), or when its math (the first ``$...$``, ``\\(...\\)`` or ``\\[...\\]``
   span, else the line without a final period) is equivalent to the gold under
   the boxed grader's rules, so ``Answer: $(1, 4.5)$`` answers
   ``(1,\\frac{9}{2})``.

The gold is the last box of ``ground_truth`` when it has one (a MATH solution),
else ``ground_truth`` itself (:func:`~dapo_megatron.rewards.math_boxed.gold_content`).

Runs in the calling process without a timeout; grade model text through
:func:`dapo_megatron.rewards.compute_score` or :class:`~dapo_megatron.rewards.RewardPool`.

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

import re

from dapo_megatron.rewards import math_boxed, math_dapo
from dapo_megatron.rewards.text import last_box, last_match

_MATH_SPAN_RE = re.compile(r"\$+([^$]+)\$+|\\\((.+?)\\\)|\\\[(.+?)\\\]")


def final_answer(solution_str: str) -> tuple[str, str | None]:
    """The final answer of a response (rules 1-3 of the module docstring):
    ``("boxed", content)``, ``("answer", line)`` or ``("none", None)``; the content
    is None when that final candidate is incomplete."""
    box_start, box_content = last_box(solution_str)
    answer = last_match(math_dapo.ANSWER_PATTERN, solution_str)
    if box_start < 0 and answer is None:
        return "none", None
    if answer is None or box_start > answer.start():
        return "boxed", box_content if box_content is not None and box_content.strip() else None
    line = answer.group(1).strip()
    return "answer", line or None


def line_math(line: str) -> str:
    """The math of an ``Answer:`` line: its first ``$...$``, ``\\(...\\)`` or ``\\[...\\]``
    span, else the line; Markdown emphasis and a final period removed."""
    m = _MATH_SPAN_RE.search(line)
    s = next(g for g in m.groups() if g is not None) if m else line
    return s.strip().strip("*").strip().rstrip(".").strip()


def grade(solution_str: str, ground_truth: str) -> dict:
    """Grade one response in this process (no timeout). Returns
    ``{"score": +1.0/-1.0, "acc": bool, "pred": box content, Answer-line math, or None}``."""
    gold = math_boxed.gold_content(ground_truth)
    form, content = final_answer(solution_str)
    if content is None:
        return {"score": -1.0, "acc": False, "pred": None}
    if form == "boxed":
        pred = content
        acc = math_boxed.answers_equivalent(content, gold)
    else:
        pred = line_math(content)
        gold_normalized = math_dapo.normalize_final_answer(gold)
        pred_normalized = math_dapo.normalize_final_answer(content)
        acc = bool(pred_normalized) and bool(gold_normalized) and math_dapo.answers_match(pred_normalized, gold_normalized)
        acc = acc or (bool(pred) and math_boxed.answers_equivalent(pred, gold))
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred or None}

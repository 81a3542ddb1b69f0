"""data_source -> grader dispatch (verl ``default_compute_score`` names).

Graders run in the calling process here; :mod:`dapo_megatron.rewards.pool` runs
them in killable worker processes. Importing this module is cheap (no sympy,
no torch): math-verify is imported by the boxed grader on first use.

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dapo_megatron.rewards import arithmetic, gsm8k, math_boxed, math_dapo, math_either
from dapo_megatron.rewards.text import sanitize_text

GRADERS: dict[str, Callable[[str, str], dict]] = {
    "math_dapo": math_dapo.grade,
    "boxed_math": math_boxed.grade,
    "math": math_either.grade,
    "gsm8k": gsm8k.grade,
    "arithmetic": arithmetic.grade,
}

# exact data_source names (verl spellings) -> grader key
DATA_SOURCES: dict[str, str] = {
    "math_dapo": "math_dapo",
    "math_dapo_reasoning": "math_dapo",
    # verl grades "math" with its Answer:-line grader, MATH data boxes the answer: both forms
    "math": "math",
    "lighteval/MATH": "boxed_math",
    "DigitalLearningGmbH/MATH-lighteval": "boxed_math",
    "HuggingFaceH4/MATH-500": "boxed_math",
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "arithmetic": "arithmetic",
}


def resolve_grader(data_source: str) -> str:
    """Grader key for ``data_source``: an exact name of :data:`DATA_SOURCES`, or any
    name starting with ``aime`` (case-insensitive: ``aime-2024``, ``AIME2025``), which
    uses the DAPO ``Answer:`` grader. Raises ValueError naming an unknown source."""
    if not isinstance(data_source, str):
        raise TypeError(f"data_source must be a str, got {type(data_source).__name__}")
    key = DATA_SOURCES.get(data_source)
    if key is None and data_source.lower().startswith("aime"):
        key = "math_dapo"
    if key is None:
        raise ValueError(
            f"unknown data_source {data_source!r}; known: {sorted(DATA_SOURCES)} or 'aime*'. "
            "Register a grader in dapo_megatron.rewards.registry.DATA_SOURCES"
        )
    return key


def normalize_request(
    data_source: str, solution_str: str | bytes, ground_truth, extra_info: dict | None = None
) -> tuple[str, str, str, dict | None]:
    """Validate one grading request and return ``(grader_key, solution, ground_truth, extra_info)``
    with both texts sanitised to valid UTF-8. Raises ValueError/TypeError naming the field."""
    key = resolve_grader(data_source)
    solution = sanitize_text(solution_str, "solution_str")
    if isinstance(ground_truth, bool) or (isinstance(ground_truth, float) and not math.isfinite(ground_truth)):
        raise TypeError(f"ground_truth={ground_truth!r} must be a str (or an int/float number)")
    if isinstance(ground_truth, int | float):
        ground_truth = str(ground_truth)
    gold = sanitize_text(ground_truth, "ground_truth")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise TypeError(f"extra_info must be a dict or None, got {type(extra_info).__name__}")
    return key, solution, gold, extra_info


def grade_in_process(grader_key: str, solution_str: str, ground_truth: str) -> dict:
    """Run a grader in *this* process, without a timeout. For trusted text and for
    the worker processes; model output must go through the pool."""
    result = GRADERS[grader_key](solution_str, ground_truth)
    return {"score": float(result["score"]), "acc": bool(result["acc"]), "pred": result["pred"]}


def warmup() -> None:
    """Import and exercise every grader once (used by workers before they report ready)."""
    math_boxed.warmup()
    for key, (sol, gt) in {
        "math_dapo": ("Answer: 1", "1"),
        "math": ("Answer: 1", "1"),
        "gsm8k": ("#### 1", "1"),
        "arithmetic": ("1", "1"),
    }.items():
        grade_in_process(key, sol, gt)

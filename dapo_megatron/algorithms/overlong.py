"""Overlong reward shaping and overlong filtering (DAPO, arXiv 2503.14476, Sec. 3.4).

Soft overlong punishment, paper Eq. 13, with ``L_max`` = ``max_response_length``,
``L_cache`` = ``overlong_buffer_len`` and ``|y|`` the number of *generated*
tokens (no prompt, no padding)::

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                  if |y| > L_max

scaled by ``penalty_factor`` (verl ``overlong_penalty_factor``) and never below
``-penalty_factor``. Overlong filtering (Sec. 3.4, "Overlong Filtering") is the
separate option of masking the loss of truncated samples.

Design: docs/design.md §3.5 (soft overlong punishment).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# OverlongConfig: its home until the config sections went torch-free, imported from here by callers
from .config import OverlongConfig, validate_overlong_lengths  # noqa: F401

# finish reasons reported by rollout engines (SGLang / vLLM / HF generate wrappers)
TRUNCATED_FINISH_REASONS = frozenset({"length"})
COMPLETED_FINISH_REASONS = frozenset({"stop", "eos", "abort"})


def soft_overlong_penalty(
    response_length: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Soft overlong punishment per response (paper Eq. 13), added to the reward.

    Args:
        response_length: integer ``[batch]`` number of generated tokens per
            response (count of the response mask, never the prompt or padding).
        max_response_length: ``L_max`` in tokens, > 0.
        overlong_buffer_len: ``L_cache`` in tokens, ``0 < L_cache <= L_max``.
        penalty_factor: scale >= 0 of the penalty (paper: 1.0).

    Returns:
        float32 ``[batch]`` in ``[-penalty_factor, 0]``.

    Raises:
        ValueError: invalid lengths/factor, non-integer or negative lengths.
    """
    validate_overlong_lengths(max_response_length, overlong_buffer_len, penalty_factor)
    if not isinstance(response_length, torch.Tensor):
        response_length = torch.as_tensor(response_length)
    if response_length.ndim != 1:
        raise ValueError(f"response_length must be [batch], got shape {tuple(response_length.shape)}")
    if response_length.is_floating_point() or response_length.dtype == torch.bool:
        raise ValueError("response_length must be an integer tensor of generated-token counts")
    if bool((response_length < 0).any()):
        raise ValueError("response_length contains negative counts")
    expected = max_response_length - overlong_buffer_len
    exceed = (response_length.to(torch.float64) - expected).clamp(min=0.0)
    penalty = (-exceed / overlong_buffer_len).clamp(min=-1.0) * penalty_factor
    return penalty.to(torch.float32) + 0.0  # + 0.0 turns -0.0 into 0.0


def overlong_filter_mask(truncated: torch.Tensor | Sequence[str]) -> torch.Tensor:
    """Keep-mask for overlong filtering: ``False`` for truncated responses.

    Multiply it into the response mask (``response_mask * keep[:, None]``) so
    truncated samples contribute no loss and no tokens to ``global_num_tokens``.

    Args:
        truncated: either a bool ``[batch]`` tensor (``True`` = truncated at the
            length limit) or a sequence of engine finish reasons: ``"length"``
            means truncated; ``"stop"``, ``"eos"``, ``"abort"`` are kept.

    Returns:
        bool ``[batch]`` tensor, ``True`` = keep the sample in the loss.

    Raises:
        ValueError: a non-bool tensor, a wrong shape, or an unknown finish reason.
    """
    if isinstance(truncated, torch.Tensor):
        if truncated.dtype != torch.bool or truncated.ndim != 1:
            raise ValueError(
                f"truncated must be a bool [batch] tensor, got dtype {truncated.dtype} shape {tuple(truncated.shape)}"
            )
        return ~truncated
    if isinstance(truncated, str):
        raise ValueError("pass a sequence of finish reasons, not a single string")
    keep = []
    for i, reason in enumerate(truncated):
        if reason in TRUNCATED_FINISH_REASONS:
            keep.append(False)
        elif reason in COMPLETED_FINISH_REASONS:
            keep.append(True)
        else:
            raise ValueError(
                f"finish_reasons[{i}]={reason!r} is unknown; expected one of "
                f"{sorted(TRUNCATED_FINISH_REASONS | COMPLETED_FINISH_REASONS)}"
            )
    return torch.tensor(keep, dtype=torch.bool)


def overlong_penalty(config: OverlongConfig, response_length: torch.Tensor) -> torch.Tensor:
    """float32 ``[batch]`` penalty of :func:`soft_overlong_penalty` with ``config``'s settings,
    zeros when ``config.enable`` is False."""
    if not config.enable:
        return torch.zeros(len(response_length), dtype=torch.float32)
    return soft_overlong_penalty(
        torch.as_tensor(response_length),
        max_response_length=config.max_response_length,
        overlong_buffer_len=config.overlong_buffer_len,
        penalty_factor=config.penalty_factor,
    )

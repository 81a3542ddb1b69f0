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
from dataclasses import dataclass

import torch

# finish reasons reported by rollout engines (SGLang / vLLM / HF generate wrappers)
TRUNCATED_FINISH_REASONS = frozenset({"length"})
COMPLETED_FINISH_REASONS = frozenset({"stop", "eos", "abort"})


def _validate_lengths(max_response_length: int, overlong_buffer_len: int, penalty_factor: float) -> None:
    if isinstance(max_response_length, bool) or not isinstance(max_response_length, int) or max_response_length <= 0:
        raise ValueError(f"max_response_length={max_response_length!r} must be a positive int (L_max, in tokens)")
    if isinstance(overlong_buffer_len, bool) or not isinstance(overlong_buffer_len, int) or overlong_buffer_len <= 0:
        raise ValueError(
            f"overlong_buffer_len={overlong_buffer_len!r} must be a positive int (L_cache, in tokens); "
            "disable the penalty instead of setting it to 0"
        )
    if overlong_buffer_len > max_response_length:
        raise ValueError(
            f"overlong_buffer_len={overlong_buffer_len} must be <= max_response_length={max_response_length} "
            "(the soft window lies inside the maximum length)"
        )
    if not penalty_factor >= 0:
        raise ValueError(f"penalty_factor={penalty_factor!r} must be >= 0")


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
    _validate_lengths(max_response_length, overlong_buffer_len, penalty_factor)
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


@dataclass
class OverlongConfig:
    """Soft overlong punishment settings (verl ``reward_model.overlong_buffer``)."""

    enable: bool = True
    """apply the penalty (verl ``overlong_buffer.enable``)."""
    max_response_length: int = 20480
    """``L_max`` in generated tokens (paper: 20,480)."""
    overlong_buffer_len: int = 4096
    """``L_cache`` in tokens (paper: 4,096; verl ``overlong_buffer.len``)."""
    penalty_factor: float = 1.0
    """scale of the penalty (paper: 1.0; verl ``overlong_buffer.penalty_factor``)."""

    def validate(self) -> None:
        """Check the fields; raise ValueError naming the bad field."""
        if not isinstance(self.enable, bool):
            raise ValueError(f"enable={self.enable!r} must be a bool")
        _validate_lengths(self.max_response_length, self.overlong_buffer_len, self.penalty_factor)

    def penalty(self, response_length: torch.Tensor) -> torch.Tensor:
        """float32 ``[batch]`` penalty of :func:`soft_overlong_penalty`, zeros when disabled."""
        if not self.enable:
            return torch.zeros(len(response_length), dtype=torch.float32)
        return soft_overlong_penalty(
            torch.as_tensor(response_length),
            max_response_length=self.max_response_length,
            overlong_buffer_len=self.overlong_buffer_len,
            penalty_factor=self.penalty_factor,
        )

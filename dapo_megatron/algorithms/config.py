"""The algorithm's config sections and the names they check, without torch.

:class:`AlgorithmConfig` (advantage estimation, :mod:`.advantages`), :class:`OverlongConfig`
(soft overlong punishment, :mod:`.overlong`) and the loss modes and rollout-correction levels
of :mod:`.policy_loss`: loading and validating a config reads these only, so a config check
(``dapo-train --check-config``, a bad key) never loads torch (tests/unit/config/test_torch_free.py).

Design: docs/design.md §3.1 (objective, ratio and advantage) and §3.5 (soft overlong punishment).
"""

from __future__ import annotations

from dataclasses import dataclass

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_LEVELS = ("token", "geometric")


@dataclass
class AlgorithmConfig:
    """Advantage estimation (verl ``algorithm.*``)."""

    norm_adv_by_std_in_grpo: bool = True
    """divide by the group std (DAPO/GRPO); False gives Dr. GRPO's mean-centred advantage."""
    adv_eps: float = 1e-6
    """epsilon added to the group std, > 0 (a group of equal rewards has std 0)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field (the domain of
        :func:`~dapo_megatron.algorithms.advantages.compute_group_advantages`)."""
        if not self.adv_eps > 0:
            raise ValueError(f"adv_eps={self.adv_eps} must be > 0 (it keeps (R - mean) / (std + eps) finite for a "
                             "group of equal rewards)")


def validate_overlong_lengths(max_response_length: int, overlong_buffer_len: int, penalty_factor: float) -> None:
    """Raise ``ValueError`` naming the bad one unless ``L_max`` and ``L_cache`` are positive ints
    with ``L_cache <= L_max`` and the factor is >= 0 (the domain of Eq. 13)."""
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


@dataclass
class OverlongConfig:
    """Soft overlong punishment settings (verl ``reward_model.overlong_buffer``); the penalty
    itself is :func:`~dapo_megatron.algorithms.overlong.overlong_penalty`."""

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
        validate_overlong_lengths(self.max_response_length, self.overlong_buffer_len, self.penalty_factor)

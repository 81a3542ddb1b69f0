"""The ``reward.*`` section: the grader pool (:class:`~dapo_megatron.rewards.pool.RewardPool`).

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    """Rule-based grading (``dapo_megatron.rewards``)."""

    num_workers: int = 1
    """grader processes per rank, >= 1 (each rank grades 1/world of a batch)."""
    timeout_s: float = 5.0
    """wall-clock limit per response (seconds, > 0); a timeout scores -1."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field (the domain of ``RewardPool``)."""
        if self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers} must be >= 1 (grader processes per rank)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 seconds")

"""The ``reward.*`` section: the grader pool (:class:`~dapo_megatron.rewards.pool.RewardPool`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    """Rule-based grading (``dapo_megatron.rewards``)."""

    num_workers: int = 1
    """grader processes per rank (each rank grades 1/world of a batch)."""
    timeout_s: float = 5.0
    """wall-clock limit per response; a timeout scores -1."""

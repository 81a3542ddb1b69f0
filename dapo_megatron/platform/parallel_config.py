"""The model-parallel config section, :class:`ParallelConfig`, and the rollout groups of a world
(:func:`rollout_groups`): layout arithmetic that needs no process group and no torch, so that
loading and checking a config (``dapo-train --check-config``) never loads torch
(tests/unit/config/test_torch_free.py). The process groups themselves: :mod:`.distributed` and
:mod:`.parallel_dims`.

Design: docs/design.md §2 (parallel layouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ROLLOUT_TP_KEY = "rollout.tensor_model_parallel_size"


def rollout_groups(world_size: int, local_world_size: int, rollout_tp_size: int) -> list[tuple[int, ...]]:
    """The rollout groups of a world: consecutive blocks of ``rollout_tp_size`` global ranks.

    Args:
        world_size: number of ranks.
        local_world_size: ranks per node (torchrun's ``LOCAL_WORLD_SIZE``); a node holds the
            consecutive global ranks ``[k * local_world_size, (k + 1) * local_world_size)``.
        rollout_tp_size: ranks per engine.

    Returns:
        ``groups[e]`` = the global ranks of engine ``e`` in order (``groups[e][0]`` leads it).

    Raises:
        ValueError: naming ``rollout.tensor_model_parallel_size`` when it is not an int >= 1,
            does not divide the world size, or does not divide the ranks per node (a group
            would span two nodes, which one engine's NVLink/IPC transport cannot serve).
    """
    if isinstance(rollout_tp_size, bool) or not isinstance(rollout_tp_size, int) or rollout_tp_size < 1:
        raise ValueError(f"{ROLLOUT_TP_KEY}={rollout_tp_size!r} must be an int >= 1")
    if world_size % rollout_tp_size:
        raise ValueError(f"{ROLLOUT_TP_KEY}={rollout_tp_size} does not divide the world size {world_size}: "
                         f"choose a divisor of {world_size}")
    if local_world_size % rollout_tp_size:
        raise ValueError(f"{ROLLOUT_TP_KEY}={rollout_tp_size} must divide the ranks per node "
                         f"(LOCAL_WORLD_SIZE={local_world_size}): an engine's ranks must sit on one node; "
                         f"choose a divisor of {local_world_size}")
    return [tuple(range(start, start + rollout_tp_size)) for start in range(0, world_size, rollout_tp_size)]


@dataclass
class ParallelConfig:
    """Model-parallel layout (Megatron names)."""

    tensor_model_parallel_size: int = 1
    """TP degree; divides the world size."""
    pipeline_model_parallel_size: int = 1
    """PP degree; TP × PP divides the world size, and DP = world / (TP × PP)."""
    expert_model_parallel_size: int = 1
    """EP degree (mixture-of-experts models only): each MoE layer's experts are split over EP ranks
    (``num_experts / EP`` per rank, tokens exchanged by all-to-all). ETP × EP × PP divides the
    world size (megatron-core's expert grid, ``parallel_state.initialize_model_parallel``); the
    EP ranks of a stage are DP (and TP) ranks of the dense layers."""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP degree (MoE only): each expert's FFN split like TP; None: the TP size (megatron-core's
    default). verl and slime's large-MoE recipes use 1."""
    distributed_timeout_minutes: float = 120.0
    """timeout of every collective, in minutes (Megatron's ``--distributed-timeout-minutes``, verl's
    ``nccl_timeout`` in seconds): the world group, every group megatron-core builds
    (``initialize_model_parallel(distributed_timeout_minutes=...)``) and the package's own; > 0.
    NCCL's watchdog ends the job when one collective waits longer. Waiting for generation is not
    bounded by it: ranks that generate nothing wait on a gloo group of their own
    (:data:`~.distributed.GENERATION_WAIT`), so a generation batch may take hours. Megatron's default is 10,
    megatron-core's 30; this one is hours because a rank's checkpoint writes and grading are
    waited for inside collectives."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming a size below 1 or a timeout that is not > 0."""
        timeout = self.distributed_timeout_minutes
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"distributed_timeout_minutes={timeout!r} must be > 0 (minutes)")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp < 1:
            raise ValueError(f"expert_tensor_parallel_size={etp} must be >= 1 or null (the TP size)")

    @property
    def etp_size(self) -> int:
        """The expert TP size: ``expert_tensor_parallel_size``, or TP when None."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless TP × PP divides ``world_size`` (the launched processes), and
        so does ETP × EP × PP (megatron-core's expert grid)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if world_size % (tp * pp) != 0:
            raise ValueError(
                f"tensor_model_parallel_size={tp} × pipeline_model_parallel_size={pp} does not divide "
                f"the world size {world_size}: launch torchrun with --nproc_per_node a multiple of "
                f"{tp * pp}, or change the parallel sizes"
            )
        ep, etp = self.expert_model_parallel_size, self.etp_size
        if world_size % (etp * ep * pp) != 0:
            raise ValueError(
                f"expert_tensor_parallel_size={etp} × expert_model_parallel_size={ep} × "
                f"pipeline_model_parallel_size={pp} = {etp * ep * pp} does not divide the world size {world_size}: "
                f"the EP ranks of a pipeline stage are its DP × TP ranks ({world_size // pp} here); lower EP or ETP"
            )

"""``async_training``: generation on the servers overlapped with training (verl's fully async names).

The config section only; the driver is :mod:`dapo_megatron.rollout.background` over the controller
thread of :mod:`dapo_megatron.rollout.async_rollout`. verl's
``async_training`` section (``verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml``)
names the keys; where verl has a key whose meaning differs from ours it is not taken over:
verl's ``staleness_threshold`` is a fraction of a batch, while the bound here is η in integer
weight versions, the NeMo-RL / AReaL / TRL meaning, and it is ``buffer.max_staleness`` (the
bound that synchronous mode already applies to carried work). The loader rejects
``async_training.staleness_threshold`` with a pointer to it (``config.loader.MOVED_KEYS``), and
verl's ``async_training.partial_rollout`` with a pointer to ``rollout.partial_rollout``, the one key
of partial rollouts in every mode.

Design: docs/design.md §2.3 (the rollout rooms).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AsyncTrainingConfig:
    """Asynchronous rollout on separate servers (``rollout.mode: server``; no Ray).

    Trainer rank 0 runs a rollout controller in a thread that speaks HTTP only to the servers
    and keeps them generating while the torchrun world trains; each step takes the oldest
    ``buffer.train_batch_size`` kept groups. The staleness bound η is ``buffer.max_staleness``;
    whether a weight sync interrupts the rows in flight is ``rollout.partial_rollout`` (true here
    by default).
    """

    enable: bool = False
    """run the rollout asynchronously to training (needs ``rollout.mode: server``); false: the
    synchronous loop, generation then training in every step."""
    trigger_parameter_sync_step: int = 1
    """push the actor's weights into the servers every this many training steps (verl's name),
    >= 1 and <= ``buffer.max_staleness + 1``: the servers' weights are at most that many steps
    behind, and a group may be at most η versions behind the actor that trains on it."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field."""
        k = self.trigger_parameter_sync_step
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"trigger_parameter_sync_step={k!r} must be an int >= 1")
        if not isinstance(self.enable, bool):
            raise ValueError(f"enable={self.enable!r} must be true or false")

"""dapo-megatron: DAPO reinforcement learning on a Megatron-core actor.

Layout (see README.md): ``algorithms/`` (loss, advantages, overlong shaping),
``rewards/`` (math graders), ``rollout/`` (engines, buffer), ``bridge/``
(Megatron <-> HF weights), ``actor/`` (logprobs, forward/backward),
``models/`` (HF config -> Megatron GPTModel), ``platform/`` (devices,
process groups, CPU compatibility), ``data/`` (prompt datasets), ``trainer.py``.

Design: docs/design.md §1 (one training step).
"""

__version__ = "0.1.0"

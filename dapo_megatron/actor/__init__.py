"""Megatron actor: vocab-parallel logprobs/entropy, micro-batch packing, DAPO policy updates.

Nothing here serves the weight sync to the rollout engine: :mod:`dapo_megatron.bridge`
reads ``MegatronActor.model_chunks`` for that.

Design: docs/design.md §1 steps 5-6 (old logprobs, updates).
"""

from .actor import ActorConfig, MegatronActor, OptimConfig, TrainOutput
from .logprobs import vocab_parallel_entropy, vocab_parallel_logprobs, vocab_parallel_logprobs_and_entropy
from .packing import PackedBatch, group_by_length, pack_samples, split_by_token_budget
from .plan import ActorPlan, OldLogprobPlan, resolve_actor_plan, resolve_old_logprob_plan

__all__ = [
    "ActorConfig",
    "ActorPlan",
    "MegatronActor",
    "OldLogprobPlan",
    "OptimConfig",
    "PackedBatch",
    "group_by_length",
    "pack_samples",
    "resolve_actor_plan",
    "resolve_old_logprob_plan",
    "split_by_token_budget",
    "TrainOutput",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
    "vocab_parallel_logprobs_and_entropy",
]

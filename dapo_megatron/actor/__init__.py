"""Megatron actor: vocab-parallel logprobs/entropy, the step's DP split into micro-batches
(:mod:`.dp_split`, :mod:`.step_plan`), micro-batch packing, DAPO policy updates.

Nothing here serves the weight sync to the rollout engine: :mod:`dapo_megatron.bridge`
reads ``MegatronActor.model_chunks`` for that.

The names below load their submodule on first use (PEP 562), so that loading a config (which
reads the torch-free :mod:`.config`) does not load torch and megatron-core through :mod:`.actor`.

Design: docs/design.md §1 steps 5-6 (old logprobs, updates).
"""

from __future__ import annotations

from dapo_megatron.lazy import lazy_exports

# public name -> its submodule
_EXPORTS = {
    "ActorConfig": "config",
    "MegatronActor": "actor",
    "OptimConfig": "config",
    "TrainOutput": "actor",
    "vocab_parallel_entropy": "logprobs",
    "vocab_parallel_logprobs": "logprobs",
    "vocab_parallel_logprobs_and_entropy": "logprobs",
    "PackedBatch": "packing",
    "group_by_length": "packing",
    "pack_samples": "packing",
    "split_by_token_budget": "packing",
    "ActorPlan": "plan",
    "OldLogprobPlan": "plan",
    "resolve_actor_plan": "plan",
    "resolve_old_logprob_plan": "plan",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

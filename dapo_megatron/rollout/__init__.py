"""Rollout: engines and their weight transports (:mod:`.engines`), dynamic sampling
(:mod:`.sampling`) and the step's data plan (:mod:`.plan`); :mod:`.types` (Sample, Group) and
:mod:`.config` (RolloutConfig) are shared by all three. Rooms: docs/design.md, "The rollout rooms".

``sglang`` itself is imported only when an SGLang engine is constructed.
"""

from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engines.buckets import bucket_metadata, iter_buckets
from dapo_megatron.rollout.engines.engine import (
    Completion,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    completions_to_group,
)
from dapo_megatron.rollout.engines.hf_engine import HFEngine
from dapo_megatron.rollout.engines.sglang_engine import SGLangEngine, SGLangServerEngine
from dapo_megatron.rollout.plan.dp_split import padding_stats, split_for_dp
from dapo_megatron.rollout.sampling.buffer import BufferConfig, RolloutBuffer, logprob_mismatch_metrics
from dapo_megatron.rollout.types import Group, Sample

__all__ = [
    "BufferConfig",
    "Completion",
    "GenerationOutput",
    "Group",
    "HFEngine",
    "RolloutBuffer",
    "RolloutConfig",
    "RolloutEngine",
    "SGLangEngine",
    "SGLangServerEngine",
    "Sample",
    "SamplingParams",
    "bucket_metadata",
    "completions_to_group",
    "iter_buckets",
    "logprob_mismatch_metrics",
    "padding_stats",
    "split_for_dp",
]

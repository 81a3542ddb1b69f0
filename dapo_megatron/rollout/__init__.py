"""Rollout: engines (transformers on CPU, SGLang on GPU), sampling params, weight-sync
buckets, the dynamic-sampling buffer and the DP split of a training batch.

``sglang`` itself is imported only when an SGLang engine is constructed.
"""

from dapo_megatron.rollout.buckets import bucket_metadata, iter_buckets
from dapo_megatron.rollout.buffer import BufferConfig, RolloutBuffer, logprob_mismatch_metrics
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.dp_split import padding_stats, split_for_dp
from dapo_megatron.rollout.engine import (
    Completion,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    completions_to_group,
)
from dapo_megatron.rollout.hf_engine import HFEngine
from dapo_megatron.rollout.sglang_engine import SGLangEngine, SGLangServerEngine
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

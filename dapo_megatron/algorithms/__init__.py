"""DAPO algorithm core, pure torch: policy loss, group advantages, overlong shaping.

The equations: docs/design.md §3 and arXiv 2503.14476. No engine, process-group or CUDA
dependency; callers pass the mini-batch-global token count for ``token-mean``.
"""

from dapo_megatron.algorithms.advantages import AlgorithmConfig, compute_group_advantages
from dapo_megatron.algorithms.overlong import OverlongConfig, overlong_filter_mask, soft_overlong_penalty
from dapo_megatron.algorithms.policy_loss import LOSS_AGG_MODES, agg_loss, compute_policy_loss

__all__ = [
    "AlgorithmConfig",
    "LOSS_AGG_MODES",
    "OverlongConfig",
    "agg_loss",
    "compute_group_advantages",
    "compute_policy_loss",
    "overlong_filter_mask",
    "soft_overlong_penalty",
]

"""DAPO algorithm core, pure torch: policy loss, group advantages, overlong shaping.

The equations: docs/design.md §3 and arXiv 2503.14476. No engine, process-group or CUDA
dependency; callers pass the mini-batch-global token count for ``token-mean``. The config
sections and the names they check (:mod:`.config`) import no torch; the names below load their
submodule on first use (PEP 562), so that loading a config does not load torch.
"""

from __future__ import annotations

from dapo_megatron.lazy import lazy_exports

# public name -> its submodule
_EXPORTS = {
    "AlgorithmConfig": "config",
    "LOSS_AGG_MODES": "config",
    "OverlongConfig": "config",
    "compute_group_advantages": "advantages",
    "overlong_filter_mask": "overlong",
    "overlong_penalty": "overlong",
    "soft_overlong_penalty": "overlong",
    "agg_loss": "policy_loss",
    "compute_policy_loss": "policy_loss",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

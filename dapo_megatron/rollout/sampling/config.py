"""The dynamic-sampling config section, :class:`BufferConfig`, without torch.

What a step keeps (the DAPO keep rule and its cap, :mod:`.buffer`), the overlong shaping's
settings and GRESO prompt skipping's (:mod:`.prompt_skip`): loading and validating a config
reads this module only, so a config check never loads torch (tests/unit/config/test_torch_free.py).

Design: docs/design.md §3.3 (dynamic sampling).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_megatron.algorithms.config import OverlongConfig
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig

FILTER_METRICS = ("acc", "score", "reward")
ON_CAP = ("error", "train_on_kept")
KEPT = "kept"
"""What ``GroupSelector.offer`` answers for a group it keeps."""
DROP_REASONS = ("all_correct", "all_wrong", "other")
"""Why a group is dropped (its ``filter_metric`` is constant): every response correct, every one
wrong, or otherwise constant (e.g. equal shaped rewards of mixed accuracy); logged as
``rollout/dropped_<reason>``."""


@dataclass
class BufferConfig:
    """Dynamic-sampling settings (verl ``data`` / ``actor_rollout_ref.rollout`` / ``algorithm.filter_groups``
    names where they exist)."""

    train_batch_size: int = 512
    """N, prompt groups per training step (verl ``data.train_batch_size``)."""
    n: int = 16
    """G, responses per prompt (verl ``rollout.n``); >= 2 when ``filter_groups`` (a single response
    can never have mixed accuracy)."""
    gen_batch_size: int = 512
    """prompts per generation batch (verl ``data.gen_batch_size``); a ``generate_batch()`` call may
    return at most this many groups."""
    max_num_gen_batches: int = 10
    """cap on generation batches per step, >= 1 (verl's 0 = "unlimited" is NOT accepted: with too
    hard or too easy data it loops forever)."""
    filter_groups: bool = True
    """dynamic sampling on (verl ``algorithm.filter_groups.enable``); off keeps every group (GRPO
    ablation)."""
    filter_metric: str = "acc"
    """``"acc"`` (raw accuracy, default and recommended), ``"score"`` (grader score before shaping)
    or ``"reward"`` (shaped reward)."""
    on_cap: str = "error"
    """``"error"`` or ``"train_on_kept"`` (see :mod:`.buffer`)."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """soft overlong punishment settings (``max_response_length`` should be the rollout
    ``max_new_tokens``)."""
    overlong_filter: bool = False
    """mask truncated responses (finish_reason "length") out of the loss: sets
    ``Sample.loss_mask_zero`` (they still count for their group's advantage statistics)."""
    prompt_skip: PromptSkipConfig = field(default_factory=PromptSkipConfig)
    """GRESO prompt skipping before rollout (``rollout/sampling/prompt_skip.py``), in every mode."""
    max_staleness: int = 1
    """carried work (surplus groups, partial rollouts) whose oldest token was sampled more than
    this many weight versions before the actor that would train on it is dropped and counted
    (``rollout/dropped_stale``). 1: the surplus of the previous step is used (corrected by
    ``actor.rollout_is``), older is not; 0: nothing is carried (verl's policy: surplus discarded)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field (``overlong`` validates itself)."""
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness!r} must be an int >= 0 (0: carry nothing)")
        for name in ("train_batch_size", "n", "gen_batch_size", "max_num_gen_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                hint = " (0 = unlimited is not supported: it can loop forever)" if name == "max_num_gen_batches" else ""
                raise ValueError(f"{name}={v!r} must be an int >= 1{hint}")
        if self.filter_groups and self.n < 2:
            raise ValueError(f"n={self.n}: dynamic sampling (filter_groups) needs n >= 2 responses "
                             "per prompt, else every group has constant accuracy and is dropped")
        if self.filter_metric not in FILTER_METRICS:
            raise ValueError(f"filter_metric={self.filter_metric!r} must be one of {FILTER_METRICS}")
        if self.on_cap not in ON_CAP:
            raise ValueError(f"on_cap={self.on_cap!r} must be one of {ON_CAP}")
        if not isinstance(self.overlong, OverlongConfig):
            raise ValueError("overlong must be a dapo_megatron.algorithms.OverlongConfig")

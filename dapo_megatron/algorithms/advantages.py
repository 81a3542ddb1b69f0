"""Group-relative advantages (GRPO / DAPO outcome supervision).

``A_i = (R_i - mean(R_group)) / (std(R_group) + eps)`` (DAPO, arXiv 2503.14476,
Eq. 9; verl ``compute_grpo_outcome_advantage``), one scalar per response; the
caller broadcasts it over the response tokens.

Numerics: the mean and the deviations are computed in float64 in two passes
(never ``E[x^2] - E[x]^2``, which cancels catastrophically in fp32 and turns a
near-constant group into a blow-up), the std is the unbiased sample std like
``torch.std``, and a group whose scores are all bitwise equal gets exactly 0.

Design: docs/design.md §3.1 (objective, ratio and advantage).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import AlgorithmConfig  # noqa: F401  (its home until the config went torch-free)


def _group_ids(group_index, batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map any group labels to contiguous int64 ids ``[batch]`` and the group count."""
    if isinstance(group_index, torch.Tensor):
        if group_index.ndim != 1 or group_index.shape[0] != batch:
            raise ValueError(
                f"group_index must have shape [batch]=[{batch}], got {tuple(group_index.shape)}"
            )
        if group_index.is_floating_point() or group_index.is_complex():
            raise ValueError("group_index must hold integer group labels (e.g. the prompt index), not floats")
        uniq, ids = torch.unique(group_index, return_inverse=True)
        return ids.to(device=device, dtype=torch.long), int(uniq.numel())
    if isinstance(group_index, (str, bytes)):
        raise TypeError("group_index must be a tensor or a sequence of hashable group labels, not a string")
    labels = list(group_index)
    if len(labels) != batch:
        raise ValueError(f"group_index has {len(labels)} labels but scores has batch {batch}")
    table: dict = {}
    ids = [table.setdefault(label, len(table)) for label in labels]
    return torch.tensor(ids, dtype=torch.long, device=device), len(table)


def compute_group_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor | Sequence,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantage of each response.

    Args:
        scores: float ``[batch]`` scalar reward per response (e.g. +1/-1 accuracy
            reward plus the overlong penalty).
        group_index: ``[batch]`` group label of each response (responses to the same
            prompt share a label): an integer tensor, or any sequence of hashable
            labels (verl passes ``uid`` strings). Groups need not be contiguous.
        norm_by_std: divide by ``std + eps`` (GRPO/DAPO). ``False`` gives
            ``R - mean`` (Dr. GRPO).
        eps: added to the std, > 0.

    Returns:
        ``[batch]`` advantages, float32 (float64 if ``scores`` is float64), on
        ``scores.device``. A group of one response, or a group whose scores are all
        equal, gets exactly 0. With the unbiased std, ``|A| <= (n - 1) / sqrt(n)``
        for a group of size ``n``, whatever the spread of the scores.

    Raises:
        ValueError: wrong shapes, non-finite scores, ``eps <= 0``.
    """
    if not isinstance(scores, torch.Tensor) or scores.ndim != 1:
        raise ValueError(
            "scores must be a 1-D tensor [batch] of per-response rewards; got "
            f"{tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__}"
        )
    if not eps > 0:
        raise ValueError(f"eps={eps} must be > 0")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores contain NaN or inf; fix the reward before computing advantages")
    batch = scores.shape[0]
    out_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    if batch == 0:
        return torch.zeros(0, dtype=out_dtype, device=scores.device)

    ids, num_groups = _group_ids(group_index, batch, scores.device)
    x = scores.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=x.device).index_add_(0, ids, torch.ones_like(x))
    mean = torch.zeros_like(count).index_add_(0, ids, x) / count
    gmax = torch.full_like(count, -float("inf")).scatter_reduce_(0, ids, x, reduce="amax")
    gmin = torch.full_like(count, float("inf")).scatter_reduce_(0, ids, x, reduce="amin")
    constant = (gmax == gmin)[ids]
    dev = torch.where(constant, torch.zeros_like(x), x - mean[ids])
    if not norm_by_std:
        return dev.to(out_dtype)
    sq = torch.zeros_like(count).index_add_(0, ids, dev * dev)
    std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
    return (dev / (std[ids] + eps)).to(out_dtype)

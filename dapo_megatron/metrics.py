"""Validation metrics: avg@k and pass@k, overall and per ``data_source``.

* avg@k: mean accuracy over k samples per prompt, averaged over prompts (DAPO
  reports AIME 2024 avg@32). With ``n >= k`` samples the mean over all ``n`` is
  the unbiased estimate of the mean of ``k`` of them, so avg@k uses every sample.
* pass@k: probability that at least one of ``k`` samples drawn without
  replacement from the ``n`` generated is correct, estimated without bias by
  ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language
  Models Trained on Code", Eq. 1), evaluated as the numerically stable product
  ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` from the paper's reference code.

Design: docs/design.md §1 step 8 (validation avg@k / pass@k).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt (Chen et al. 2021, Eq. 1).

    Args:
        n: samples generated for the prompt (>= 1).
        c: correct samples among them (0 <= c <= n).
        k: samples allowed (1 <= k <= n).

    Returns:
        float in [0, 1]: ``1 - C(n-c, k) / C(n, k)``.

    Raises:
        ValueError: counts out of range.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if int(v) != v:
            raise ValueError(f"pass_at_k: {name} must be an integer count, got {v!r}")
    n, c, k = int(n), int(c), int(k)
    if n < 1:
        raise ValueError(f"pass_at_k: n (samples) must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c (correct) must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}], got {k}; generate at least k samples")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def _as_rows(accs: Sequence[Sequence[float]], name: str = "accs") -> list[np.ndarray]:
    rows = [np.asarray(a, dtype=np.float64).reshape(-1) for a in accs]
    if not rows:
        raise ValueError(f"{name} is empty; need accuracies [n_prompts][n_samples]")
    for i, r in enumerate(rows):
        if r.size == 0:
            raise ValueError(f"{name}[{i}] has no samples")
        if not np.all((r >= 0) & (r <= 1)):
            raise ValueError(f"{name}[{i}] has accuracies outside [0, 1]: {r.tolist()}")
    return rows


def avg_at_k(accs: Sequence[Sequence[float]], k: int | None = None) -> float:
    """avg@k: mean over prompts of the mean accuracy of the prompt's samples.

    Args:
        accs: accuracies ``[n_prompts][n_samples]`` in [0, 1] (rows may differ in length).
        k: if given, every prompt must have at least ``k`` samples.

    Returns:
        float in [0, 1].

    Raises:
        ValueError: empty input, values outside [0, 1], or fewer than ``k`` samples.
    """
    rows = _as_rows(accs)
    if k is not None:
        short = [i for i, r in enumerate(rows) if r.size < k]
        if short:
            raise ValueError(f"avg@{k}: prompts {short[:5]} have fewer than {k} samples")
    return float(np.mean([r.mean() for r in rows]))


def _pass_rows(rows: list[np.ndarray], k: int) -> list[float]:
    out = []
    for i, r in enumerate(rows):
        if not np.all((r == 0) | (r == 1)):
            raise ValueError(f"pass@{k}: accs[{i}] must be 0/1 correctness, got {r.tolist()}")
        out.append(pass_at_k(r.size, int(r.sum()), k))
    return out


def compute_val_metrics(
    data_sources: Sequence[str], accs: Sequence[Sequence[float]], k: int
) -> dict[str, float]:
    """avg@k and pass@k over all prompts and per data source.

    Args:
        data_sources: ``[n_prompts]`` data_source of each prompt.
        accs: 0/1 correctness ``[n_prompts][n_samples]``, ``n_samples >= k``.
        k: samples per prompt the metrics refer to.

    Returns:
        ``{"val/avg@k", "val/pass@k", "val/num_prompts", "val/<source>/avg@k",
        "val/<source>/pass@k", "val/<source>/num_prompts"}``. Overall values
        average over prompts (not over sources).

    Raises:
        ValueError: length mismatch, non-0/1 values, or fewer than k samples.
    """
    if len(data_sources) != len(accs):
        raise ValueError(
            f"compute_val_metrics: {len(data_sources)} data_sources but {len(accs)} rows of accs"
        )
    rows = _as_rows(accs)
    short = [i for i, r in enumerate(rows) if r.size < k]
    if short:
        raise ValueError(f"compute_val_metrics: prompts {short[:5]} have fewer than k={k} samples")
    passes = _pass_rows(rows, k)
    means = [float(r.mean()) for r in rows]
    out = {
        f"val/avg@{k}": float(np.mean(means)),
        f"val/pass@{k}": float(np.mean(passes)),
        "val/num_prompts": float(len(rows)),
    }
    groups: dict[str, list[int]] = defaultdict(list)
    for i, src in enumerate(data_sources):
        groups[str(src)].append(i)
    for src, idx in sorted(groups.items()):
        out[f"val/{src}/avg@{k}"] = float(np.mean([means[i] for i in idx]))
        out[f"val/{src}/pass@{k}"] = float(np.mean([passes[i] for i in idx]))
        out[f"val/{src}/num_prompts"] = float(len(idx))
    return out

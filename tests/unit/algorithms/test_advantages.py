"""Group-relative advantages: stability on near-constant groups (docs/design.md §3.1)."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.algorithms import compute_group_advantages


def _reference(scores, groups, norm_by_std=True, eps=1e-6):
    """Independent per-group reference with Python's statistics module (exact-ish float math)."""
    out = []
    for s, g in zip(scores, groups):
        members = [x for x, h in zip(scores, groups) if h == g]
        if len(members) == 1 or len(set(members)) == 1:
            out.append(0.0)
            continue
        mean = statistics.fmean(members)
        if not norm_by_std:
            out.append(s - mean)
        else:
            out.append((s - mean) / (statistics.stdev(members) + eps))
    return out


def test_seven_equal_and_one_different_is_bounded():
    scores = torch.tensor([0.35] * 7 + [0.4], dtype=torch.float32)
    adv = compute_group_advantages(scores, torch.zeros(8, dtype=torch.long))
    assert adv.abs().max().item() <= 3.0
    # exact values: dev = (-1/160) x7 and 7/160, unbiased std = sqrt(sum dev^2 / 7)
    std = math.sqrt((7 * (0.05 / 8) ** 2 + (0.35 / 8) ** 2) / 7)
    assert adv[-1].item() == pytest.approx((0.35 / 8) / (std + 1e-6), rel=1e-4)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("value", [0.35, 0.1, -1.0, 1.0, 1e-3, 12345.678])
def test_constant_group_is_exactly_zero(value):
    scores = torch.full((7,), value, dtype=torch.float32)
    adv = compute_group_advantages(scores, [0] * 7)
    assert torch.equal(adv, torch.zeros(7))
    assert torch.equal(compute_group_advantages(scores, [0] * 7, norm_by_std=False), torch.zeros(7))


def test_group_of_one_is_zero_and_groups_are_independent():
    scores = torch.tensor([1.0, -1.0, 1.0, 5.0, 1.0, -1.0])
    groups = ["b", "a", "a", "solo", "b", "b"]  # verl-style uid strings, interleaved
    adv = compute_group_advantages(scores, groups)
    assert adv[3].item() == 0.0
    torch.testing.assert_close(adv, torch.tensor(_reference(scores.tolist(), groups), dtype=torch.float32))
    # group "a" = {-1, 1}: mean 0, stdev sqrt(2)
    assert adv[1].item() == pytest.approx(-1 / (math.sqrt(2) + 1e-6))


def test_integer_tensor_labels_and_dtypes():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    adv = compute_group_advantages(scores, torch.tensor([10, 10, 3, 3]))
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, torch.tensor(_reference([1, 0, 0, 1], [10, 10, 3, 3]), dtype=torch.float64))
    assert compute_group_advantages(scores.float(), [0, 0, 1, 1]).dtype == torch.float32
    assert compute_group_advantages(torch.zeros(0), []).shape == (0,)


@pytest.mark.parametrize(
    "scores,groups,kwargs,match",
    [
        (torch.ones(2, 2), [0, 0], {}, "scores"),
        (torch.ones(3), [0, 0], {}, "group_index"),
        (torch.ones(3), torch.tensor([0.0, 0.0, 1.0]), {}, "group_index"),
        (torch.tensor([1.0, float("nan")]), [0, 0], {}, "NaN"),
        (torch.ones(2), [0, 0], {"eps": 0.0}, "eps"),
    ],
)
def test_bad_input_raises(scores, groups, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_group_advantages(scores, groups, **kwargs)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([-1.0, 1.0, 0.35, 0.4, 0.1, 0.7, -0.25, 1e-4])),
        min_size=1,
        max_size=24,
    ),
    st.booleans(),
)
def test_matches_reference_and_is_bounded(pairs, norm_by_std):
    groups = [g for g, _ in pairs]
    # shaped rewards: accuracy reward plus a small length penalty, as in DAPO
    scores = [s for _, s in pairs]
    adv = compute_group_advantages(torch.tensor(scores, dtype=torch.float32), groups, norm_by_std=norm_by_std)
    ref = _reference([float(torch.tensor(s, dtype=torch.float32)) for s in scores], groups, norm_by_std)
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float32), rtol=1e-5, atol=1e-5)
    if norm_by_std:
        for g in set(groups):
            n = groups.count(g)
            bound = (n - 1) / math.sqrt(n) + 1e-4
            assert all(abs(a) <= bound for a, h in zip(adv.tolist(), groups) if h == g)

"""avg@k / pass@k against brute-force enumeration of k-subsets."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.metrics import avg_at_k, compute_val_metrics, pass_at_k


def brute_pass_at_k(correct: list[int], k: int) -> float:
    """Fraction of all k-subsets of the samples that contain a correct one."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_pass_at_k_equals_subset_enumeration(data):
    n = data.draw(st.integers(1, 12))
    correct = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    k = data.draw(st.integers(1, n))
    assert pass_at_k(n, sum(correct), k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)


def test_pass_at_k_edges():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # n - c < k: every 5-subset has a correct sample
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    # large n stays finite and matches the closed form 1 - C(n-c,k)/C(n,k)
    from math import comb

    assert pass_at_k(1000, 3, 100) == pytest.approx(1 - comb(997, 100) / comb(1000, 100), rel=1e-12)
    for bad in [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (4.5, 2, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_avg_at_k():
    accs = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert avg_at_k(accs) == pytest.approx((0.25 + 0.5 + 0.0) / 3)
    # ragged rows: mean per prompt, then over prompts
    assert avg_at_k([[1], [0, 1, 1]]) == pytest.approx((1 + 2 / 3) / 2)
    # avg@k with more samples than k equals the mean over all k-subsets' means
    row = [1, 0, 1, 1, 0]
    subs = list(itertools.combinations(row, 3))
    assert avg_at_k([row], k=3) == pytest.approx(sum(sum(s) / 3 for s in subs) / len(subs))
    with pytest.raises(ValueError, match="fewer than 8"):
        avg_at_k([[1, 0]], k=8)
    with pytest.raises(ValueError, match="outside"):
        avg_at_k([[1.5]])
    with pytest.raises(ValueError, match="empty"):
        avg_at_k([])


def test_compute_val_metrics_overall_and_per_source():
    rng = random.Random(0)
    sources = ["aime"] * 3 + ["gsm8k"] * 5
    accs = [[rng.randint(0, 1) for _ in range(6)] for _ in sources]
    k = 4
    m = compute_val_metrics(sources, accs, k)

    def brute(idx):
        return (
            sum(sum(accs[i]) / 6 for i in idx) / len(idx),
            sum(brute_pass_at_k(accs[i], k) for i in idx) / len(idx),
        )

    avg_all, pass_all = brute(range(8))
    assert m["val/avg@4"] == pytest.approx(avg_all)
    assert m["val/pass@4"] == pytest.approx(pass_all)
    assert m["val/num_prompts"] == 8
    for src, idx in (("aime", range(3)), ("gsm8k", range(3, 8))):
        a, p = brute(idx)
        assert m[f"val/{src}/avg@4"] == pytest.approx(a)
        assert m[f"val/{src}/pass@4"] == pytest.approx(p)
        assert m[f"val/{src}/num_prompts"] == len(idx)
    assert len(m) == 9


def test_compute_val_metrics_errors():
    with pytest.raises(ValueError, match="2 data_sources but 1"):
        compute_val_metrics(["a", "b"], [[1, 0]], 1)
    with pytest.raises(ValueError, match="0/1"):
        compute_val_metrics(["a"], [[0.5, 1]], 1)
    with pytest.raises(ValueError, match="fewer than k=3"):
        compute_val_metrics(["a"], [[1, 0]], 3)

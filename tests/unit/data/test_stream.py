"""PromptStream (DALI CPU pipeline): DP sharding, per-epoch reshuffle, exact resume.

The tests that read batches need DALI and skip without it; argument checks, the epoch
permutation and the missing-install error run everywhere."""

import importlib.util
import sys

import numpy as np
import pytest

from dapo_megatron.data.dataset import PromptRecord
from dapo_megatron.data.stream import PromptStream, epoch_permutation


def _have_dali() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no `nvidia` namespace package at all
        return False


needs_dali = pytest.mark.skipif(not _have_dali(), reason="NVIDIA DALI (nvidia-dali-cuda130) is not installed")


def make_dataset(n):
    return [PromptRecord(i, "toy", [1, 2, i], [{"role": "user", "content": str(i)}], str(i), {}) for i in range(n)]


def take(stream, steps):
    return [[r.index for r in stream.next_batch()] for _ in range(steps)]


@needs_dali
def test_shards_disjoint_and_cover_each_epoch():
    n, bs, dp = 50, 4, 3  # global batch 12: 4 steps per epoch, 2 prompts unused
    ds = make_dataset(n)
    streams = [PromptStream(ds, bs, r, dp, seed=5) for r in range(dp)]
    assert streams[0].steps_per_epoch == 4
    for epoch in range(3):
        seen = []
        for _ in range(4):
            batches = [[r.index for r in s.next_batch()] for s in streams]
            assert all(len(b) == bs for b in batches)
            flat = sum(batches, [])
            assert len(set(flat)) == len(flat)  # ranks disjoint within a step
            seen += flat
        assert len(set(seen)) == len(seen) == 48  # disjoint across the epoch
        assert all(s.epoch == epoch + 1 for s in streams)
        # the epoch's prompts are the first 48 of that epoch's permutation
        assert seen == epoch_permutation(n, 5, epoch)[:48].tolist()


@needs_dali
def test_global_batch_independent_of_dp_size():
    ds = make_dataset(40)
    single = PromptStream(ds, 8, 0, 1, seed=3)
    pair = [PromptStream(ds, 4, r, 2, seed=3) for r in range(2)]
    for _ in range(12):  # crosses two epoch boundaries
        assert [r.index for r in single.next_batch()] == sum(([r.index for r in s.next_batch()] for s in pair), [])


@needs_dali
def test_reshuffled_each_epoch_and_reproducible():
    ds = make_dataset(30)
    a = take(PromptStream(ds, 10, seed=11), 9)  # 3 epochs
    b = take(PromptStream(ds, 10, seed=11), 9)
    c = take(PromptStream(ds, 10, seed=12), 9)
    assert a == b and a != c
    epochs = [sum(a[3 * e : 3 * e + 3], []) for e in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(30))  # every prompt once per epoch
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]


@needs_dali
def test_no_shuffle_keeps_file_order():
    out = take(PromptStream(make_dataset(9), 3, shuffle=False), 4)
    assert out == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]


@needs_dali
def test_drop_last_false_wraps_and_balances_ranks():
    n, bs, dp = 10, 2, 2  # 3 steps of 4: the last pads with 2 prompts from the epoch start
    ds = make_dataset(n)
    streams = [PromptStream(ds, bs, r, dp, seed=1, drop_last=False) for r in range(dp)]
    assert streams[0].steps_per_epoch == 3
    seen = []
    for _ in range(3):
        for s in streams:
            seen += [r.index for r in s.next_batch()]
    perm = epoch_permutation(n, 1, 0).tolist()
    assert seen == perm + perm[:2]
    assert set(seen) == set(range(n))


@needs_dali
@pytest.mark.parametrize("stop", [1, 5, 6, 7, 13])  # mid-epoch, at the epoch boundary, next epoch
def test_exact_resume_mid_epoch(stop):
    ds = make_dataset(37)
    for rank in range(2):
        ref = PromptStream(ds, 3, rank, 2, seed=9)
        full = take(ref, 16)  # 6 steps per epoch
        first = PromptStream(ds, 3, rank, 2, seed=9)
        head = take(first, stop)
        state = first.state_dict()
        assert state["epoch"] == stop // 6 and state["offset"] == stop % 6
        resumed = PromptStream(ds, 3, rank, 2, seed=9)
        resumed.load_state_dict(dict(state))
        tail = take(resumed, 16 - stop)
        assert head + tail == full


@needs_dali
def test_resume_with_different_dp_size_same_global_batch():
    ds = make_dataset(40)
    one = PromptStream(ds, 8, 0, 1, seed=2)
    take(one, 3)
    state = one.state_dict()
    ref = take(one, 4)
    pair = [PromptStream(ds, 4, r, 2, seed=2) for r in range(2)]
    for s in pair:
        s.load_state_dict(state)
    got = [sum(([r.index for r in s.next_batch()] for s in pair), []) for _ in range(4)]
    assert got == ref


def test_bad_arguments_and_state():
    ds = make_dataset(10)
    with pytest.raises(ValueError, match="batch_size"):
        PromptStream(ds, 0)
    with pytest.raises(ValueError, match="dp_rank"):
        PromptStream(ds, 2, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="one global batch of 12"):
        PromptStream(ds, 6, 0, 2)
    s = PromptStream(ds, 2, seed=0)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict({**s.state_dict(), "seed": 1})
    with pytest.raises(ValueError, match="out of range"):
        s.load_state_dict({"epoch": 0, "offset": 5})
    with pytest.raises(ValueError, match="missing 'offset'"):
        s.load_state_dict({"epoch": 0})


def test_epoch_permutation_properties():
    p0, p1 = epoch_permutation(100, 0, 0), epoch_permutation(100, 0, 1)
    assert p0.dtype == np.int64 and sorted(p0.tolist()) == list(range(100))
    assert not np.array_equal(p0, p1)
    assert np.array_equal(p0, epoch_permutation(100, 0, 0))


def test_missing_dali_gives_install_hint(monkeypatch):
    """Runs with or without DALI installed: a None entry in sys.modules makes every
    `import nvidia.dali` fail, even after DALI was imported by the tests above."""
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    s = PromptStream(make_dataset(4), 2)
    with pytest.raises(ImportError, match="pip install nvidia-dali-cuda130"):
        s.next_batch()

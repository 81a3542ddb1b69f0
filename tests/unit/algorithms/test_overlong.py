"""Soft overlong punishment (DAPO Eq. 13), overlong filtering mask and OverlongConfig."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dapo_megatron.algorithms import OverlongConfig, overlong_filter_mask, overlong_penalty, soft_overlong_penalty

L_MAX, L_CACHE = 20480, 4096  # paper settings: 16,384 expected + 4,096 soft window


def _eq13(length, l_max, l_cache):
    """Paper Eq. 13 written out case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_boundaries_match_eq13():
    lengths = torch.tensor([0, 1, 16384, 16385, 18432, 20479, 20480, 20481, 100000])
    pen = soft_overlong_penalty(lengths, max_response_length=L_MAX, overlong_buffer_len=L_CACHE)
    expected = [0.0, 0.0, 0.0, -1 / 4096, -0.5, -4095 / 4096, -1.0, -1.0, -1.0]
    torch.testing.assert_close(pen, torch.tensor(expected), rtol=0, atol=1e-7)
    assert pen.dtype == torch.float32
    assert not torch.signbit(pen[:3]).any()  # exactly +0.0 before the window


def test_penalty_factor_scales_and_floors():
    lengths = torch.tensor([12, 13, 14, 16, 17, 1000])
    pen = soft_overlong_penalty(lengths, max_response_length=16, overlong_buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.125, -0.25, -0.5, -0.5, -0.5]))


@given(st.integers(1, 64), st.integers(1, 64), st.lists(st.integers(0, 200), min_size=1, max_size=16))
def test_matches_eq13_everywhere(l_max, l_cache, lengths):
    if l_cache > l_max:
        l_max, l_cache = l_cache, l_max
    pen = soft_overlong_penalty(torch.tensor(lengths), max_response_length=l_max, overlong_buffer_len=l_cache)
    expected = torch.tensor([_eq13(n, l_max, l_cache) for n in lengths], dtype=torch.float32)
    torch.testing.assert_close(pen, expected, rtol=0, atol=1e-6)
    assert pen.min().item() >= -1.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_response_length=16, overlong_buffer_len=32), "overlong_buffer_len"),
        (dict(max_response_length=0, overlong_buffer_len=0), "max_response_length"),
        (dict(max_response_length=16, overlong_buffer_len=0), "overlong_buffer_len"),
        (dict(max_response_length=16, overlong_buffer_len=4, penalty_factor=-1.0), "penalty_factor"),
    ],
)
def test_invalid_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        soft_overlong_penalty(torch.tensor([1]), **kwargs)


def test_invalid_lengths_raise():
    with pytest.raises(ValueError, match="negative"):
        soft_overlong_penalty(torch.tensor([-1]), max_response_length=16, overlong_buffer_len=4)
    with pytest.raises(ValueError, match="integer"):
        soft_overlong_penalty(torch.tensor([1.5]), max_response_length=16, overlong_buffer_len=4)


def test_overlong_filter_mask():
    keep = overlong_filter_mask(torch.tensor([True, False, True]))
    assert keep.tolist() == [False, True, False]
    assert overlong_filter_mask(["stop", "length", "eos", "abort"]).tolist() == [True, False, True, True]
    with pytest.raises(ValueError, match=r"finish_reasons\[1\]"):
        overlong_filter_mask(["stop", "timeout"])
    with pytest.raises(ValueError, match="bool"):
        overlong_filter_mask(torch.tensor([1, 0]))


def test_overlong_config():
    cfg = OverlongConfig(enable=True, max_response_length=16, overlong_buffer_len=4, penalty_factor=1.0)
    assert cfg.validate() is None
    torch.testing.assert_close(overlong_penalty(cfg, torch.tensor([12, 14, 20])), torch.tensor([0.0, -0.5, -1.0]))
    off = OverlongConfig(enable=False, max_response_length=16, overlong_buffer_len=4, penalty_factor=1.0)
    assert overlong_penalty(off, torch.tensor([100])).tolist() == [0.0]
    with pytest.raises(ValueError, match="^overlong_buffer_len=16 must be <= max_response_length=8"):
        OverlongConfig(enable=True, max_response_length=8, overlong_buffer_len=16, penalty_factor=1.0).validate()
    with pytest.raises(ValueError, match="^enable='yes' must be a bool"):
        OverlongConfig(enable="yes", max_response_length=8, overlong_buffer_len=4, penalty_factor=1.0).validate()

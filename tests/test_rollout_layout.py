"""The rollout layout (rollout/layout.py): the model's heads against the rollout TP, the deal of
prompts over engines, the ranks of a server weight-update group."""

from types import SimpleNamespace

import pytest

from dapo_megatron.rollout.layout import check_rollout_tp_fits_model, engine_share, server_rank_offsets
from test_examples import QWEN2_5


def _model(heads, kv, ffn):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn)


@pytest.mark.parametrize("name, valid", [
    # Qwen2.5-32B: 40 heads, 8 KV heads, MLP 27648 -> 1, 2, 4, 5, 8, 10 divide 40; 5 and 10 neither divide
    # nor are multiples of the 8 KV heads; 16 does not divide 40
    ("32b", [1, 2, 4, 8]),
    # Qwen2.5-7B: 28 heads, 4 KV heads, MLP 18944 -> 7 and 14 divide 28 but are no multiple of 4 KV heads
    ("7b", [1, 2, 4]),
])
def test_rollout_tp_must_shard_the_heads_as_sglang_does(name, valid):
    hf = _model(QWEN2_5[name]["num_attention_heads"], QWEN2_5[name]["num_key_value_heads"],
                QWEN2_5[name]["intermediate_size"])
    ok = []
    for tp in range(1, 17):
        try:
            check_rollout_tp_fits_model(hf, tp)
            ok.append(tp)
        except ValueError as err:
            assert "rollout.tensor_model_parallel_size" in str(err) and f"Valid sizes up to 16: {valid}" in str(err)
    assert ok == valid


def test_kv_heads_fewer_than_tp_are_replicated_when_tp_is_a_multiple():
    hf = _model(16, 2, 64)  # 2 KV heads: TP 4 and 8 replicate each on 2 / 4 GPUs
    for tp in (1, 2, 4, 8, 16):
        check_rollout_tp_fits_model(hf, tp)
    with pytest.raises(ValueError, match=r"=3 cannot shard.*24 attention heads, 2 KV heads and an MLP of 48.*\[1, 2, 4, 6, 8, 12\]"):
        check_rollout_tp_fits_model(_model(24, 2, 48), 3)  # 3 divides 24 and 48 but is no multiple of 2
    with pytest.raises(ValueError, match="MLP of 100"):
        check_rollout_tp_fits_model(_model(8, 8, 100), 8)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        check_rollout_tp_fits_model(hf, 0)
    check_rollout_tp_fits_model(SimpleNamespace(num_attention_heads=8, intermediate_size=16), 8)  # no GQA field: MHA


@pytest.mark.parametrize("num_items", [0, 1, 7, 32])
@pytest.mark.parametrize("num_engines", [1, 2, 3, 8])
def test_engine_share_deals_every_item_once_and_evenly(num_items, num_engines):
    shares = [engine_share(num_items, num_engines, e) for e in range(num_engines)]
    assert sorted(i for s in shares for i in s) == list(range(num_items))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError):
        engine_share(num_items, num_engines, num_engines)


def test_server_rank_offsets():
    assert server_rank_offsets([2, 4, 1]) == ([1, 3, 7], 8)
    assert server_rank_offsets([1]) == ([1], 2)
    with pytest.raises(ValueError):
        server_rank_offsets([])

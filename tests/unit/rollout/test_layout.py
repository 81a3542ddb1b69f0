"""The rollout layout (rollout/engines/layout.py): the model's heads against the rollout TP, the deal of
prompts over engines, the ranks of a server weight-update group."""

from types import SimpleNamespace

import pytest

from dapo_megatron.rollout.engines.layout import check_rollout_tp_fits_model, engine_share
from dapo_megatron.bridge.servers import server_rank_offsets
from integration.test_examples import QWEN2_5


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


@pytest.mark.parametrize("world, rollout_tp", [(1, 1), (2, 2), (4, 2), (8, 4), (8, 8), (16, 8), (6, 3)])
def test_rollout_groups_are_consecutive_ranks_and_leaders_drive_the_engines(world, rollout_tp):
    from dapo_megatron.platform.parallel_dims import rollout_groups
    from dapo_megatron.rollout.engines.layout import rollout_engines

    groups = rollout_groups(world, min(world, 8), rollout_tp)
    assert [r for g in groups for r in g] == list(range(world)), "every rank in one group, in order"
    assert all(len(g) == rollout_tp and list(g) == list(range(g[0], g[0] + rollout_tp)) for g in groups)
    leaders = {}
    for rank in range(world):
        num_engines, index = rollout_engines(rank, world, rollout_tp=rollout_tp)
        assert num_engines == world // rollout_tp
        if index is not None:
            leaders[index] = rank
    assert leaders == {e: g[0] for e, g in enumerate(groups)}, "engine e is led by the first rank of group e"


@pytest.mark.parametrize("world, actor_tp, actor_pp, rollout_tp", [
    (8, 8, 1, 8), (8, 2, 2, 8), (8, 4, 1, 2), (8, 1, 8, 4), (16, 8, 2, 8), (16, 4, 1, 1), (4, 1, 2, 2),
])
def test_layouts_are_independent_every_prompt_sampled_once(world, actor_tp, actor_pp, rollout_tp):
    """Whatever the actor's TP × PP × DP, the prompts of a batch (every DP rank's, in global
    order) are dealt over the engines: each once, each engine's share within one of the others'."""
    from dapo_megatron.rollout.engines.layout import rollout_engines

    dp = world // (actor_tp * actor_pp)
    batch = 4 * dp  # gen_batch_size prompts, gen_batch_size / DP per DP rank
    sampled = []
    for rank in range(world):
        num_engines, index = rollout_engines(rank, world, rollout_tp=rollout_tp)
        if index is not None:
            sampled.append(engine_share(batch, num_engines, index))
    assert sorted(g for share in sampled for g in share) == list(range(batch))
    assert max(map(len, sampled)) - min(map(len, sampled)) <= 1


def test_server_mode_rank_e_drives_server_e():
    from dapo_megatron.rollout.engines.layout import rollout_engines

    assert [rollout_engines(r, 4, mode="server", num_servers=2) for r in range(4)] == [(2, 0), (2, 1), (2, None),
                                                                                         (2, None)]
    with pytest.raises(ValueError, match=r"rollout.server_urls lists 3 servers; a launch of 2 trainer ranks"):
        rollout_engines(0, 2, mode="server", num_servers=3)
    # async_training: rank 0's controller sends the training rows to all 3; ranks 0, 1 drive servers 0, 1
    # for validation
    assert [rollout_engines(r, 2, mode="server", num_servers=3, one_driver=True) for r in range(2)] == [(2, 0), (2, 1)]
    with pytest.raises(ValueError, match=r"lists 0 servers"):
        rollout_engines(0, 2, mode="server", num_servers=0, one_driver=True)


def test_rollout_tp_must_divide_the_world_and_fit_a_node():
    from dapo_megatron.rollout.engines.layout import check_rollout_layout

    check_rollout_layout(16, 8, 8)
    with pytest.raises(ValueError, match=r"^rollout.tensor_model_parallel_size=4 does not divide the world size 6"):
        check_rollout_layout(6, 4, 6)
    with pytest.raises(ValueError, match=r"^rollout.tensor_model_parallel_size=16 exceeds a node \(8 ranks per node\)"):
        check_rollout_layout(16, 16, 8)
    with pytest.raises(ValueError, match=r"^rollout.tensor_model_parallel_size=4 must divide the ranks per node "
                                         r"\(LOCAL_WORLD_SIZE=6\)"):
        check_rollout_layout(12, 4, 6)
    with pytest.raises(ValueError, match=r"^rollout.tensor_model_parallel_size=0 must be an int >= 1"):
        check_rollout_layout(8, 0)


def test_config_names_the_rollout_field():
    from dapo_megatron.config import ConfigError, DAPOConfig, load_config

    base = ["model.hf_path=/models/x"]
    cfg = load_config(DAPOConfig, None, [*base, "rollout.tensor_model_parallel_size=4"])
    cfg.check_world_size(8, 8)
    with pytest.raises(ConfigError, match=r"^rollout.tensor_model_parallel_size=4 does not divide the world size 2"):
        cfg.check_world_size(2)
    with pytest.raises(ConfigError, match=r"^rollout.tensor_model_parallel_size=4 exceeds a node \(2 ranks"):
        cfg.check_world_size(8, 2)
    for overrides, message in [
        (["rollout.mode=server", "rollout.name=sglang"], "rollout.server_urls is empty: mode='server' needs"),
        (["rollout.mode=server"], "rollout.mode='server' needs name='sglang'"),
        (["rollout.mode=remote"], "rollout.mode='remote' must be 'colocated' or 'server'"),
        (["rollout.server_urls=[http://a:1]"], "rollout.server_urls=['http://a:1'] is set but mode='colocated'"),
        (["rollout.mode=server", "rollout.name=sglang", "rollout.server_urls=[a:1]"],
         "rollout.server_urls=['a:1'] must start with http://"),
        (["rollout.mode=server", "rollout.name=sglang", "rollout.server_urls=[http://a:1]",
          "rollout.tensor_model_parallel_size=2"], "rollout.tensor_model_parallel_size=2 applies to colocated"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(DAPOConfig, None, [*base, *overrides])
        assert str(err.value).startswith(message), (overrides, str(err.value))
    cfg = load_config(DAPOConfig, None, [*base, "rollout.mode=server", "rollout.name=sglang",
                                         "rollout.server_urls=[http://a:1,http://b:2]"])
    cfg.check_world_size(2)
    with pytest.raises(ConfigError, match=r"^rollout.server_urls lists 2 servers; a launch of 1 trainer ranks"):
        cfg.check_world_size(1)

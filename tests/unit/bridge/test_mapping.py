"""The HF ⇄ Megatron mapping table on its own (no processes): layouts built by explicit
loops over heads / rows, compared with what the table produces."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_hf_config
from dapo_megatron.bridge.mapping import (
    ModelLayout,
    canonical_megatron_name,
    expected_hf_names,
    hf_to_megatron_shard,
    match_rule,
    megatron_to_hf,
)


def _layout(name="llama_untied", padded=256, **kw):
    return ModelLayout.from_hf_config(tiny_hf_config(name, **kw), padded_vocab_size=padded)


def _qkv_reference(q, k, v, heads, groups, hd, tp_rank, tp):
    """Megatron per-query-group order, written head by head."""
    hpg = heads // groups
    per_rank = groups // tp
    rows = []
    for g in range(tp_rank * per_rank, (tp_rank + 1) * per_rank):
        for h in range(g * hpg, (g + 1) * hpg):
            rows.append(q[h * hd:(h + 1) * hd])
        rows.append(k[g * hd:(g + 1) * hd])
        rows.append(v[g * hd:(g + 1) * hd])
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_is_interleaved_per_query_group_and_split_on_whole_groups(tp):
    lay = _layout()  # 4 heads, 2 KV groups (GQA), head_dim 16, hidden 64
    hd, H = lay.head_dim, lay.hidden_size
    q = torch.randn(4 * hd, H)
    k = torch.randn(2 * hd, H)
    v = torch.randn(2 * hd, H)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    shards = [hf_to_megatron_shard(lay, name, [q, k, v], r, tp) for r in range(tp)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, _qkv_reference(q, k, v, 4, 2, hd, r, tp))
    # the naive concatenation is NOT Megatron's layout when groups < heads
    assert not torch.equal(torch.cat(shards), torch.cat([q, k, v]))
    back = dict(megatron_to_hf(lay, name, shards))
    assert list(back) == ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                          "model.layers.1.self_attn.v_proj.weight"]
    assert torch.equal(back["model.layers.1.self_attn.q_proj.weight"], q)
    assert torch.equal(back["model.layers.1.self_attn.k_proj.weight"], k)
    assert torch.equal(back["model.layers.1.self_attn.v_proj.weight"], v)


def test_padded_query_groups_are_zero_on_import_and_dropped_on_export():
    # SmolLM2-like: 6 heads in 3 KV groups at TP=2 → Megatron holds 4 groups, the 4th all zero
    lay = ModelLayout.from_hf_config(tiny_hf_config("llama_gqa3"), padded_vocab_size=256, padded_num_query_groups=4)
    hd, H = lay.head_dim, lay.hidden_size
    q, k, v = torch.randn(6 * hd, H), torch.randn(3 * hd, H), torch.randn(3 * hd, H)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    shards = [hf_to_megatron_shard(lay, name, [q, k, v], r, 2) for r in range(2)]
    group_rows = (2 + 2) * hd  # 2 q heads + k + v per group
    assert shards[0].shape == shards[1].shape == (2 * group_rows, H)
    full_reference = _qkv_reference(q, k, v, 6, 3, hd, 0, 1)  # 3 real groups, no TP
    assert torch.equal(torch.cat(shards)[: 3 * group_rows], full_reference)
    assert torch.count_nonzero(shards[1][group_rows:]) == 0
    back = dict(megatron_to_hf(lay, name, shards))
    assert torch.equal(back["model.layers.0.self_attn.k_proj.weight"], k)
    assert torch.equal(back["model.layers.0.self_attn.q_proj.weight"], q)
    o = torch.randn(H, 6 * hd)
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    o_shards = [hf_to_megatron_shard(lay, proj, [o], r, 2) for r in range(2)]
    assert torch.equal(torch.cat(o_shards, dim=1)[:, : 6 * hd], o)
    assert torch.count_nonzero(torch.cat(o_shards, dim=1)[:, 6 * hd:]) == 0
    (_, o_back), = megatron_to_hf(lay, proj, o_shards)
    assert torch.equal(o_back, o)


def test_qkv_bias_follows_the_weight_layout():
    lay = _layout("qwen2_bias")
    hd = lay.head_dim
    q, k, v = torch.randn(4 * hd), torch.randn(2 * hd), torch.randn(2 * hd)
    name = "decoder.layers.0.self_attention.linear_qkv.bias"
    shard1 = hf_to_megatron_shard(lay, name, [q, k, v], 1, 2)
    assert torch.equal(shard1, torch.cat([q[2 * hd:4 * hd], k[hd:], v[hd:]]))


def test_gate_up_are_fused_per_tp_shard():
    lay = _layout()
    F, H = lay.ffn_hidden_size, lay.hidden_size
    gate, up = torch.randn(F, H), torch.randn(F, H)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    s0 = hf_to_megatron_shard(lay, name, [gate, up], 0, 2)
    s1 = hf_to_megatron_shard(lay, name, [gate, up], 1, 2)
    half = F // 2
    assert torch.equal(s0, torch.cat([gate[:half], up[:half]]))
    assert torch.equal(s1, torch.cat([gate[half:], up[half:]]))
    back = dict(megatron_to_hf(lay, name, [s0, s1]))
    assert torch.equal(back["model.layers.0.mlp.gate_proj.weight"], gate)
    assert torch.equal(back["model.layers.0.mlp.up_proj.weight"], up)


def test_row_parallel_splits_the_input_dim():
    lay = _layout()
    w = torch.randn(lay.hidden_size, lay.num_attention_heads * lay.head_dim)
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    s1 = hf_to_megatron_shard(lay, name, [w], 1, 2)
    assert torch.equal(s1, w[:, w.shape[1] // 2:])


def test_vocab_rows_are_padded_with_zeros_on_import_and_trimmed_on_export():
    lay = _layout(padded=256)
    emb = torch.randn(250, lay.hidden_size)
    name = "embedding.word_embeddings.weight"
    s0 = hf_to_megatron_shard(lay, name, [emb], 0, 2)
    s1 = hf_to_megatron_shard(lay, name, [emb], 1, 2)
    assert s0.shape == s1.shape == (128, lay.hidden_size)
    assert torch.equal(s0, emb[:128])
    assert torch.equal(s1[:122], emb[128:]) and torch.count_nonzero(s1[122:]) == 0
    (hf_name, back), = megatron_to_hf(lay, name, [s0, s1 + 1.0 * (torch.arange(128) >= 122)[:, None]])
    assert hf_name == "model.embed_tokens.weight" and back.shape == (250, lay.hidden_size)
    assert torch.equal(back[:128], emb[:128])


def test_names_te_spec_aliases_and_export_order():
    assert canonical_megatron_name("module.module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") \
        == "decoder.layers.3.input_layernorm.weight"
    assert canonical_megatron_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") \
        == "decoder.layers.0.pre_mlp_layernorm.weight"
    tied = expected_hf_names(_layout("llama_tied"))
    untied = expected_hf_names(_layout("llama_untied"))
    assert tied[0] == "model.embed_tokens.weight" and "lm_head.weight" not in tied
    assert untied[-1] == "lm_head.weight" and untied[:-1] == tied
    assert len(tied) == 1 + 2 * 9 + 1
    q3 = expected_hf_names(_layout("qwen3_qknorm"))
    assert "model.layers.1.self_attn.q_norm.weight" in q3 and "model.layers.1.self_attn.k_norm.weight" in q3
    assert "model.layers.0.self_attn.q_proj.bias" in expected_hf_names(_layout("qwen2_bias"))
    assert "model.layers.0.self_attn.q_proj.bias" not in untied


def test_bad_inputs_name_the_tensor():
    lay = _layout()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(8, 64\)"):
        hf_to_megatron_shard(lay, "decoder.layers.0.self_attention.linear_qkv.weight",
                             [torch.zeros(64, 64), torch.zeros(8, 64), torch.zeros(32, 64)])
    with pytest.raises(KeyError, match="linear_qkv.bias"):
        match_rule(lay, "decoder.layers.0.self_attention.linear_qkv.bias")  # llama has no qkv bias
    with pytest.raises(KeyError, match="layer 2"):
        match_rule(lay, "decoder.layers.2.mlp.linear_fc2.weight")
    with pytest.raises(ValueError, match="TP shard 1"):
        megatron_to_hf(lay, "decoder.layers.0.mlp.linear_fc2.weight", [torch.zeros(64, 48), torch.zeros(64, 47)])
    with pytest.raises(ValueError, match="padded_vocab_size=200 is smaller"):
        _layout(padded=200)

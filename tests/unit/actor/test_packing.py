"""Packing Samples into THD / BSHD model inputs; packed forward == per-sequence forward."""

import pytest
import torch

from dapo_megatron.actor.packing import group_by_length, pack_samples, split_by_token_budget
from dapo_megatron.platform import spawn
from dapo_megatron.rollout.types import Sample


def _sample(prompt, response, **kw):
    return Sample(prompt_ids=list(prompt), response_ids=list(response),
                  rollout_logprobs=[0.0] * len(response), finish_reason="stop", **kw)


def random_samples(n, vocab, seed, max_prompt=6, max_resp=7, min_resp=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        P = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        R = int(torch.randint(min_resp, max_resp + 1, (1,), generator=g))
        out.append(_sample(torch.randint(0, vocab, (P,), generator=g).tolist(),
                           torch.randint(0, vocab, (R,), generator=g).tolist()))
    return out


def tiny_gpt_config(tp=1, pp=1, num_layers=2, sequence_parallel=False):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.05, params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )


def tiny_gpt_model(cfg, vocab_size=64, tie=True, parallel=None):
    """A tiny Llama-like GPTModel with the local (non-TE) spec; builds the PP stage of
    ``parallel`` (a ``ParallelDims``; None: the only stage)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=vocab_size, max_sequence_length=64,
        position_embedding_type="rope", share_embeddings_and_output_weights=tie,
        pre_process=parallel is None or parallel.is_pp_first, post_process=parallel is None or parallel.is_pp_last,
    )


def test_labels_masks_positions_and_cu_seqlens():
    s = [_sample([5, 6, 7], [8, 9]), _sample([1], [2, 3, 4], loss_mask_zero=True), _sample([10, 11], [])]
    b = pack_samples(s, pad_to_multiple_of=4)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 10, 11, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 0]]
    assert b.cu_seqlens.tolist() == [0, 5, 9, 11] and b.cu_seqlens.dtype == torch.int32
    assert b.num_padding == 1
    # response token j of a sample is predicted at position P + j - 1 of its sequence
    assert b.labels.tolist() == [[0, 0, 8, 9, 0, 2, 3, 4, 0, 0, 0, 0]]
    assert b.response_mask.int().tolist() == [[0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0]]
    assert b.loss_mask.int().tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]]
    m = b.attention_mask[0, 0]
    assert m.shape == (12, 12) and m.dtype == torch.bool
    assert not m[4, 0] and m[5, 4] and not m[8, 5] and m[5, 6]  # causal inside, blocked across
    assert not m[11, 11] and m[11, 10]  # the padding is its own block
    psp = b.packed_seq_params
    assert psp.qkv_format == "thd" and psp.cu_seqlens_q.tolist() == [0, 5, 9, 11, 12] and psp.max_seqlen_q == 5


def test_unpack_and_scatter_are_inverse():
    s = random_samples(5, 50, seed=1)
    for layout in ("thd", "bshd"):
        b = pack_samples(s, layout=layout, pad_to_multiple_of=2)
        per = [torch.arange(len(x.response_ids), dtype=torch.float32) + 100 * i for i, x in enumerate(s)]
        full = b.scatter_per_sample(per)
        assert full.shape == b.input_ids.shape
        back = b.unpack(full)
        assert all(torch.equal(x, y) for x, y in zip(back, per))
        assert float(full[~b.response_mask].abs().sum()) == 0
        assert [x.tolist() for x in b.unpack(b.labels)] == [x.response_ids for x in s]
    with pytest.raises(ValueError, match="sample 0"):
        b.scatter_per_sample([[1.0] * 99] + per[1:])
    with pytest.raises(ValueError, match="empty prompt_ids"):
        pack_samples([_sample([], [1])])


def test_split_by_token_budget_keeps_order_and_budget():
    s = random_samples(9, 50, seed=2)
    mbs = split_by_token_budget(s, 16)
    assert [x for mb in mbs for x in mb] == s
    assert all(sum(x.total_length for x in mb) <= 16 for mb in mbs)
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        split_by_token_budget(s, 3)


def _packed_vs_single_worker(out_path):
    from dapo_megatron.actor.logprobs import vocab_parallel_logprobs
    from dapo_megatron.platform import init_distributed

    init_distributed(seed=0)
    torch.manual_seed(0)
    model = tiny_gpt_model(tiny_gpt_config()).eval()
    samples = random_samples(4, 64, seed=3, min_resp=1)
    samples.append(_sample([3], [4, 5]))  # shortest prompt
    with torch.no_grad():
        single = []
        for s in samples:
            b = pack_samples([s], layout="bshd", build_attention_mask=False)  # plain causal, no mask
            logits = model(b.input_ids, b.position_ids, None)
            single.append(b.unpack(vocab_parallel_logprobs(logits, b.labels))[0])
        res = {"single": single}
        for layout in ("thd", "bshd"):
            b = pack_samples(samples, layout=layout, pad_to_multiple_of=4)
            logits = model(b.input_ids, b.position_ids, b.attention_mask)
            res[layout] = b.unpack(vocab_parallel_logprobs(logits, b.labels))
    torch.save(res, out_path)


def test_packed_forward_equals_per_sequence_forward(tmp_path):
    path = str(tmp_path / "packed.pt")
    spawn(_packed_vs_single_worker, 1, path)
    res = torch.load(path)
    assert len(res["single"]) == 5 and all(x.numel() > 0 for x in res["single"])
    for layout in ("thd", "bshd"):
        for got, ref in zip(res[layout], res["single"]):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]


def test_group_by_length_is_optimal_and_a_partition():
    """Brute force over every set partition (n <= 7): the DP's cut has the minimal padded cost."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = int(torch.randint(1, 8, (1,), generator=g))
        lens = torch.randint(1, 40, (n,), generator=g).tolist()
        pad, over = (1, 2, 4)[trial % 3], (0, 5, 64)[trial % 3]

        def cost(groups):
            return sum(len(x) * (-(-max(lens[i] for i in x) // pad) * pad) + over for x in groups)

        got = group_by_length(lens, pad_to_multiple_of=pad, overhead_tokens=over)
        assert sorted(i for x in got for i in x) == list(range(n))
        assert all([lens[i] for i in x] == sorted(lens[i] for i in x) for x in got)
        assert cost(got) == min(cost(p) for p in _set_partitions(list(range(n))))
    assert group_by_length([5, 5, 5], overhead_tokens=0) == [[0, 1, 2]]
    assert group_by_length([10, 80], overhead_tokens=0) == [[0], [1]]
    assert group_by_length([10, 80], overhead_tokens=100) == [[0, 1]]
    with pytest.raises(ValueError, match="overhead_tokens"):
        group_by_length([3], overhead_tokens=-1)
    with pytest.raises(ValueError, match="at least one"):
        group_by_length([])

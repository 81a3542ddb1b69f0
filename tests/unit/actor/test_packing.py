"""Packing Samples into THD / BSHD model inputs; packed forward == per-sequence forward."""

import pytest
import torch

import math

from dapo_megatron.actor.packing import group_by_length, pack_samples, padded_tokens, split_by_token_budget
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


def _smallest_row(longest, rows, pad, align):
    """Brute force: the shortest row length >= longest with S % pad == 0 and rows * S % align == 0."""
    S = longest
    while S % pad or (rows * S) % align:
        S += 1
    return S


def test_group_by_length_is_optimal_and_a_partition():
    """Brute force over every set partition (n <= 7): the DP's cut has the minimal padded cost,
    also when the rows of a group must hold a multiple of the FP8 alignment in tokens."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = int(torch.randint(1, 8, (1,), generator=g))
        lens = torch.randint(1, 40, (n,), generator=g).tolist()
        pad, over = (1, 2, 4)[trial % 3], (0, 5, 64)[trial % 3]
        align = (1, 16, 32, 16)[trial % 4]

        def cost(groups):
            return sum(len(x) * _smallest_row(max(lens[i] for i in x), len(x), pad, align) + over for x in groups)

        got = group_by_length(lens, pad_to_multiple_of=pad, align_tokens_to=align, overhead_tokens=over)
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


def test_shared_prompt_segments_labels_positions_and_mask():
    """Two responses (and an empty one) after one prompt, and a sample with its own prompt: the
    prompt is packed once, responses continue its positions, label slots stay unique, and the
    logits row of each later response's first token is the prompt's last position."""
    s = [_sample([5, 6, 7], [8, 9]), _sample([1], [2, 3], loss_mask_zero=True), _sample([5, 6, 7], []),
         _sample([5, 6, 7], [10, 11, 12])]
    b = pack_samples(s, share_prompts=True, build_attention_mask=False, pad_to_multiple_of=4)
    #                  prompt   r0     r3          | prompt r1   | pad
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2, 0]]
    assert b.segment_lens == [8, 3] and b.cu_seqlens.tolist() == [0, 8, 11] and b.num_padding == 1
    assert b.seq_lens == [5, 3, 3, 6] and b.num_copied_tokens == 17 and b.num_tokens == 12
    # slots: r0 at 2, 3 (positions before 8, 9); r3 at 4, 5, 6 (before 10, 11, 12); r1 at 8, 9
    assert b.labels.tolist() == [[0, 0, 8, 9, 10, 11, 12, 0, 2, 3, 0, 0]]
    assert b.loss_mask.int().tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]]
    assert [x.tolist() for x in b.unpack(b.labels)] == [x.response_ids for x in s]
    rows = b.label_rows.tolist()
    assert rows[4] == 2 and all(rows[k] == k for k in range(12) if k != 4)  # 10 is predicted after 7
    m = ~b.attention_mask[0, 0]  # True = may attend
    assert m[5].tolist() == [1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0]  # r3's first token: prompt + itself
    assert m[4].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]  # r0's last token: prompt + r0
    assert m[9].tolist() == [0] * 8 + [1, 1, 0, 0] and m[11, 11]
    with pytest.raises(ValueError, match="PackedSeqParams"):
        b.packed_seq_params
    # bshd: one row per segment, the mask built although no plain-causal row would need one
    c = pack_samples(s, layout="bshd", share_prompts=True, build_attention_mask=False)
    assert c.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert c.attention_mask.shape == (2, 1, 8, 8) and c.label_rows.tolist()[4] == 2
    assert [x.tolist() for x in c.unpack(c.labels)] == [x.response_ids for x in s]
    # one non-empty response per prompt is the copied form: no mask needed, no label rows
    d = pack_samples(s[1:3], layout="bshd", share_prompts=True, build_attention_mask=False)
    assert d.label_rows is None and d.attention_mask is None and not d.shares_prompts


@pytest.mark.parametrize("recipe,align", [("delayed", 16), ("tensorwise", 16), ("blockwise", 16), ("mxfp8", 32)])
def test_fp8_alignment_padded_lengths(recipe, align):
    """Under FP8 every micro-batch holds a multiple of megatron-core's get_fp8_align_size tokens
    (B * T), with the shortest rows that also keep the sequence-parallel multiple."""
    from dapo_megatron.actor.plan import fp8_align_size

    assert fp8_align_size(recipe) == align
    s = [_sample([1] * 5, [2] * 4), _sample([3] * 2, [4] * 9), _sample([5] * 7, [6])]  # lengths 9, 11, 8
    for sp in (1, 2, 3):
        thd = pack_samples(s, layout="thd", pad_to_multiple_of=sp, align_tokens_to=align)
        assert thd.num_tokens == _smallest_row(28, 1, sp, align) and thd.num_tokens % math.lcm(sp, align) == 0
        bshd = pack_samples(s, layout="bshd", pad_to_multiple_of=sp, align_tokens_to=align, build_attention_mask=False)
        T = bshd.input_ids.shape[1]
        assert T == _smallest_row(11, 3, sp, align) and (3 * T) % align == 0 and T % sp == 0
        assert padded_tokens([9, 11, 8], layout="bshd", pad_to_multiple_of=sp, align_tokens_to=align) == 3 * T
        for b in (thd, bshd):  # padding holds no label: the loss sees the same tokens
            assert b.num_loss_tokens == 14 and b.num_padding == b.num_tokens - 28
            assert [x.tolist() for x in b.unpack(b.labels)] == [x.response_ids for x in s]
    assert pack_samples(s, layout="thd", align_tokens_to=16).num_tokens == 32  # 28 -> 32
    # 3 rows: 3 * S % 32 == 0 needs S % 32 == 0 (gcd(3, 32) = 1); 2 rows would need S % 16 == 0
    assert pack_samples(s, layout="bshd", align_tokens_to=32, build_attention_mask=False).input_ids.shape == (3, 32)
    assert pack_samples(s[:2], layout="bshd", align_tokens_to=32, build_attention_mask=False).input_ids.shape == (2, 16)


def test_split_by_token_budget_counts_a_shared_prompt_once():
    group = [_sample([1] * 10, [2] * 3) for _ in range(4)] + [_sample([7] * 2, [8] * 2)]  # 13 each, then 4
    assert [len(mb) for mb in split_by_token_budget(group, 26)] == [2, 2, 1]
    shared = split_by_token_budget(group, 26, share_prompts=True)  # 10 + 4 * 3 = 22, then 22 + 4 = 26
    assert [len(mb) for mb in shared] == [5]
    # 13 + 3 + 3 = 19, a 4th response would make 22 > 21: the next micro-batch encodes the prompt again
    assert [len(mb) for mb in split_by_token_budget(group, 21, share_prompts=True)] == [3, 2]


# ------------------------------------------------------------------ FP8 GEMM shapes under sequence parallelism
def _te_fp8_exec_ok(shape) -> bool:
    """Transformer Engine 2.11 ``pytorch/utils.py`` ``assert_dim_for_fp8_exec``, verbatim condition."""
    return math.prod(shape[:-1]) % 8 == 0 and shape[-1] % 16 == 0


def _te_quantizable(recipe, shape) -> bool:
    """``is_quantizable`` of the recipe's input quantizer (TE 2.11), asked by ``assert_dim_for_all_gather``
    for a sequence-parallel input: MXFP8 blocks of 32 (``tensor/mxfp8_tensor.py``), FP8 blocks of 128
    (``tensor/float8_blockwise_tensor.py``); per-tensor quantizers take any shape (``quantized_tensor.py``)."""
    block = {"mxfp8": 32, "blockwise": 128}.get(recipe)
    return block is None or (shape[-1] % block == 0 and math.prod(shape[:-1]) % block == 0)


class _ProbeModel(torch.nn.Module):
    """What :func:`resolve_actor_plan` reads of a model chunk: its config and, for THD, a module
    named like TE's core attention (the plan's test for the TE spec)."""

    def __init__(self, config, te):
        super().__init__()
        self.config = config
        if te:
            self.add_module("core_attention", type("TEDotProductAttention", (torch.nn.Module,), {})())


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8", "blockwise"])
def test_fp8_gemm_inputs_fit_transformer_engine_at_every_tp_and_layout(recipe):
    """Every GEMM input the actor produces under FP8 passes TE 2.11's checks on the LOCAL shard
    (issue 18 item 2): with sequence parallelism the column-parallel GEMMs (qkv, fc1) get
    ``[T / TP, B, H]`` before the all-gather, the row-parallel ones (proj, fc2) ``[T, B, d / TP]``,
    and the weight-gradient GEMM's inner dimension is the ``T * B`` gathered tokens (a multiple
    of megatron-core's ``get_fp8_align_size``). Plans come from :func:`resolve_actor_plan`,
    micro-batches from :func:`make_micro_batches` (length buckets included), over TP 1/2/4/8,
    sequence parallel on / off, THD and BSHD, and random lengths."""
    from types import SimpleNamespace

    from dapo_megatron.actor.actor import ActorConfig
    from dapo_megatron.actor.micro_batch import make_micro_batches
    from dapo_megatron.actor.plan import fp8_align_size, resolve_actor_plan

    H, q, kv, ffn = 256, 256, 128, 512  # a model whose dims TE accepts at TP 8 (h / TP multiples of 16)
    align = fp8_align_size(recipe)
    g = torch.Generator().manual_seed(hash(recipe) % 1000)
    checked = 0
    for tp in (1, 2, 4, 8):
        for sp in ((False, True) if tp > 1 else (False,)):
            for layout in ("thd", "bshd"):
                config = SimpleNamespace(sequence_parallel=sp, fp8="e4m3", fp8_recipe=recipe, mtp_num_layers=None,
                                         context_parallel_size=1, multi_latent_attention=False)
                plan = resolve_actor_plan(ActorConfig(micro_batch_layout=layout, shared_prompt="off"),
                                          _ProbeModel(config, te=layout == "thd"), tp_size=tp)
                for trial in range(12):
                    n = int(torch.randint(1, 7, (1,), generator=g))
                    samples = random_samples(n, 100, seed=int(torch.randint(0, 10**6, (1,), generator=g)),
                                             max_prompt=40, max_resp=70, min_resp=1)
                    mbs, _ = make_micro_batches([samples], plan, device="cpu")
                    for mb in mbs:
                        B, T = mb.batch.input_ids.shape
                        where = f"TP {tp} SP {sp} {layout} {recipe}: [B={B}, T={T}] of lengths " \
                                f"{[len(s.prompt_ids) + len(s.response_ids) for s in samples]}"
                        assert T % (tp if sp else 1) == 0, where
                        local = (T // tp if sp else T, B)  # Megatron's [S, B, H] order
                        inputs = [(*local, H), (*local, H), (T, B, q // tp), (T, B, ffn // tp)]  # qkv, fc1, proj, fc2
                        weights = [((q + 2 * kv) // tp, H), (2 * ffn // tp, H), (H, q // tp), (H, ffn // tp)]
                        for shape in inputs + weights:
                            assert _te_fp8_exec_ok(shape), f"{where}: GEMM input {shape} fails assert_dim_for_fp8_exec"
                        if sp:  # LayerNormLinear / LayerNormMLP all-gather the quantized local input
                            assert _te_quantizable(recipe, (local[0] * B, H)), f"{where}: local {local} not quantizable"
                        assert (T * B) % align == 0, f"{where}: wgrad inner dim {T * B} % {align}"
                        checked += 1
    assert checked > 100


def test_no_length_buckets_where_the_experts_span_dp():
    """An EP=2 MoE's every model call is an all-to-all over the DP ranks: a caller micro-batch must
    be one model call (length buckets cut the one below into 2 calls on one rank, and the other
    rank, cut differently, hung in the all-to-all of a call it never made)."""
    from types import SimpleNamespace

    from dapo_megatron.actor.actor import ActorConfig
    from dapo_megatron.actor.micro_batch import make_micro_batches
    from dapo_megatron.actor.plan import resolve_actor_plan

    config = SimpleNamespace(sequence_parallel=False, fp8=None, mtp_num_layers=None, context_parallel_size=1,
                             multi_latent_attention=False)
    cfg = ActorConfig(micro_batch_layout="bshd", shared_prompt="off")
    samples = [Sample(prompt_ids=[1] * 4, response_ids=[2] * r, rollout_logprobs=[0.0] * r, finish_reason="stop")
               for r in (2, 3, 300, 310)]  # two short rows, two long: buckets pay off
    calls = {}
    for span in (False, True):
        plan = resolve_actor_plan(cfg, _ProbeModel(config, te=False), tp_size=1, experts_span_dp=span)
        calls[span] = len(make_micro_batches([samples], plan, device="cpu")[0])
    assert calls == {False: 2, True: 1}

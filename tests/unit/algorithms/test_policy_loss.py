"""DAPO policy loss: hand-computed values for every mode and clip branch, and the
token-mean invariance to micro-batching and DP (docs/design.md §3.4)."""

import math
import os
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.algorithms import agg_loss, compute_policy_loss
from dapo_megatron.algorithms.policy_loss import rollout_correction
from dapo_megatron.platform.distributed import free_port

# ---------------------------------------------------------------------------
# Hand-computed example (ratios chosen to hit every branch), old_log_prob = 0
#   row 0: r=1.5 A=+1 -> upper clip: max(-1.5, -1.28) = -1.28
#          r=0.5 A=-1 -> lower clip: max( 0.5,  0.80) =  0.80
#          r=1.1 A=+1 -> unclipped : -1.1
#   row 1: r=0.7 A=-1 -> lower clip: max( 0.7,  0.80) =  0.80
#          r=1.0 A=+2 -> unclipped : -2.0
#          r=2.0 A=-1 -> masked out (would be 2.0)
# ---------------------------------------------------------------------------
RATIOS = [[1.5, 0.5, 1.1], [0.7, 1.0, 2.0]]
ADV = [[1.0, -1.0, 1.0], [-1.0, 2.0, -1.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
TOKEN_LOSS = [[-1.28, 0.80, -1.1], [0.80, -2.0, 0.0]]


def _example(dtype=torch.float64):
    log_prob = torch.tensor(RATIOS, dtype=dtype).log().requires_grad_(True)
    old = torch.zeros(2, 3, dtype=dtype)
    return log_prob, old, torch.tensor(ADV, dtype=dtype), torch.tensor(MASK, dtype=torch.bool)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (-1.28 + 0.8 - 1.1 + 0.8 - 2.0) / 5),
        ("seq-mean-token-mean", ((-1.28 + 0.8 - 1.1) / 3 + (0.8 - 2.0) / 2) / 2),
        ("seq-mean-token-sum", ((-1.28 + 0.8 - 1.1) + (0.8 - 2.0)) / 2),
        ("seq-mean-token-sum-norm", ((-1.28 + 0.8 - 1.1) / 3 + (0.8 - 2.0) / 3) / 2),
    ],
)
def test_hand_computed_modes(mode, expected):
    log_prob, old, adv, mask = _example()
    loss, metrics = compute_policy_loss(log_prob, old, adv, mask, loss_agg_mode=mode)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_upper"].item() == pytest.approx(1 / 5)
    assert metrics["ratio_min"].item() == pytest.approx(0.5)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)  # the masked r=2.0 is ignored
    kl = -(math.log(1.5) + math.log(0.5) + math.log(1.1) + math.log(0.7) + 0.0) / 5
    assert metrics["ppo_kl"].item() == pytest.approx(kl, rel=1e-6)
    assert "pg_clipfrac_dual" not in metrics
    for v in metrics.values():
        assert isinstance(v, torch.Tensor) and v.ndim == 0 and not v.requires_grad


def test_gradient_branches_token_mean():
    """d loss / d log_prob = -A * r / N on unclipped tokens, 0 on clipped or masked ones."""
    log_prob, old, adv, mask = _example()
    loss, _ = compute_policy_loss(log_prob, old, adv, mask)
    loss.backward()
    n = 5
    expected = [[0.0, 0.0, -1.0 * 1.1 / n], [0.0, -2.0 * 1.0 / n, 0.0]]
    torch.testing.assert_close(log_prob.grad, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_global_num_tokens_divides_sum():
    log_prob, old, adv, mask = _example()
    total = -1.28 + 0.8 - 1.1 + 0.8 - 2.0
    for g in (17, 17.0, torch.tensor(17.0), torch.tensor([17])):
        loss, _ = compute_policy_loss(log_prob, old, adv, mask, global_num_tokens=g)
        assert loss.item() == pytest.approx(total / 17, abs=1e-12)


def test_dual_clip_hand_computed():
    # r=5, A=-1: clipped loss max(5, 1.28) = 5, dual bound 3*1 = 3 -> 3 (dual active)
    # r=2, A=-1: max(2, 1.28) = 2 < 3 -> 2
    # r=0.5, A=-2: max(1.0, 1.6) = 1.6 < 6 -> 1.6
    # r=5, A=+1: upper clip -1.28 (dual clip never touches A > 0)
    log_prob = torch.tensor([[5.0, 2.0, 0.5, 5.0]], dtype=torch.float64).log().requires_grad_(True)
    old = torch.zeros(1, 4, dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, -2.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    loss, m = compute_policy_loss(log_prob, old, adv, mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 + 1.6 - 1.28) / 4, abs=1e-12)
    assert m["pg_clipfrac_dual"].item() == pytest.approx(1 / 4)
    assert m["pg_clipfrac_upper"].item() == pytest.approx(1 / 4)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)  # r=0.5 with A<0
    loss.backward()
    # only the r=2 token (unclipped, A=-1) has a gradient: -A * r / N = 2/4
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.5, 0.0, 0.0]], dtype=torch.float64))
    # without dual clip the r=5, A=-1 token costs 5 instead of 3
    loss_nodual, _ = compute_policy_loss(log_prob.detach(), old, adv, mask)
    assert loss_nodual.item() == pytest.approx((5.0 + 2.0 + 1.6 - 1.28) / 4, abs=1e-12)


def test_truncated_importance_sampling_hand_computed():
    # TIS weight w = min(exp(old - rollout), cap): rollout=log(0.25) -> 4 -> capped 2; rollout=log(2) -> 0.5
    log_prob = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)  # r = 1, no PPO clipping
    old = torch.zeros(1, 2, dtype=torch.float64)
    rollout = torch.tensor([[0.25, 2.0]], dtype=torch.float64).log()
    adv = torch.tensor([[1.0, -3.0]], dtype=torch.float64)
    w, mask, cm = rollout_correction(old, rollout, torch.ones(1, 2), rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5]], dtype=torch.float64))
    assert mask.tolist() == [[1.0, 1.0]] and cm["rollout_is_clipfrac"].item() == pytest.approx(0.5)
    loss, _ = compute_policy_loss(log_prob, old, adv, mask, is_weights=w)
    assert loss.item() == pytest.approx((-1.0 * 2.0 + 3.0 * 0.5) / 2, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-2.0 / 2, 1.5 / 2]], dtype=torch.float64))


def test_rejected_tokens_leave_the_denominator():
    # slime PR #657's example: 5 tokens, log rho = [0.1, -1.5, 0.8, -10, 0.3], rejection outside [0.5, 2]
    log_rho = torch.tensor([[0.1, -1.5, 0.8, -10.0, 0.3]], dtype=torch.float64)
    old, rollout = log_rho, torch.zeros_like(log_rho)
    w, mask, cm = rollout_correction(old, rollout, torch.ones(1, 5), rollout_is="token", rollout_is_threshold=1e9,
                                     rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5)
    assert mask.tolist() == [[1.0, 0.0, 0.0, 0.0, 1.0]]
    torch.testing.assert_close(w, log_rho.exp())  # the weights are true ratios, never zeroed by the rejection
    assert cm["rollout_rs_masked_frac"].item() == pytest.approx(3 / 5)
    log_prob = old.clone().requires_grad_(True)  # r = 1
    adv = torch.ones(1, 5, dtype=torch.float64)
    loss, _ = compute_policy_loss(log_prob, old, adv, mask, is_weights=w)
    expected = -(math.exp(0.1) + math.exp(0.3)) / 2  # denominator 2 (unrejected), not 5
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_sequence_weight_and_geometric_rejection_over_corrected_tokens_only():
    # row 0: tokens 0-1 stale (log rho 0.2, 0.3), token 2 fresh; row 1: all stale, log rho 1.0 each
    old = torch.tensor([[0.2, 0.3, 5.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    rollout = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3)
    stale = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    w, keep, cm = rollout_correction(old, rollout, mask, tokens=stale, rollout_is="sequence",
                                     rollout_is_threshold=10.0, rollout_rs="geometric", rollout_rs_threshold=2.0)
    # sequence weight of row 0: exp(0.2 + 0.3) on its two stale tokens, 1 on the fresh one (log rho 5 ignored)
    torch.testing.assert_close(w[0], torch.tensor([math.exp(0.5), math.exp(0.5), 1.0], dtype=torch.float64))
    # row 1: exp(3) = 20.1 truncated at 10; its geometric mean exp(1) = 2.72 > 2 rejects the whole row
    torch.testing.assert_close(w[1], torch.full((3,), 10.0, dtype=torch.float64))
    assert keep.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert cm["rollout_corr_frac"].item() == pytest.approx(5 / 6)
    assert cm["rollout_is_clipfrac"].item() == pytest.approx(3 / 6)


def test_fresh_tokens_are_untouched_by_the_correction():
    old = torch.randn(3, 4, dtype=torch.float64)
    rollout = old + 0.5 * torch.randn(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    w, keep, _ = rollout_correction(old, rollout, mask, tokens=torch.zeros(3, 4, dtype=torch.bool),
                                    rollout_rs="token", rollout_rs_threshold=1.01)
    torch.testing.assert_close(w, mask.to(torch.float64))
    torch.testing.assert_close(keep, mask.to(torch.float64))


@pytest.mark.parametrize("kwargs,match", [
    (dict(rollout_is="seq"), "rollout_is"),
    (dict(rollout_is_threshold=0.0), "rollout_is_threshold"),
    (dict(rollout_rs="sequence", rollout_rs_threshold=2.0), "rollout_rs"),
    (dict(rollout_rs="token"), "rollout_rs_threshold"),
    (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0), "rollout_rs_threshold_lower"),
])
def test_rollout_correction_bad_arguments_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rollout_correction(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), **kwargs)


def test_advantages_given_per_sequence_broadcast():
    log_prob, old, adv, mask = _example()
    adv_seq = torch.tensor([0.5, -0.25], dtype=torch.float64)
    a, _ = compute_policy_loss(log_prob, old, adv_seq, mask)
    b, _ = compute_policy_loss(log_prob, old, adv_seq[:, None].expand(2, 3), mask)
    assert a.item() == b.item()


def test_empty_mask_gives_zero_loss_with_graph():
    log_prob = torch.randn(2, 3, requires_grad=True)
    loss, m = compute_policy_loss(log_prob, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert loss.item() == 0.0 and loss.requires_grad
    assert m["ratio_min"].item() == 1.0 and m["pg_clipfrac_lower"].item() == 0.0
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss, _ = compute_policy_loss(log_prob, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), loss_agg_mode=mode)
        assert loss.item() == 0.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(loss_agg_mode="token-sum"), "loss_agg_mode"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(clip_ratio_low=-0.1), "clip_ratio_low"),
        (dict(is_weights=torch.ones(2, 2)), "is_weights"),
        (dict(global_num_tokens=0), "global_num_tokens"),
        (dict(global_num_tokens=torch.tensor([1.0, 2.0])), "global_num_tokens"),
    ],
)
def test_bad_arguments_raise_naming_the_field(kwargs, match):
    log_prob, old, adv, mask = _example()
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(log_prob, old, adv, mask, **kwargs)


def test_shape_mismatch_names_tensor():
    log_prob, old, adv, mask = _example()
    with pytest.raises(ValueError, match="old_log_prob"):
        compute_policy_loss(log_prob, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="response_mask"):
        compute_policy_loss(log_prob, old, adv, mask[:1])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-3, 3, allow_nan=False), min_size=6, max_size=6),
    st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_on_policy_loss_is_minus_mean_advantage(adv_values, mask_values):
    """At r = 1 nothing is clipped: loss = -sum(A * mask) / N and grad = -A * mask / N."""
    adv = torch.tensor(adv_values, dtype=torch.float64).view(2, 3)
    mask = torch.tensor(mask_values).view(2, 3)
    lp = torch.randn(2, 3, dtype=torch.float64)
    log_prob = lp.clone().requires_grad_(True)
    loss, m = compute_policy_loss(log_prob, lp, adv, mask)
    n = max(int(mask.sum()), 1)
    expected = -sum(a for a, keep in zip(adv_values, mask_values) if keep) / n
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    expected_grad = [-a / n if keep else 0.0 for a, keep in zip(adv_values, mask_values)]
    torch.testing.assert_close(log_prob.grad.flatten(), torch.tensor(expected_grad, dtype=torch.float64))
    assert m["pg_clipfrac_lower"].item() == 0.0 and m["pg_clipfrac_upper"].item() == 0.0


# ---------------------------------------------------------------------------
# Token-mean invariance: micro-batches and DP ranks
# ---------------------------------------------------------------------------
VOCAB, HIDDEN = 11, 4


def _toy_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    head = torch.randn(HIDDEN, VOCAB, generator=g, dtype=torch.float64)
    return [emb.requires_grad_(True), head.requires_grad_(True)]


def _logprobs(params, tokens):
    """Per-token logprob of tokens[:, 1:] under a bigram model, [batch, len-1]."""
    emb, head = params
    logits = emb[tokens[:, :-1]] @ head
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _minibatch(lengths, seed=1, width=None):
    """Right-padded random responses with the given valid lengths, plus old logprobs/advantages."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    b = len(lengths)
    tokens = torch.randint(0, VOCAB, (b, width + 1), generator=g)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        old = _logprobs(_toy_model(seed=7), tokens)  # a different "old" policy -> real clipping
    adv = torch.randn(b, generator=g, dtype=torch.float64)[:, None].expand(b, width).contiguous()
    return tokens, old, adv, mask


def _grads(params, tokens, old, adv, mask, global_num_tokens, **kw):
    loss, _ = compute_policy_loss(_logprobs(params, tokens), old, adv, mask, global_num_tokens=global_num_tokens, **kw)
    return torch.autograd.grad(loss, params)


def _rel_err(a, b):
    return max(((x - y).norm() / y.norm().clamp(min=1e-30)).item() for x, y in zip(a, b))


@pytest.mark.parametrize("kw", [dict(), dict(clip_ratio_c=3.0)])
def test_token_mean_invariant_to_uneven_micro_batches(kw):
    lengths = [1, 9, 3, 12, 2, 7, 5]
    tokens, old, adv, mask = _minibatch(lengths)
    params = _toy_model()
    n_total = int(mask.sum())
    full = _grads(params, tokens, old, adv, mask, None, **kw)  # one micro-batch, one rank

    summed = [torch.zeros_like(p) for p in params]
    naive = [torch.zeros_like(p) for p in params]
    splits = [(0, 1), (1, 4), (4, 7)]  # uneven micro-batches
    for s, e in splits:
        # each micro-batch keeps only its own padding width, as a packer would
        width = int(mask[s:e].sum(-1).max())
        sl = (slice(s, e), slice(0, width))
        g = _grads(params, tokens[s:e, : width + 1], old[sl], adv[sl], mask[sl], n_total, **kw)
        summed = [a + b for a, b in zip(summed, g)]
        g_local = _grads(params, tokens[s:e, : width + 1], old[sl], adv[sl], mask[sl], None, **kw)
        naive = [a + b / len(splits) for a, b in zip(naive, g_local)]
    assert _rel_err(summed, full) <= 1e-6
    # per-micro-batch token counts (the fault class) really give another gradient
    assert _rel_err(naive, full) > 1e-2


def _dp_worker(rank, world_size, port, out_dir, lengths_per_rank):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        lengths = [n for rank_lengths in lengths_per_rank for n in rank_lengths]
        tokens, old, adv, mask = _minibatch(lengths)
        start = sum(len(x) for x in lengths_per_rank[:rank])
        stop = start + len(lengths_per_rank[rank])
        width = max(lengths_per_rank[rank])  # ranks hold very different sequence lengths
        sl = (slice(start, stop), slice(0, width))
        local_mask = mask[sl]
        # the mini-batch-global token count, all-reduced like the actor does it
        n_global = local_mask.sum().to(torch.float64)
        dist.all_reduce(n_global)
        params = _toy_model()
        grads = _grads(params, tokens[start:stop, : width + 1], old[sl], adv[sl], local_mask, n_global)
        grads = [g.clone() for g in grads]
        for g in grads:
            dist.all_reduce(g)  # SUM
        if rank == 0:
            torch.save({"grads": grads, "n_global": n_global.item()}, os.path.join(out_dir, "dp.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_token_mean_invariant_across_two_dp_ranks():
    import torch.multiprocessing as mp

    lengths_per_rank = [[1, 2, 1], [15, 12]]  # rank 0: short responses, rank 1: long ones
    lengths = [n for r in lengths_per_rank for n in r]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_dp_worker, args=(2, free_port(), out_dir, lengths_per_rank), nprocs=2, join=True)
        result = torch.load(os.path.join(out_dir, "dp.pt"))
    tokens, old, adv, mask = _minibatch(lengths)
    assert result["n_global"] == sum(lengths)
    full = _grads(_toy_model(), tokens, old, adv, mask, None)  # whole mini-batch on one rank
    assert _rel_err(result["grads"], full) <= 1e-6


def test_agg_loss_token_mean_matches_manual():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    assert agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 3)
    assert agg_loss(loss_mat, mask, "token-mean", 8).item() == pytest.approx(10 / 8)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 6.0) / 2)

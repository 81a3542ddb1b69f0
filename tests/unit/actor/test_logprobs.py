"""Vocab-parallel logprobs/entropy against torch.log_softmax on the gathered logits."""

import pytest
import torch

from dapo_megatron.actor.logprobs import (
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_entropy,
)
from dapo_megatron.platform import spawn


def _reference(full_logits, labels, vocab_size, temperature):
    """torch.log_softmax (fp32) over the gathered real vocabulary (padding columns dropped)."""
    x = full_logits[..., :vocab_size] / temperature
    logp = torch.log_softmax(x, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _grads(fn, logits, w_lp, w_ent):
    x = logits.clone().requires_grad_(True)
    lp, ent = fn(x)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return x.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_size", [40, 37])
def test_tp1_matches_log_softmax_values_and_grads(temperature, vocab_size):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g) * 4
    labels = torch.randint(0, vocab_size, (3, 5), generator=g)
    w_lp = torch.randn(3, 5, generator=g, dtype=torch.float64)
    w_ent = torch.randn(3, 5, generator=g, dtype=torch.float64)

    lp, ent = vocab_parallel_logprobs_and_entropy(logits, labels, vocab_size=vocab_size, temperature=temperature)
    ref_lp, ref_ent = _reference(logits, labels, vocab_size, temperature)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)

    ours = _grads(
        lambda x: vocab_parallel_logprobs_and_entropy(x, labels, vocab_size=vocab_size, temperature=temperature),
        logits, w_lp, w_ent,
    )
    ref = _grads(lambda x: _reference(x, labels, vocab_size, temperature), logits, w_lp, w_ent)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    if vocab_size < 40:
        assert torch.all(ours[..., vocab_size:] == 0)  # padding columns get no gradient


def test_bf16_input_is_computed_in_fp32_and_grad_keeps_dtype():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 32, generator=g) * 3).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 32, (4,), generator=g)
    lp = vocab_parallel_logprobs(logits, labels)
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_entropy_only_and_logprob_only_grads():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 16, (6,), generator=g)
    x = logits.clone().requires_grad_(True)
    vocab_parallel_entropy(x, temperature=1.3).sum().backward()
    y = logits.clone().requires_grad_(True)
    ref_ent = -(torch.log_softmax(y / 1.3, -1).exp() * torch.log_softmax(y / 1.3, -1)).sum(-1)
    ref_ent.sum().backward()
    torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=0)
    x = logits.clone().requires_grad_(True)
    vocab_parallel_logprobs(x, labels).sum().backward()
    y = logits.clone().requires_grad_(True)
    torch.log_softmax(y, -1).gather(-1, labels[:, None]).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=0)


def test_bad_inputs_name_the_field():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="labels must be global token ids"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="labels must be global token ids"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 6]), vocab_size=6)
    with pytest.raises(ValueError, match="labels shape"):
        vocab_parallel_logprobs(logits, torch.tensor([0]))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 1]), temperature=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 1]), vocab_size=9)


CASES = [(48, 1.0), (29, 0.6)]  # 29: rank 1 holds 5 real and 19 padding columns


def _tp2_worker(out_path):
    import torch.distributed as dist

    from dapo_megatron.platform import ParallelConfig, init_distributed

    par = init_distributed(ParallelConfig(2, 1), seed=0)
    rank = par.tp_rank
    results = []
    for vocab_size, temperature in CASES:
        g = torch.Generator().manual_seed(3)
        full = torch.randn(2, 7, 48, generator=g) * 5
        labels = torch.randint(0, vocab_size, (2, 7), generator=g)
        w_lp = torch.randn(2, 7, generator=g, dtype=torch.float64)
        w_ent = torch.randn(2, 7, generator=g, dtype=torch.float64)
        shard = full[..., rank * 24:(rank + 1) * 24].clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs_and_entropy(shard, labels, vocab_size=vocab_size, temperature=temperature,
                                                      tp_group=par.tp_group)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grads = [torch.zeros_like(shard) for _ in range(2)]
        dist.all_gather(grads, shard.grad.contiguous())
        results.append({"full": full, "labels": labels, "w_lp": w_lp, "w_ent": w_ent, "lp": lp.detach(),
                        "ent": ent.detach(), "grad": torch.cat(grads, -1)})
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)


@pytest.mark.dist
def test_tp2_matches_gathered_log_softmax(tmp_path):
    """TP=2 on 2 gloo ranks, with and without vocab padding: both ranks return the full-vocab answer."""
    path = str(tmp_path / "tp2.pt")
    spawn(_tp2_worker, 2, path)
    for rank_results in torch.load(path):
        for (vocab_size, temperature), out in zip(CASES, rank_results):
            ref_lp, ref_ent = _reference(out["full"], out["labels"], vocab_size, temperature)
            torch.testing.assert_close(out["lp"], ref_lp, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(out["ent"], ref_ent, atol=1e-6, rtol=1e-6)
            ref_grad = _grads(lambda x: _reference(x, out["labels"], vocab_size, temperature), out["full"],
                              out["w_lp"], out["w_ent"])
            torch.testing.assert_close(out["grad"], ref_grad, atol=1e-6, rtol=0)

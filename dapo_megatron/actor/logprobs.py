"""Per-token logprobs and entropy of a vocab-parallel LM head, without gathering the vocab.

Megatron's output layer is a ``ColumnParallelLinear`` over the vocabulary: on TP
rank ``r`` of ``TP`` ranks the logits hold the vocabulary columns
``[r * V_local, (r + 1) * V_local)`` with ``V_local = V_padded / TP``. The full
softmax is never materialised on one rank; as in Megatron's
``tensor_parallel.vocab_parallel_cross_entropy`` (Shoeybi et al. 2019, §3) only
three per-token scalars cross the TP group:

1. the max logit (all-reduce MAX), for a stable exp;
2. the sum of exponentials (all-reduce SUM);
3. the target logit (each rank contributes it if it owns the label, all-reduce SUM),
   and, for the entropy, the sum of ``p * x`` (all-reduce SUM).

With ``x = logits / temperature`` (fp32), ``m = max x``, ``Z = sum exp(x - m)``::

    logprob[t] = x[label] - m - log Z
    entropy    = log Z - sum_j p_j (x_j - m),        p = exp(x - m) / Z

Columns with a global index ``>= vocab_size`` (Megatron pads the vocabulary to a
multiple of ``make_vocab_size_divisible_by * TP``) are excluded from the softmax.

Backward (no communication: every TP rank already holds the global ``p`` of its
own columns and receives the same upstream gradient):

    d logprob / d x_j = 1[j == label] - p_j
    d entropy / d x_j = -p_j (log p_j + H)        (= -p_j (x_j - E_p[x]))

and ``d x / d logits = 1 / temperature``. The only tensor saved for backward is
``p`` (fp32, the size of the local logits), as in Megatron's cross entropy.

Design: docs/design.md §3.1 (objective, ratio and advantage).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dapo_megatron.platform import collectives


def _tp_rank_world(tp_group) -> tuple[int, int]:
    if tp_group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _all_reduce(t: torch.Tensor, op, tp_group, world: int) -> torch.Tensor:
    return collectives.all_reduce(t, group=tp_group, op=op) if world > 1 else t


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Fused vocab-parallel log-softmax gather + entropy (see module docstring)."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_size, temperature, tp_group, world, rank):
        v_local = logits.shape[-1]
        vocab_start = rank * v_local
        # fp32 copy (division always allocates, so the caller's logits are never modified)
        x = logits.float().div(temperature)
        n_valid_local = max(0, min(v_local, vocab_size - vocab_start))
        padded = n_valid_local < v_local
        if padded:
            x[..., n_valid_local:] = float("-inf")

        m = x.max(dim=-1).values  # -inf on a rank that holds only padding columns
        _all_reduce(m, dist.ReduceOp.MAX, tp_group, world)
        x.sub_(m.unsqueeze(-1))  # x := x - m, padding stays -inf

        # target logit: owned by exactly one rank
        local_label = labels - vocab_start
        owned = (local_label >= 0) & (local_label < n_valid_local)
        idx = local_label.clamp(0, v_local - 1).unsqueeze(-1)
        target = torch.gather(x, -1, idx).squeeze(-1)
        target = torch.where(owned, target, torch.zeros_like(target))

        p = x.exp()  # exp(-inf) = 0 for padding
        if padded:
            x[..., n_valid_local:] = 0.0  # so that p * x is 0 (not nan) on padding columns
        stats = torch.stack([p.sum(dim=-1), target, (p * x).sum(dim=-1)], dim=0)
        _all_reduce(stats, dist.ReduceOp.SUM, tp_group, world)
        sum_exp, target, sum_px = stats[0], stats[1], stats[2]
        del x

        log_z = sum_exp.log()
        logprob = target - log_z
        entropy = log_z - sum_px / sum_exp
        p.div_(sum_exp.unsqueeze(-1))  # softmax of the local columns

        ctx.save_for_backward(p, local_label, owned, entropy)
        ctx.temperature = temperature
        ctx.in_dtype = logits.dtype
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        p, local_label, owned, entropy = ctx.saved_tensors
        grad = torch.zeros_like(p)
        if grad_logprob is not None:
            g = grad_logprob.float()
            grad.sub_(p * g.unsqueeze(-1))
            onehot_val = torch.where(owned, g, torch.zeros_like(g)).unsqueeze(-1)
            grad.scatter_add_(-1, local_label.clamp(0, p.shape[-1] - 1).unsqueeze(-1), onehot_val)
        if grad_entropy is not None:
            g = grad_entropy.float().unsqueeze(-1)
            # dH/dx_j = -(p_j log p_j + p_j H); xlogy gives 0 at p_j = 0 (padding, underflow)
            grad.sub_((torch.special.xlogy(p, p) + p * entropy.unsqueeze(-1)) * g)
        grad.div_(ctx.temperature)
        return grad.to(ctx.in_dtype), None, None, None, None, None, None


def _check_inputs(logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size, temperature, world):
    if not isinstance(logits, torch.Tensor) or logits.ndim < 1:
        raise ValueError("logits must be a tensor [..., V_padded / TP] (Megatron's vocab-parallel output)")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (the rollout's sampling temperature)")
    v_padded = logits.shape[-1] * world
    if vocab_size is None:
        vocab_size = v_padded
    if not 0 < int(vocab_size) <= v_padded:
        raise ValueError(
            f"vocab_size={vocab_size} must be in [1, {v_padded}] (= logits.shape[-1] {logits.shape[-1]} "
            f"x TP {world}); pass the unpadded tokenizer vocabulary size"
        )
    if labels is not None:
        if labels.shape != logits.shape[:-1]:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}"
            )
        if labels.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"labels must be int64/int32 token ids, got {labels.dtype}")
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= int(vocab_size)):
            raise ValueError(
                f"labels must be global token ids in [0, vocab_size={vocab_size}), got range "
                f"[{int(labels.min())}, {int(labels.max())}]; put a valid id (e.g. 0) at masked positions"
            )
    return int(vocab_size)


def vocab_parallel_logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    tp_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of ``labels`` and entropy of ``softmax(logits / temperature)``, vocab-parallel.

    Args:
        logits: ``[..., V_padded / TP]`` any float dtype; TP rank ``r`` holds global
            vocabulary columns ``[r * V_local, (r + 1) * V_local)`` (Megatron
            ``ColumnParallelLinear`` output layer). Not modified.
        labels: ``[...]`` int64/int32 global token ids in ``[0, vocab_size)``.
        vocab_size: real (unpadded) vocabulary size; columns ``>= vocab_size`` are
            excluded from the softmax. ``None``: no padding (``V_local * TP``).
        temperature: logits are divided by it first (the temperature the rollout
            sampled at, so that logprobs match the sampling distribution).
        tp_group: the tensor-parallel process group (``ParallelDims.tp_group``);
            ``None``: a world of one (the logits hold the whole vocabulary).

    Returns:
        ``(logprob, entropy)``, both float32 ``[...]`` in nats. Both are
        differentiable w.r.t. ``logits`` (gradient returned in ``logits.dtype``);
        an output whose gradient is unused costs nothing in backward.

    Raises:
        ValueError / TypeError: shape mismatch, labels out of range, bad
        ``vocab_size`` or ``temperature``.

    All math is fp32. Every TP rank must call this with the same ``labels``.
    """
    rank, world = _tp_rank_world(tp_group)
    vocab_size = _check_inputs(logits, labels, vocab_size, temperature, world)
    return _VocabParallelLogprobEntropy.apply(
        logits, labels.long(), vocab_size, float(temperature), tp_group, world, rank
    )


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    tp_group=None,
) -> torch.Tensor:
    """Per-token ``log softmax(logits / temperature)[label]``, vocab-parallel (float32 ``[...]``, nats).

    Same arguments and errors as :func:`vocab_parallel_logprobs_and_entropy`;
    differentiable w.r.t. ``logits``.
    """
    return vocab_parallel_logprobs_and_entropy(
        logits, labels, vocab_size=vocab_size, temperature=temperature, tp_group=tp_group
    )[0]


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    tp_group=None,
) -> torch.Tensor:
    """Per-token entropy of ``softmax(logits / temperature)``, vocab-parallel (float32 ``[...]``, nats).

    Differentiable (for an entropy bonus). Arguments as in
    :func:`vocab_parallel_logprobs_and_entropy`, without labels.
    """
    rank, world = _tp_rank_world(tp_group)
    _check_inputs(logits, None, vocab_size, temperature, world)
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return vocab_parallel_logprobs_and_entropy(
        logits, labels, vocab_size=vocab_size, temperature=temperature, tp_group=tp_group
    )[1]

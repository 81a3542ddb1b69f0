"""The loss functions the actor hands to megatron-core's forward-backward schedule.

Contract (megatron-core ``pipeline_parallel/schedules.py``, ``forward_step_calc_loss``: 0.19.2
:290 with the 3-tuple at :329-335, core_v0.16.1 :218, unchanged): on the last pipeline stage the schedule calls
``loss_func(output_tensor)`` and, for a 3-tuple ``(loss, num_tokens, reduced)``,

- back-propagates ``loss`` (a 0-d float tensor; with ``config.calculate_per_token_loss=True``,
  which the actor sets, it is neither divided by ``num_tokens`` nor by the number of
  micro-batches, and ``grad_scale_func`` scales it);
- collects ``num_tokens`` (0-d int tensor) and passes the sum to ``finalize_model_grads``
  (the actor's finalize ignores it: the loss is already divided by the global count);
- appends ``reduced`` (a dict of tensors) to the list the schedule returns, one per
  micro-batch, on the last stage only.

Both functions take the micro-batch first so that ``functools.partial(fn, mb, ...)`` is the
``loss_func`` of that micro-batch's ``forward_step``.

Design: docs/design.md §3.4 (token-level loss, exact under any micro-batch or DP split).
"""

from __future__ import annotations

from typing import Optional

import torch

from dapo_megatron.algorithms.policy_loss import agg_loss, compute_policy_loss
from .micro_batch import MicroBatch

# the per-micro-batch values that are summed over micro-batches, PP stages and DP ranks
SUM_KEYS = ("loss", "pg_loss", "pg_clipfrac_lower", "pg_clipfrac_upper", "ppo_kl", "entropy", "num_tokens",
            "rollout_corr_frac", "rollout_is_mean", "rollout_is_clipfrac", "rollout_rs_masked_frac")


def _per_sample_padded(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """[B, T] values at label slots -> [n, R_max] right-padded (differentiable)."""
    per = mb.batch.unpack(values)
    r_max = max((x.numel() for x in per), default=0)
    return torch.stack([torch.nn.functional.pad(x, (0, r_max - x.numel())) for x in per])


def logprob_loss_func(mb: MicroBatch, output_tensor: torch.Tensor, *, temperature: float,
                      vocab_size: Optional[int], logits_at_labels_only: bool, tp_group=None):
    """``loss_func`` of a forward-only pass (:meth:`MegatronActor.compute_logprobs`).

    Args:
        mb: the micro-batch.
        output_tensor: last-stage logits (see :meth:`MicroBatch.logprobs_and_entropy`).
        temperature, vocab_size, logits_at_labels_only, tp_group: as there.

    Returns:
        ``(0.0, 0, {"logprobs": [B, T] float32, "entropy": [B, T] float32})`` (nats, at the
        label slots, 0 elsewhere); nothing is back-propagated.
    """
    lp, ent = mb.logprobs_and_entropy(output_tensor, logits_at_labels_only=logits_at_labels_only,
                                      vocab_size=vocab_size, temperature=temperature, tp_group=tp_group)
    zero = output_tensor.new_zeros(())
    return zero, torch.tensor(0, dtype=torch.int), {"logprobs": lp, "entropy": ent}


def dapo_loss_func(mb: MicroBatch, output_tensor: torch.Tensor, *, actor_cfg, temperature: float,
                   vocab_size: Optional[int], logits_at_labels_only: bool, global_num_tokens: int,
                   global_num_seqs: int, global_num_valid_tokens: Optional[int] = None,
                   return_logprobs: bool = False, tp_group=None):
    """``loss_func`` of a training pass: this micro-batch's share of the mini-batch's DAPO loss.

    The DAPO token-level loss (arXiv 2503.14476 Eq. 12, with the decoupled clip ``[1 - eps_low,
    1 + eps_high]`` of Eq. 8-10, :func:`~dapo_megatron.algorithms.policy_loss.compute_policy_loss`) of a
    mini-batch is ``sum over its valid tokens / N`` with ``N = global_num_tokens`` over every
    micro-batch and DP rank. Each micro-batch returns its own tokens' sum divided by that ``N``
    ("token-mean"), or (``seq-mean-token-mean``) the mean of its sequences' token means
    weighted by ``its sequences / global_num_seqs``, so that summing over micro-batches and
    DP ranks gives the mini-batch loss however it was cut. With ``actor_cfg.entropy_coeff``
    the entropy (same aggregation) is subtracted, differentiably. Tokens sampled by older
    weights carry the micro-batch's behaviour-policy weights and rejection mask
    (:meth:`MicroBatch.correction`, the three-policy form of ``algorithms/policy_loss.py``);
    without ``mb.old_logprobs`` (an ``OldLogprobPlan`` ``FROM_TRAINING``) ``log pi_old`` is this forward's own
    detached logprobs and the weights are computed from them here.

    Args:
        mb: the micro-batch (with targets: old logprobs, advantages, loss mask).
        output_tensor: last-stage logits ``[B, T, V/TP]`` or ``[1, N, V/TP]`` (labels only).
        actor_cfg: :class:`~dapo_megatron.actor.ActorConfig` (clip ratios, ``clip_ratio_c``,
            ``loss_agg_mode``, ``entropy_coeff``, the correction settings), read at every call.
        temperature, vocab_size, logits_at_labels_only, tp_group: see
            :meth:`MicroBatch.logprobs_and_entropy`.
        global_num_tokens, global_num_seqs: loss tokens / sequences of the whole mini-batch
            (after ``rollout_rs`` rejection: the denominators).
        global_num_valid_tokens: loss tokens before rejection (weights the correction's
            statistics); None: ``global_num_tokens``.
        return_logprobs: also put this forward's detached logprobs in ``reduced``.

    Returns:
        ``(loss, num_tokens, reduced)`` as the schedule expects (module docstring): ``loss``
        0-d float32 with a graph; ``num_tokens`` 0-d int32, this micro-batch's loss tokens;
        ``reduced`` 0-d float32 tensors: ``loss``, ``pg_loss`` (contributions to the mini-batch
        values), ``pg_clipfrac_lower``, ``pg_clipfrac_upper``, ``ppo_kl``, ``entropy`` (weighted
        by the token share, so their sum over micro-batches is the mini-batch token mean),
        ``num_tokens``, ``ratio_min``, ``ratio_max`` (+inf / -inf without tokens), and the
        correction's ``rollout_corr_frac``, ``rollout_is_mean``, ``rollout_is_clipfrac``,
        ``rollout_rs_masked_frac`` weighted by the valid-token share; with ``return_logprobs``
        also ``logprobs`` ``[B, T]``.
    """
    cfg, mode, n_tok, n_seq = actor_cfg, actor_cfg.loss_agg_mode, global_num_tokens, global_num_seqs
    n_valid = n_tok if global_num_valid_tokens is None else global_num_valid_tokens
    lp, ent = mb.logprobs_and_entropy(output_tensor, logits_at_labels_only=logits_at_labels_only,
                                      vocab_size=vocab_size, temperature=temperature, tp_group=tp_group)
    old, is_w, mask, corr = mb.old_logprobs, mb.is_weights, mb.loss_mask, mb.corr_metrics
    if old is None:  # pi_old = sg(pi_theta): the value of the recompute this forward replaces
        old = lp.detach()
        if mb.corrected is not None:
            is_w, mask, corr = mb.correction(old, cfg)
    if mode == "token-mean":
        # [B, T] tensors directly: sum(loss * mask) / N is layout-free
        views = (lp, old, mb.advantages, mask, is_w, ent)
        weight, kwargs = 1.0, {"global_num_tokens": max(n_tok, 1)}
    else:  # seq-mean-token-mean: per-sample rows, weighted by the share of sequences
        views = tuple(None if t is None else _per_sample_padded(mb, t) for t in (lp, old, mb.advantages, mask, is_w, ent))
        weight, kwargs = mb.num_loss_seqs / max(n_seq, 1), {}
    lp_v, old_v, adv_v, mask_v, w_v, ent_v = views
    pg_loss, m = compute_policy_loss(
        lp_v, old_v, adv_v, mask_v,
        clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=mode, is_weights=w_v, **kwargs,
    )
    ent_term = agg_loss(ent_v if cfg.entropy_coeff else ent_v.detach(), mask_v, mode, **kwargs)
    pg_loss = pg_loss * weight
    ent_term = ent_term * weight
    loss = pg_loss - cfg.entropy_coeff * ent_term if cfg.entropy_coeff else pg_loss
    n_local = float(mb.num_loss_tokens)
    share = n_local / max(n_tok, 1)  # token share of this micro-batch in the mini-batch
    valid_share = mb.num_valid_tokens / max(n_valid, 1)  # the same before rejection
    zero = torch.zeros((), dtype=torch.float32)
    reduced = {
        "loss": loss.detach().float(),
        "pg_loss": pg_loss.detach().float(),
        "pg_clipfrac_lower": m["pg_clipfrac_lower"] * share,
        "pg_clipfrac_upper": m["pg_clipfrac_upper"] * share,
        "ppo_kl": m["ppo_kl"] * share,
        "entropy": (ent.detach().float() * mask.float()).sum() / max(n_tok, 1),
        "num_tokens": torch.tensor(n_local),
        "ratio_min": m["ratio_min"] if n_local else torch.tensor(float("inf")),
        "ratio_max": m["ratio_max"] if n_local else torch.tensor(float("-inf")),
        "rollout_corr_frac": corr.get("rollout_corr_frac", zero) * valid_share,
        "rollout_is_mean": corr.get("rollout_is_mean", torch.ones(())) * valid_share,
        "rollout_is_clipfrac": corr.get("rollout_is_clipfrac", zero) * valid_share,
        "rollout_rs_masked_frac": corr.get("rollout_rs_masked_frac", zero) * valid_share,
    }
    if return_logprobs:
        reduced["logprobs"] = lp.detach()
    return loss, torch.tensor(int(n_local), dtype=torch.int), reduced

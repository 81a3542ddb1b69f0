"""DAPO / PPO clipped policy-gradient loss with token-level aggregation.

Pure torch, no engine or process-group dependency. Tensor layout follows verl:
every per-token tensor is ``[batch, response_len]`` (right-padded responses) and
``response_mask`` marks the valid (generated, not padded, not filtered) tokens.

Sources:
- PPO clipped surrogate (Schulman et al. 2017, Eq. 7) with DAPO's decoupled
  clip range ``[1 - eps_low, 1 + eps_high]`` ("Clip-Higher", arXiv 2503.14476
  Eq. 8-10) and DAPO's token-level loss (Eq. 12).
- Dual clip for negative advantages (Ye et al. 2020, "Mastering Complex Control
  in MOBA Games", Eq. 5); verl's ``clip_ratio_c``.
- Truncated importance sampling against the rollout engine's logprobs (Yao et
  al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"); verl's ``tis_imp_ratio_cap``.
- Aggregation modes mirror verl's ``agg_loss`` (``loss_agg_mode``).
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# exp() of a log-ratio beyond this bound overflows fp32/bf16 gradients; verl clamps
# the same way before exponentiating.
_LOG_RATIO_CLAMP = 20.0


def _check_per_token(name: str, t: torch.Tensor, shape: torch.Size) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [batch, response_len], got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} but log_prob has shape {tuple(shape)}; "
            "all per-token tensors must be [batch, response_len]"
        )


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar (verl ``agg_loss``).

    Args:
        loss_mat: float ``[batch, response_len]`` per-token loss.
        loss_mask: ``[batch, response_len]`` (bool or float 0/1) valid tokens.
        loss_agg_mode: one of
            - ``"token-mean"`` (DAPO Eq. 12): ``sum(loss * mask) / global_num_tokens``.
              ``global_num_tokens`` must be the number of valid tokens of the whole
              mini-batch summed over all micro-batches and all DP ranks; then the
              summed gradients of all micro-batches/ranks equal the gradient of the
              mini-batch processed at once, however it is cut. When it is ``None``
              the local ``mask.sum()`` is used, which is only correct for one
              micro-batch on one rank.
            - ``"seq-mean-token-mean"`` (GRPO): mean over tokens of each sequence,
              then mean over the sequences that have at least one valid token.
            - ``"seq-mean-token-sum"``: sum over tokens, mean over sequences (all rows).
            - ``"seq-mean-token-sum-norm"`` (Dr. GRPO, Liu et al. 2025): token sum of
              each sequence divided by the constant ``response_len``, mean over
              sequences, i.e. ``sum(loss * mask) / (batch * response_len)`` (as in the
              Dr. GRPO reference code; verl's variant omits the division by ``batch``).
            The three ``seq-*`` modes average over the *local* sequences; a caller
            that splits a mini-batch must weight each micro-batch by its share of
            sequences. ``global_num_tokens`` is ignored by them.
        global_num_tokens: positive count (int, float or one-element tensor) for
            ``token-mean``. Python numbers are checked to be > 0; tensors are not
            (that would sync the device on every micro-batch).

    Returns:
        0-dim tensor with ``loss_mat``'s dtype; it keeps the autograd graph even when
        the mask is empty (the value is then 0).

    Raises:
        ValueError: unknown ``loss_agg_mode`` or non-positive ``global_num_tokens``.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if global_num_tokens is None:
            denom = mask.sum().clamp(min=1.0)
        else:
            if isinstance(global_num_tokens, torch.Tensor):
                # A tensor is not checked for > 0: that would force a device->host sync
                # on every micro-batch. The caller all-reduces it from masks.
                if global_num_tokens.numel() != 1:
                    raise ValueError(
                        f"global_num_tokens must be a scalar, got shape {tuple(global_num_tokens.shape)}"
                    )
                denom = global_num_tokens.reshape(()).to(device=loss_mat.device, dtype=loss_mat.dtype)
            else:
                if not float(global_num_tokens) > 0:
                    raise ValueError(
                        f"global_num_tokens must be > 0 (valid tokens of the whole mini-batch over all "
                        f"micro-batches and DP ranks), got {global_num_tokens}"
                    )
                denom = torch.tensor(float(global_num_tokens), dtype=loss_mat.dtype, device=loss_mat.device)
        return _masked_sum(loss_mat, mask) / denom
    if loss_agg_mode == "seq-mean-token-mean":
        tokens_per_seq = mask.sum(dim=-1)
        seq_losses = (loss_mat * mask).sum(dim=-1) / tokens_per_seq.clamp(min=1.0)
        num_seqs = (tokens_per_seq > 0).sum().clamp(min=1).to(loss_mat.dtype)
        return seq_losses.sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum(dim=-1).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return ((loss_mat * mask).sum(dim=-1) / loss_mat.shape[-1]).mean()
    raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")


def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: int | float | torch.Tensor | None = None,
    rollout_log_prob: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO clipped policy-gradient loss (decoupled clip, token-level mean).

    Per valid token, with ``r = exp(log_prob - old_log_prob)`` and advantage ``A``::

        loss_t = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        if clip_ratio_c is set and A < 0:   loss_t = min(loss_t, -A * clip_ratio_c)
        if TIS is on:                       loss_t = loss_t * min(exp(old_log_prob - rollout_log_prob), tis_cap)

    then aggregated with :func:`agg_loss`. The TIS weight is detached (a constant
    importance weight for the train/inference mismatch).

    Args:
        log_prob: float ``[batch, response_len]`` logprobs of the sampled tokens
            under the current policy (requires grad).
        old_log_prob: float ``[batch, response_len]`` logprobs under the policy
            that generated the rollout, recomputed by the actor (no grad needed).
        advantages: float ``[batch, response_len]`` (or ``[batch]``, broadcast over
            tokens) per-token advantages.
        response_mask: ``[batch, response_len]`` bool or 0/1 float; valid tokens.
        clip_ratio_low: ``eps_low`` >= 0 (DAPO 0.2).
        clip_ratio_high: ``eps_high`` >= 0 (DAPO 0.28).
        clip_ratio_c: dual-clip constant ``c > 1`` or ``None`` (off).
        loss_agg_mode: see :func:`agg_loss`.
        global_num_tokens: valid-token count of the whole mini-batch across all
            micro-batches and DP ranks (``token-mean``). ``None`` uses the local
            mask sum, which is only correct for one micro-batch on one rank.
        rollout_log_prob: float ``[batch, response_len]`` logprobs reported by the
            rollout engine; with ``tis_cap`` turns on truncated importance sampling.
        tis_cap: truncation ``C > 0`` of the TIS weight; needs ``rollout_log_prob``.

    DP note: with ``token-mean`` and ``global_num_tokens`` the per-rank losses are
    meant to have their gradients *summed* over DP ranks and micro-batches.
    Megatron DDP averages gradients over DP (and Megatron's pipeline schedules
    divide by the number of micro-batches unless ``calculate_per_token_loss``),
    so a caller on Megatron multiplies the loss by those factors (verl does the same).

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-dim tensor in ``log_prob.dtype``.
        ``metrics`` maps names to **0-dim detached float32 tensors** (no host sync;
        call ``.item()`` when logging), computed over the valid tokens of *this*
        call only (local to the micro-batch):

        - ``pg_clipfrac_lower``: fraction of valid tokens with ``A < 0`` and
          ``r < 1 - clip_ratio_low`` (clipped at the lower bound).
        - ``pg_clipfrac_upper``: fraction with ``A > 0`` and ``r > 1 + clip_ratio_high``.
        - ``ppo_kl``: approximate KL(old || new) = mean of ``old_log_prob - log_prob``.
        - ``ratio_min`` / ``ratio_max``: extremes of ``r`` over valid tokens (1.0 if none).
        - ``pg_clipfrac_dual`` (dual clip on): fraction with ``A < 0`` and ``r > c``.
        - ``tis_clipfrac`` (TIS on): fraction whose TIS weight exceeded ``tis_cap``.

    Raises:
        ValueError / TypeError: mismatched shapes, negative clip ratios,
        ``clip_ratio_c <= 1``, ``tis_cap`` without ``rollout_log_prob`` (or the
        reverse), ``tis_cap <= 0``, unknown ``loss_agg_mode``, bad
        ``global_num_tokens``.
    """
    if not isinstance(log_prob, torch.Tensor) or log_prob.ndim != 2:
        raise ValueError(
            f"log_prob must be a [batch, response_len] tensor, got "
            f"{tuple(log_prob.shape) if isinstance(log_prob, torch.Tensor) else type(log_prob).__name__}"
        )
    shape = log_prob.shape
    _check_per_token("old_log_prob", old_log_prob, shape)
    _check_per_token("response_mask", response_mask, shape)
    if isinstance(advantages, torch.Tensor) and advantages.ndim == 1 and advantages.shape[0] == shape[0]:
        advantages = advantages.unsqueeze(-1).expand(shape)
    _check_per_token("advantages", advantages, shape)
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low={clip_ratio_low} and clip_ratio_high={clip_ratio_high} must be >= 0 "
            "(DAPO uses 0.2 and 0.28)"
        )
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (dual clip lower-bounds A<0 losses), or None")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
    if (tis_cap is None) != (rollout_log_prob is None):
        raise ValueError(
            "truncated importance sampling needs both rollout_log_prob and tis_cap; got "
            f"rollout_log_prob={'set' if rollout_log_prob is not None else None}, tis_cap={tis_cap}"
        )
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap={tis_cap} must be > 0 (verl uses 2.0)")

    mask = response_mask.to(log_prob.dtype)
    valid = response_mask.bool()
    advantages = advantages.to(log_prob.dtype)

    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)

    pg_losses_unclipped = -advantages * ratio
    pg_losses_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses_unclipped, pg_losses_clipped)

    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        n_valid = mask.sum().clamp(min=1.0).float()
        r = ratio.detach()
        adv = advantages.detach()
        lower = valid & (adv < 0) & (r < 1.0 - clip_ratio_low)
        upper = valid & (adv > 0) & (r > 1.0 + clip_ratio_high)
        metrics["pg_clipfrac_lower"] = lower.sum().float() / n_valid
        metrics["pg_clipfrac_upper"] = upper.sum().float() / n_valid
        metrics["ppo_kl"] = _masked_sum(-log_ratio.detach().float(), mask.float()) / n_valid
        # masked min/max without a device->host sync; 1.0 when no token is valid
        any_valid = valid.any()
        one = torch.ones((), dtype=torch.float32, device=r.device)
        rf = r.float()
        metrics["ratio_min"] = torch.where(any_valid, rf.masked_fill(~valid, float("inf")).min(), one)
        metrics["ratio_max"] = torch.where(any_valid, rf.masked_fill(~valid, float("-inf")).max(), one)

    if clip_ratio_c is not None:
        pg_losses_dual = -advantages * clip_ratio_c
        negative = advantages < 0
        with torch.no_grad():
            dual = valid & negative & (pg_losses.detach() > pg_losses_dual.detach())
            metrics["pg_clipfrac_dual"] = dual.sum().float() / n_valid
        pg_losses = torch.where(negative, torch.minimum(pg_losses, pg_losses_dual), pg_losses)

    if tis_cap is not None:
        _check_per_token("rollout_log_prob", rollout_log_prob, shape)
        with torch.no_grad():
            tis_log = (old_log_prob.detach() - rollout_log_prob.detach()).to(log_prob.dtype)
            tis_weight = torch.exp(tis_log.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
            metrics["tis_clipfrac"] = (valid & (tis_weight > tis_cap)).sum().float() / n_valid
            tis_weight = tis_weight.clamp(max=tis_cap)
        pg_losses = pg_losses * tis_weight

    loss = agg_loss(pg_losses, mask, loss_agg_mode, global_num_tokens)
    return loss, metrics

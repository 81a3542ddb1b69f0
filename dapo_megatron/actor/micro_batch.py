"""The actor's micro-batches as run: the caller's cut, refined by the :class:`~.plan.ActorPlan`.

The caller (trainer) cuts a mini-batch into micro-batches by a token budget. Each one is
then packed as the plan says: in the shared-prompt form where the plan allows it (and,
with ``shared_prompt='auto'``, where it computes fewer tokens), and, for BSHD, as row
groups of similar length (length buckets). Every rank of a model-parallel group receives
the same micro-batches, so all cut them identically.

Design: docs/design.md §1 steps 5-6 (the plan, micro-batches) and §3.4 (token-level loss under any split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dapo_megatron.algorithms.policy_loss import rollout_correction
from dapo_megatron.rollout.types import Sample

from .config import ActorConfig
from .logprobs import vocab_parallel_logprobs_and_entropy
from .packing import PackedBatch, group_by_length, pack_samples, padded_tokens, prompt_segments, segment_length
from .plan import ActorPlan, OldLogprobPlan



@dataclass(frozen=True)
class Targets:
    """What one :meth:`~dapo_megatron.actor.MegatronActor.forward_backward` call trains against.

    Attributes:
        cfg: the actor's config (the correction settings ``rollout_is*``, ``rollout_rs*``).
        policy_version: the actor's weights version; a token whose ``Sample.versions`` entry
            is older is stale. None: no token is.
        old: the step's :class:`~.plan.OldLogprobPlan`: whether ``Sample.old_logprobs`` is read
            (not with ``FROM_TRAINING``: ``log pi_old = sg(log pi_theta)`` of the training
            forward) and whether the correction applies.
    """

    cfg: ActorConfig
    policy_version: Optional[int]
    old: OldLogprobPlan


class MicroBatch:
    """One model call: a :class:`~.packing.PackedBatch` plus its per-token training targets.

    Attributes:
        samples: the samples, in the order they were packed.
        batch: the model inputs.
        label_index: int64 ``[N]``, the response label slots, row-major over ``[B, T]``.
        label_index_sb: int64 ``[N]``, the hidden-state rows (Megatron's ``[S, B]`` order) whose
            logits predict those labels; with a shared prompt, a prompt's last position is
            repeated once per response that starts after it.
        old_logprobs, advantages: float32 ``[B, T]`` at the label slots (with ``targets``;
            ``old_logprobs`` None when ``targets.old`` is ``FROM_TRAINING``).
        rollout_logprobs, corrected: the behaviour policy's logprobs and the tokens the
            correction applies to (``[B, T]``; both None when no token is corrected, so an
            on-policy micro-batch trains exactly as without correction).
        loss_mask: float32 ``[B, T]``, the packed batch's loss mask minus the tokens
            ``rollout_rs`` rejects; ``is_weights`` the detached ``rollout_is`` weights (None:
            1); ``corr_metrics`` their statistics. Known here unless ``targets.old`` is
            ``FROM_TRAINING`` (then :func:`~.loss.dapo_loss_func` computes them from the training forward).
        num_valid_tokens: response tokens in the loss before rejection.
        num_loss_tokens, num_loss_seqs: response tokens / sequences in the loss.

    Raises:
        ValueError: (with ``targets``) a sample without one old logprob per response token,
            without rollout logprobs where they are corrected, or with a non-finite advantage.
    """

    def __init__(self, samples: Sequence[Sample], plan: ActorPlan, *, share_prompts: bool, device,
                 targets: Optional[Targets] = None):
        self.samples = list(samples)
        self.batch: PackedBatch = pack_samples(
            samples, layout=plan.layout, **plan.padding,
            build_attention_mask=plan.build_attention_mask, share_prompts=share_prompts, device=device,
        )
        b = self.batch
        B, T = b.input_ids.shape
        # response label slots, row-major over [B, T] (int64 [N]), and the rows that predict them in
        # Megatron's [S, B] hidden-state order: the output layer only needs these N rows
        self.label_index = b.response_mask.reshape(-1).nonzero().squeeze(1)
        rows = self.label_index if b.label_rows is None else b.label_rows.index_select(0, self.label_index)
        self.label_index_sb = (rows % T) * B + rows // T
        if targets is None:
            return
        cfg, from_training = targets.cfg, targets.old.from_training
        for i, s in enumerate(samples):
            if not from_training and (s.old_logprobs is None or len(s.old_logprobs) != len(s.response_ids)):
                raise ValueError(
                    f"sample {i}: old_logprobs must hold one value per response token (got "
                    f"{None if s.old_logprobs is None else len(s.old_logprobs)}, need {len(s.response_ids)}); "
                    "call MegatronActor.compute_logprobs first and store the result in Sample.old_logprobs"
                )
            if not math.isfinite(s.advantage):
                raise ValueError(f"sample {i}: advantage={s.advantage} is not finite")
        self.old_logprobs = (None if from_training
                             else b.scatter_per_sample([s.old_logprobs for s in samples]))
        self.advantages = b.scatter_per_sample([[s.advantage] * len(s.response_ids) for s in samples])
        self.loss_mask = b.loss_mask.float()
        self.is_weights = self.corrected = self.rollout_logprobs = None
        self.corr_metrics: dict[str, torch.Tensor] = {}
        if targets.old.corrects:
            if cfg.rollout_is_scope == "all":
                flags = [[1.0] * len(s.response_ids) for s in samples]
            else:  # the tokens of weights older than the actor's
                version = targets.policy_version
                flags = [[1.0 if version is not None and v < version else 0.0 for v in s.token_versions()]
                         or [0.0] * len(s.response_ids) for s in samples]
            if any(1.0 in f for f in flags):
                for i, s in enumerate(samples):
                    if len(s.rollout_logprobs) != len(s.response_ids):
                        raise ValueError(f"sample {i}: rollout_logprobs has {len(s.rollout_logprobs)} values, need "
                                         f"{len(s.response_ids)} (the behaviour-policy correction needs them)")
                self.corrected = b.scatter_per_sample(flags) > 0.5
                self.rollout_logprobs = b.scatter_per_sample([s.rollout_logprobs for s in samples])
                if self.old_logprobs is not None:
                    self.is_weights, self.loss_mask, self.corr_metrics = self.correction(self.old_logprobs, cfg)
        self.num_valid_tokens = b.num_loss_tokens  # before rejection
        self.num_loss_tokens = int(self.loss_mask.sum().item())
        self.num_loss_seqs = sum(1 for m in b.unpack(self.loss_mask) if m.sum() > 0)

    def correction(self, old_logprobs: torch.Tensor, cfg: ActorConfig):
        """:func:`~dapo_megatron.algorithms.policy_loss.rollout_correction` of this micro-batch:
        ``(is_weights, loss_mask, metrics)``."""
        return rollout_correction(
            old_logprobs, self.rollout_logprobs, self.batch.loss_mask, tokens=self.corrected,
            rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold, rollout_rs=cfg.rollout_rs,
            rollout_rs_threshold=cfg.rollout_rs_threshold, rollout_rs_threshold_lower=cfg.rollout_rs_threshold_lower)

    def logprobs_and_entropy(self, output_tensor: torch.Tensor, *, logits_at_labels_only: bool,
                             vocab_size, temperature: float, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprob and entropy at the label slots, float32 ``[B, T]`` (0 elsewhere).

        Args:
            output_tensor: the last PP stage's logits, ``[B, T, V/TP]``, or ``[1, N, V/TP]`` at
                :attr:`label_index_sb` when the output layer ran on the label rows only.
            logits_at_labels_only: which of the two ``output_tensor`` is.
            vocab_size: the real vocabulary (columns beyond it are Megatron's padding).
            temperature: the rollout's sampling temperature.
            tp_group: the TP group the vocabulary is split over (None: a world of one).

        Differentiable w.r.t. ``output_tensor``; a shared prompt row used by G responses receives
        the sum of their gradients, as its G copies do in the copied form.
        """
        b = self.batch
        if not logits_at_labels_only:
            if b.label_rows is not None:  # each slot reads the logits row that predicts it
                B, T = b.labels.shape
                output_tensor = output_tensor.reshape(B * T, -1).index_select(0, b.label_rows).view(B, T, -1)
            return vocab_parallel_logprobs_and_entropy(
                output_tensor, b.labels, vocab_size=vocab_size, temperature=temperature, tp_group=tp_group
            )
        labels = b.labels.reshape(-1).index_select(0, self.label_index).unsqueeze(0)  # [1, N]
        lp, ent = vocab_parallel_logprobs_and_entropy(
            output_tensor, labels, vocab_size=vocab_size, temperature=temperature, tp_group=tp_group
        )
        zeros = lp.new_zeros(b.labels.numel())
        return tuple(zeros.index_copy(0, self.label_index, x[0]).view(b.labels.shape) for x in (lp, ent))


def _cut(samples: list[Sample], plan: ActorPlan, share: bool) -> tuple[list[list[int]], int]:
    """Model calls of one caller micro-batch (sample-index groups) and the tokens they compute."""
    segs = prompt_segments(samples, share)
    lens = [segment_length(samples, seg) for seg in segs]
    pad = plan.padding
    if plan.length_buckets:
        groups = group_by_length(lens, overhead_tokens=plan.length_bucket_overhead_tokens, **pad)
        cost = sum(padded_tokens([lens[k] for k in g], layout="bshd", **pad) + plan.length_bucket_overhead_tokens
                   for g in groups)
    else:
        groups = [list(range(len(segs)))]
        cost = padded_tokens(lens, layout=plan.layout, **pad)
    return [[i for k in g for i in segs[k]] for g in groups], cost


def make_micro_batches(micro_batches: Sequence[Sequence[Sample]], plan: ActorPlan, *, device,
                       targets: Optional[Targets] = None) -> tuple[list[MicroBatch], list[int]]:
    """Pack the caller's micro-batches as the plan says (shared prompt, length buckets).

    Returns:
        ``(mbs, order)``: the packed micro-batches as run, and for each of their samples
        (in run order) its index in the caller's flattened micro-batches.

    Raises:
        ValueError: an empty list or an empty micro-batch; see :class:`MicroBatch`.
    """
    if len(micro_batches) == 0 or any(len(mb) == 0 for mb in micro_batches):
        raise ValueError("micro_batches must be a non-empty list of non-empty lists of Sample")
    runs, order, start = [], [], 0
    for mb in micro_batches:
        mb = list(mb)
        share = plan.shares_prompts
        groups, cost = _cut(mb, plan, share)
        if share and plan.shared_prompt == "auto":
            copied_groups, copied_cost = _cut(mb, plan, False)
            if copied_cost <= cost:  # sharing saves nothing here (e.g. no two samples share a prompt)
                share, groups = False, copied_groups
        for g in groups:
            runs.append(([mb[i] for i in g], share))
            order.extend(start + i for i in g)
        start += len(mb)
    mbs = [MicroBatch(s, plan, share_prompts=share, device=device, targets=targets) for s, share in runs]
    return mbs, order

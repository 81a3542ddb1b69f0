"""The step's training plan: which DP rank trains each kept response, in which micro-batches
(:func:`plan_step`), the responses' tokens sent there (:func:`route_step`), and that DP rank's
old-logprob micro-batches (:func:`old_logprob_micro_batches`). Design: docs/design.md §1 step 5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dapo_megatron.actor.dp_split import split_for_dp
from dapo_megatron.platform.parallel_dims import ParallelDims
from dapo_megatron.rollout.plan.step_data import send_tokens
from dapo_megatron.rollout.types import Group, Sample


@dataclass(frozen=True)
class MiniBatchPlan:
    """One mini-batch of the step: samples ``[start, start + size)`` of the step's flat list.

    Attributes:
        micro_batches: ``micro_batches[dp_rank][k]`` = the step-global sample indices of
            micro-batch ``k`` of that DP rank (every DP rank has the same count).
        global_num_tokens: loss tokens of the whole mini-batch (overlong-filtered samples
            count 0, a multi-turn sample its model tokens only: ``Sample.num_model_tokens``), the
            denominator of DAPO's token-mean loss (docs/design.md §3.4).
        total_tokens: prompt + response tokens of the mini-batch (for throughput).
    """

    start: int
    size: int
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    global_num_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class StepPlan:
    """The DP split of every mini-batch of a step, and the DP rank that trains each sample."""

    mini_batches: tuple[MiniBatchPlan, ...]
    owner: tuple[int, ...]

    def owned(self, dp_rank: int) -> list[int]:
        """Step-global indices of the samples DP rank ``dp_rank`` trains, ascending."""
        return [i for i, d in enumerate(self.owner) if d == dp_rank]


def plan_step(groups: Sequence[Group], groups_per_mini_batch: int, dp_size: int,
              max_tokens_per_micro_batch: int, *, share_prompts: bool = False) -> StepPlan:
    """Cut the step's groups into mini-batches and split each over DP (no communication).

    Mini-batch ``m`` holds groups ``[m * groups_per_mini_batch, (m + 1) * groups_per_mini_batch)``
    (the last may be smaller); its samples are split with
    :func:`~dapo_megatron.actor.dp_split.split_for_dp` from their lengths alone, so every
    rank computes the same plan, and every PPO epoch reuses it. ``share_prompts``: as there
    (the actor encodes a prompt once per micro-batch).

    Raises:
        ValueError: as :func:`~dapo_megatron.actor.dp_split.split_for_dp`.
    """
    samples = [s for g in groups for s in g.samples]
    owner = [-1] * len(samples)
    minis, start = [], 0
    for first in range(0, len(groups), groups_per_mini_batch):
        mini = [s for g in groups[first:first + groups_per_mini_batch] for s in g.samples]
        split = split_for_dp(mini, dp_size, max_tokens_per_micro_batch, share_prompts=share_prompts)
        micro = tuple(tuple(tuple(start + i for i in mb) for mb in rank_mbs) for rank_mbs in split)
        for dp_rank, rank_mbs in enumerate(micro):
            for mb in rank_mbs:
                for i in mb:
                    owner[i] = dp_rank
        minis.append(MiniBatchPlan(
            start=start, size=len(mini), micro_batches=micro,
            global_num_tokens=sum(s.num_model_tokens for s in mini if not s.loss_mask_zero),
            total_tokens=sum(s.total_length for s in mini)))
        start += len(mini)
    return StepPlan(mini_batches=tuple(minis), owner=tuple(owner))



def old_logprob_micro_batches(plan: StepPlan, mine: Sequence[int], dp_rank: int, max_tokens_per_micro_batch: int,
                              local: Sequence[Sample], *, share_prompts: bool = False,
                              equal_counts: bool = False) -> list[list[int]]:
    """The micro-batches of this DP rank's old-logprob (forward-only) pass, as indices into
    ``mine`` (= into ``local``, this rank's samples ``[samples[i] for i in mine]``).

    ``equal_counts=False`` (dense models): ``local`` packed anew by the budget
    (:func:`~dapo_megatron.actor.dp_split.split_for_dp` at one rank): the fewest forwards; a
    dense model's forward has no collective across DP ranks, so counts may differ.
    ``equal_counts=True`` (``ParallelDims.experts_span_dp``: an MoE whose EP all-to-all reaches
    other DP shards): the plan's training micro-batches of ``dp_rank``, mini-batch after
    mini-batch, whose counts :func:`plan_step` makes equal on every DP rank; packing anew could
    give the ranks different counts, and the rank with more forwards would wait forever in the
    all-to-all of a forward the others never run.

    Every index of ``range(len(mine))`` appears exactly once.
    """
    if not equal_counts:
        return split_for_dp(local, 1, max_tokens_per_micro_batch, share_prompts=share_prompts)[0]
    position = {i: j for j, i in enumerate(mine)}
    return [[position[i] for i in mb] for mini in plan.mini_batches for mb in mini.micro_batches[dp_rank]]


def route_step(groups: Sequence[Group], samples: Sequence[Sample], parallel: ParallelDims, groups_per_mini_batch: int,
               max_tokens_per_micro_batch: int, *, share_prompts: bool = False,
               routes: Optional[tuple[int, int, torch.dtype]] = None) -> tuple[StepPlan, list[int]]:
    """The step's plan (:func:`plan_step`) and every sample's tokens sent to the ranks of the DP
    rank that trains it (:func:`send_tokens`, with ``Sample.routes`` when ``routes`` is given:
    routing replay); collective. ``samples``: every sample of
    ``groups``, group by group. Returns ``(plan, mine)``: the plan and the indices into
    ``samples`` of this DP rank's samples (:meth:`StepPlan.owned`).

    Raises:
        ValueError: as :func:`plan_step`.
    """
    plan = plan_step(groups, groups_per_mini_batch, parallel.dp_size, max_tokens_per_micro_batch,
                     share_prompts=share_prompts)
    ranks_of = [parallel.ranks_of_dp_rank(d) for d in range(parallel.dp_size)]
    send_tokens(samples, [ranks_of[d] for d in plan.owner], parallel=parallel, routes=routes)
    return plan, plan.owned(parallel.dp_rank)

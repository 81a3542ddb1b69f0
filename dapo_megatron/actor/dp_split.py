"""Split a training batch across data-parallel ranks and into token-budget micro-batches.

Every DP rank must run the same number of micro-batches (forward/backward collectives and
the pipeline schedule would otherwise hang), and ranks should carry similar token counts
(the slowest rank sets the step time). With DAPO's token-level loss the result does not
depend on the split: the loss is normalised by the mini-batch-global token count.

``split_for_dp`` is deterministic (ties broken by sample index), so every rank computes
the same plan from the same all-gathered samples without communication.

Algorithm:
  1. ranks: longest-processing-time greedy — samples by decreasing ``total_length``, each
     to the rank with the fewest tokens so far (ties: fewer samples, then lower rank);
  2. micro-batches per rank: first-fit-decreasing bin packing with capacity
     ``max_tokens_per_micro_batch`` (verl ``ppo_max_token_len_per_gpu`` /
     ``use_dynamic_bsz``); a sample longer than the budget gets a micro-batch of its own
     (with a warning);
  3. equal counts: ranks with fewer micro-batches than the maximum split their heaviest
     splittable micro-batch in two (balanced by tokens) until the counts match;
  4. fallback, when a rank of step 1 holds fewer samples than another rank's micro-batch
     count (e.g. one very long sample alone on a rank): the whole batch is packed
     first-fit-decreasing, micro-batches are split until their count K is a multiple of
     ``dp_size`` and whole micro-batches are dealt K / dp_size per rank, heaviest first to
     the lightest rank with room (token balance within one micro-batch, with a warning).
     Any plan needs ``dp_size`` equal counts of non-empty micro-batches, so a plan exists iff
     some multiple of ``dp_size`` lies between the minimum micro-batch count of the batch and
     the number of samples; the fallback fails only when its first-fit-decreasing count,
     rounded up to a multiple of ``dp_size``, exceeds the number of samples.

With ``share_prompts`` the unit of steps 1-4 is an *item*, a prompt's group of samples,
weighted by the tokens the shared-prompt forward computes (the prompt once plus every
response); a group is cut into two items only where it overflows the budget or where a
split needs it (an item for every rank; a micro-batch holding a single group).

Design: docs/design.md §3.4 (exact under any micro-batch or DP split).
"""

from __future__ import annotations

import heapq
import warnings
from typing import Sequence

from dapo_megatron.rollout.types import Sample


def _lengths(samples: Sequence[Sample]) -> list[int]:
    return [s.total_length for s in samples]


class _Items:
    """What the planner places: lists of sample indices that must share a micro-batch, with the
    tokens each computes. Without shared prompts every sample is its own item (weight prompt +
    response, item index = sample index); with them, the samples of one prompt form one item
    (weight: the prompt once plus every response), cut in order into items that fit the budget."""

    def __init__(self, samples: Sequence[Sample], budget: int, share_prompts: bool):
        self.samples = samples
        self.items: list[list[int]] = []
        if not share_prompts:
            self.items = [[i] for i in range(len(samples))]
        else:
            by_prompt: dict[tuple, list[int]] = {}
            for i, s in enumerate(samples):
                by_prompt.setdefault(tuple(s.prompt_ids), []).append(i)
            for idx in by_prompt.values():
                cur: list[int] = []
                for i in idx:
                    if cur and self._weight(cur + [i]) > budget:
                        self.items.append(cur)
                        cur = []
                    cur.append(i)
                self.items.append(cur)
        self.weights = [self._weight(it) for it in self.items]

    def _weight(self, item: list[int]) -> int:
        return len(self.samples[item[0]].prompt_ids) + sum(self.samples[i].response_length for i in item)

    def split(self, k: int) -> tuple[int, int]:
        """Cut item ``k`` (>= 2 samples) into two new items, balanced by tokens; their indices."""
        a, b = _split_in_two(self.items[k], _lengths(self.samples))
        for part in (sorted(a), sorted(b)):
            self.items.append(part)
            self.weights.append(self._weight(part))
        return len(self.items) - 2, len(self.items) - 1

    def num_samples(self, mbs: list[list[int]]) -> int:
        return sum(len(self.items[it]) for mb in mbs for it in mb)

    def samples_of(self, mbs: list[list[int]]) -> list[list[int]]:
        return [sorted(i for it in mb for i in self.items[it]) for mb in mbs]


def _balance_ranks(lengths: list[int], dp_size: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, 0, r) for r in range(dp_size)]  # (tokens, num_samples, rank)
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        tokens, count, r = heapq.heappop(heap)
        ranks[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, r))
    return ranks


def _pack(indices: list[int], lengths: list[int], budget: int, warn: bool = True) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        if lengths[i] > budget:
            if warn:
                warnings.warn(f"sample {i} has {lengths[i]} tokens, more than max_tokens_per_micro_batch={budget}: "
                              "it gets a micro-batch of its own (raise the budget to avoid memory spikes)")
            bins.append([i])
            loads.append(lengths[i])
            continue
        for b in range(len(bins)):
            if loads[b] + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _split_in_two(mb: list[int], lengths: list[int]) -> tuple[list[int], list[int]]:
    a, b, la, lb = [], [], 0, 0
    for i in sorted(mb, key=lambda i: (-lengths[i], i)):
        if la <= lb:
            a.append(i)
            la += lengths[i]
        else:
            b.append(i)
            lb += lengths[i]
    return a, b


def _split_heaviest(mbs: list[list[int]], its: _Items) -> bool:
    """Split the heaviest micro-batch holding >= 2 samples in two, in place (a micro-batch of one
    group cuts the group into two items); False if none can be."""
    splittable = [k for k, mb in enumerate(mbs) if len(mb) >= 2 or len(its.items[mb[0]]) >= 2]
    if not splittable:
        return False
    k = max(splittable, key=lambda k: (sum(its.weights[i] for i in mbs[k]), -k))
    if len(mbs[k]) == 1:
        a, b = its.split(mbs[k][0])
        mbs[k:k + 1] = [[a], [b]]
    else:
        mbs[k:k + 1] = list(_split_in_two(mbs[k], its.weights))
    return True


def _deal_micro_batches(its: _Items, dp_size: int, budget: int) -> list[list[list[int]]]:
    """Step 4 of the module docstring: pack the whole batch, split to a multiple of dp_size, deal."""
    n = len(its.samples)
    mbs = _pack(list(range(len(its.items))), its.weights, budget, warn=False)
    total = -(-len(mbs) // dp_size) * dp_size
    if total > n:
        raise ValueError(f"the batch of {n} samples needs {len(mbs)} micro-batches of at most "
                         f"max_tokens_per_micro_batch={budget} tokens (first-fit-decreasing), and no multiple of "
                         f"dp_size={dp_size} between that and {n} (one non-empty micro-batch per sample at "
                         "most) lets every rank run the same count; raise the budget or the batch size")
    while len(mbs) < total:  # fewer micro-batches than samples: one holds >= 2
        _split_heaviest(mbs, its)
    per_rank = total // dp_size
    plan: list[list[list[int]]] = [[] for _ in range(dp_size)]
    heap = [(0, r) for r in range(dp_size)]  # (tokens, rank) of the ranks with room
    for mb in sorted(mbs, key=lambda mb: (-sum(its.weights[i] for i in mb), min(mb))):
        tokens, r = heapq.heappop(heap)
        plan[r].append(mb)
        if len(plan[r]) < per_rank:
            heapq.heappush(heap, (tokens + sum(its.weights[i] for i in mb), r))
    return plan


def split_for_dp(samples: Sequence[Sample], dp_size: int, max_tokens_per_micro_batch: int, *,
                 share_prompts: bool = False) -> list[list[list[int]]]:
    """Plan the DP split and micro-batches of one (mini-)batch.

    Args:
        samples: the batch, e.g. all ``N * G`` samples of a step (or of one mini-batch).
            Token count of a sample = ``Sample.total_length`` (prompt + response).
        dp_size: number of data-parallel ranks, >= 1.
        max_tokens_per_micro_batch: token budget of a packed micro-batch, >= 1.
        share_prompts: the actor encodes a prompt once per micro-batch
            (``actor.shared_prompt``): keep the samples of one prompt (a GRPO group) on one
            rank and in one micro-batch, and count the prompt once in the budget. A group
            is cut only where it overflows the budget, or where a split needs it.

    Returns:
        ``plan[rank][micro_batch]`` = sorted list of indices into ``samples``. Every sample
        appears exactly once, every micro-batch is non-empty, every rank has the same
        number of micro-batches, and a micro-batch exceeds the budget only when it holds a
        single over-long sample.

    Raises:
        ValueError: ``dp_size`` or the budget < 1; fewer samples than ``dp_size``; or the
            batch packs into so many micro-batches (first-fit-decreasing) that no multiple of
            ``dp_size`` fits between that count and the number of samples (step 4), naming
            both counts.

    Warns:
        UserWarning: a sample longer than the budget; the step-4 fallback (coarser balance).
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if (isinstance(max_tokens_per_micro_batch, bool) or not isinstance(max_tokens_per_micro_batch, int)
            or max_tokens_per_micro_batch < 1):
        raise ValueError(f"max_tokens_per_micro_batch must be an int >= 1, got {max_tokens_per_micro_batch!r}")
    if len(samples) < dp_size:
        raise ValueError(f"cannot split {len(samples)} samples over dp_size={dp_size} ranks: every rank needs at "
                         "least one sample; raise train_batch_size * n or lower the DP size")
    budget = max_tokens_per_micro_batch
    its = _Items(samples, budget, share_prompts)
    while len(its.items) < dp_size:  # every rank needs an item: cut the largest group
        k = max(range(len(its.items)), key=lambda k: (len(its.items[k]), -k))
        its.split(k)
        del its.items[k], its.weights[k]
    plan = [_pack(r, its.weights, budget) for r in _balance_ranks(its.weights, dp_size)]
    target = max(len(mbs) for mbs in plan)
    for mbs in plan:
        while len(mbs) < target and _split_heaviest(mbs, its):
            pass
    short = [r for r, mbs in enumerate(plan) if len(mbs) < target]
    if short:
        warnings.warn(f"DP rank {short[0]} of the token-balanced split holds {its.num_samples(plan[short[0]])} "
                      f"samples but another rank needs {target} micro-batches (max_tokens_per_micro_batch="
                      f"{max_tokens_per_micro_batch}): dealing whole micro-batches to the ranks instead, token "
                      "balance within one micro-batch")
        its = _Items(samples, budget, share_prompts)  # afresh: the split above cut some groups
        plan = _deal_micro_batches(its, dp_size, budget)
    return [its.samples_of(mbs) for mbs in plan]


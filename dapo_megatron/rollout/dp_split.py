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
     splittable micro-batch in two (balanced by tokens) until the counts match.

With ``share_prompts`` the unit of steps 1-3 is a prompt's group of samples instead of a
sample, weighted by the tokens the shared-prompt forward computes (the prompt once).
"""

from __future__ import annotations

import heapq
import warnings
from typing import Sequence

from dapo_megatron.rollout.types import Sample


def _lengths(samples: Sequence[Sample]) -> list[int]:
    return [s.total_length for s in samples]


# An *item* is what the planner places: a list of sample indices that must share a micro-batch,
# weighted by the tokens it computes. Without shared prompts every sample is its own item
# (weight prompt + response); with them, the samples of one prompt are one item (weight: the
# prompt once plus every response), cut into items that fit the budget where needed.


def _prompt_items(samples: Sequence[Sample], budget: int) -> list[list[int]]:
    """Samples with identical prompt_ids as items, in order of first appearance; a prompt whose
    responses overflow the budget is cut, in order, into items that fit (each with its prompt)."""
    by_prompt: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(i)
    items: list[list[int]] = []
    for idx in by_prompt.values():
        cur: list[int] = []
        for i in idx:
            if cur and _weight(samples, cur + [i]) > budget:
                items.append(cur)
                cur = []
            cur.append(i)
        items.append(cur)
    return items


def _weight(samples: Sequence[Sample], item: list[int]) -> int:
    """Tokens an item computes: its prompt once (all its samples share it) plus every response."""
    return len(samples[item[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in item)


def _balance_ranks(weights: list[int], dp_size: int) -> list[list[int]]:
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    heap = [(0, 0, r) for r in range(dp_size)]  # (tokens, num_items, rank)
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        tokens, count, r = heapq.heappop(heap)
        ranks[r].append(i)
        heapq.heappush(heap, (tokens + weights[i], count + 1, r))
    return ranks


def _pack(indices: list[int], weights: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-weights[i], i)):
        if weights[i] > budget:
            warnings.warn(f"sample {i} has {weights[i]} tokens, more than max_tokens_per_micro_batch={budget}: "
                          "it gets a micro-batch of its own (raise the budget to avoid memory spikes)")
            bins.append([i])
            loads.append(weights[i])
            continue
        for b in range(len(bins)):
            if loads[b] + weights[i] <= budget:
                bins[b].append(i)
                loads[b] += weights[i]
                break
        else:
            bins.append([i])
            loads.append(weights[i])
    return bins


def _split_in_two(mb: list[int], weights: list[int]) -> tuple[list[int], list[int]]:
    a, b, la, lb = [], [], 0, 0
    for i in sorted(mb, key=lambda i: (-weights[i], i)):
        if la <= lb:
            a.append(i)
            la += weights[i]
        else:
            b.append(i)
            lb += weights[i]
    return a, b


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
            is cut only where it overflows the budget, or where a rank needs more
            micro-batches (or the batch more items) than whole groups give.

    Returns:
        ``plan[rank][micro_batch]`` = sorted list of indices into ``samples``. Every sample
        appears exactly once, every micro-batch is non-empty, every rank has the same
        number of micro-batches, and a micro-batch exceeds the budget only when it holds a
        single over-long sample.

    Raises:
        ValueError: ``dp_size`` or the budget < 1; fewer samples than ``dp_size``; or a rank
            that cannot be cut into as many micro-batches as another rank needs (too few
            samples), naming both counts.
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
    items = _prompt_items(samples, budget) if share_prompts else [[i] for i in range(len(samples))]

    def split_item(k: int) -> None:  # item k -> two items (each keeps its own prompt)
        a, b = _split_in_two(items[k], _lengths(samples))
        items[k:k + 1] = [sorted(a), sorted(b)]

    while len(items) < dp_size:  # every rank needs an item: cut the largest group
        split_item(max(range(len(items)), key=lambda k: (len(items[k]), -k)))
    weights = [_weight(samples, it) for it in items]
    plan = [_pack(r, weights, budget) for r in _balance_ranks(weights, dp_size)]
    target = max(len(mbs) for mbs in plan)
    for rank, mbs in enumerate(plan):
        while len(mbs) < target:
            splittable = [k for k, mb in enumerate(mbs) if len(mb) >= 2 or len(items[mb[0]]) >= 2]
            if not splittable:
                n = sum(len(items[i]) for mb in mbs for i in mb)
                raise ValueError(f"DP rank {rank} holds {n} samples but every rank needs {target} micro-batches "
                                 f"(max_tokens_per_micro_batch={max_tokens_per_micro_batch}); raise the budget or "
                                 "the batch size so each rank has at least as many samples as micro-batches")
            k = max(splittable, key=lambda k: (sum(weights[i] for i in mbs[k]), -k))
            if len(mbs[k]) == 1:  # one group alone: cut it into two items
                a, b = _split_in_two(items[mbs[k][0]], _lengths(samples))
                items.extend([sorted(a), sorted(b)])
                weights.extend([_weight(samples, sorted(a)), _weight(samples, sorted(b))])
                mbs[k:k + 1] = [[len(items) - 2], [len(items) - 1]]
            else:
                a, b = _split_in_two(mbs[k], weights)
                mbs[k:k + 1] = [a, b]
    return [[sorted(i for it in mb for i in items[it]) for mb in mbs] for mbs in plan]


def padding_stats(samples: Sequence[Sample], plan: list[list[list[int]]], *, pad_to_multiple: int = 1,
                  packed_sequence_multiple: int = 1) -> dict[str, float]:
    """Padding share of the training tokens under two layouts of the same ``plan``.

    (a) padded: each micro-batch is a ``[mb_size, max_len]`` tensor, max_len rounded up
        to ``pad_to_multiple``; padding = everything that is not a real token.
    (b) packed (THD, sequence packing): sequences are concatenated; each sequence is
        padded to a multiple of ``packed_sequence_multiple`` (Megatron needs 2 * CP size with
        context parallelism, 1 otherwise) and the packed buffer to ``pad_to_multiple``
        (e.g. the TP size with sequence parallelism). With both multiples 1 it is 0.

    Returns:
        ``padding/real_tokens``; ``padding/padded_tokens`` and ``padding/padded_share``
        (= padding tokens / tokens computed) for (a); ``padding/packed_tokens`` and
        ``padding/packed_share`` for (b); ``dp/token_imbalance`` = max / mean real tokens per
        rank (1.0 = perfect balance); ``dp/micro_batches_per_rank``.
    """
    for name, v in (("pad_to_multiple", pad_to_multiple), ("packed_sequence_multiple", packed_sequence_multiple)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    def up(x: int, m: int) -> int:
        return -(-x // m) * m

    lengths = _lengths(samples)
    real = padded = packed = 0
    rank_tokens = []
    for mbs in plan:
        rank_real = 0
        for mb in mbs:
            ls = [lengths[i] for i in mb]
            rank_real += sum(ls)
            padded += len(ls) * up(max(ls), pad_to_multiple)
            packed += up(sum(up(x, packed_sequence_multiple) for x in ls), pad_to_multiple)
        rank_tokens.append(rank_real)
        real += rank_real
    mean_rank = real / len(plan) if plan else 0.0
    return {
        "padding/real_tokens": float(real),
        "padding/padded_tokens": float(padded),
        "padding/padded_share": (padded - real) / padded if padded else 0.0,
        "padding/packed_tokens": float(packed),
        "padding/packed_share": (packed - real) / packed if packed else 0.0,
        "dp/token_imbalance": max(rank_tokens) / mean_rank if mean_rank else 1.0,
        "dp/micro_batches_per_rank": float(len(plan[0])) if plan else 0.0,
    }

"""The step's data path across ranks: decisions replicated, token data sent once (docs/design.md §1).

Every rank keeps a :class:`~dapo_megatron.rollout.types.Sample` record of every response of
the step, so the replicated logic (the dynamic-sampling buffer, the advantages, the DP plan)
runs identically everywhere without further communication. The token lists of a response
(``response_ids``, ``rollout_logprobs``) stay on the rank that generated it
(``Sample.holder``; None elsewhere, the length in ``Sample.num_response_tokens``) until the
step's plan names the DP rank that trains it; then they travel once, as tensors, to the
TP × PP ranks of that DP rank. In order:

1. :func:`gather_groups`, per generation batch: an all-gather of ``3 + 3n`` int64 per
   group (DP rank, position, prompt index; each response's length, finish reason and count of
   context tokens, ``Sample.num_context_tokens``: 0 but for a multi-turn trajectory's).
   Prompt ids and grading inputs come from the dataset, which every rank holds.
2. :class:`~dapo_megatron.rewards.distributed.DistributedGrader`, per generation batch: each
   response graded on the rank that holds it, the grades replicated.
3. The actor's plan of the step (:mod:`dapo_megatron.actor.step_plan`), from the replicated
   lengths: the DP rank that trains each sample.
4. :func:`send_tokens`, once per step: one ``all_to_all_single`` of int32 words (the
   token ids, then the float32 bits of the rollout logprobs, then, for a sample with context
   tokens, its ``response_mask``) from each holder to the ranks of the owning DP rank (3 and 4
   together: :func:`~dapo_megatron.actor.step_plan.route_step`).

The old logprobs are then computed on the ranks that train each sample and stay there; their
mismatch metrics are pooled over DP as sums
(:func:`~dapo_megatron.rollout.sampling.buffer.logprob_mismatch_metrics`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from dapo_megatron.platform import collectives
from dapo_megatron.platform.distributed import collective_device
from dapo_megatron.platform.parallel_dims import ParallelDims, dims_or_single
from dapo_megatron.rollout.engines.routes import num_route_tokens, route_words, routes_from_words, routes_to_words
from dapo_megatron.rollout.types import HELD_BY_ALL, Group, Sample

FINISH_REASONS = ("stop", "length")
"""The finish reasons an engine reports (``rollout.engine.Completion``), coded by position."""


def all_gather_rows(rows: torch.Tensor, max_rows: Optional[int] = None, *, group) -> list[tuple[int, list[int]]]:
    """Every rank's rows of an int64 record table on every rank; a collective over ``group``.

    Args:
        rows: ``[k, w]`` int64 on this rank (``k`` may differ between ranks, ``w`` may not).
        max_rows: a bound on every rank's ``k``, the same on every rank: one all-gather of the
            padded tables; None: the row counts are all-gathered first (two collectives).
        group: the process group (``parallel.world_group`` for the world).

    Returns:
        ``(source rank, row)`` for every row of every rank, in rank order, each rank's rows in
        its order (ranks of ``group``).

    Raises:
        ValueError: more than ``max_rows`` rows here.
    """
    world = collectives.group_size(group)
    k, width = rows.shape
    if world == 1:
        return [(dist.get_rank(group) if dist.is_initialized() else 0, row) for row in rows.tolist()]
    if max_rows is not None and k > max_rows:
        raise ValueError(f"{k} rows, more than max_rows={max_rows}")
    dev = collective_device(group)
    if max_rows is None:
        counts = [torch.empty(1, dtype=torch.int64, device=dev) for _ in range(world)]
        collectives.all_gather(counts, torch.tensor([k], dtype=torch.int64, device=dev), group=group)
        max_rows = int(max(int(c) for c in counts))
    padded = torch.zeros((max_rows, 1 + width), dtype=torch.int64)  # column 0 marks a real row
    padded[:k, 0] = 1
    padded[:k, 1:] = rows
    parts = [torch.empty_like(padded, device=dev) for _ in range(world)]
    collectives.all_gather(parts, padded.to(dev), group=group)
    return [(src, row[1:]) for src, part in enumerate(parts) for row in part.cpu().tolist() if row[0]]


# --------------------------------------------------------------------------- 1. generation
def gather_groups(local: Sequence[tuple[int, int, Group]], *, n: int, max_local: int,
                  record_of: Callable[[int], Any], parallel: Optional[ParallelDims] = None) -> list[Group]:
    """Every group of one generation batch on every rank, the token lists only where generated.

    A collective over the world. Each rank passes the groups it generated, with their DP
    rank and position in that DP rank's share of the batch; every rank gets all groups
    ordered by (DP rank, position). Its own groups are returned as given (``holder`` set to
    this rank); the others are built from their prompt's dataset record and the gathered
    lengths and finish reasons, without token lists (``holder`` = the generating rank).

    Args:
        local: ``(dp_rank, position, group)`` per group generated here, each with ``n``
            complete samples (``prompt_index`` set).
        n: responses per group.
        max_local: the most groups any rank generated (the same on every rank).
        record_of: prompt index → its dataset record (``PromptRecord``: ``prompt_ids``,
            ``data_source``, ``ground_truth``, ``extra_info``, ``index``).
        parallel: the run's layout (its world group); None: a world of one.

    Returns:
        The batch's groups; ``group_id`` is left for the caller to number.

    Raises:
        ValueError: more than ``max_local`` local groups, a group without ``n`` samples, or
            an unknown finish reason; ``parallel`` None in a world of more than one rank.
    """
    parallel = dims_or_single(parallel, "gather_groups")
    rank = parallel.rank
    if len(local) > max_local:
        raise ValueError(f"{len(local)} local groups, more than max_local={max_local}")
    rows = torch.zeros((len(local), 3 + 3 * n), dtype=torch.int64)
    for k, (dp_rank, position, g) in enumerate(local):
        if len(g.samples) != n:
            raise ValueError(f"group at DP rank {dp_rank}, position {position} has {len(g.samples)} samples, need {n}")
        for s in g.samples:
            if s.finish_reason not in FINISH_REASONS:
                raise ValueError(f"finish_reason={s.finish_reason!r} is not one of {FINISH_REASONS}")
            s.holder = rank
        rows[k] = torch.tensor([dp_rank, position, g.samples[0].prompt_index]
                               + [s.response_length for s in g.samples]
                               + [FINISH_REASONS.index(s.finish_reason) for s in g.samples]
                               + [s.num_context_tokens for s in g.samples])
    mine = {(dp_rank, position): g for dp_rank, position, g in local}
    entries = sorted((row[0], row[1], src, row) for src, row in all_gather_rows(rows, max_rows=max_local,
                                                                                   group=parallel.world_group))
    groups = []
    for dp_rank, position, src, row in entries:
        if src == rank:
            groups.append(mine[(dp_rank, position)])
            continue
        rec = record_of(row[2])
        groups.append(Group(-1, [
            Sample(prompt_ids=list(rec.prompt_ids), response_ids=None, rollout_logprobs=None,
                   finish_reason=FINISH_REASONS[finish], prompt_index=rec.index, data_source=rec.data_source,
                   ground_truth=rec.ground_truth,
                   extra_info=dict(rec.extra_info) if rec.extra_info is not None else None,
                   holder=src, num_response_tokens=length, num_context_tokens=context)
            for length, finish, context in zip(row[3:3 + n], row[3 + n:3 + 2 * n], row[3 + 2 * n:])
        ]))
    return groups


# --------------------------------------------------------------------------- 4. the tokens (2: rewards.distributed, 3: actor.step_plan)
def send_tokens(samples: Sequence[Sample], destinations: Sequence[Sequence[int]], *,
                parallel: Optional[ParallelDims] = None, routes: Optional[tuple[int, int, torch.dtype]] = None) -> int:
    """Deliver each sample's token lists from its holder to the ranks of ``destinations[i]``.

    A collective over the world of ``parallel`` (None: a world of one; global ranks): every
    rank passes the same samples (records) and destinations. Sample ``i`` travels from
    ``samples[i].holder`` to every destination other than the holder, as int32 words:
    ``response_ids`` then the float32 bits of ``rollout_logprobs`` (exact for the engines'
    float32 logprobs), then, when the sample has context tokens (``num_context_tokens > 0``, a
    replicated count, so the receiver knows), its ``response_mask``, all pairs in one
    ``all_to_all_single``. A sample held by every rank
    (:data:`~dapo_megatron.rollout.types.HELD_BY_ALL`) does not travel. On arrival the
    receiver's record gets the lists.

    ``routes = (L, K, dtype)`` (routing replay; a
    :class:`~dapo_megatron.rollout.engines.routes.RoutesLayout` reads so): ``Sample.routes``
    (``[P + R - 1, L, K]`` of ``dtype``) travels too, its bytes after the logprobs in the same words
    (:func:`~dapo_megatron.rollout.engines.routes.routes_to_words`).

    Returns:
        The bytes this rank received.

    Raises:
        ValueError: a holder without the token lists it should send (or, with ``routes``, without
            routes of that shape); ``parallel`` None in a world of more than one rank.
    """
    parallel = dims_or_single(parallel, "send_tokens")
    rank, world, group = parallel.rank, parallel.world_size, parallel.world_group
    if world == 1:
        return 0

    def n_routes(s: Sample) -> int:
        return num_route_tokens(len(s.prompt_ids), s.response_length)

    def n_mask(s: Sample) -> int:  # the mask's words: a multi-turn sample's only
        return s.response_length if s.num_context_tokens else 0

    words = [2 * s.response_length + n_mask(s) + (route_words(n_routes(s), *routes[:3]) if routes else 0)
             for s in samples]
    send_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    recv_plan: list[list[int]] = [[] for _ in range(world)]  # per source: the sample indices, in order
    for i, (s, dests) in enumerate(zip(samples, destinations)):
        if s.holder == HELD_BY_ALL:
            continue
        for dst in dests:
            if dst == s.holder:
                continue
            if s.holder == rank:
                if s.response_ids is None or s.rollout_logprobs is None:
                    raise ValueError(f"sample {i} is held by rank {rank}, which has no token lists for it")
                send_parts[dst].append(torch.tensor(s.response_ids, dtype=torch.int32))
                send_parts[dst].append(torch.tensor(s.rollout_logprobs, dtype=torch.float32).view(torch.int32))
                if n_mask(s):
                    send_parts[dst].append(torch.tensor(s.loss_token_mask(), dtype=torch.int32))
                if routes:
                    want = (n_routes(s), routes[0], routes[1])
                    if s.routes is None or tuple(s.routes.shape) != want or s.routes.dtype != routes[2]:
                        raise ValueError(f"sample {i} is held by rank {rank} with routes "
                                         f"{None if s.routes is None else tuple(s.routes.shape)}, need {want} "
                                         f"of {routes[2]} (routing replay)")
                    send_parts[dst].append(routes_to_words(s.routes))
            elif dst == rank:
                recv_plan[s.holder].append(i)
    send_sizes = [sum(p.numel() for p in parts) for parts in send_parts]
    recv_sizes = [sum(words[i] for i in idx) for idx in recv_plan]
    dev = collective_device(group)
    flat = [p for parts in send_parts for p in parts]
    send = torch.cat(flat).to(dev) if flat else torch.zeros(0, dtype=torch.int32, device=dev)
    recv = torch.empty(sum(recv_sizes), dtype=torch.int32, device=dev)
    collectives.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group)
    recv = recv.cpu()
    offset = 0
    for idx in recv_plan:
        for i in idx:
            length = samples[i].response_length
            samples[i].response_ids = recv[offset:offset + length].tolist()
            samples[i].rollout_logprobs = recv[offset + length:offset + 2 * length].view(torch.float32).tolist()
            end = offset + 2 * length + n_mask(samples[i])
            if n_mask(samples[i]):
                samples[i].response_mask = recv[offset + 2 * length:end].tolist()
            if routes:
                samples[i].routes = routes_from_words(recv[end:offset + words[i]],
                                                      n_routes(samples[i]), *routes[:3])
            offset += words[i]
    return 4 * recv.numel()


def gather_preds(samples: Sequence[Sample], *, parallel: Optional[ParallelDims] = None, dst: int = 0) -> None:
    """Give rank ``dst`` the ``pred`` (extracted answer) of every sample from its holder; a
    collective over the world of ``parallel`` (None: a world of one, nothing to do; small python
    objects, for checkpoints and logs only)."""
    parallel = dims_or_single(parallel, "gather_preds")
    if parallel.world_size == 1:
        return
    mine = {i: s.pred for i, s in enumerate(samples) if s.holder == parallel.rank}
    parts = parallel.gather_objects(mine, "world", dst=dst)
    if parts is not None:  # on dst only
        for part in parts:
            for i, pred in part.items():
                samples[i].pred = pred

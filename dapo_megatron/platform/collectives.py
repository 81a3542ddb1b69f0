"""Every ``torch.distributed`` collective of the package, each over an explicit process group.

The package calls no collective of ``torch.distributed`` outside ``platform/``
(``tests/unit/platform/test_collectives.py`` scans the source): code that holds the run's
:class:`~.parallel_dims.ParallelDims` calls its methods, which name the group
(``parallel.broadcast_object(obj, "world")``, ``parallel.all_reduce(t, "dp")``); code handed
a bare group (the TP group of the logprob kernels, an engine's rollout group, the weight-update
group of the SGLang servers) calls the functions here with it. ``group`` is required and never
None: the world is ``torch.distributed.group.WORLD`` (:attr:`ParallelDims.world_group`), so
no call reaches the default group by omission.

Devices: a tensor collective is handed tensors on ``collective_device(group)``
(:mod:`.distributed`; NCCL: this rank's CUDA device, gloo: the host) by the caller, as before.
The object collectives pickle into a byte tensor that torch places itself: on
``torch.cuda.current_device()`` for an NCCL group (set by ``init_distributed``), on the host for
gloo (``torch/distributed/distributed_c10d.py``, ``_object_to_tensor`` and its callers).

Ranks: ``src`` / ``dst`` are global ranks, as in torch's collectives.

Design: docs/design.md §2 (parallel layouts: the process groups) and §5.1 (gloo on CPU).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


def _require(group: Any, op: str) -> Any:
    """``group``; a None group is refused once ``torch.distributed`` runs (it would be the default
    group). Without it (a world of one) None is the only group there is."""
    if group is None and dist.is_initialized():
        raise TypeError(f"{op}: group=None would be the default world group; pass the group explicitly "
                        "(ParallelDims.world_group for the world)")
    return group


def group_size(group: Any) -> int:
    """Ranks in ``group``; 1 when ``torch.distributed`` is not initialised (a world of one).

    Raises:
        TypeError: ``group`` is None while ``torch.distributed`` runs (so in every function here:
            the default group is never implied).
    """
    return dist.get_world_size(_require(group, "group_size")) if dist.is_initialized() else 1


def broadcast_object(obj: Any, *, group: Any, src: int = 0) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (pickled; small objects only).

    Returns ``obj`` itself on ``src`` and in a group of one (no communication)."""
    if group_size(_require(group, "broadcast_object")) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj: Any, *, group: Any) -> list[Any]:
    """Every rank's ``obj``, in the rank order of ``group``, on every rank of it."""
    world = group_size(_require(group, "all_gather_objects"))
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_objects(obj: Any, *, group: Any, dst: int = 0) -> Optional[list[Any]]:
    """Every rank's ``obj`` on global rank ``dst`` (group rank order); None on the other ranks."""
    world = group_size(_require(group, "gather_objects"))
    if world == 1:
        return [obj]
    parts: Optional[list[Any]] = [None] * world if dist.get_rank() == dst else None
    dist.gather_object(obj, parts, dst=dst, group=group)
    return parts


def barrier(*, group: Any) -> None:
    """Wait until every rank of ``group`` reaches here (nothing in a group of one)."""
    if group_size(_require(group, "barrier")) > 1:
        dist.barrier(group=group)


def all_reduce(tensor: torch.Tensor, *, group: Any, op=ReduceOp.SUM) -> torch.Tensor:
    """``tensor`` reduced in place over ``group`` (``torch.distributed.all_reduce``, synchronous)
    and returned; in a group of one it already is the result (no communication)."""
    if group_size(_require(group, "all_reduce")) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def broadcast(tensor: torch.Tensor, *, src: int, group: Any, async_op: bool = False):
    """``tensor`` of global rank ``src`` copied in place on every rank of ``group``; the work handle
    when ``async_op``. Always communicates (the weight-update groups of the SGLang servers have
    ranks outside this ``torch.distributed`` world's view of sizes)."""
    return dist.broadcast(tensor, src=src, group=_require(group, "broadcast"), async_op=async_op)


def all_gather(parts: Sequence[torch.Tensor], tensor: torch.Tensor, *, group: Any, async_op: bool = False):
    """Every rank's ``tensor`` into ``parts`` (one per rank of ``group``, same shape and dtype)."""
    return dist.all_gather(list(parts), tensor, group=_require(group, "all_gather"), async_op=async_op)


def all_gather_into_tensor(out: torch.Tensor, tensor: torch.Tensor, *, group: Any, async_op: bool = False):
    """Every rank's ``tensor`` concatenated into ``out`` (``world * tensor.numel()`` elements)."""
    return dist.all_gather_into_tensor(out, tensor, group=_require(group, "all_gather_into_tensor"),
                                       async_op=async_op)


def all_to_all_single(out: torch.Tensor, tensor: torch.Tensor, *, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], group: Any) -> None:
    """``tensor``'s ``input_split_sizes[r]`` slice to rank ``r`` of ``group``, into ``out`` by
    ``output_split_sizes`` (``torch.distributed.all_to_all_single``)."""
    dist.all_to_all_single(out, tensor, output_split_sizes=list(output_split_sizes),
                           input_split_sizes=list(input_split_sizes), group=_require(group, "all_to_all_single"))

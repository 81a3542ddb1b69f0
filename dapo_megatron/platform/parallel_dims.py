"""One frozen object with this rank's place in every parallel layout (torchtitan's ``ParallelDims``).

:func:`dapo_megatron.platform.init_distributed` builds megatron-core's process groups and
returns a :class:`ParallelDims`; the trainer hands it to the model builder, the actor, the
bridge, checkpointing and the engines, which read ranks, sizes and groups from it instead of
megatron-core's module-level ``parallel_state`` (read only in ``platform/distributed.py``).

Two layouts share the world (docs/design.md §2):

- the actor's: TP × PP × DP in megatron-core's default rank order (``tp-cp-ep-dp-pp``: the
  ranks of a TP group are consecutive); the model-parallel (MP) group is a DP rank's
  TP × PP ranks, which hold the same data. The MoE layers' experts use megatron-core's
  expert grid over the same ranks, ETP × EP × EDP × PP (EP groups cut across the dense DP and TP
  ranks of one stage, so the ranks of an EP group hold different data);
- the rollout's: the world cut into rollout groups of ``rollout_tp_size`` consecutive ranks on
  one node (verl's ``rollout.tensor_model_parallel_size``); each group owns one engine, whose
  leader is the group's first rank. With ``rollout_tp_size == 1`` every rank is its own engine.

The collectives over these groups are its methods (:meth:`ParallelDims.broadcast_object`,
:meth:`~ParallelDims.all_reduce`, ...), which name the group (``"world"``, ``"dp"``, ...) and call
:mod:`.collectives`; the package calls no ``torch.distributed`` collective elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from . import collectives

# the layout arithmetic that needs no process group: its home until the config went torch-free
from .parallel_config import ROLLOUT_TP_KEY, rollout_groups  # noqa: F401

@dataclass(frozen=True, eq=False)
class ParallelDims:
    """This rank's ranks, sizes and process groups; built by ``init_distributed``, never mutated.

    Sizes satisfy ``tp_size * pp_size * dp_size == world_size`` and
    ``mp_size == tp_size * pp_size``; ranks are 0-based within their group. A group of size
    one is still a process group (megatron-core's), except ``rollout_group``, which is None
    when ``rollout_tp_size == 1`` (nothing to talk to).

    Attributes:
        world_size, rank: the default (world) group.
        local_rank, local_world_size: this rank's index on its node and the ranks per node.
        tp_size, tp_rank, tp_group: tensor parallelism (Megatron's TP group).
        pp_size, pp_rank, pp_group: pipeline parallelism; ``pp_ranks`` are the global ranks of
            this rank's pipeline, stage 0 first.
        dp_size, dp_rank, dp_group: data parallelism (without context parallelism).
        dp_rank_of: the DP rank of every global rank (``dp_rank_of[r]``), so a rank can address
            the TP × PP ranks that train one DP shard (:meth:`ranks_of_dp_rank`).
        mp_size, mp_rank, mp_group: the model-parallel group (TP × PP ranks of one DP rank).
        rollout_tp_size: ranks per rollout engine.
        rollout_group_ranks: global ranks of this rank's rollout group (leader first).
        rollout_index: index of this rank's engine, ``0 .. num_engines - 1``.
        num_engines: ``world_size // rollout_tp_size``.
        rollout_group: a gloo group over ``rollout_group_ranks`` (None when
            ``rollout_tp_size == 1``).
        ep_size, ep_rank, ep_group: expert parallelism (megatron-core's expert grid
            ``etp-ep-edp-pp``): the ranks of one pipeline stage that split each MoE layer's
            experts; expert ``e`` lives on EP rank ``e // (num_experts / ep_size)`` as local
            expert ``e % (num_experts / ep_size)``. ``ep_ranks``: the group's global ranks in EP-rank
            order. Size 1 (and this rank alone) for a dense model.
        etp_size, etp_rank, etp_group: expert tensor parallelism (each expert's FFN split like
            TP); ``etp_size`` is the TP size unless ``parallel.expert_tensor_parallel_size`` says
            otherwise.
        wait_group: a gloo group over the world whose timeout is days (``distributed.GENERATION_WAIT``),
            not ``parallel.distributed_timeout_minutes``: ranks that generate nothing (a rollout
            group's other ranks, ranks driving no server, ranks 1..N of the async mode) wait there
            (:meth:`wait_for_generation`) until every rank's generation is done, so no NCCL
            collective is enqueued before its data exists and none waits out NCCL's watchdog.
            None in a world of one, and in layouts built by hand (the world group is used then).
    """

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    tp_size: int
    tp_rank: int
    tp_group: Any
    pp_size: int
    pp_rank: int
    pp_group: Any
    pp_ranks: tuple[int, ...]
    dp_size: int
    dp_rank: int
    dp_group: Any
    dp_rank_of: tuple[int, ...]
    mp_size: int
    mp_rank: int
    mp_group: Any
    rollout_tp_size: int
    rollout_group_ranks: tuple[int, ...]
    rollout_index: int
    num_engines: int
    rollout_group: Optional[Any] = None
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Optional[Any] = None
    ep_ranks: Optional[tuple[int, ...]] = None
    etp_size: Optional[int] = None
    etp_rank: Optional[int] = None
    etp_group: Optional[Any] = None
    wait_group: Optional[Any] = None

    def __post_init__(self) -> None:
        # a layout built without expert parallelism (tests, tools): EP of one, experts split as TP
        if self.ep_ranks is None:
            object.__setattr__(self, "ep_ranks", (self.rank,))
        if self.etp_size is None:
            object.__setattr__(self, "etp_size", self.tp_size)
            object.__setattr__(self, "etp_rank", self.tp_rank)
            object.__setattr__(self, "etp_group", self.tp_group)
        if self.world_size % (self.etp_size * self.ep_size * self.pp_size):
            raise ValueError(f"etp_size={self.etp_size} × ep_size={self.ep_size} × pp_size={self.pp_size} does not "
                             f"divide world_size={self.world_size}")
        for name, size in (("ep_rank", self.ep_size), ("etp_rank", self.etp_size)):
            if not 0 <= getattr(self, name) < size:
                raise ValueError(f"{name}={getattr(self, name)} is not in [0, {size})")
        if len(self.ep_ranks) != self.ep_size or self.ep_ranks[self.ep_rank] != self.rank:
            raise ValueError(f"ep_ranks={self.ep_ranks} must list the {self.ep_size} EP ranks with this rank "
                             f"({self.rank}) at ep_rank={self.ep_rank}")
        if self.tp_size * self.pp_size * self.dp_size != self.world_size:
            raise ValueError(f"tp_size={self.tp_size} × pp_size={self.pp_size} × dp_size={self.dp_size} "
                             f"!= world_size={self.world_size}")
        if self.mp_size != self.tp_size * self.pp_size:
            raise ValueError(f"mp_size={self.mp_size} != tp_size × pp_size = {self.tp_size * self.pp_size}")
        for name, size in (("rank", self.world_size), ("tp_rank", self.tp_size), ("pp_rank", self.pp_size),
                           ("dp_rank", self.dp_size), ("mp_rank", self.mp_size),
                           ("rollout_index", self.num_engines)):
            if not 0 <= getattr(self, name) < size:
                raise ValueError(f"{name}={getattr(self, name)} is not in [0, {size})")
        if (len(self.dp_rank_of) != self.world_size or self.dp_rank_of[self.rank] != self.dp_rank
                or sorted(self.dp_rank_of) != sorted(d for d in range(self.dp_size) for _ in range(self.mp_size))):
            raise ValueError(f"dp_rank_of={self.dp_rank_of} must give each of the {self.world_size} ranks a DP rank, "
                             f"{self.mp_size} ranks per DP rank, this rank's being dp_rank={self.dp_rank}")
        if len(self.pp_ranks) != self.pp_size or self.pp_ranks[self.pp_rank] != self.rank:
            raise ValueError(f"pp_ranks={self.pp_ranks} must list the {self.pp_size} stages with this rank "
                             f"({self.rank}) at pp_rank={self.pp_rank}")
        if (len(self.rollout_group_ranks) != self.rollout_tp_size or self.rank not in self.rollout_group_ranks
                or self.num_engines * self.rollout_tp_size != self.world_size):
            raise ValueError(f"rollout_group_ranks={self.rollout_group_ranks} must be the {self.rollout_tp_size} "
                             f"ranks of this rank's engine ({self.num_engines} engines × {self.rollout_tp_size} "
                             f"= world_size {self.world_size})")

    @property
    def is_pp_first(self) -> bool:
        """This rank holds the first pipeline stage (the embedding)."""
        return self.pp_rank == 0

    @property
    def is_pp_last(self) -> bool:
        """This rank holds the last pipeline stage (final norm, output layer, the loss)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last stage of this rank's pipeline (the source of its broadcasts)."""
        return self.pp_ranks[-1]

    def ranks_of_dp_rank(self, dp_rank: int) -> tuple[int, ...]:
        """Global ranks (ascending) of the model-parallel group that trains DP shard ``dp_rank``."""
        return tuple(r for r, d in enumerate(self.dp_rank_of) if d == dp_rank)

    @property
    def expert_owner(self) -> Optional[int]:
        """The EP rank whose experts this rank exports to one-rank-per-owner receivers
        (``rollout.mode: server`` at EP > 1, :func:`~dapo_megatron.bridge.iter_hf_weights` with
        ``expert_owners``): its ``ep_rank`` when its EP group holds a rank of DP shard 0 (expert-data-
        parallel rank 0: megatron-core's expert grid lays ``ep`` inside ``dp`` when ETP is TP, so DP
        shard 0's rank is in the first EP group), None where its experts are copies of those. The
        sender of those experts is the owner's expert-TP rank 0; its expert-TP peers gather with it."""
        return self.ep_rank if set(self.ep_ranks) & set(self.ranks_of_dp_rank(0)) else None

    @property
    def experts_span_dp(self) -> bool:
        """The MoE layers' collectives (the EP all-to-all, an expert-TP group wider than TP) reach
        ranks of other DP shards: every forward is then a collective across DP ranks, so forward-only
        passes too must run the same number of micro-batches on every DP rank (or hang)."""
        own = set(self.ranks_of_dp_rank(self.dp_rank))
        return not set(self.ep_ranks) <= own or self.etp_size > self.tp_size

    @property
    def rollout_leader(self) -> int:
        """Global rank that creates and drives this rank's engine (its group's first rank)."""
        return self.rollout_group_ranks[0]

    @property
    def rollout_rank(self) -> int:
        """This rank's index within its rollout group (0 on the leader)."""
        return self.rollout_group_ranks.index(self.rank)

    @property
    def is_rollout_leader(self) -> bool:
        return self.rank == self.rollout_leader

    # ------------------------------------------------------------------ collectives (platform/collectives.py)

    #: the group names the collectives take, with the attribute holding each group and its size
    GROUPS = {"world": ("world_group", "world_size"), "tp": ("tp_group", "tp_size"), "pp": ("pp_group", "pp_size"),
              "dp": ("dp_group", "dp_size"), "mp": ("mp_group", "mp_size"),
              "rollout": ("rollout_group", "rollout_tp_size"), "ep": ("ep_group", "ep_size"),
              "etp": ("etp_group", "etp_size"), "wait": ("generation_wait_group", "world_size")}

    @property
    def world_group(self) -> Any:
        """The world as an explicit group handle (``torch.distributed.group.WORLD``)."""
        return dist.group.WORLD

    @property
    def generation_wait_group(self) -> Any:
        """:attr:`wait_group`, or the world group in a layout built without one."""
        return self.wait_group if self.wait_group is not None else self.world_group

    def wait_for_generation(self) -> None:
        """Wait, on the gloo :attr:`wait_group`, until every rank has got here: call it after this
        rank's generation (or grading) and before the collective that gathers the results, so ranks
        with nothing to generate wait on the host, not inside an NCCL collective whose timeout
        (``parallel.distributed_timeout_minutes``) bounds one operation, not a generation batch."""
        self.barrier("wait")

    def group(self, name: str) -> Any:
        """The process group called ``name`` (a key of :attr:`GROUPS`).

        Raises:
            ValueError: ``name`` is not a group name.
        """
        return self._sized(name)[0]

    def _sized(self, name: str) -> tuple[Any, int]:
        if name not in self.GROUPS:
            raise ValueError(f"group={name!r} is none of {sorted(self.GROUPS)}")
        attr, size = self.GROUPS[name]
        return getattr(self, attr), getattr(self, size)

    def broadcast_object(self, obj: Any, group: str = "world", src: Optional[int] = None) -> Any:
        """``obj`` of global rank ``src`` (default: the group's first rank) on every rank of ``group``;
        returned as is in a group of one (no communication, also without ``torch.distributed``)."""
        handle, size = self._sized(group)
        if size == 1:
            return obj
        src = dist.get_global_rank(handle, 0) if src is None else src
        return collectives.broadcast_object(obj, group=handle, src=src)

    def all_gather_objects(self, obj: Any, group: str = "world") -> list[Any]:
        """Every rank's ``obj`` on every rank of ``group``, in its rank order (``[obj]`` in a group of one)."""
        handle, size = self._sized(group)
        return [obj] if size == 1 else collectives.all_gather_objects(obj, group=handle)

    def gather_objects(self, obj: Any, group: str = "world", dst: Optional[int] = None) -> Optional[list[Any]]:
        """Every rank's ``obj`` (group rank order) on global rank ``dst`` (default: the group's first
        rank); **None on every other rank**. ``[obj]`` in a group of one."""
        handle, size = self._sized(group)
        if size == 1:
            return [obj]
        dst = dist.get_global_rank(handle, 0) if dst is None else dst
        return collectives.gather_objects(obj, group=handle, dst=dst)

    def barrier(self, group: str = "world") -> None:
        """Wait for every rank of ``group`` (nothing in a group of one)."""
        handle, size = self._sized(group)
        if size > 1:
            collectives.barrier(group=handle)

    def all_reduce(self, tensor, group: str, op=collectives.ReduceOp.SUM):
        """``tensor`` reduced in place over ``group`` and returned (as is in a group of one). The
        tensor lives on ``collective_device(parallel.group(group))`` (the caller's part)."""
        handle, size = self._sized(group)
        return tensor if size == 1 else collectives.all_reduce(tensor, group=handle, op=op)

    def all_gather(self, tensor, group: str) -> list:
        """Every rank's ``tensor`` (same shape and dtype on all) in the rank order of ``group``."""
        handle, size = self._sized(group)
        if size == 1:
            return [tensor]
        parts = [tensor.new_empty(tensor.shape) for _ in range(size)]
        collectives.all_gather(parts, tensor, group=handle)
        return parts

    def broadcast(self, tensor, group: str, src: int) -> None:
        """``tensor`` of global rank ``src`` copied in place on every rank of ``group`` (nothing in a
        group of one)."""
        handle, size = self._sized(group)
        if size > 1:
            collectives.broadcast(tensor, src=src, group=handle)


def single_process() -> ParallelDims:
    """The layout of a world of one: rank 0, every size one, no process groups (a plain
    ``python`` process without ``torch.distributed``: unit tests, tools). Every collective of it
    returns without communicating."""
    return ParallelDims(world_size=1, rank=0, local_rank=0, local_world_size=1, tp_size=1, tp_rank=0, tp_group=None,
                        pp_size=1, pp_rank=0, pp_group=None, pp_ranks=(0,), dp_size=1, dp_rank=0, dp_group=None,
                        dp_rank_of=(0,), mp_size=1, mp_rank=0, mp_group=None, rollout_tp_size=1,
                        rollout_group_ranks=(0,), rollout_index=0, num_engines=1)


def dims_or_single(parallel: Optional[ParallelDims], what: str) -> ParallelDims:
    """``parallel``, or :func:`single_process` when it is None and no ``torch.distributed`` world of
    more than one rank runs.

    Raises:
        ValueError: ``parallel`` is None in a world of more than one rank (naming ``what``, the
            caller): its collectives need the run's layout.
    """
    if parallel is not None:
        return parallel
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{what}: pass parallel= (the run's ParallelDims from init_distributed) in a world of "
                         f"{dist.get_world_size()} ranks")
    return single_process()

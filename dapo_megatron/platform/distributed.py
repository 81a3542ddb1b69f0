"""Process groups and Megatron parallel state, the same way on CPU and GPU.

Under ``torchrun`` the usual ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
``MASTER_ADDR`` / ``MASTER_PORT`` variables are read; a plain ``python`` process
becomes a world of one. The backend is NCCL when CUDA is available and gloo
otherwise, in which case the CPU compatibility layer (:mod:`.cpu_compat`) is
activated before megatron-core is touched.

Design: docs/design.md §2 (parallel layouts) and §5.1 (gloo on CPU).
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import collectives, cpu_compat
from .parallel_config import ParallelConfig  # noqa: F401  (its home until the config went torch-free)
from .parallel_dims import ParallelDims, rollout_groups


GENERATION_WAIT = timedelta(days=7)
"""Timeout of the generation-wait group (:attr:`~.parallel_dims.ParallelDims.wait_group`): ranks that
generate nothing wait there for those that do, as long as generation takes (bounded by the engines'
own timeouts, e.g. ``rollout.server_silence_timeout_s``). Gloo fails the wait at once when a peer
process dies (its socket closes), so the bound only matters for a peer that hangs forever."""


_issued_ports: set[int] = set()
_issued_lock = threading.Lock()


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for single-process and test worlds), never one this process
    handed out before: the kernel may give a port it just gave again once its socket is closed, and
    two listeners started at once on such a port collide (the second fails to bind, and its clients
    reach the first: three rollout servers started together were seen to get two the same).

    Raises:
        RuntimeError: 100 ports in a row were ones handed out before.
    """
    with _issued_lock:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _issued_ports:
                _issued_ports.add(port)
                return port
    raise RuntimeError("free_port: the kernel gave 100 ports this process had handed out already")


def local_device_index() -> int:
    """CUDA device index of this rank: ``LOCAL_RANK % torch.cuda.device_count()``.

    Under torchrun every process of a node sees all its GPUs and ``LOCAL_RANK`` picks
    one. Under Slurm with one GPU per task (``CUDA_VISIBLE_DEVICES`` holds that GPU only)
    ``device_count()`` is 1 while ``LOCAL_RANK`` still counts the node's tasks, so the
    index is 0 on every rank, not ``LOCAL_RANK`` (an invalid device ordinal).

    Raises:
        RuntimeError: no CUDA device is visible.
    """
    count = torch.cuda.device_count()
    if count < 1:
        raise RuntimeError("local_device_index: no CUDA device is visible to this process "
                           "(check CUDA_VISIBLE_DEVICES and the container's --gpus flag)")
    return int(os.environ.get("LOCAL_RANK", "0")) % count


def device() -> torch.device:
    """The device this rank computes on: ``cuda:<local_device_index()>``, or ``cpu``.

    Every choice of a CUDA device in the package goes through here (the actor, the
    colocated engines' GPU, ``torch.cuda.set_device``), so they all agree.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", local_device_index())
    return torch.device("cpu")


def group_backend(group=None) -> str:
    """The backend name of ``group`` (``None``: the default group), e.g. ``"nccl"`` / ``"gloo"``."""
    return str(dist.get_backend(group)).lower()


def collective_device(group=None) -> torch.device:
    """The device of every tensor this package hands to a collective over ``group``.

    NCCL moves CUDA tensors only ("No backend type associated with device type cpu"
    for a CPU tensor), and they must be on this rank's device; gloo is given CPU tensors
    here. A tensor built for a collective (counts, metrics, broadcast buffers) is
    allocated with ``device=collective_device(group)``; tensors that already live on the
    compute device (parameters, activations) are on it whenever the backend is NCCL,
    because NCCL is only chosen when CUDA is available (:func:`init_distributed`).
    ``tests/integration/test_collective_devices.py`` checks every collective of an actor step and a
    trainer-like flow against this function under an NCCL answer.
    """
    return device() if group_backend(group) == "nccl" else torch.device("cpu")


def init_distributed(
    parallel: Optional[ParallelConfig] = None,
    seed: int = 1234,
    rollout_tp: int = 1,
) -> ParallelDims:
    """Initialise torch.distributed, Megatron's parallel state and its RNG streams.

    Idempotent for the same layout. Every rank must call it (it is collective).

    Args:
        parallel: TP/PP (and EP/ETP) sizes, DP derived from the world size; its
            ``distributed_timeout_minutes`` is the timeout of every group built here (the world,
            megatron-core's, the rollout groups), the generation-wait group excepted.
        seed: base seed; Megatron derives the TP-rank-specific streams from it
            (``model_parallel_cuda_manual_seed``).
        rollout_tp: ranks per rollout engine (``rollout.tensor_model_parallel_size``):
            the world is cut into groups of that many consecutive ranks on one node.

    Returns:
        This rank's :class:`~.parallel_dims.ParallelDims`: the only way the package reads
        ranks, sizes and groups (megatron-core's ``parallel_state`` is read here only).

    Raises:
        ValueError: the world size does not fit ``parallel`` (TP × PP, or ETP × EP × PP, does
            not divide it), or ``rollout_tp`` does not
            divide the world size and the ranks per node (naming
            ``rollout.tensor_model_parallel_size``).
    """
    # megatron-core here, not at the top: platform loads before quiet_third_party has silenced its import warnings
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel = parallel or ParallelConfig()
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_compat.activate()
    parallel.validate()
    timeout = timedelta(minutes=parallel.distributed_timeout_minutes)
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python script.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if use_cuda:
            torch.cuda.set_device(device())
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timeout)
    else:  # started by the caller: its world group gets the run's timeout too (torch's own setter)
        dist.set_timeout(timeout, dist.group.WORLD)
    parallel.check_world_size(dist.get_world_size())
    # before any group is built: a bad rollout layout stops every rank with the same error
    world = dist.get_world_size()
    # a launcher without LOCAL_WORLD_SIZE (not torchrun) is taken as one node
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    engines = rollout_groups(world, local_world, rollout_tp)
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() != parallel.tensor_model_parallel_size
            or parallel_state.get_pipeline_model_parallel_world_size()
            != parallel.pipeline_model_parallel_size
            or parallel_state.get_expert_model_parallel_world_size() != parallel.expert_model_parallel_size
            or parallel_state.get_expert_tensor_parallel_world_size() != parallel.etp_size
            or _MODEL_PARALLEL_TIMEOUT.get("timeout") != timeout
        ):
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.etp_size,
            # every group megatron-core builds (parallel_state.py initialize_model_parallel's
            # distributed_timeout_minutes=30 by default: 0.19.2 :616, used at :909; core_v0.16.1 :561, :819)
            distributed_timeout_minutes=parallel.distributed_timeout_minutes,
        )
        # ... but not EXPERT_DATA_PARALLEL_GROUP_GLOO, built without it (torch's gloo default, 30
        # minutes): parallel_state.py:1464-1467 in 0.19.2 (installed), core_v0.16.1 :1277-1280. Every
        # group megatron-core made (its _global_process_group_list, the list its own
        # update_pg_timeout walks) gets the run's timeout here.
        for group in parallel_state._global_process_group_list or ():
            if isinstance(group, dist.ProcessGroup) and group_backend(group) != "undefined":
                dist.set_timeout(timeout, group)
        _MODEL_PARALLEL_TIMEOUT["timeout"] = timeout
    model_parallel_cuda_manual_seed(seed)

    rank = dist.get_rank()
    index = rank // rollout_tp
    dp_rank = parallel_state.get_data_parallel_rank()
    # once per call: every rank's DP shard, for routing data to it
    dp_rank_of = collectives.all_gather_objects(dp_rank, group=dist.group.WORLD)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    mp_group = parallel_state.get_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    return ParallelDims(
        world_size=world,
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=local_world,
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_group=pp_group,
        pp_ranks=tuple(dist.get_process_group_ranks(pp_group)),
        dp_size=parallel_state.get_data_parallel_world_size(),
        dp_rank=dp_rank,
        dp_group=parallel_state.get_data_parallel_group(),
        dp_rank_of=tuple(dp_rank_of),
        mp_size=dist.get_world_size(mp_group),
        mp_rank=dist.get_rank(mp_group),
        mp_group=mp_group,
        rollout_tp_size=rollout_tp,
        rollout_group_ranks=engines[index],
        rollout_index=index,
        num_engines=len(engines),
        rollout_group=_rollout_gloo_group(engines, index, timeout) if rollout_tp > 1 else None,
        wait_group=_wait_group(world) if world > 1 else None,
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_group=ep_group,
        ep_ranks=tuple(dist.get_process_group_ranks(ep_group)),
        etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        etp_group=parallel_state.get_expert_tensor_parallel_group(),
    )


_ROLLOUT_GROUPS: dict[tuple, Any] = {}
_WAIT_GROUPS: dict[int, Any] = {}
_MODEL_PARALLEL_TIMEOUT: dict[str, timedelta] = {}  # the timeout megatron-core's groups were built with


def _rollout_gloo_group(engines: list[tuple[int, ...]], index: int, timeout: timedelta):
    """This rank's gloo group over its rollout group, with the run's collective ``timeout``
    (``new_group`` without one takes torch's default, 30 minutes for gloo, not the world's).
    ``new_group`` is collective over the world (every rank creates every group, in the same
    order); built once per layout and timeout and reused by a repeated ``init_distributed``."""
    key = (tuple(engines), timeout)
    if key not in _ROLLOUT_GROUPS:
        _ROLLOUT_GROUPS[key] = [dist.new_group(list(ranks), backend="gloo", timeout=timeout) for ranks in engines]
    return _ROLLOUT_GROUPS[key][index]


def _wait_group(world: int):
    """The generation-wait group: gloo over the whole world with :data:`GENERATION_WAIT` as its
    timeout (:attr:`~.parallel_dims.ParallelDims.wait_group`); built once per world (collective)."""
    if world not in _WAIT_GROUPS:
        _WAIT_GROUPS[world] = dist.new_group(list(range(world)), backend="gloo", timeout=GENERATION_WAIT)
    return _WAIT_GROUPS[world]


def destroy_distributed() -> None:
    """Tear down Megatron parallel state and the default process group."""
    # megatron-core here, not at the top: platform loads before quiet_third_party has silenced its import warnings
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _ROLLOUT_GROUPS.clear()
    _WAIT_GROUPS.clear()
    _MODEL_PARALLEL_TIMEOUT.clear()
    if dist.is_initialized():
        dist.destroy_process_group()

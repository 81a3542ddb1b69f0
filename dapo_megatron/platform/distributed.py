"""Process groups and Megatron parallel state, the same way on CPU and GPU.

Under ``torchrun`` the usual ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
``MASTER_ADDR`` / ``MASTER_PORT`` variables are read; a plain ``python`` process
becomes a world of one. The backend is NCCL when CUDA is available and gloo
otherwise, in which case the CPU compatibility layer (:mod:`.cpu_compat`) is
activated before megatron-core is touched.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import cpu_compat


@dataclass
class ParallelConfig:
    """Model-parallel layout (Megatron names)."""

    tensor_model_parallel_size: int = 1
    """TP degree; divides the world size."""
    pipeline_model_parallel_size: int = 1
    """PP degree; TP × PP divides the world size, and DP = world / (TP × PP)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming a size below 1."""
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless TP × PP divides ``world_size`` (the launched processes)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if world_size % (tp * pp) != 0:
            raise ValueError(
                f"tensor_model_parallel_size={tp} × pipeline_model_parallel_size={pp} does not divide "
                f"the world size {world_size}: launch torchrun with --nproc_per_node a multiple of "
                f"{tp * pp}, or change the parallel sizes"
            )


def require_launch_world(tp: int, pp: int) -> None:
    """Exit (``SystemExit`` with the torchrun command to use) unless this launch has exactly
    ``tp × pp`` processes: the tools take their layout from ``--tp``/``--pp``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * pp:
        raise SystemExit(f"--tp {tp} × --pp {pp} = {tp * pp} processes needed, running {world}: "
                         f"launch with torchrun --nproc_per_node={tp * pp}")


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for single-process and test worlds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` or ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(
    parallel: Optional[ParallelConfig] = None,
    seed: int = 1234,
    timeout_s: int = 1800,
) -> None:
    """Initialise torch.distributed, Megatron's parallel state and its RNG streams.

    Idempotent for the same layout. Every rank must call it.

    Args:
        parallel: TP/PP sizes; DP is derived from the world size.
        seed: base seed; Megatron derives the TP-rank-specific streams from it
            (``model_parallel_cuda_manual_seed``).
        timeout_s: collective timeout.

    Raises:
        ValueError: the world size does not fit ``parallel``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel = parallel or ParallelConfig()
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_compat.activate()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python script.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if use_cuda:
            torch.cuda.set_device(device())
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s)
        )
    parallel.validate()
    parallel.check_world_size(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() != parallel.tensor_model_parallel_size
            or parallel_state.get_pipeline_model_parallel_world_size()
            != parallel.pipeline_model_parallel_size
        ):
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        )
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron parallel state and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

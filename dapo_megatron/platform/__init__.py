"""Devices, process groups and the CPU compatibility layer for megatron-core.

Design: docs/design.md §2 (parallel layouts) and §5 (megatron-core on CPU).
"""

from .cpu_compat import activate as activate_cpu_compat
from .launch import spawn
from .distributed import (
    ParallelConfig,
    collective_device,
    destroy_distributed,
    device,
    free_port,
    init_distributed,
    local_device_index,
)
from .parallel_dims import ParallelDims, dims_or_single, rollout_groups, single_process

__all__ = [
    "ParallelConfig",
    "ParallelDims",
    "activate_cpu_compat",
    "collective_device",
    "destroy_distributed",
    "device",
    "dims_or_single",
    "free_port",
    "init_distributed",
    "local_device_index",
    "rollout_groups",
    "single_process",
    "spawn",
]

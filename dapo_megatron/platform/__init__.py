"""Devices, process groups and the CPU compatibility layer for megatron-core."""

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

__all__ = [
    "ParallelConfig",
    "activate_cpu_compat",
    "collective_device",
    "destroy_distributed",
    "device",
    "free_port",
    "init_distributed",
    "local_device_index",
    "spawn",
]

"""Devices, process groups and the CPU compatibility layer for megatron-core."""

from .cpu_compat import activate as activate_cpu_compat
from .launch import spawn
from .distributed import ParallelConfig, destroy_distributed, device, free_port, init_distributed
from .parallel_dims import ParallelDims, rollout_groups

__all__ = [
    "ParallelConfig",
    "ParallelDims",
    "activate_cpu_compat",
    "destroy_distributed",
    "device",
    "free_port",
    "init_distributed",
    "rollout_groups",
    "spawn",
]

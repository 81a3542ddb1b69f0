"""Devices, process groups, processes (the reaper; the environment of SGLang's processes,
:mod:`.sglang_env`, and the ``sglang.Engine`` arguments of the pinned SGLang,
:mod:`.sglang_server_args`) and the CPU compatibility layer for megatron-core.

The names below load their submodule on first use (PEP 562), so that a torch-free process can
import one torch-free submodule of this package (the grader worker imports
:mod:`.reaper`, ~0 ms, where importing the whole package would load torch, ~1.6 s per worker).

Design: docs/design.md §2 (parallel layouts), §5 (megatron-core on CPU) and §6 (SGLang's processes).
"""

from __future__ import annotations

from dapo_megatron.lazy import lazy_exports

# public name -> (submodule, its name there)
_EXPORTS = {
    "activate_cpu_compat": ("cpu_compat", "activate"),
    "spawn": ("launch", "spawn"),
    "ParallelConfig": ("parallel_config", "ParallelConfig"),
    "collective_device": ("distributed", "collective_device"),
    "destroy_distributed": ("distributed", "destroy_distributed"),
    "device": ("distributed", "device"),
    "free_port": ("distributed", "free_port"),
    "init_distributed": ("distributed", "init_distributed"),
    "local_device_index": ("distributed", "local_device_index"),
    "ParallelDims": ("parallel_dims", "ParallelDims"),
    "dims_or_single": ("parallel_dims", "dims_or_single"),
    "rollout_groups": ("parallel_config", "rollout_groups"),
    "single_process": ("parallel_dims", "single_process"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

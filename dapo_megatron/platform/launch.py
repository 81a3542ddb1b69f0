"""Start a small local world of processes without torchrun (tests, benchmarks).

``spawn(fn, world_size, *args)`` runs ``fn(*args)`` in ``world_size`` fresh
processes (the ``spawn`` start method: no forked torch threads) with the same
environment torchrun would set, so code under test calls
:func:`dapo_megatron.platform.init_distributed` exactly as in production.
An exception in any rank is re-raised in the caller with that rank's traceback. Whatever
a rank leaves running when it ends (a child of a rank killed mid-step) is killed on return.

Design: docs/design.md §2 (parallel layouts).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import reaper
from .distributed import destroy_distributed, free_port


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        fn(*args)
    finally:
        if dist.is_initialized():
            destroy_distributed()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = None) -> None:
    """Run ``fn(*args)`` on ``world_size`` local ranks and wait for all of them.

    Args:
        fn: a module-level (picklable) function; it reads its rank from
            ``torch.distributed`` after calling ``init_distributed``.
        world_size: number of processes.
        timeout_s: unused by torch.multiprocessing; kept for symmetry (use
            pytest-timeout around the caller).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised; the message
            holds its traceback.
    """
    # A rank that dies without cleanup (os._exit, SIGKILL: the kill/resume tests) leaves its own
    # multiprocessing children running; as a subreaper for the world's lifetime this process adopts
    # them, and kills them once every rank has ended (reaper.py).
    before = set(reaper.child_pids())
    was_subreaper = reaper.set_subreaper(True)
    try:
        mp.start_processes(
            _entry, args=(world_size, free_port(), fn, args), nprocs=world_size, start_method="spawn"
        )
    finally:
        reaper.reap_children(keep=before)
        if not was_subreaper:
            reaper.set_subreaper(False)

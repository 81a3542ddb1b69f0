"""Start a small local world of processes without torchrun (tests, benchmarks).

``spawn(fn, world_size, *args)`` runs ``fn(*args)`` in ``world_size`` fresh
processes with the same environment torchrun would set, so code under test calls
:func:`dapo_megatron.platform.init_distributed` exactly as in production.

The processes are forked from a *fork server* (multiprocessing's ``forkserver`` start method,
Linux): one single-threaded process, started by the first call, that has imported torch,
megatron-core and this package once and forks each rank from that state (no torch threads are
forked: the server never runs a torch op). A rank then starts in ~0.5 s instead of the ~5 s a
fresh interpreter takes to import them, which is most of the cost of a small test world. Each
rank gets what a freshly spawned one would: the caller's environment, ``sys.path`` and working
directory *at the call* (multiprocessing passes the last two; the environment and the caller's
stdout / stderr are passed here, since a forked rank would otherwise inherit the server's from
when it started). Elsewhere than Linux, ``spawn`` (a fresh interpreter) is used.
An exception in any rank is re-raised in the caller with that rank's traceback. Whatever
a rank leaves running when it ends (a child of a rank killed mid-step) is killed on return.

Design: docs/design.md §2 (parallel layouts).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing import forkserver, reduction
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import reaper
from .distributed import destroy_distributed, free_port


# Imported once by the fork server, so that each forked rank starts with them loaded: what nearly
# every world imports (a name that fails to import is skipped by multiprocessing; a module, not
# a package: actor/ loads its names on first use).
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "transformers",
            "dapo_megatron.platform.distributed", "dapo_megatron.actor.actor", "dapo_megatron.bridge"]
START_METHOD = "forkserver" if sys.platform.startswith("linux") else "spawn"


class _InheritedFd:
    """The caller's file descriptor ``fd``, handed to a forked rank as multiprocessing hands a
    child an fd (``reduction.DupFd`` at pickling time: the fork server passes it over its socket)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
           env: dict[str, str] | None = None, stdio: tuple[int, int] | None = None) -> None:
    if env is not None:  # the caller's environment at the call, not the fork server's at its start
        os.environ.clear()
        os.environ.update(env)
    if stdio is not None:  # the caller's stdout / stderr (a test's captured output)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(stdio, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
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
    extra: tuple = ()
    if START_METHOD == "forkserver":
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call)
        forkserver.ensure_running()  # before `before`: the server is this process's, not the world's
        sys.stdout.flush()
        sys.stderr.flush()
        extra = (dict(os.environ), (_InheritedFd(1), _InheritedFd(2)))
    before = set(reaper.child_pids())
    was_subreaper = reaper.set_subreaper(True)
    try:
        mp.start_processes(
            _entry, args=(world_size, free_port(), fn, args, *extra), nprocs=world_size, start_method=START_METHOD
        )
    finally:
        reaper.reap_children(keep=before)
        if not was_subreaper:
            reaper.set_subreaper(False)

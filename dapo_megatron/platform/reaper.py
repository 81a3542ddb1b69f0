"""Reap the processes a killed child leaves behind (Linux), for :func:`launch.spawn` and the test suite.

A process that dies without cleanup (``SIGKILL``, ``os._exit``: what the kill/resume tests do to a
trainer rank) leaves its own children running: the grader workers die with it
(``rewards/worker.py``: ``PR_SET_PDEATHSIG``), but a ``multiprocessing`` helper it started (the
manager behind megatron-core's torch_dist writer, a spawn child) is re-parented to init and runs
on, ~275 MB each. A *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux 3.4+) adopts such
orphans instead of init, so the process that started the world can find them among its own
children (``/proc/<pid>/stat`` field 4, the parent pid) and kill them.

Elsewhere than Linux every function here does nothing (returns False / empty).

Design: docs/design.md §5.2 (entry points, and the processes a killed rank leaves).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

# Long-lived helpers a test process legitimately owns until it exits (they exit with it): never reaped.
_KEEP = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _prctl(option: int, arg: int | ctypes.c_int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, arg, 0, 0, 0)


def set_subreaper(on: bool) -> bool:
    """Make this process a child subreaper (``on``) or stop it; returns the previous setting.
    False (and nothing changed) where ``prctl`` is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        previous = ctypes.c_int(0)
        _prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(previous))
        _prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0)
        return bool(previous.value)
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int | None) -> bool:
    """SIGKILL this process when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, which fires
    when the parent *thread* that started this process exits), and exit now (status 0) if the
    parent is already gone: ``parent_pid`` is the parent this process was started by (read
    before the call, or passed on the command line), and a different ``os.getppid()`` after the
    call means it died first (the race the call cannot close by itself).

    Who calls it: the grader workers (``rewards/worker.py``), and each torchrun worker of
    ``dapo-train`` (``train.py``). torchrun starts its workers in sessions of their own
    (``start_new_session=True``, torch 2.14 ``elastic/multiprocessing/subprocess_handler/
    subprocess_handler.py:_popen``), so a ``SIGKILL`` of the launcher's process group, or of
    torchrun alone (the OOM killer, a scheduler that kills the launcher), would leave the ranks
    training on without an agent: still writing checkpoints into the run directory a restarted
    job is resuming from.

    Returns True when the signal is armed; False (nothing done) elsewhere than Linux.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        armed = _prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)
    return armed


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from ``/proc/<pid>/stat``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()  # the command name (field 2) may hold spaces and ")"
    return rest[0], int(rest[1])


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (empty when it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def child_pids(pid: int | None = None) -> dict[int, str]:
    """``{child pid: state}`` of the direct children of ``pid`` (default: this process), zombies
    included (state ``"Z"``)."""
    if not os.path.isdir("/proc"):
        return {}
    parent = os.getpid() if pid is None else pid
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] == parent:
                out[int(name)] = st[0]
    return out


def reap_children(keep: set[int] = frozenset(), wait_s: float = 5.0) -> list[str]:
    """SIGKILL every live child of this process not in ``keep`` (and not a :data:`_KEEP` helper),
    repeatedly, so that what a killed child's children leave is adopted (when this process is a
    subreaper) and killed too; wait for each child reaped here (zombies included).

    Returns:
        ``"<pid> <command line>"`` of each process that was still alive (empty: nothing was left).
    """
    killed: list[str] = []
    deadline = time.monotonic() + wait_s
    while True:
        found = False
        for pid, state in child_pids().items():
            if pid in keep:
                continue
            line = cmdline(pid)
            if any(k in line for k in _KEEP):
                continue
            found = True
            if state != "Z":
                killed.append(f"{pid} {line}")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.waitpid(pid, 0)  # only this pid: never another owner's child (subprocess's)
            except ChildProcessError:
                pass
        if not found or time.monotonic() > deadline:
            return killed

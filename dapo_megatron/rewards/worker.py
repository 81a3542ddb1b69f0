"""A grader worker process: ``python -m dapo_megatron.rewards.worker``.

:class:`~dapo_megatron.rewards.RewardPool` starts each worker as a fresh
interpreter running this module, so a worker never imports the caller's main
module: a script without an ``if __name__ == "__main__":`` guard, ``python -``
fed on stdin and a notebook all work (``multiprocessing``'s spawn re-imports
``__main__`` and fails or re-runs the script for all three).

Protocol: one JSON object per line (ASCII, so any model text survives it).

- parent -> worker on stdin: ``{"index": i, "key": grader_key, "solution": str, "ground_truth": str}``;
  end of stdin means stop.
- worker -> parent on its original stdout: first ``{"ready": pid, "package": dir}``
  (the ``dapo_megatron`` directory it imported, which the parent checks), then
  ``{"index": i, "result": {"score", "acc", "pred"[, "error"]}}`` per request.

Anything a grader prints goes to stderr: file descriptor 1 is pointed at 2
after the protocol stream is set aside, so a stray ``print`` cannot corrupt it.

The worker ignores SIGINT (the parent decides; a terminal Ctrl-C reaches the
whole process group), limits its address space to ``--memory-limit-mb`` above
its size after warm-up (Linux ``RLIMIT_AS``; a grader that runs out gets a
MemoryError and the item scores -1), and dies with its parent (Linux
``PR_SET_PDEATHSIG``), so a parent killed with SIGKILL leaves no worker
computing a power tower for hours. It stays in the parent's process group, so
a launcher that kills the group (torchrun) stops it too.

Design: docs/design.md §4 (rewards in killable processes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys

# the pool never imports this module, so "python -m" runs its only copy
from dapo_megatron.platform.reaper import die_with_parent
from dapo_megatron.rewards import registry
from dapo_megatron.rewards.pool import error_result, package_dir


def _vm_size_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _limit_memory(memory_limit_mb: int) -> None:
    try:
        current = _vm_size_bytes()
        if current is not None:
            limit = current + memory_limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):  # a hard limit already lower
        pass


def _writer(fd: int):
    def send(message: dict) -> None:
        data = (json.dumps(message) + "\n").encode("ascii")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    return send


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="dapo_megatron reward grader worker (started by RewardPool)")
    parser.add_argument("--memory-limit-mb", type=int, default=None)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(args.parent_pid)
    protocol_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the protocol stream
    send = _writer(protocol_fd)

    registry.warmup()
    if args.memory_limit_mb is not None:
        _limit_memory(args.memory_limit_mb)
    send({"ready": os.getpid(), "package": package_dir()})
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            index = request["index"]
        except (ValueError, KeyError, TypeError):
            return  # not our parent's protocol: stop
        try:
            result = registry.grade_in_process(request["key"], request["solution"], request["ground_truth"])
        except Exception as err:  # a grader bug or MemoryError on hostile text: score it -1
            result = error_result(f"{type(err).__name__}: {err}")
        try:
            send({"index": index, "result": result})
        except OSError:  # the parent is gone
            return


if __name__ == "__main__":
    main()

"""Sandboxed grading: every grading call runs in a killable worker process with a
wall-clock timeout.

Why processes and not threads or signals (docs/design.md §4): a pathological
answer (``\\boxed{9^{9^{9^{9^{9}}}}}``) makes sympy compute for hours inside C
code that no signal or thread can interrupt; ``signal.alarm`` only works on the
main thread; a timed-out thread-pool task keeps its thread forever. A hung worker
process is killed (SIGKILL) and replaced, and its item scores -1.

Each worker is a fresh interpreter, ``python -m dapo_megatron.rewards.worker``
(:mod:`dapo_megatron.rewards.worker`), talking JSON lines over its stdin/stdout
pipes. No Python code runs in a forked copy of the caller (``subprocess``
execs the new interpreter at once; the trainer runs under torchrun with torch
threads, and forking such a process is unsafe) and, unlike ``multiprocessing``'s spawn,
the caller's ``__main__`` is never re-imported: ``compute_score`` works from a
script without an ``if __name__ == "__main__":`` guard, from ``python -`` on
stdin and from a notebook. The worker runs with its working directory and
``PYTHONPATH`` set to the directory holding this ``dapo_megatron`` package, and
reports the package it imported, so it always grades with the caller's code.
Workers ignore SIGINT (the parent decides), limit their address space
(``memory_limit_mb`` above what they use after import), die with the process
that started them, and each grades one item at a time, so one slow item never
delays a timeout verdict on another.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import dapo_megatron
from dapo_megatron.rewards.registry import normalize_request

logger = logging.getLogger(__name__)

TIMEOUT_RESULT = {"score": -1.0, "acc": False, "pred": None, "timeout": True}


def _timeout_result() -> dict:
    return dict(TIMEOUT_RESULT)


def error_result(message: str) -> dict:
    """The result of an item that could not be graded (scores -1)."""
    return {"score": -1.0, "acc": False, "pred": None, "error": message[:500]}


def package_dir() -> str:
    """The real path of the ``dapo_megatron`` package this process imported."""
    return os.path.dirname(os.path.realpath(dapo_megatron.__file__))


def _worker_command(memory_limit_mb: int | None) -> list[str]:
    """argv of one worker process (the test suite swaps it to simulate start-up failures)."""
    if not sys.executable:
        raise RuntimeError("RewardPool starts its workers with sys.executable, which is empty in this interpreter")
    command = [sys.executable, "-m", "dapo_megatron.rewards.worker", "--parent-pid", str(os.getpid())]
    if memory_limit_mb is not None:
        command += ["--memory-limit-mb", str(int(memory_limit_mb))]
    return command


class _Worker:
    """One worker process and the parent's end of its two pipes."""

    def __init__(self, memory_limit_mb: int | None):
        root = os.path.dirname(package_dir())  # the directory that holds dapo_megatron/
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.process = subprocess.Popen(
            _worker_command(memory_limit_mb),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=root,  # sys.path[0] of "python -m": the caller's cwd could hold another dapo_megatron
            env=env,
        )
        self.fd = self.process.stdout.fileno()
        self.buffer = bytearray()
        self.started_at = time.monotonic()
        self.ready = False
        self.task: int | None = None
        self.deadline = float("inf")

    def send(self, message: dict) -> None:
        """Write one request line; raises OSError (BrokenPipeError) if the worker is gone."""
        self.process.stdin.write((json.dumps(message) + "\n").encode("ascii"))
        self.process.stdin.flush()

    def receive(self) -> list[dict] | None:
        """Complete messages now readable (call when the selector reports the pipe
        readable, so ``os.read`` does not block); None at end of stream (the worker died)."""
        try:
            chunk = os.read(self.fd, 1 << 16)
        except OSError:
            return None
        if not chunk:
            return None
        self.buffer += chunk
        *lines, rest = self.buffer.split(b"\n")
        self.buffer = bytearray(rest)
        return [json.loads(line) for line in lines if line]

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state): do not hang the caller
            logger.warning("reward worker %d did not exit after SIGKILL", self.process.pid)
        self._close_pipes()

    def stop(self) -> None:
        """Close its stdin (the worker's signal to exit), give it a second, then kill it."""
        self._close_pipes(stdout=False)
        try:
            self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def _close_pipes(self, stdout: bool = True) -> None:
        pipes = (self.process.stdin, self.process.stdout) if stdout else (self.process.stdin,)
        for pipe in pipes:
            try:
                pipe.close()
            except OSError:  # unflushed bytes to a dead worker
                pass


class RewardPool:
    """A pool of killable grader processes; :meth:`grade` keeps the input order.

    Args:
        num_workers: worker processes (each grades one item at a time), >= 1.
        timeout_s: wall-clock limit per item in seconds, measured from the moment
            the item is handed to a ready worker, > 0. An item over the limit gets
            ``{"score": -1.0, "acc": False, "pred": None, "timeout": True}`` and its
            worker is killed and replaced.
        memory_limit_mb: address-space headroom per worker above its size after
            importing the graders (Linux ``RLIMIT_AS``); ``None`` disables it. A
            grader that runs out gets a ``MemoryError`` and scores -1.
        startup_timeout_s: how long a new worker may take to import and warm up.

    Workers are ``python -m dapo_megatron.rewards.worker`` processes (see the module
    docstring): any caller works, with or without a ``__main__`` guard. Linux kills a
    worker when the thread that started it exits; a pool created in a short-lived
    thread then replaces its workers on the next :meth:`grade`.

    Each result is a dict with ``score`` (float, +1/-1), ``acc`` (bool), ``pred``
    (str or None), plus ``timeout: True`` on timeout or ``error`` (str) when the
    grader raised (e.g. a malformed ground truth) or the worker died.

    Requests are validated in the calling process first: an unknown
    ``data_source`` raises ValueError naming it before anything is graded.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        *,
        memory_limit_mb: int | None = 4096,
        startup_timeout_s: float = 120.0,
    ):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be an int >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
        if memory_limit_mb is not None and not memory_limit_mb > 0:
            raise ValueError(f"memory_limit_mb={memory_limit_mb!r} must be > 0 or None")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = float(startup_timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self.num_timeouts = 0  # items that hit the wall-clock limit since construction
        self.num_restarts = 0  # workers killed and replaced since construction
        self._package_dir = package_dir()  # each worker must report the same one
        self._selector = selectors.DefaultSelector()  # epoll on Linux: no FD_SETSIZE limit
        self._workers: list[_Worker] = []
        for _ in range(num_workers):
            self._start_worker()

    # -- public API ---------------------------------------------------------

    def grade(self, requests: Sequence[tuple[str, str, str, dict | None]]) -> list[dict]:
        """Grade ``(data_source, solution_str, ground_truth, extra_info)`` tuples.

        Returns one result dict per request, in input order. Raises ValueError /
        TypeError (naming the field and the request index) on invalid requests,
        RuntimeError if the pool is closed or workers cannot start.
        """
        checked = []
        for i, request in enumerate(requests):
            if not isinstance(request, tuple | list) or len(request) not in (3, 4):
                raise TypeError(
                    f"requests[{i}] must be a (data_source, solution_str, ground_truth, extra_info) tuple"
                )
            try:
                key, solution, gold, _ = normalize_request(*request)
            except (ValueError, TypeError) as err:
                raise type(err)(f"requests[{i}]: {err}") from None
            checked.append((key, solution, gold))
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            return self._run_or_reset(checked)

    def wait_ready(self) -> None:
        """Block until every worker has imported and warmed up its graders (the first
        :meth:`grade` call does this implicitly). Raises RuntimeError if a worker dies
        or does not start within ``startup_timeout_s``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            while not all(w.ready for w in self._workers):
                self._run_or_reset([])

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                worker.stop()
            self._workers = []
            self._selector.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- scheduling ---------------------------------------------------------

    def _start_worker(self, index: int | None = None) -> None:
        worker = _Worker(self.memory_limit_mb)
        self._selector.register(worker.fd, selectors.EVENT_READ, worker)
        if index is None:
            self._workers.append(worker)
        else:
            self._workers[index] = worker

    def _replace(self, worker: _Worker) -> None:
        self._selector.unregister(worker.fd)
        worker.kill()
        self.num_restarts += 1
        self._start_worker(self._workers.index(worker))

    def _finish(self, worker: _Worker, results: list, result: dict) -> None:
        if "error" in result:
            logger.warning("grading item %d failed and scores -1: %s", worker.task, result["error"])
        results[worker.task] = result
        worker.task = None
        worker.deadline = float("inf")

    def _run_or_reset(self, requests: list[tuple[str, str, str]]) -> list[dict]:
        try:
            return self._run(requests)
        except BaseException:
            # interrupted (KeyboardInterrupt, start-up failure): workers still busy with
            # this batch would answer into the next one, so replace them
            for worker in list(self._workers):
                if worker.task is not None:
                    worker.task = None
                    worker.deadline = float("inf")
                    self._replace(worker)
            raise

    def _run(self, requests: list[tuple[str, str, str]]) -> list[dict]:
        results: list[dict | None] = [None] * len(requests)
        pending = collections.deque(range(len(requests)))
        attempts = [0] * len(requests)  # an item whose worker dies is retried once
        # with no requests, one pass waits for worker start-up messages (wait_ready)
        first_pass = True
        while first_pass or pending or any(w.task is not None for w in self._workers):
            first_pass = False
            # hand out work to idle, ready workers
            for worker in self._workers:
                if pending and worker.ready and worker.task is None:
                    index = pending.popleft()
                    key, solution, ground_truth = requests[index]
                    try:
                        worker.send({"index": index, "key": key, "solution": solution, "ground_truth": ground_truth})
                    except OSError:  # BrokenPipeError: the worker died while idle
                        pending.appendleft(index)
                        self._replace(worker)
                        continue
                    worker.task = index
                    attempts[index] += 1
                    worker.deadline = time.monotonic() + self.timeout_s
            now = time.monotonic()
            waits = [w.deadline - now for w in self._workers if w.task is not None]
            waits += [w.started_at + self.startup_timeout_s - now for w in self._workers if not w.ready]
            if not waits:  # nothing in flight and every worker ready
                if pending:
                    raise RuntimeError("RewardPool has no workers")
                break
            wait_s = max(0.0, min(waits))
            for event_key, _ in self._selector.select(timeout=wait_s):
                worker = event_key.data
                messages = worker.receive()
                if messages is None:  # end of stream: the worker died
                    code = worker.exit_code()
                    if worker.task is not None:
                        if attempts[worker.task] < 2:  # the worker may have died before this item
                            pending.appendleft(worker.task)
                            worker.task = None
                        else:
                            self._finish(worker, results, error_result(f"grader worker died (exit code {code})"))
                    elif not worker.ready:
                        raise RuntimeError(
                            f"reward worker exited during start-up (exit code {code}); its error is on stderr above"
                        )
                    self._replace(worker)
                    continue
                for message in messages:
                    if "ready" in message:
                        if message["package"] != self._package_dir:
                            raise RuntimeError(
                                f"reward worker imported dapo_megatron from {message['package']}, "
                                f"this process from {self._package_dir}"
                            )
                        worker.ready = True
                    elif message["index"] == worker.task:
                        self._finish(worker, results, message["result"])
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.task is not None and now >= worker.deadline:
                    self.num_timeouts += 1
                    logger.warning("grading item %d exceeded %.1f s; killing its worker", worker.task, self.timeout_s)
                    self._finish(worker, results, _timeout_result())
                    self._replace(worker)
                elif not worker.ready and now >= worker.started_at + self.startup_timeout_s:
                    raise RuntimeError(f"reward worker did not start within {self.startup_timeout_s:.0f} s")
        return results


_DEFAULT_POOL: RewardPool | None = None
_DEFAULT_LOCK = threading.Lock()


def _default_pool() -> RewardPool:
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is None or _DEFAULT_POOL._closed:
            _DEFAULT_POOL = RewardPool(num_workers=1, timeout_s=5.0)
            atexit.register(_DEFAULT_POOL.close)
        return _DEFAULT_POOL


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Grade one response (verl ``default_compute_score`` contract).

    Runs in a shared single-worker :class:`RewardPool` (started on first use,
    5 s wall-clock timeout); for batches create a :class:`RewardPool` and call
    :meth:`RewardPool.grade`, which grades in parallel.

    Args:
        data_source: ``"math_dapo"`` / ``"aime*"`` (last ``Answer:`` line),
            ``"lighteval/MATH"``, ``"HuggingFaceH4/MATH-500"``, ... (last ``\\boxed{}``,
            math-verify), ``"math"`` (the later of the last box and the last ``Answer:`` line),
            ``"openai/gsm8k"`` (number after the last ``####``), ``"arithmetic"``
            (last integer). See :data:`dapo_megatron.rewards.registry.DATA_SOURCES`.
        solution_str: the decoded response (str, or bytes: invalid UTF-8 is replaced).
        ground_truth: the reference answer (for GSM8K also a full ``#### N`` solution).
        extra_info: accepted for verl compatibility, unused by these graders.

    Returns:
        ``{"score": float (+1.0 / -1.0), "acc": bool, "pred": str | None}`` plus
        ``"timeout": True`` or ``"error": str`` when grading did not complete.

    Raises:
        ValueError: unknown ``data_source`` (named in the message).
        TypeError: a field of the wrong type.
    """
    normalize_request(data_source, solution_str, ground_truth, extra_info)  # raise here, not in a worker
    return _default_pool().grade([(data_source, solution_str, ground_truth, extra_info)])[0]

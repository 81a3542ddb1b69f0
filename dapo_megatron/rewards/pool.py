"""Sandboxed grading: every grading call runs in a killable worker process with a
wall-clock timeout.

Why processes and not threads or signals (docs/design.md §4): a pathological
answer (``\\boxed{9^{9^{9^{9^{9}}}}}``) makes sympy compute for hours inside C
code that no signal or thread can interrupt; ``signal.alarm`` only works on the
main thread; a timed-out thread-pool task keeps its thread forever. A hung worker
process is killed (SIGKILL) and replaced, and its item scores -1.

Workers are started with the ``spawn`` (default) or ``forkserver`` context: the
trainer runs under torchrun with torch threads, and forking such a process is
unsafe. A spawned child re-imports the launching script as ``__mp_main__``, so
that script needs an ``if __name__ == "__main__":`` guard (as any torchrun
entry point should have). Workers ignore SIGINT (the parent decides), limit
their address space (``memory_limit_mb`` above what they use after import),
and each grades one item at a time, so one slow item never delays a timeout
verdict on another.
"""

from __future__ import annotations

import atexit
import collections
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import threading
import time
from collections.abc import Sequence

from dapo_megatron.rewards.registry import normalize_request

logger = logging.getLogger(__name__)

TIMEOUT_RESULT = {"score": -1.0, "acc": False, "pred": None, "timeout": True}


def _timeout_result() -> dict:
    return dict(TIMEOUT_RESULT)


def _error_result(message: str) -> dict:
    return {"score": -1.0, "acc": False, "pred": None, "error": message[:500]}


def _vm_size_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _worker_main(conn, memory_limit_mb: int | None) -> None:
    """Worker loop: warm up graders, report ready, then grade ``(index, request)`` messages."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from dapo_megatron.rewards import registry

    registry.warmup()
    if memory_limit_mb is not None:
        try:
            import resource

            current = _vm_size_bytes()
            if current is not None:
                limit = current + int(memory_limit_mb) * 1024 * 1024
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):  # not Linux, or a hard limit already lower
            pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, (key, solution, ground_truth) = message
        try:
            result = registry.grade_in_process(key, solution, ground_truth)
        except Exception as err:  # a grader bug or MemoryError on hostile text: score it -1
            result = _error_result(f"{type(err).__name__}: {err}")
        try:
            conn.send((index, result))
        except (BrokenPipeError, OSError):
            return


class _Worker:
    def __init__(self, ctx, memory_limit_mb: int | None):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, memory_limit_mb), daemon=True, name="dapo-reward-worker"
        )
        self.process.start()
        child_conn.close()
        self.conn = parent_conn
        self.started_at = time.monotonic()
        self.ready = False
        self.task: int | None = None
        self.deadline = float("inf")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=1)
        self.kill()


class RewardPool:
    """A pool of killable grader processes; :meth:`grade` keeps the input order.

    Args:
        num_workers: worker processes (each grades one item at a time), >= 1.
        timeout_s: wall-clock limit per item in seconds, measured from the moment
            the item is handed to a ready worker, > 0. An item over the limit gets
            ``{"score": -1.0, "acc": False, "pred": None, "timeout": True}`` and its
            worker is killed and replaced.
        start_method: ``"spawn"`` (default) or ``"forkserver"``; never ``"fork"``.
        memory_limit_mb: address-space headroom per worker above its size after
            importing the graders (Linux ``RLIMIT_AS``); ``None`` disables it. A
            grader that runs out gets a ``MemoryError`` and scores -1.
        startup_timeout_s: how long a new worker may take to import and warm up.

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
        start_method: str = "spawn",
        memory_limit_mb: int | None = 4096,
        startup_timeout_s: float = 120.0,
    ):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be an int >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"start_method={start_method!r} must be 'spawn' or 'forkserver' "
                "(forking a process that holds torch threads is unsafe)"
            )
        if memory_limit_mb is not None and not memory_limit_mb > 0:
            raise ValueError(f"memory_limit_mb={memory_limit_mb!r} must be > 0 or None")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = float(startup_timeout_s)
        self._ctx = mp.get_context(start_method)
        self._lock = threading.Lock()
        self._closed = False
        self.num_timeouts = 0  # items that hit the wall-clock limit since construction
        self.num_restarts = 0  # workers killed and replaced since construction
        self._workers = [_Worker(self._ctx, memory_limit_mb) for _ in range(num_workers)]

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

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.num_restarts += 1
        index = self._workers.index(worker)
        self._workers[index] = _Worker(self._ctx, self.memory_limit_mb)

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
                    try:
                        worker.conn.send((index, requests[index]))
                    except (BrokenPipeError, OSError):
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
            ready_conns = mp_connection.wait([w.conn for w in self._workers], timeout=wait_s)
            for worker in list(self._workers):
                if worker.conn not in ready_conns:
                    continue
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError):
                    if worker.task is not None:
                        worker.process.join(timeout=1)
                        code = worker.process.exitcode
                        if attempts[worker.task] < 2:  # the worker may have died before this item
                            pending.appendleft(worker.task)
                            worker.task = None
                        else:
                            self._finish(worker, results, _error_result(f"grader worker died (exit code {code})"))
                    elif not worker.ready:
                        raise RuntimeError(
                            f"reward worker failed to start (exit code {worker.process.exitcode}); "
                            "does the launching script have an `if __name__ == '__main__':` guard?"
                        ) from None
                    self._replace(worker)
                    continue
                if message[0] == "ready":
                    worker.ready = True
                else:
                    index, result = message
                    if index == worker.task:
                        self._finish(worker, results, result)
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
            ``"math"``, ``"lighteval/MATH"``, ... (last ``\\boxed{}``, math-verify),
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

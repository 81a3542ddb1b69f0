"""The process environment around SGLang: what its processes inherit from ours, what
``sglang.Engine`` changes in ours, and the one ``NCCL_CUMEM_ENABLE`` of server mode.

Files are those of ``python/sglang/srt/`` in sglang 0.5.11 (the image's pin); docs/design.md
§6 lists the same for users.

Children inherit our environment. ``sglang.Engine`` starts its scheduler processes with
``multiprocessing`` spawn (``entrypoints/engine.py`` ``_launch_scheduler_processes``), and a
spawned child copies ``os.environ`` as it is at ``Process.start()``. Each scheduler then calls
``torch.distributed.init_process_group(init_method="tcp://127.0.0.1:<nccl_port>")``
(``model_executor/model_runner.py`` ``init_torch_distributed`` ->
``distributed/parallel_state.py`` ``init_distributed_environment``). torchrun sets
``TORCHELASTIC_USE_AGENT_STORE=True`` in every worker; a child that inherits it builds its
store as a client of a store the elastic agent is supposed to host (torch
``distributed/rendezvous.py`` ``_create_c10d_store``: ``is_master=False`` on every rank,
rank 0 included), nobody listens on ``nccl_port``, and the engine hangs until the
distributed timeout (pytorch PRs #191989 / #192113; verl's torchrun SGLang tests delete the
variable first, ``tests/workers/rollout/utils_sglang.py`` ``clean_torchelastic_env``; torch's
own DCP async writer sets it to ``False`` in its child, ``distributed/checkpoint/
_async_process_executor.py``). :func:`engine_launch_env` removes it for the duration of the
engine's construction only and puts it back: the trainer's own store (its default process
group, already built) never reads it again, but a later ``init_process_group`` of ours would.
The other ``TORCHELASTIC_*`` variables (run id, restart counts, error file) are read only by
torchelastic's agent and its ``@record`` decorator, which SGLang's children do not use; they
are left as they are.

The same context sets ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` unless the user set it: only then
does the scheduler capture its CUDA graphs under the memory saver (``model_executor/
cuda_graph_runner.py`` ``_capture_graph``; default off, ``environ.py``), so that
``release_memory_occupation(["cuda_graph"])`` frees them while the actor trains (slime sets it
too). With it off the graphs stay resident: :func:`cuda_graphs_released` tells the memory
estimate (:mod:`dapo_megatron.platform.memory`).

What ``sglang.Engine(...)`` changes in the process that builds it (kept, since its tokenizer
manager runs here): ``_set_envs_and_config`` sets ``NCCL_CUMEM_ENABLE`` (to 0, unless already
set or ``enable_symm_mem``), ``NCCL_NVLS_ENABLE``, ``CUDA_DEVICE_MAX_CONNECTIONS=8``
(0.5.23 ``entrypoints/engine.py:1878-1995``; 0.5.11 also set ``CUDA_MODULE_LOADING=AUTO``),
``TRTLLM_ENABLE_PDL``, ``CUTE_DSL_LOG_*``, ``SGLANG_RUN_ID``,
raises the open-files limit, installs a SIGQUIT handler that kills this whole process tree,
this process included (a failing child sends SIGQUIT; its subprocess watchdog too,
``utils/watchdog.py``), and forces the ``spawn`` start method for every later
``multiprocessing`` use of this process. Importing ``entrypoints/engine.py`` replaces
``threading._register_atexit`` with a no-op. ``Engine.__init__`` registers
``atexit(self.shutdown)``, and ``Engine.shutdown`` kills EVERY child of this process
(``kill_process_tree(os.getpid(), include_parent=False)``): reward graders and checkpoint
writers included. The variables do not reach the trainer's CUDA context or its NCCL
communicators, which exist before the engine (CUDA reads ``CUDA_DEVICE_MAX_CONNECTIONS`` at
context creation, NCCL caches its parameters at its first communicator).
:func:`engine_child_pids` / :func:`shutdown_engine` replace the kill-all: our engine's
shutdown (and its atexit) kill the engine's own processes only, so the graders survive it
whatever the order (``tools/eval.py`` shuts the engine down before grading).

Server mode (item 5 of issue 18): ``sglang.launch_server`` runs the same
``_set_envs_and_config``, so the server's workers use ``NCCL_CUMEM_ENABLE=0`` unless it was set
in the server's environment; the trainer's end of the weight-update NCCL group must use the
same value (a mismatch is a reported cause of P2P set-up failures, NVIDIA NeMo-RL #564).
:func:`align_nccl_with_sglang_server` sets it before the trainer's first NCCL communicator.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import time
from multiprocessing import resource_tracker
from typing import Any, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

#: Removed from the environment SGLang's children inherit (module docstring).
TORCHELASTIC_CHILD_VARS = ("TORCHELASTIC_USE_AGENT_STORE",)
#: Set for SGLang's children unless the user set them.
ENGINE_CHILD_DEFAULTS = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
#: The value ``sglang.launch_server`` gives ``NCCL_CUMEM_ENABLE`` when it is unset and
#: ``enable_symm_mem`` is off (``entrypoints/engine.py`` ``_set_envs_and_config``).
SGLANG_NCCL_CUMEM_ENABLE = "0"


@contextlib.contextmanager
def engine_launch_env(environ: Optional[dict] = None) -> Iterator[dict]:
    """The environment SGLang's children must inherit, for the duration of the ``with`` block
    (wrap ``sglang.Engine(...)``, which spawns them): :data:`TORCHELASTIC_CHILD_VARS` removed,
    :data:`ENGINE_CHILD_DEFAULTS` set where unset. On exit those keys get back the values they
    had (what SGLang itself sets during the block is kept). Yields the changes made (key ->
    new value, None for removed). ``environ``: the mapping to change (``os.environ``)."""
    env = os.environ if environ is None else environ
    keys = TORCHELASTIC_CHILD_VARS + tuple(ENGINE_CHILD_DEFAULTS)
    saved = {k: env.get(k) for k in keys}
    changes: dict[str, Optional[str]] = {}
    try:
        for k in TORCHELASTIC_CHILD_VARS:
            if env.pop(k, None) is not None:
                changes[k] = None
        for k, v in ENGINE_CHILD_DEFAULTS.items():
            if k not in env:  # the user's explicit value wins
                env[k] = changes[k] = v
        yield changes
    finally:
        for k, v in saved.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v


def _env_bool(value: str) -> bool:
    """sglang 0.5.11 ``utils/common.py`` ``get_bool_env_var``: ``"true"`` / ``"1"`` (any case) is True."""
    return value.lower() in ("true", "1")


def cuda_graphs_released(environ: Optional[dict] = None) -> bool:
    """Whether a colocated engine's ``sleep()`` frees its CUDA graphs: the value of
    ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` its children get from :func:`engine_launch_env`."""
    env = os.environ if environ is None else environ
    return _env_bool(env.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH", ENGINE_CHILD_DEFAULTS["SGLANG_MEMORY_SAVER_CUDA_GRAPH"]))


def release_allocator_cache() -> None:
    """Hand this process's cached-but-free CUDA blocks back to the driver before an engine starts.

    SGLang sizes its KV pool from the memory free when each TP worker starts (sglang 0.5.11
    ``model_executor/model_runner_kv_cache_mixin.py`` ``_profile_available_bytes``) and, at TP > 1,
    refuses to start when its GPUs' free memory differs too much (``model_runner.py``: "memory
    capacity is unbalanced"); blocks our allocator caches (weight loading, the HF export) are
    invisible to it. No-op without an initialised CUDA context."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def align_nccl_with_sglang_server(environ: Optional[dict] = None) -> str:
    """Server mode: give this trainer the ``NCCL_CUMEM_ENABLE`` SGLang's server uses (module
    docstring). Call before the first NCCL communicator (``init_distributed``). A value the user
    set is kept, with a warning that the server must be launched with the same. Returns the value."""
    env = os.environ if environ is None else environ
    if "NCCL_CUMEM_ENABLE" in env:
        if env["NCCL_CUMEM_ENABLE"] != SGLANG_NCCL_CUMEM_ENABLE:
            logger.warning("NCCL_CUMEM_ENABLE=%s is set for the trainer; sglang.launch_server uses %s unless it is set "
                           "there too: launch the server with NCCL_CUMEM_ENABLE=%s, or the weight-update group may "
                           "fail to connect", env["NCCL_CUMEM_ENABLE"], SGLANG_NCCL_CUMEM_ENABLE,
                           env["NCCL_CUMEM_ENABLE"])
        return env["NCCL_CUMEM_ENABLE"]
    env["NCCL_CUMEM_ENABLE"] = SGLANG_NCCL_CUMEM_ENABLE
    return SGLANG_NCCL_CUMEM_ENABLE


def _proc_children(pid: int) -> list[int]:
    """Direct children of ``pid`` from Linux's ``/proc/<pid>/task/<tid>/children`` (where psutil,
    an SGLang dependency, is missing: the fake SGLang on a bare machine)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:  # gone
        pass
    return out


def child_pids(pid: Optional[int] = None, recursive: bool = False) -> set[int]:
    """PIDs of the children of ``pid`` (this process), with their descendants when ``recursive``."""
    try:  # psutil comes with sglang (GPU image); /proc is read without it
        import psutil
    except ImportError:
        psutil = None
    pid = os.getpid() if pid is None else pid
    if psutil is not None:
        try:
            return {p.pid for p in psutil.Process(pid).children(recursive=recursive)}
        except psutil.NoSuchProcess:
            return set()
    found, todo = set(), _proc_children(pid)
    while todo:
        c = todo.pop()
        if c not in found:
            found.add(c)
            if recursive:
                todo += _proc_children(c)
    return found


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def engine_child_pids(engine: Any, before: set[int]) -> list[int]:
    """The processes an ``sglang.Engine`` started: ``Engine.get_all_child_pids()`` (scheduler(s),
    detokenizer; sglang 0.5.11 ``entrypoints/engine.py``), else the children born during its
    construction (``before``: :func:`child_pids` just before), multiprocessing's resource tracker
    excepted (it serves every later spawn of this process)."""
    get = getattr(engine, "get_all_child_pids", None)
    if callable(get):
        return [int(p) for p in get()]
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return sorted(p for p in child_pids() - set(before) if p != tracker)


def detach_engine_atexit(engine: Any) -> None:
    """Remove the ``atexit(engine.shutdown)`` that ``Engine.__init__`` registers (its kill-all);
    the caller registers its own scoped shutdown instead."""
    atexit.unregister(engine.shutdown)


def shutdown_engine(engine: Any, pids: list[int], timeout_s: float = 60.0) -> None:
    """``Engine.shutdown`` restricted to the engine's own processes: stop its subprocess watchdog
    (which would SIGQUIT this process when it sees a scheduler die), then SIGKILL each of ``pids``
    with its descendants and wait until they are gone (as ``Engine.shutdown``'s
    ``kill_process_tree(..., wait_timeout=60)``, so the GPU memory is free when this returns).
    Other children (reward graders, checkpoint writers) are untouched. Linux (``/proc``)."""
    watchdog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
    if watchdog is not None:
        watchdog.stop()
    victims = []
    for pid in pids:
        if pid_alive(pid):
            victims += sorted(child_pids(pid, recursive=True)) + [pid]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    alive = [p for p in victims if pid_alive(p)]  # a killed child of ours is a zombie until multiprocessing reaps it
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    if alive:
        logger.warning("SGLang engine processes %s did not exit within %.0f s of SIGKILL", alive, timeout_s)

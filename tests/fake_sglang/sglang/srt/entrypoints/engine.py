"""``sglang.srt.entrypoints.engine`` of the fake SGLang (see ``sglang/__init__.py``), after
sglang 0.5.11 ``python/sglang/srt/entrypoints/engine.py``."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import random
import signal
import socket
import threading
import time
from typing import Optional

# sglang 0.5.11 entrypoints/engine.py, at import: "Fix a bug of Python threading"
setattr(threading, "_register_atexit", lambda *args, **kwargs: None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_process_tree(parent_pid, include_parent: bool = True, skip_pid: Optional[int] = None,
                      wait_timeout: Optional[float] = None):
    """sglang 0.5.11 ``srt/utils/common.py`` ``kill_process_tree``: SIGKILL every descendant of
    ``parent_pid`` (and itself with ``include_parent``), then wait up to ``wait_timeout`` (the
    real one uses psutil; the process tree is read from /proc here, psutil may be missing)."""
    import sys

    from dapo_megatron.platform.sglang_env import child_pids, pid_alive

    if parent_pid is None:
        parent_pid, include_parent = os.getpid(), False
    if not pid_alive(parent_pid):
        return
    killed = []
    for pid in sorted(child_pids(parent_pid, recursive=True)):
        if pid == skip_pid:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    if include_parent:
        if parent_pid == os.getpid():
            os.kill(parent_pid, signal.SIGKILL)
            sys.exit(0)
        os.kill(parent_pid, signal.SIGKILL)
        killed.append(parent_pid)
    if wait_timeout is not None:
        deadline = time.monotonic() + wait_timeout
        while any(pid_alive(p) for p in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [p for p in killed if pid_alive(p)]
        if alive:
            raise RuntimeError(f"processes {alive} did not exit within {wait_timeout} s")


def _server_args(kwargs: dict) -> dict:
    """``ServerArgs(**kwargs)`` (sglang 0.5.23 ``entrypoints/engine.py:297``): the fake's
    ``ServerArgs`` (``srt/server_args.py``), which refuses an unknown field with msgspec's
    ``TypeError`` as the real one does; returned as a dict (it goes to the child processes)."""
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(**kwargs)
    return {name: getattr(args, name) for name in ServerArgs.__struct_fields__}


def _set_envs_and_config(server_args: dict) -> None:
    """sglang 0.5.23 ``_set_envs_and_config`` (``entrypoints/engine.py:1878``): the variables (those
    of a single-node launch without symmetric memory / KV sharding / DCP), the SIGQUIT handler, spawn."""
    if "NCCL_CUMEM_ENABLE" not in os.environ or server_args["enable_symm_mem"]:
        os.environ["NCCL_CUMEM_ENABLE"] = str(int(server_args["enable_symm_mem"]))
    if "NCCL_NVLS_ENABLE" not in os.environ or server_args["enable_nccl_nvls"] or server_args["enable_symm_mem"]:
        os.environ["NCCL_NVLS_ENABLE"] = str(int(server_args["enable_nccl_nvls"] or server_args["enable_symm_mem"]))
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"  # 0.5.23 sets no CUDA_MODULE_LOADING (0.5.11 did)
    if os.environ.get("TRTLLM_ENABLE_PDL", "1") != "0":
        os.environ["TRTLLM_ENABLE_PDL"] = "1"
    os.environ.setdefault("CUTE_DSL_LOG_LEVEL", "30")
    os.environ.setdefault("CUTE_DSL_LOG_TO_CONSOLE", "1")
    os.environ["SGLANG_RUN_ID"] = f"sglang-run-{time.time()}-{random.randint(0, 100000000)}"
    if threading.current_thread() is threading.main_thread():
        if server_args["custom_sigquit_handler"] is None:
            def launch_phase_sigquit_handler(signum, frame):
                kill_process_tree(os.getpid())

            signal.signal(signal.SIGQUIT, launch_phase_sigquit_handler)
        else:
            signal.signal(signal.SIGQUIT, server_args["custom_sigquit_handler"])
    mp.set_start_method("spawn", force=True)


class Engine:
    """sglang 0.5.11 ``Engine`` at the process level (module docstring of ``sglang``)."""

    def __init__(self, **kwargs):
        from sglang.srt.managers.scheduler import run_detokenizer_process, run_scheduler_process

        server_args = _server_args(kwargs)
        self.server_args = server_args
        self.tokenizer_manager = None
        atexit.register(self.shutdown)
        _set_envs_and_config(server_args)
        port_args = {"nccl_port": _free_port()}  # PortArgs.init_new
        self._procs, self._commands, readers = [], [], []
        for tp_rank in range(server_args["tp_size"]):
            reader, writer = mp.Pipe(duplex=False)
            ours, theirs = mp.Pipe(duplex=True)
            gpu_id = server_args["base_gpu_id"] + tp_rank * server_args["gpu_id_step"]
            proc = mp.Process(target=run_scheduler_process,
                              args=(server_args, port_args, gpu_id, tp_rank, writer, theirs))
            proc.start()
            self._procs.append(proc)
            self._commands.append(ours)
            readers.append(reader)
        self.scheduler_env, self.init_seconds = [], []
        for tp_rank, (reader, proc) in enumerate(zip(readers, self._procs)):  # _wait_for_scheduler_ready
            try:
                info = reader.recv()
            except EOFError:
                proc.join(timeout=10)
                raise RuntimeError(f"Rank {tp_rank} scheduler died during initialization (exit code: "
                                   f"{proc.exitcode}).") from None
            if info["status"] != "ready":
                proc.join(timeout=10)
                raise RuntimeError(f"Rank {tp_rank} scheduler died during initialization: {info.get('error')}")
            self.scheduler_env.append(info["env"])
            self.init_seconds.append(info["init_seconds"])
        detoken = mp.Process(target=run_detokenizer_process, args=(server_args, port_args))
        detoken.start()
        self._procs.append(detoken)
        self._all_child_pids = [p.pid for p in self._procs]

    def get_all_child_pids(self):
        return self._all_child_pids

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if load_format != "flattened_bucket" or len(named_tensors) != self.server_args["tp_size"]:
            return False, f"the fake takes load_format='flattened_bucket' with one entry per TP rank, got " \
                          f"{load_format!r} x {len(named_tensors)}"
        for conn, payload in zip(self._commands, named_tensors):
            conn.send(("update_weights_from_tensor", payload))
        results = [conn.recv() for conn in self._commands]
        failed = [msg for ok, msg in results if not ok]
        return (not failed), "; ".join(failed) or "Succeeded to update model weights."

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        self._commands[0].send(("get_weights_by_name", (name, truncate_size)))
        return self._commands[0].recv()

    def flush_cache(self):
        return None

    def release_memory_occupation(self, tags=None):
        return None

    def resume_memory_occupation(self, tags=None):
        return None

    def shutdown(self):
        kill_process_tree(os.getpid(), include_parent=False, wait_timeout=60)

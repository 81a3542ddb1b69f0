"""The scheduler process of the fake SGLang (see ``sglang/__init__.py``)."""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta

#: Environment variables each scheduler reports back (a test hook).
REPORTED_ENV = ("TORCHELASTIC_USE_AGENT_STORE", "SGLANG_MEMORY_SAVER_CUDA_GRAPH", "NCCL_CUMEM_ENABLE",
                "CUDA_DEVICE_MAX_CONNECTIONS", "SGLANG_RUN_ID", "RANK", "LOCAL_RANK")


def _load_flattened_bucket(payload: bytes, weights: dict) -> list[str]:
    """What a TP worker does with its entry of a ``flattened_bucket`` update: deserialize
    (``MultiprocessingSerializer.deserialize``), view each tensor of the flat ``uint8`` buffer
    (``FlattenedTensorBucket.reconstruct_tensors``) and copy it into the weights."""
    obj = pickle.loads(payload)
    flat, names = obj["flattened_tensor"], []
    for m in obj["metadata"]:
        view = flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
        weights[m.name] = view.clone()  # model.load_weights copies into its parameters
        names.append(m.name)
    return names


def run_scheduler_process(server_args: dict, port_args: dict, gpu_id: int, tp_rank: int, pipe_writer, commands):
    """``managers/scheduler.py`` ``run_scheduler_process`` as far as the process level goes."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        timeout = server_args.get("dist_timeout")
        # model_runner.py init_torch_distributed -> parallel_state.init_distributed_environment
        dist.init_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port_args['nccl_port']}",
                                world_size=server_args["tp_size"], rank=tp_rank,
                                timeout=timedelta(seconds=timeout) if timeout is not None else None)
        dist.barrier()
    except BaseException as err:
        pipe_writer.send({"status": "error", "error": f"{type(err).__name__}: {err}"})
        raise
    pipe_writer.send({"status": "ready", "pid": os.getpid(), "init_seconds": time.perf_counter() - t0,
                      "env": {k: os.environ.get(k) for k in REPORTED_ENV}})
    weights: dict = {}
    while True:  # the scheduler's request loop, one request at a time
        try:
            kind, arg = commands.recv()
        except EOFError:  # the engine is gone
            return
        try:
            if kind == "update_weights_from_tensor":
                names = _load_flattened_bucket(arg, weights)
                commands.send((True, f"Succeeded to update model weights ({len(names)} tensors)."))
            elif kind == "get_weights_by_name":
                name, truncate = arg
                t = weights.get(name)
                # models/llama.py get_weights_by_name: param.float().tolist()[:truncate_size] (rows)
                commands.send(None if t is None else t.float().tolist()[:truncate])
            else:
                commands.send((False, f"unknown request {kind!r}"))
        except Exception as err:  # answered, as the scheduler returns a failed output
            commands.send((False, f"{type(err).__name__}: {err}"))


def run_detokenizer_process(server_args: dict, port_args: dict):
    """The detokenizer process: idles until killed."""
    while True:
        time.sleep(3600)

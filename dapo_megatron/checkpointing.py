"""Atomic, resumable trainer checkpoints: Megatron distributed checkpoint + per-rank RNG + the
state of every other component, saved and restored by one :class:`Checkpointer`.

Directory layout (``run_dir`` is ``trainer.default_local_dir``)::

    run_dir/checkpoints/
        latest                     text file holding the step of the newest complete
                                   checkpoint, e.g. "40\\n" (written temp + os.replace)
        step_40/                   one complete checkpoint (only ever created by rename)
            metadata.json          \\
            (common.pt)             |  megatron.core.dist_checkpointing (torch_dist backend;
                                    |  common.pt up to megatron-core 0.16, in the index from 0.19):
            .metadata               |  {"model" | "model0", "model1", ...: model sharded state,
            __0_0.distcp, ...      /    "optimizer": optimizer sharded state,
                                         "opt_param_scheduler": scheduler.state_dict()}
            rng/rank_0.pt          RNG state of global rank 0 (python, numpy, torch CPU,
            rng/rank_1.pt          torch CUDA if present, Megatron's CUDA RNG tracker) ...
            trainer_state.pt       the components' picklable state, from global rank 0
                                   (:class:`Checkpointer`: layout below)
            checkpoint_info.json   step, world/TP/PP/DP sizes, optimizer sharding type
        step_40.tmp-<uuid>/        an unfinished or abandoned save: never loaded, deleted
                                   by the next save

Commit protocol of :func:`save_checkpoint` (every rank calls it):

1. global rank 0 deletes stale ``step_*.tmp-*`` dirs and creates ``step_{k}.tmp-<uuid>``
   (the uuid is broadcast so all ranks write to the same directory);
2. every rank writes its shards (synchronous ``dist_checkpointing.save``), its RNG file,
   rank 0 the trainer state and ``checkpoint_info.json``;
3. barrier, then rank 0 renames the tmp dir to ``step_{k}`` (an atomic ``rename`` on one
   file system) and only then rewrites ``latest`` through a temp file + ``os.replace``;
4. rank 0 prunes the oldest ``step_*`` dirs beyond ``max_ckpt_to_keep``; final barrier.

A crash at any point therefore leaves ``latest`` naming either the previous complete
checkpoint or the new one, never a half-written one.

``trainer_state.pt`` as :class:`Checkpointer` writes it (layout 2)::

    {"layout": 2, "step": k, "tracking_run_id": <MLflow run id or None>,
     "components": {name: component.state_dict(), ...}}     e.g. {"rollout": {...}}

Layout 1 (written up to commit e9128fc) is flat: ``{"step", "mlflow_run_id", **rollout state}``;
:func:`upgrade_trainer_state` reads it as layout 2 with the one component ``"rollout"``.

Launcher requirement: megatron-core's torch_dist writer can start a multiprocessing
manager; a script launched with ``torchrun script.py`` whose module-level code is not
under ``if __name__ == "__main__":`` re-executes in that child and hangs (docs/design.md §5.2).
Saves here are synchronous (``async_sharded_save=False``), but keep the guard in every
entry point.

Sources: megatron-core 0.16.1 ``dist_checkpointing.save/load``,
``MegatronModule.sharded_state_dict``, ``DistributedOptimizer.sharded_state_dict``
(``metadata["distrib_optim_sharding_type"]``), and Megatron-LM's
``megatron/training/checkpointing.py`` (same "model"/"model{i}"/"optimizer"/
"opt_param_scheduler" keys, RNG restored last).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from dapo_megatron.platform.parallel_dims import ParallelDims, dims_or_single

logger = logging.getLogger(__name__)

CHECKPOINTS_DIRNAME = "checkpoints"
LATEST_FILENAME = "latest"
TRAINER_STATE_FILENAME = "trainer_state.pt"
INFO_FILENAME = "checkpoint_info.json"
RNG_DIRNAME = "rng"
FORMAT_VERSION = 1
TRAINER_STATE_LAYOUT = 2  # of trainer_state.pt as Checkpointer writes it (module docstring)

DCP_METADATA_FILENAME = ".metadata"  # torch.distributed.checkpoint.filesystem._metadata_fn
MCORE_CONFIG_FILENAME = "metadata.json"  # megatron.core.dist_checkpointing.core.CONFIG_FNAME
# The common (non-tensor) state: a file of its own up to megatron-core 0.16
# (dist_checkpointing.strategies.common.COMMON_STATE_FNAME), an item of the torch_dist index from 0.19
# (dist_checkpointing.serialization.load_common_state_dict: ShardedObject("common_state", ...)).
MCORE_COMMON_FILENAME = "common.pt"
MCORE_COMMON_STATE_KEY = "common_state"

OptimShardingType = Literal["dp_reshardable", "fully_reshardable"]
_SHARDING_TYPES = ("dp_reshardable", "fully_reshardable")
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_\d+\.tmp-[0-9a-f]+$")


class CheckpointError(ValueError):
    """A checkpoint (or the ``latest`` pointer) that cannot be loaded; the message names the
    file and the way out (which ``trainer.resume_mode`` to set). A ``ValueError``: bad input,
    printed as one line by the CLIs."""


# --------------------------------------------------------------------------- paths


def checkpoints_dir(run_dir: str) -> str:
    """``run_dir/checkpoints``: where every checkpoint of a run lives."""
    return os.path.join(run_dir, CHECKPOINTS_DIRNAME)


def step_dir(run_dir: str, step: int) -> str:
    """``run_dir/checkpoints/step_{step}``: the complete checkpoint of one step."""
    return os.path.join(checkpoints_dir(run_dir), f"step_{int(step)}")


def list_checkpoint_steps(run_dir: str) -> list[int]:
    """Steps with a complete ``step_{k}`` directory, ascending (tmp dirs are ignored)."""
    root = checkpoints_dir(run_dir)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_latest_step(run_dir: str) -> int | None:
    """The step to resume from, or None when the run has no complete checkpoint.

    Reads ``checkpoints/latest``. If that file is missing or names a directory that no
    longer exists (a crash between re-saving an already existing step and updating
    ``latest``), falls back to the newest complete ``step_{k}`` directory.

    Raises:
        ValueError: ``latest`` exists but does not hold an integer step.
    """
    path = os.path.join(checkpoints_dir(run_dir), LATEST_FILENAME)
    if os.path.isfile(path):
        text = open(path, encoding="utf-8").read().strip()
        try:
            step = int(text)
        except ValueError:
            raise ValueError(
                f"{path} must hold an integer step, found {text!r}: fix or delete the file"
            ) from None
        if os.path.isdir(step_dir(run_dir, step)):
            return step
        logger.warning("%s names step %d but %s is missing", path, step, step_dir(run_dir, step))
    steps = list_checkpoint_steps(run_dir)
    return steps[-1] if steps else None


# --------------------------------------------------------------------------- validation


def check_torch_dist_files(ckpt_dir: str) -> None:
    """Check that a megatron-core ``torch_dist`` directory is whole, without reading a tensor.

    Reads only the index of torch DCP (``.metadata``: a pickled
    ``torch.distributed.checkpoint.metadata.Metadata`` whose ``storage_data`` maps every
    stored item to a ``filesystem._StorageInfo(relative_path, offset, length)``, read with
    ``FileSystemReader.read_metadata``) and compares each data file's size with the end of
    the last item it must hold; also requires megatron-core's ``metadata.json`` and the
    common state (``common.pt`` as megatron-core 0.16 wrote it, or the ``common_state`` item of
    the index as 0.19 writes it: checkpoints of either load). A shard cut short by a full disk or an interrupted copy is caught here,
    not 50 frames deep in ``torch.load`` (torch 2.13 ``filesystem.FileSystemReader.read_data``).

    Raises:
        CheckpointError: naming the missing / unreadable / truncated file.
    """

    for name in (MCORE_CONFIG_FILENAME, DCP_METADATA_FILENAME):
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a complete torch_dist checkpoint")
    try:
        metadata = FileSystemReader(ckpt_dir).read_metadata()
    except Exception as exc:  # a cut pickle: EOFError, UnpicklingError, ...
        raise CheckpointError(f"{os.path.join(ckpt_dir, DCP_METADATA_FILENAME)} is unreadable "
                              f"({type(exc).__name__}: {exc}): the checkpoint index is damaged") from None
    # The common (non-tensor) state: megatron-core <= 0.16 wrote it to common.pt, 0.19 writes it
    # as one ShardedObject "common_state" inside the torch_dist index and still reads a legacy
    # common.pt first (megatron/core/dist_checkpointing/serialization.py:206-237,
    # load_common_state_dict; 0.16.1: strategies/common.py save_common). Either must be there.
    common_pt = os.path.join(ckpt_dir, MCORE_COMMON_FILENAME)
    if not os.path.isfile(common_pt) and not any(
            key.split("/", 1)[0] == MCORE_COMMON_STATE_KEY for key in (metadata.state_dict_metadata or {})):
        raise CheckpointError(f"{ckpt_dir} holds no common state (neither {MCORE_COMMON_FILENAME} nor the "
                              f"'{MCORE_COMMON_STATE_KEY}' item in its {DCP_METADATA_FILENAME}): it is not "
                              "a complete torch_dist checkpoint")
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, end in sorted(needed.items()):
        path = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing (the checkpoint index {DCP_METADATA_FILENAME} lists it)")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(f"{path} is truncated: {size} bytes, the checkpoint index "
                                  f"{DCP_METADATA_FILENAME} needs {end}")


def validate_checkpoint(ckpt_dir: str) -> dict[str, Any]:
    """Check a trainer checkpoint (``step_{k}``) cheaply and return its ``checkpoint_info.json``.

    Checks the info file, the trainer state, one RNG file per rank of the saving world and
    the ``torch_dist`` files (:func:`check_torch_dist_files`: sizes against the index, no
    tensor read). Cost: a few ``stat`` calls and the small index, whatever the model size.

    Raises:
        CheckpointError: naming the missing, empty or truncated file.
    """
    info_path = os.path.join(ckpt_dir, INFO_FILENAME)
    if not os.path.isfile(info_path):
        raise CheckpointError(f"{ckpt_dir} is not a complete checkpoint (no {INFO_FILENAME})")
    try:
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{info_path} is damaged ({exc})") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{info_path} is damaged (not a JSON object)")
    required = [TRAINER_STATE_FILENAME]
    required += [os.path.join(RNG_DIRNAME, f"rank_{r}.pt") for r in range(int(info.get("world_size", 0)))]
    for rel in required:
        path = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise CheckpointError(f"{path} is {'empty' if os.path.isfile(path) else 'missing'}")
    check_torch_dist_files(ckpt_dir)
    return info


def is_run_dir(path: str) -> bool:
    """Whether ``path`` is a run directory (holds ``checkpoints/``) rather than one checkpoint."""
    return os.path.isdir(checkpoints_dir(path)) and not os.path.isfile(os.path.join(path, MCORE_CONFIG_FILENAME))


def latest_checkpoint_dir(run_dir: str) -> str:
    """The ``step_{k}`` directory a resume of ``run_dir`` would load (:func:`read_latest_step`),
    for the tools that take a run directory (conversion, evaluation).

    Raises:
        CheckpointError: ``latest`` is unreadable, or the run has no complete checkpoint.
    """
    try:
        step = read_latest_step(run_dir)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if step is None:
        raise CheckpointError(f"run directory {run_dir} holds no complete checkpoint in {checkpoints_dir(run_dir)}")
    return step_dir(run_dir, step)


def check_model_checkpoint(ckpt_dir: str) -> None:
    """:func:`validate_checkpoint` for a trainer checkpoint, :func:`check_torch_dist_files` for a
    model-only one (``bridge.save_model_checkpoint``); cheap, no tensor read.

    Raises:
        CheckpointError: naming the missing or truncated file.
    """
    if os.path.isfile(os.path.join(ckpt_dir, INFO_FILENAME)):
        validate_checkpoint(ckpt_dir)
    else:
        check_torch_dist_files(ckpt_dir)


# --------------------------------------------------------------------------- dist helpers


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save_durable(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory + ``os.replace``."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(path))


# --------------------------------------------------------------------------- RNG


def get_rng_state() -> dict[str, Any]:
    """This rank's RNG state: python ``random``, numpy, torch CPU, torch CUDA, Megatron.

    Returns:
        dict with keys ``random`` (``random.getstate()``), ``numpy``
        (``np.random.get_state()``), ``torch_cpu`` (uint8 tensor), ``torch_cuda``
        (list of uint8 tensors, one per visible device, or None without CUDA) and
        ``megatron_tracker`` (``get_cuda_rng_tracker().get_states()``: stream name →
        state tensor; the TP-rank-specific model-parallel stream lives here), or None
        when megatron-core's parallel state is not initialised.
    """
    tracker_states = None
    try:  # megatron-core here, not at the top: dapo-train imports this module before quiet_third_party has silenced its import warnings
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker_states = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
    except ImportError:  # megatron-core absent: nothing to save for it
        pass
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "megatron_tracker": tracker_states,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a state produced by :func:`get_rng_state` on this rank.

    Raises:
        RuntimeError: the state holds CUDA RNG states but CUDA is absent here, or the
            number of visible CUDA devices changed.
    """
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda")
    if cuda_states is not None:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda_states):
            raise RuntimeError(
                f"checkpoint holds CUDA RNG states of {len(cuda_states)} device(s) but this "
                f"process sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}: "
                "resume with the same devices per process, or pass load_rng=False"
            )
        torch.cuda.set_rng_state_all(cuda_states)
    if state.get("megatron_tracker") is not None:
        # megatron-core here, not at the top: dapo-train imports this module before quiet_third_party has silenced its import warnings
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _save_rng_state(ckpt_dir: str) -> None:
    """Write this rank's RNG state to ``ckpt_dir/rng/rank_{global rank}.pt``."""
    os.makedirs(os.path.join(ckpt_dir, RNG_DIRNAME), exist_ok=True)
    _torch_save_durable(get_rng_state(), os.path.join(ckpt_dir, RNG_DIRNAME, f"rank_{_rank()}.pt"))


def _load_rng_state(ckpt_dir: str) -> None:
    path = os.path.join(ckpt_dir, RNG_DIRNAME, f"rank_{_rank()}.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint was written by a different world size; resume "
            "with the same number of ranks, or pass load_rng=False (the run is then not "
            "bitwise reproducible)"
        )
    set_rng_state(torch.load(path, weights_only=False))


# --------------------------------------------------------------------------- state dicts


def _as_list(model_chunks: Any) -> list:
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        raise ValueError("model_chunks is empty: pass the list of (DDP-wrapped) model chunks")
    return chunks


def _model_sharded_state_dict(model_chunks: list) -> dict[str, Any]:
    """{"model": ...} for one chunk, {"model0": ..., "model1": ...} for virtual PP."""
    # megatron-core here, not at the top: dapo-train imports this module before quiet_third_party has silenced its import warnings
    from megatron.core.utils import unwrap_model

    unwrapped = unwrap_model(model_chunks)
    if len(unwrapped) == 1:
        return {"model": unwrapped[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(unwrapped)}


def _optimizer_metadata(optimizer: Any, sharding_type: str) -> dict[str, Any]:
    if sharding_type not in _SHARDING_TYPES:
        raise ValueError(
            f"optim_sharding_type={sharding_type!r} is not supported: use one of {_SHARDING_TYPES}"
        )
    return {"distrib_optim_sharding_type": sharding_type}


def _torch_optimizers_of_cpu_distributed_optimizer(optimizer: Any) -> list:
    """The plain ``torch.optim`` optimizers that megatron-core's ``DistributedOptimizer``
    wraps when neither Apex nor Transformer Engine is installed (the CPU path); [] otherwise."""
    # megatron-core here, not at the top: dapo-train imports this module before quiet_third_party has silenced its import warnings
    from megatron.core.optimizer import distrib_optimizer as mdo

    if getattr(mdo, "HAVE_APEX_OR_TE", True):
        return []
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [sub.optimizer for sub in subs
            if isinstance(sub, mdo.DistributedOptimizer) and isinstance(sub.optimizer, torch.optim.Optimizer)]


def _allocate_torch_adam_state(optimizer: Any) -> None:
    """Give a never-stepped ``DistributedOptimizer`` the state torch's Adam would create.

    Without Apex/Transformer Engine (CPU), megatron-core 0.16.1 wraps a plain
    ``torch.optim.Adam`` whose per-parameter state (including ``step``) only exists after
    the first step, and ``DistributedOptimizer.state_dict()`` asserts ``len(steps) == 1``
    on it (``megatron/core/optimizer/distrib_optimizer.py``, ``state_dict``): both a load
    and a save before the first optimizer step (a step that kept no group) need a state.
    A step with zero gradients, ``lr=0`` and ``weight_decay=0`` allocates it without
    changing any parameter (moments stay 0); its ``step`` is then set back to 0, so the
    state equals the one ``torch.optim.Adam._init_group`` creates at the first real step
    and a save here changes nothing in the run that goes on. A load overwrites every
    value. With Apex/TE (GPU), megatron-core handles the empty state and this is a no-op.
    """
    for inner in _torch_optimizers_of_cpu_distributed_optimizer(optimizer):
        if len(inner.state) > 0:
            continue
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in inner.param_groups]
        created = []
        for g in inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
            for p in g["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                    created.append(p)
        inner.step()
        for g, (lr, wd) in zip(inner.param_groups, saved):
            g["lr"], g["weight_decay"] = lr, wd
        for p in created:
            p.grad = None
        for state in inner.state.values():  # one tensor per parameter, as Adam creates them
            state["step"] = torch.zeros_like(state["step"])


def _restore_torch_adam_steps(optimizer: Any) -> None:
    """Set every parameter's own Adam ``step`` from the loaded param groups (no Apex/TE).

    megatron-core 0.16.1 ``DistributedOptimizer`` without Apex/TE (the CPU path) wraps a
    plain ``torch.optim.Adam`` and, after ``load_state_dict``, leaves the per-parameter
    ``step`` wrong in two ways (found by the exact-resume test here): the
    ``dp_reshardable`` parameter state copies the *template's* step (the value of the
    state allocated before loading) into ``state["step"]``, and every parameter shares
    ONE step tensor object, which torch's Adam increments in place once per parameter.
    The saved step itself is correct in the loaded ``param_groups[i]["step"]`` (written by
    ``DistributedOptimizer.state_dict``), so give each parameter a fresh tensor with it.
    With Apex/TE (GPU) the step lives in the param groups and this is a no-op.
    """
    for inner in _torch_optimizers_of_cpu_distributed_optimizer(optimizer):
        for group in inner.param_groups:
            if group.get("step") is None:
                continue
            for p in group["params"]:
                state = inner.state.get(p)
                if state is not None and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def _full_sharded_state_dict(
    model_chunks: list, optimizer: Any, scheduler: Any, sharding_type: str, is_loading: bool
) -> dict[str, Any]:
    state = _model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        _allocate_torch_adam_state(optimizer)  # no-op once the optimizer has stepped
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=_optimizer_metadata(optimizer, sharding_type)
        )
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


# --------------------------------------------------------------------------- save


def _clean_stale_tmp_dirs(root: str) -> None:
    for name in os.listdir(root):
        if _TMP_DIR.match(name):
            logger.info("removing abandoned checkpoint dir %s", name)
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _rename_into_place(tmp_dir: str, final_dir: str) -> None:
    """Rank 0: make ``tmp_dir`` the complete ``final_dir`` (atomic rename)."""
    if os.path.exists(final_dir):
        # Re-saving a step that already exists (e.g. the run was resumed from an older
        # `latest`): move the old one aside under a tmp name first; it is cleaned later.
        os.rename(final_dir, f"{final_dir}.tmp-{uuid.uuid4().hex}")
    os.rename(tmp_dir, final_dir)
    _fsync_path(os.path.dirname(final_dir))


def _update_latest(root: str, step: int) -> None:
    _write_text_atomic(os.path.join(root, LATEST_FILENAME), f"{int(step)}\n")


def _prune(run_dir: str, max_ckpt_to_keep: int | None, keep_step: int) -> list[int]:
    if not max_ckpt_to_keep:
        return []
    steps = list_checkpoint_steps(run_dir)
    removed = []
    for s in steps[: max(0, len(steps) - max_ckpt_to_keep)]:
        if s == keep_step:
            continue
        shutil.rmtree(step_dir(run_dir, s), ignore_errors=True)
        removed.append(s)
    return removed


def save_checkpoint(
    run_dir: str,
    step: int,
    model_chunks: Any,
    optimizer: Any,
    scheduler: Any,
    trainer_state: dict[str, Any],
    *,
    max_ckpt_to_keep: int | None = None,
    optim_sharding_type: OptimShardingType = "dp_reshardable",
    write_extra: Callable[[str], None] | None = None,
    parallel: ParallelDims | None = None,
) -> str:
    """Save model, optimizer, scheduler, per-rank RNG and trainer state atomically.

    A collective: every rank of the world must call it with the same ``run_dir`` and
    ``step``. Layout and commit protocol: see the module docstring.

    Args:
        run_dir: the run directory (``trainer.default_local_dir``); must be on a file
            system shared by all ranks (rank 0 renames what every rank wrote).
        step: the number of completed training steps (``>= 0``).
        model_chunks: a Megatron model chunk or the list of chunks (virtual PP), possibly
            wrapped in Megatron DDP / Float16Module (unwrapped with
            ``megatron.core.utils.unwrap_model``).
        optimizer: a megatron-core ``MegatronOptimizer`` (``DistributedOptimizer``,
            ``ChainedOptimizer``, ...) or None to save the model only.
        scheduler: anything with ``state_dict()`` / ``load_state_dict()`` (e.g.
            ``megatron.core.optimizer_param_scheduler.OptimizerParamScheduler``) or None.
        trainer_state: picklable dict from the trainer; only global rank 0's copy is
            written, so gather per-rank items first (e.g. the data-reader position of
            every DP rank, the rollout-buffer surplus). Conventionally holds ``"step"``.
        max_ckpt_to_keep: keep only this many newest ``step_*`` dirs (None or 0: all).
        optim_sharding_type: ``DistributedOptimizer`` state format:
            ``"dp_reshardable"`` (fully parallel; reload only with the same TP/PP, any DP)
            or ``"fully_reshardable"`` (gathers on DP rank 0; reload at other TP/PP).
        write_extra: called on rank 0 with the temporary directory before the commit,
            to add files that must be part of the checkpoint (the trainer writes the HF
            config, tokenizer and ``dapo_megatron.json`` there, so
            ``tools/convert_megatron_to_hf.py`` converts the step directory).
        parallel: the run's layout, recorded in ``checkpoint_info.json`` (TP / PP / DP
            sizes), whose world group the save's collectives run over; None: a world of one
            (records no layout).

    Returns:
        The path of the complete checkpoint, ``run_dir/checkpoints/step_{step}``.

    Raises:
        ValueError: ``step`` is negative, ``trainer_state`` is not a dict,
            ``optim_sharding_type`` or ``max_ckpt_to_keep`` is invalid, or ``parallel`` is
            None in a world of more than one rank.
        OSError / CheckpointingException: a write failed; ``latest`` still names the
            previous checkpoint and the partial tmp dir is removed by the next save.
    """
    # megatron-core here, not at the top: dapo-train imports this module before quiet_third_party has silenced its import warnings
    from megatron.core import dist_checkpointing

    if int(step) != step or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative integer")
    if not isinstance(trainer_state, dict):
        raise ValueError(f"trainer_state must be a dict, got {type(trainer_state).__name__}")
    if max_ckpt_to_keep is not None and max_ckpt_to_keep < 0:
        raise ValueError(f"max_ckpt_to_keep={max_ckpt_to_keep} must be >= 0 (0 or None keeps all)")
    dims = dims_or_single(parallel, "save_checkpoint")
    chunks = _as_list(model_chunks)
    state = _full_sharded_state_dict(chunks, optimizer, scheduler, optim_sharding_type, False)

    root = checkpoints_dir(run_dir)
    tmp_dir = None
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        _clean_stale_tmp_dirs(root)
        tmp_dir = os.path.join(root, f"step_{int(step)}.tmp-{uuid.uuid4().hex}")
        os.makedirs(tmp_dir)
    tmp_dir = dims.broadcast_object(tmp_dir, "world", src=0)

    # Synchronous save: no async writer process (see the module docstring).
    dist_checkpointing.save(state, tmp_dir, async_sharded_save=False)
    _save_rng_state(tmp_dir)
    if _rank() == 0:
        _torch_save_durable(trainer_state, os.path.join(tmp_dir, TRAINER_STATE_FILENAME))
        if write_extra is not None:  # inside the atomic commit, like every other file
            write_extra(tmp_dir)
        info = _info(step, chunks, optim_sharding_type, optimizer, parallel)
        _write_text_atomic(os.path.join(tmp_dir, INFO_FILENAME), json.dumps(info, indent=2))
    dims.barrier("world")  # every rank's files are on disk before the commit

    final_dir = step_dir(run_dir, step)
    if _rank() == 0:
        _rename_into_place(tmp_dir, final_dir)
        _update_latest(root, step)
        removed = _prune(run_dir, max_ckpt_to_keep, keep_step=step)
        if removed:
            logger.info("pruned checkpoints of steps %s", removed)
    dims.barrier("world")
    return final_dir


def _info(step: int, chunks: list, sharding_type: str, optimizer: Any,
          parallel: ParallelDims | None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "world_size": _world_size(),
        "num_model_chunks": len(chunks),
        "optim_sharding_type": sharding_type if optimizer is not None else None,
    }
    if parallel is not None:
        info.update(
            tensor_model_parallel_size=parallel.tp_size,
            pipeline_model_parallel_size=parallel.pp_size,
            data_parallel_size=parallel.dp_size,
            expert_model_parallel_size=parallel.ep_size,  # MoE: the experts' layout of the save
            expert_tensor_parallel_size=parallel.etp_size,
        )
    return info


# --------------------------------------------------------------------------- load


def load_checkpoint(
    run_dir: str,
    model_chunks: Any,
    optimizer: Any,
    scheduler: Any,
    step: int | None = None,
    *,
    checkpoint_dir: str | None = None,
    load_rng: bool = True,
    parallel: ParallelDims | None = None,
) -> dict[str, Any] | None:
    """Restore a checkpoint written by :func:`save_checkpoint`; the trainer state or None.

    A collective: every rank calls it. Order: model weights, optimizer state (which
    also restores the fp32 main params of the distributed optimizer), scheduler, and
    RNG last, so nothing seeded during loading perturbs the restored streams. Do not
    re-seed (e.g. ``init_distributed(seed=...)``) after this call.

    Args:
        run_dir: the run directory the checkpoint was saved under.
        model_chunks, optimizer, scheduler: built exactly as for the saved run (same
            TP/PP layout for ``"dp_reshardable"``); optimizer/scheduler may be None.
        step: the step to load; None loads ``checkpoints/latest`` (see
            :func:`read_latest_step`).
        checkpoint_dir: load this ``step_{k}`` directory instead (``trainer.resume_mode``
            given as a path); overrides ``run_dir`` and ``step``.
        load_rng: restore this rank's RNG from ``rng/rank_{r}.pt``; set False only when
            resuming at a different world size.
        parallel: the run's layout (the world group of the final barrier); None: a world of one.

    Returns:
        The dict given as ``trainer_state`` to :func:`save_checkpoint`, on every rank, or
        None when ``step`` is None and the run has no complete checkpoint yet.

    Raises:
        FileNotFoundError: ``step`` / ``checkpoint_dir`` names no complete checkpoint, or
            the RNG file of this rank is missing (world size changed).
        CheckpointError: a file of the checkpoint is missing or truncated
            (:func:`validate_checkpoint`, naming it).
        ValueError: the checkpoint's format or optimizer sharding is unknown, or ``parallel``
            is None in a world of more than one rank.
    """
    dims = dims_or_single(parallel, "load_checkpoint")
    # megatron-core here, not at the top: dapo-train imports this module before quiet_third_party has silenced its import warnings
    from megatron.core import dist_checkpointing

    if checkpoint_dir is None:
        if step is None:
            step = read_latest_step(run_dir)
            if step is None:
                return None
        checkpoint_dir = step_dir(run_dir, step)
    if not os.path.isfile(os.path.join(checkpoint_dir, INFO_FILENAME)):
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a complete checkpoint (no {INFO_FILENAME}); "
            f"available steps under {checkpoints_dir(run_dir)}: {list_checkpoint_steps(run_dir)}"
        )
    info = validate_checkpoint(checkpoint_dir)  # a truncated shard: named here, not deep in torch.load
    if info.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{checkpoint_dir} has checkpoint format_version={info.get('format_version')}, "
            f"this code reads {FORMAT_VERSION}"
        )
    if optimizer is not None and info.get("optim_sharding_type") is None:
        raise ValueError(f"{checkpoint_dir} holds no optimizer state: pass optimizer=None")

    chunks = _as_list(model_chunks)
    sharding_type = info.get("optim_sharding_type") or "dp_reshardable"
    sharded = _full_sharded_state_dict(chunks, optimizer, scheduler, sharding_type, True)
    loaded = dist_checkpointing.load(sharded, checkpoint_dir)

    # megatron-core here, not at the top: dapo-train imports this module before quiet_third_party has silenced its import warnings
    from megatron.core.utils import unwrap_model

    unwrapped = unwrap_model(chunks)
    if len(unwrapped) == 1:
        unwrapped[0].load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(unwrapped):
            chunk.load_state_dict(loaded[f"model{i}"], strict=True)
    if optimizer is not None:
        # fp32 main params may be views of leaf model params: copy into them without autograd
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_torch_adam_steps(optimizer)
    if scheduler is not None:
        if "opt_param_scheduler" not in loaded:
            raise ValueError(f"{checkpoint_dir} holds no scheduler state: pass scheduler=None")
        scheduler.load_state_dict(loaded["opt_param_scheduler"])

    trainer_state = torch.load(
        os.path.join(checkpoint_dir, TRAINER_STATE_FILENAME), weights_only=False
    )
    dims.barrier("world")
    if load_rng:
        _load_rng_state(checkpoint_dir)
    return trainer_state


# --------------------------------------------------------------------------- the components


class Stateful(Protocol):
    """A component with checkpointed state. ``state_dict()`` is called on every rank (it may be a
    collective) and returns plain picklable python; global rank 0's is written. ``load_state_dict``
    gets that dict on every rank and raises ``ValueError`` / ``KeyError`` for one it cannot take."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.load` restored besides the components: the step count and the
    tracking (MLflow) run to continue."""

    step: int
    tracking_run_id: str | None


def upgrade_trainer_state(state: Any, path: str) -> dict[str, Any]:
    """``trainer_state.pt`` as layout 2 (module docstring), whichever layout ``path`` holds.

    Raises:
        CheckpointError: neither layout (naming ``path`` and the ``trainer.resume_mode`` to set).
    """
    fix = "set trainer.resume_mode=disable to start a new run, or to the path of another step_<k>"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{path} holds no trainer state (a dict with an int 'step'): {fix}")
    layout = state.get("layout", 1)
    if layout == 1:  # e9128fc and before: the rollout's keys beside step and the MLflow run id
        rollout = {k: v for k, v in state.items() if k not in ("step", "mlflow_run_id")}
        return {"layout": TRAINER_STATE_LAYOUT, "step": state["step"], "tracking_run_id": state.get("mlflow_run_id"),
                "components": {"rollout": rollout}}
    if layout != TRAINER_STATE_LAYOUT or not isinstance(state.get("components"), dict):
        raise CheckpointError(f"{path} has trainer-state layout {layout!r}; this code reads layouts 1 and "
                              f"{TRAINER_STATE_LAYOUT}: {fix}")
    return state


class Checkpointer:
    """Saves and restores everything a run resumes from, atomically (:func:`save_checkpoint`'s
    protocol, module docstring): the actor's model chunks, optimizer and LR scheduler
    (``torch_dist`` shards from every rank), every rank's RNG, and the state of each named
    component (:class:`Stateful`: the rollout, which holds the prompt streams, the selector's
    surplus, the streamed partial groups, prompt queue and skip history), with the step count
    and the tracking run id. Every method is a collective: call it on every rank.

    Args:
        run_dir: the run directory (``trainer.default_local_dir``).
        actor: has ``model_chunks``, ``optimizer``, ``scheduler``
            (:class:`~dapo_megatron.actor.MegatronActor`).
        components: ``{name: component}``; each name keys its state in ``trainer_state.pt``.
        parallel: the run's layout (recorded in ``checkpoint_info.json``; its world group runs the
            collectives); None: a world of one.
        max_ckpt_to_keep, write_extra: as :func:`save_checkpoint`.
    """

    def __init__(self, run_dir: str, actor: Any, components: Mapping[str, Stateful], *,
                 parallel: ParallelDims | None = None, max_ckpt_to_keep: int | None = None,
                 write_extra: Callable[[str], None] | None = None):
        self.run_dir, self.actor, self.components = run_dir, actor, dict(components)
        self.parallel, self.max_ckpt_to_keep, self.write_extra = parallel, max_ckpt_to_keep, write_extra

    def save(self, step: int, *, tracking_run_id: str | None = None) -> str:
        """Write the checkpoint of ``step`` completed steps; returns its ``step_{step}`` directory."""
        state = {"layout": TRAINER_STATE_LAYOUT, "step": int(step), "tracking_run_id": tracking_run_id,
                 "components": {name: c.state_dict() for name, c in self.components.items()}}
        a = self.actor
        return save_checkpoint(self.run_dir, step, a.model_chunks, a.optimizer, a.scheduler, state,
                               max_ckpt_to_keep=self.max_ckpt_to_keep, write_extra=self.write_extra,
                               parallel=self.parallel)

    def load(self, checkpoint_dir: str) -> Restored:
        """Restore the ``step_{k}`` directory ``checkpoint_dir`` (layout 1 or 2): the actor and the RNG
        (:func:`load_checkpoint`), then every component, in the order given.

        Raises:
            CheckpointError: a missing or truncated file (:func:`validate_checkpoint`), a trainer
                state of neither layout, without a component's state, or one its component refuses;
                each names the file and the ``trainer.resume_mode`` to set.
        """
        a = self.actor
        raw = load_checkpoint(self.run_dir, a.model_chunks, a.optimizer, a.scheduler, checkpoint_dir=checkpoint_dir,
                              parallel=self.parallel)
        path = os.path.join(checkpoint_dir, TRAINER_STATE_FILENAME)
        state = upgrade_trainer_state(raw, path)
        fix = "set trainer.resume_mode=disable to start a new run"
        for name, component in self.components.items():
            if name not in state["components"]:
                raise CheckpointError(f"{path} holds no {name!r} state (it has {sorted(state['components'])}): {fix}")
            try:
                component.load_state_dict(state["components"][name])
            except (KeyError, TypeError, ValueError) as err:
                detail = f"missing key {err}" if isinstance(err, KeyError) else str(err)
                raise CheckpointError(f"{path}: the {name!r} state does not load: {detail}; or {fix}") from err
        return Restored(step=state["step"], tracking_run_id=state["tracking_run_id"])

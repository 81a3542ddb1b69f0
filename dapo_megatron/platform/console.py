"""The main job's console: our progress and results; known third-party noise filtered here.

:func:`quiet_third_party` (``dapo-train`` calls it before anything imports megatron-core)
hides exactly

* the warnings of :data:`KNOWN_BENIGN_WARNINGS`, each matched by category, emitting module
  and the start of its text, with the reason it is benign,
* the log records of :data:`KNOWN_BENIGN_LOG_RECORDS` (matched by logger and start of text,
  with the reason), and
* the INFO records of :data:`QUIET_LOGGERS` (megatron-core's dumps of the DDP and optimizer
  configs and its list of every parameter of each gradient bucket, 180 lines for
  SmolLM2; MLflow's "Creating initial MLflow database tables"); their warnings stay.

Every other warning and log record is printed as usual. ``DAPO_SHOW_WARNINGS=1`` in the
environment turns the filtering off, so the hidden lines are printed again.

This module does not import torch: a command-line tool installs the filters first and may stop
on bad input before it ever loads torch (~1.2 s a process). Until torch is imported the
``cpu_only`` entries, which need ``torch.cuda.is_available()``, wait for it (an import hook that
installs them as soon as ``import torch`` has run, before anything imports megatron-core).

Design: docs/design.md §5 (megatron-core on CPU: the warnings it prints there).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

SHOW_WARNINGS_ENV = "DAPO_SHOW_WARNINGS"


@dataclass(frozen=True)
class BenignWarning:
    """One known warning that says nothing the user can act on.

    Attributes:
        category: its warning class.
        module: regular expression matched against the emitting module's name.
        message: regular expression matched at the start of the text (``warnings.filterwarnings``).
        why: the reason it is safe to hide.
        cpu_only: hide it only on a machine without CUDA (on a GPU it is advice worth seeing).
    """

    category: type[Warning]
    module: str
    message: str
    why: str
    cpu_only: bool = False


KNOWN_BENIGN_WARNINGS: tuple[BenignWarning, ...] = (
    BenignWarning(
        UserWarning, r"megatron\.core\.", r"Transformer Engine and Apex are not installed",
        "megatron-core 0.19.2 (optimizer/, clip_grads, fsdp mixed_precision) falls back to its torch "
        "implementations, which is what a CPU run uses; a GPU without TE should still see it", cpu_only=True),
    BenignWarning(
        UserWarning, r"megatron\.core\.models\.", r"Apex is not installed\. Falling back to Torch Norm",
        "printed at import of the local layer spec; this stack never uses Apex (TE norms on GPU, "
        "torch norms on CPU)"),
    BenignWarning(
        UserWarning, r"megatron\.core\.transformer\.transformer_config", r"full scope is deprecated",
        "megatron-core 0.19.2's TransformerConfig warns about its own default cuda_graph_scope='full' "
        "(transformer_config.py:2413-2418; CUDA graphs are off here)"),
    BenignWarning(
        UserWarning, r"megatron\.core\.hyper_comm_grid", r"absl\.logging is not installed",
        "megatron-core 0.19 (hyper_comm_grid.py:11-21) logs through absl when it is installed and "
        "through the standard logging module otherwise; its records are the same either way"),
    BenignWarning(
        UserWarning, r"megatron\.core\.tensor_parallel\.layers",
        r"When using async grad allreduce it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS",
        "a CUDA stream-scheduling hint, meaningless on CPU (the GPU launchers and the Docker image set "
        "CUDA_DEVICE_MAX_CONNECTIONS=1)", cpu_only=True),
    BenignWarning(
        UserWarning, r"(megatron\.core\.|torch\.distributed\.)", r"The argument order of load has been changed",
        "megatron-core 0.19.2 calls torch DCP's load(state_dict, reader) positionally "
        "(dist_checkpointing/strategies/torch.py:979); torch 2.14 maps them as before "
        "(distributed/checkpoint/utils.py:463-470, _api_bc_check)"),
    BenignWarning(
        UserWarning, r"(megatron\.core\.|torch\.distributed\.)",
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load",
        "megatron-core 0.19.2 reads a checkpoint's common state on each rank alone, on purpose "
        "(dist_checkpointing/serialization.py:229, no_dist=True); torch says so at every load"),
    BenignWarning(
        FutureWarning, r"dapo_megatron\.platform\.cpu_compat", r"Please use DTensor instead and we are deprecating ShardedTensor",
        "torch 2.14 deprecates its ShardedTensor (distributed/_shard/_utils.py:7), which megatron-core 0.19.2's "
        "torch_dist strategy still builds; the warning is attributed to cpu_compat's CPU torch-function "
        "mode, which only forwards the call", cpu_only=True),
    BenignWarning(
        FutureWarning, r"torch\.distributed\.c10d_logger",
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        "torch 2.13+ renamed the collectives megatron-core 0.19.2 calls (distributed/param_and_grad_buffer.py, "
        "tensor_parallel/mappings.py); the operation is the same"),
)

# INFO records that are configuration dumps, not progress; WARNING and above still print.
QUIET_LOGGERS: tuple[str, ...] = ("megatron.core", "mlflow.store.db.utils")


@dataclass(frozen=True)
class BenignLogRecord:
    """One known log record (not a warning) that says nothing the user can act on.

    Attributes:
        logger: the logger's name (exact).
        message: regular expression matched at the start of the record's formatted message.
        why: the reason it is safe to hide.
        cpu_only: hide it only on a machine without CUDA.
    """

    logger: str
    message: str
    why: str
    cpu_only: bool = False


KNOWN_BENIGN_LOG_RECORDS: tuple[BenignLogRecord, ...] = (
    BenignLogRecord(
        "torch.utils.cpp_extension", r"No CUDA runtime is found",
        "PyPI's torch 2.14.1 is a CUDA build; on a CPU machine that has a CUDA toolkit "
        "(nvcc on PATH) its cpp_extension module says so at import (torch/utils/cpp_extension.py:182-183, "
        "_find_cuda_home); nothing here compiles a CUDA extension", cpu_only=True),
    BenignLogRecord(
        "megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED",
        "megatron-core 0.19.2 logs it at every GPTModel construction (models/gpt/gpt_model.py:118-124): "
        "GPTModel still takes critical fixes and is what this stack builds; moving to HybridModel is a "
        "change of this project's model builder, not something a user can do"),
    BenignLogRecord(
        "megatron.core.distributed.distributed_data_parallel", r"DistributedDataParallel: full_param_layout not provided",
        "megatron-core 0.19.2 computes the distributed optimizer's parameter layout itself when the caller "
        "does not (distributed/distributed_data_parallel.py:132-149, DistributedOptimizer."
        "compute_full_param_layout with the DDP's own bucket size and groups): the same layout"),
    BenignLogRecord(
        "megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated",
        "logged once per process by megatron-core 0.19.2's torch_dist save whatever the save mode "
        "(strategies/torch.py:746-752); this stack saves synchronously (checkpointing.py)"),
    BenignLogRecord(
        "megatron.core.dist_checkpointing.strategies.common", r"load_common is deprecated",
        "megatron-core 0.19.2 reads the common.pt of a checkpoint written by 0.16 through its deprecated "
        "reader (strategies/common.py:32-46); such checkpoints still resume (checkpointing.py)"),
)


class _DropRecords(logging.Filter):
    """A logging filter dropping the records whose message starts with one of ``patterns``."""

    def __init__(self, patterns: list[str]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def show_warnings(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when ``DAPO_SHOW_WARNINGS`` is set to anything but ``""``/``0``/``false``/``no``."""
    value = (os.environ if environ is None else environ).get(SHOW_WARNINGS_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no")


def quiet_third_party(on_cpu: Optional[bool] = None, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Install the filters of this module in this process (idempotent).

    Args:
        on_cpu: whether this machine has no CUDA (default: ``not torch.cuda.is_available()``);
            decides the ``cpu_only`` entries. Left ``None`` in a process that has not imported
            torch yet, the ``cpu_only`` entries are installed right after its ``import torch``
            (:class:`_AfterTorchImport`), so this call does not load torch.
        environ: the environment to read ``DAPO_SHOW_WARNINGS`` from (default ``os.environ``).

    Returns:
        False, installing nothing, when ``DAPO_SHOW_WARNINGS`` asks to see everything.
    """
    if show_warnings(environ):
        return False
    _install(lambda entry: not entry.cpu_only)
    if on_cpu is None and "torch" not in sys.modules:
        _AfterTorchImport.arm(_install_cpu_only)
    else:
        if on_cpu is None:
            on_cpu = _no_cuda()
        if on_cpu:
            _install(lambda entry: entry.cpu_only)
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level < logging.WARNING:  # NOTSET (inherit the root's INFO) included
            logger.setLevel(logging.WARNING)
    return True


def _no_cuda() -> bool:
    import torch  # here, not at the top: a tool's bad flag stops before anything loads torch (~1.2 s)

    return not torch.cuda.is_available()


def _install_cpu_only() -> None:
    if _no_cuda():
        _install(lambda entry: entry.cpu_only)


def _install(selected: Callable[[object], bool]) -> None:
    """The warning filters and log-record filters of the entries ``selected`` picks."""
    for w in KNOWN_BENIGN_WARNINGS:
        if selected(w):
            warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
    by_logger: dict[str, list[str]] = {}
    for r in KNOWN_BENIGN_LOG_RECORDS:
        if selected(r):
            by_logger.setdefault(r.logger, []).append(r.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        drop = _DropRecords(patterns)
        if not any(isinstance(f, _DropRecords) and f.pattern.pattern == drop.pattern.pattern
                   for f in logger.filters):  # idempotent
            logger.addFilter(drop)


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that runs a callback once, right after the module ``torch`` has been
    executed (its ``exec_module``; the import system's PEP 451 protocol). It finds nothing itself: on
    the first ``import torch`` it leaves ``sys.meta_path`` and wraps the loader of the spec the other
    finders return. At most one is armed at a time (the callback of the last :meth:`arm` runs)."""

    _armed: Optional["_AfterTorchImport"] = None

    def __init__(self, callback: Callable[[], None]):
        self.callback = callback

    @classmethod
    def arm(cls, callback: Callable[[], None]) -> None:
        if cls._armed is not None and cls._armed in sys.meta_path:
            cls._armed.callback = callback
            return
        cls._armed = cls(callback)
        sys.meta_path.insert(0, cls._armed)

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the other finders (torch is not in sys.modules yet)
        if spec is None or isinstance(spec.loader, (type(None), type)) or not hasattr(spec.loader, "exec_module"):
            return spec  # no loader of its own to wrap (a class-level importer): nothing deferred
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_callback(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_callback
        return spec

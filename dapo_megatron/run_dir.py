"""How a run starts in its run directory: resume, start new, or stop because it is done.

:func:`plan_start` decides from the files alone (rank 0, before any model loads);
:func:`prepare_run_dir` applies it on rank 0 and hands the same :class:`RunStart` to every
rank. The rules (``trainer.resume_mode``, docs/design.md §7):

* ``auto``: resume from ``checkpoints/latest``. If ``latest`` names a step whose directory is
  gone, resume from the newest complete checkpoint left, with a warning that says so (the
  commit protocol of :mod:`dapo_megatron.checkpointing` can leave that state; verl and
  Megatron-LM also resume from the newest checkpoint they find); if none is left, stop with
  an error naming ``latest`` (never a silent step 0 in the same directory).
* a ``step_<k>`` path: resume from it.
* ``disable``: start from step 0.

The checkpoint to resume from is checked cheaply first
(:func:`~dapo_megatron.checkpointing.validate_checkpoint`: file sizes against the torch DCP
index); a truncated or missing file stops the run with a :class:`CheckpointError` naming it
and the ``trainer.resume_mode`` to set (the newest older checkpoint that is whole, or
``disable``): a damaged checkpoint is not skipped silently, as Megatron-LM and verl stop on
one too, and the older checkpoint it names may be pruned by the next save of this run.

A run that starts from step 0 never appends to another run's files: the previous run's
``checkpoints/``, metrics file, ``params.json`` and ``texts/`` are moved to
``previous_runs/<UTC time>/`` inside the run directory (nothing is deleted; the MLflow store
stays, the new run is a new MLflow run next to the old one). A resume whose checkpoint is
already at ``trainer.total_training_steps`` is :attr:`RunStart.finished`: ``dapo-train``
says so in one line and exits before loading a model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from dapo_megatron.checkpointing import (
    LATEST_FILENAME,
    CheckpointError,
    checkpoints_dir,
    list_checkpoint_steps,
    step_dir,
    validate_checkpoint,
)
from dapo_megatron.platform.parallel_dims import ParallelDims, dims_or_single

if TYPE_CHECKING:
    from dapo_megatron.config.run import DAPOConfig
    from dapo_megatron.config.trainer import TrainerConfig

logger = logging.getLogger(__name__)

PREVIOUS_RUNS_DIRNAME = "previous_runs"
RUN_FILES = ("checkpoints", "params.json", "texts")  # + the metrics file: one run's own files


@dataclass
class RunStart:
    """How this run starts (the same on every rank).

    Attributes:
        run_dir: absolute run directory.
        checkpoint_dir: the ``step_<k>`` directory to load, or None for a new run (step 0).
        step: the step of that checkpoint (0 for a new run).
        finished: the checkpoint is at ``trainer.total_training_steps`` or beyond: nothing to train.
        move_aside: the previous run's files that a new run moves away (names inside
            ``run_dir``); empty when there are none or the run resumes.
        moved_to: where :func:`prepare_run_dir` moved them, or None.
        warning: a fallback the user must know about (printed by rank 0), or None.
    """

    run_dir: str
    checkpoint_dir: Optional[str] = None
    step: int = 0
    finished: bool = False
    move_aside: tuple[str, ...] = ()
    moved_to: Optional[str] = None
    warning: Optional[str] = None

    @property
    def resuming(self) -> bool:
        return self.checkpoint_dir is not None

    def describe(self) -> str:
        """The resume state in a few words, for the start-up banner."""
        if self.resuming:
            return f"resuming from step {self.step} ({self.checkpoint_dir})"
        if self.moved_to:
            return f"new run from step 0 (the previous run's files moved to {self.moved_to})"
        return "new run from step 0"


def _previous_run_files(run_dir: str, metrics_file: str) -> tuple[str, ...]:
    names = []
    for name in (*RUN_FILES, metrics_file):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and os.listdir(path) or os.path.isfile(path) and os.path.getsize(path) > 0:
            names.append(name)
    return tuple(names)


def _older_whole_checkpoint(run_dir: str, below: int) -> Optional[str]:
    """The newest ``step_<k>`` with ``k < below`` that passes the cheap check, or None."""
    for k in reversed([s for s in list_checkpoint_steps(run_dir) if s < below]):
        try:
            validate_checkpoint(step_dir(run_dir, k))
            return step_dir(run_dir, k)
        except CheckpointError:
            continue
    return None


def _checked(ckpt: str, run_dir: Optional[str], step_hint: Optional[int]) -> dict[str, Any]:
    """:func:`validate_checkpoint`, its error extended with the ``trainer.resume_mode`` to set."""
    try:
        return validate_checkpoint(ckpt)
    except CheckpointError as err:
        older = _older_whole_checkpoint(run_dir, step_hint) if run_dir and step_hint is not None else None
        if older:
            fix = f"resume from the newest whole one with trainer.resume_mode={older}"
        elif run_dir is None:  # trainer.resume_mode named this checkpoint
            fix = "point trainer.resume_mode at another step_<k> directory"
        else:
            fix = "no older whole checkpoint is left"
        raise CheckpointError(f"cannot resume: {err}; {fix}, or set trainer.resume_mode=disable to start a new run "
                              f"(the old run's files are moved aside)") from None


def plan_start(trainer: TrainerConfig, metrics_file: str = "metrics.jsonl") -> RunStart:
    """Decide how the run starts (module docstring) from the files; no side effects.

    Raises:
        CheckpointError: ``latest`` is unreadable or names a missing step with no checkpoint
            left, or the checkpoint to resume from fails :func:`validate_checkpoint`.
    """
    run_dir = os.path.abspath(trainer.run_dir)
    total = trainer.total_training_steps
    if trainer.resume_path is not None:  # an explicit step_<k> directory
        ckpt = os.path.abspath(trainer.resume_path)
        info = _checked(ckpt, None, None)
        step = int(info["step"])
        return RunStart(run_dir, ckpt, step, finished=step >= total)
    new = RunStart(run_dir, move_aside=_previous_run_files(run_dir, metrics_file))
    if trainer.resume_mode == "disable":
        return new
    latest = os.path.join(checkpoints_dir(run_dir), LATEST_FILENAME)
    steps = list_checkpoint_steps(run_dir)
    warning = None
    if os.path.isfile(latest):
        text = open(latest, encoding="utf-8", errors="replace").read().strip()
        try:
            step = int(text)
        except ValueError:
            raise CheckpointError(f"{latest} must hold an integer step, found {text[:40]!r}: write the step of a "
                                  f"checkpoint in {checkpoints_dir(run_dir)} into it, or set "
                                  "trainer.resume_mode=disable to start a new run") from None
        if step not in steps:
            if not steps:
                raise CheckpointError(
                    f"{latest} names step {step} but {step_dir(run_dir, step)} is missing and no other checkpoint "
                    f"is left in {checkpoints_dir(run_dir)}: restore it, or set trainer.resume_mode=disable to "
                    "start a new run (the old run's files are moved aside)")
            warning = (f"{latest} names step {step} but {step_dir(run_dir, step)} is missing: resuming from the "
                       f"newest complete checkpoint, step {steps[-1]}")
            step = steps[-1]
    elif steps:
        step = steps[-1]  # `latest` deleted: the newest step directory (each is complete once renamed)
    else:
        return new
    ckpt = step_dir(run_dir, step)
    info = _checked(ckpt, run_dir, step)
    step = int(info.get("step", step))
    return RunStart(run_dir, ckpt, step, finished=step >= total, warning=warning)


def move_previous_run(run_dir: str, names: tuple[str, ...]) -> Optional[str]:
    """Move ``names`` (inside ``run_dir``) to ``run_dir/previous_runs/<UTC time>/``; returns that
    directory, or None when ``names`` is empty. Renames only: nothing is copied or deleted."""
    if not names:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = os.path.join(run_dir, PREVIOUS_RUNS_DIRNAME, stamp)
    n = 1
    while os.path.exists(dest):  # two new runs within a second
        n += 1
        dest = os.path.join(run_dir, PREVIOUS_RUNS_DIRNAME, f"{stamp}-{n}")
    os.makedirs(dest)
    for name in names:
        os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    return dest


def prepare_run_dir(cfg: DAPOConfig, parallel: Optional[ParallelDims] = None) -> RunStart:
    """:func:`plan_start` on rank 0, the previous run moved aside there (a new run), and the same
    :class:`RunStart` (or the same :class:`CheckpointError`) on every rank; collective over the
    world of ``parallel`` (None: a world of one). Rank 0 logs the plan's warning.

    Raises:
        CheckpointError: on every rank, from :func:`plan_start`.
        ValueError: ``parallel`` is None in a world of more than one rank.
    """
    parallel = dims_or_single(parallel, "prepare_run_dir")
    rank = parallel.rank
    result: Any = None
    if rank == 0:
        try:
            start = plan_start(cfg.trainer, cfg.tracking.metrics_file)
            if not start.resuming:
                os.makedirs(start.run_dir, exist_ok=True)
                start.moved_to = move_previous_run(start.run_dir, start.move_aside)
            result = start
        except CheckpointError as err:
            result = err
    result = parallel.broadcast_object(result, "world", src=0)
    if isinstance(result, CheckpointError):
        raise CheckpointError(str(result))
    if rank == 0:
        if result.warning:
            logger.warning("%s", result.warning)
        if result.moved_to:
            logger.warning("%s holds a previous run; a new run starts from step 0: its files (%s) were moved to %s",
                           result.run_dir, ", ".join(result.move_aside), result.moved_to)
    return result


# --------------------------------------------------------------------------- banner and summary


def banner(cfg: DAPOConfig, parallel: ParallelDims, start: RunStart) -> str:
    """The start-up banner (a few lines, printed by rank 0): run directory, world and layout,
    steps, resume state."""
    r = cfg.rollout
    p = parallel
    if r.mode == "server":
        rollout = f"server mode, {len(r.server_urls)} server(s) at {', '.join(r.server_urls)}"
    else:
        engines = p.world_size // r.tensor_model_parallel_size
        rollout = f"colocated {r.name}, {engines} engine(s) of TP {r.tensor_model_parallel_size}"
    t = cfg.trainer

    def every(freq: int) -> str:
        return "never" if freq <= 0 else f"every {freq}"

    lines = [
        f"run directory {start.run_dir}",
        f"world {p.world_size}: actor TP {p.tp_size} x PP {p.pp_size} x DP {p.dp_size}; rollout {rollout}",
        f"steps {t.total_training_steps} (checkpoint {every(t.save_freq)}, validation {every(t.test_freq)}); "
        f"{start.describe()}",
    ]
    return "\n".join(lines)


def read_val_history(metrics_path: str) -> dict[str, list[tuple[int, float]]]:
    """``{"val/avg@k": [(step, value), ...]}`` for every overall validation score (``val/<name>``
    without a data-source part) in a metrics JSONL file; the last row of a step wins (a resumed
    run repeats the steps after its checkpoint). Missing file: ``{}``."""
    if not os.path.isfile(metrics_path):
        return {}
    by_step: dict[str, dict[int, float]] = {}
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            for k, v in row.items():
                if k.startswith("val/") and k.count("/") == 1 and isinstance(v, (int, float)):
                    by_step.setdefault(k, {})[int(row["step"])] = float(v)
    return {k: sorted(d.items()) for k, d in by_step.items()}


def summary(run_dir: str, metrics_path: str, steps_done: int, total_steps: int, wall_s: float,
            mlflow_uri: Optional[str] = None) -> str:
    """The end-of-run summary (printed by rank 0): steps, wall time, the final and best value of
    every ``val/avg@k`` and ``val/pass@k`` score, and where the curves are."""
    lines = [f"done: {steps_done} of {total_steps} steps in {_duration(wall_s)}; run directory {run_dir}"]
    for key, hist in sorted(read_val_history(metrics_path).items()):
        if not (key.startswith("val/avg@") or key.startswith("val/pass@")) or not hist:
            continue
        finite = [(s, v) for s, v in hist if math.isfinite(v)]
        best = max(finite, key=lambda sv: sv[1]) if finite else hist[-1]
        lines.append(f"{key}: final {hist[-1][1]:.4g} (step {hist[-1][0]}), best {best[1]:.4g} (step {best[0]})")
    lines.append(f"curves: {metrics_path}" + (f"; mlflow ui --backend-store-uri {mlflow_uri}" if mlflow_uri else ""))
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"

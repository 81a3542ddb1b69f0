"""The ``trainer`` section: the training loop's length, its checkpoints and the run directory.

Read by :class:`~dapo_megatron.trainer.DAPOTrainer`, :mod:`dapo_megatron.run_dir` and
:mod:`dapo_megatron.checkpointing`; it lives in the config package because the trainer is the
top floor and the root config imports nothing above it (docs/design.md §1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainerConfig:
    """The training loop, its checkpoints and the run directory (verl ``trainer.*`` names)."""

    project_name: str = "dapo-megatron"
    """project name: the MLflow experiment (as in verl); part of the default run directory."""
    experiment_name: str = "default"
    """this run's name: the MLflow run name (as in verl); part of the default run directory."""
    total_training_steps: int = 100
    """number of DAPO training steps (each: rollout, reward, dynamic sampling, actor updates, weight
    sync); >= 1."""
    save_freq: int = -1
    """save a checkpoint every this many steps (and after the last step); -1 never saves."""
    test_freq: int = -1
    """evaluate (avg@k / pass@k on the validation set) every this many steps; -1 never evaluates."""
    seed: int = 1
    """base random seed; Megatron derives the TP-rank model-parallel RNG stream from it; the data
    order and sampling seeds derive from it too. >= 0."""
    default_local_dir: Optional[str] = None
    """run directory holding ``checkpoints/`` (and logs); None means
    ``runs/<project_name>/<experiment_name>`` (see :attr:`run_dir`). Must be on a file system
    shared by all ranks."""
    resume_mode: str = "auto"
    """``"auto"`` resumes from ``<run dir>/checkpoints/latest`` when it exists (the newest complete
    checkpoint, with a warning, when ``latest`` names a missing one), ``"disable"`` always starts
    from step 0, any other value is the path of a ``step_<k>`` checkpoint directory to resume from.
    A run that starts from step 0 moves a previous run's checkpoints and metrics to
    ``<run dir>/previous_runs/<time>/``; a damaged checkpoint stops the run, naming the file."""
    val_before_train: bool = True
    """validate once before the first step (logged at step 0) when ``test_freq`` > 0, so a run's
    validation curve has its starting point."""
    max_ckpt_to_keep: Optional[int] = None
    """keep only this many newest checkpoints (verl ``max_actor_ckpt_to_keep``), >= 1; None keeps
    all."""

    @property
    def run_dir(self) -> str:
        """``default_local_dir``, or ``runs/<project_name>/<experiment_name>`` when None."""
        if self.default_local_dir:
            return self.default_local_dir
        return os.path.join("runs", self.project_name, self.experiment_name)

    @property
    def resume_path(self) -> str | None:
        """The explicit checkpoint directory of ``resume_mode``, or None for auto/disable."""
        return None if self.resume_mode in ("auto", "disable") else self.resume_mode

    def validate(self) -> None:
        """Check ranges and names.

        Raises:
            ValueError: naming the field, its value and the accepted values.
        """
        for name in ("project_name", "experiment_name"):
            value = getattr(self, name)
            if not value or not value.strip():
                raise ValueError(f"{name}={value!r} must be a non-empty name")
        if self.total_training_steps < 1:
            raise ValueError(f"total_training_steps={self.total_training_steps} must be >= 1")
        for name in ("save_freq", "test_freq"):
            value = getattr(self, name)
            if value != -1 and value < 1:
                raise ValueError(f"{name}={value} must be -1 (never) or >= 1 (every N steps)")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.default_local_dir is not None and not self.default_local_dir.strip():
            raise ValueError(
                "default_local_dir='' must be a directory path, or null for "
                "runs/<project_name>/<experiment_name>"
            )
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep < 1:
            raise ValueError(
                f"max_ckpt_to_keep={self.max_ckpt_to_keep} must be >= 1, or null to keep all"
            )
        if not self.resume_mode:
            raise ValueError("resume_mode='' must be 'auto', 'disable' or a checkpoint directory")
        path = self.resume_path
        if path is not None and not os.path.isdir(path):
            raise ValueError(
                f"resume_mode={path!r} is neither 'auto', 'disable' nor an existing checkpoint "
                "directory (expected <run dir>/checkpoints/step_<k>)"
            )

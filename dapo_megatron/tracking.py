"""Experiment tracking over MLflow, plus a rank-0 progress bar.

Default (embedded): a local sqlite store in the run directory,
``sqlite:///<run_dir>/mlflow.db`` with artifacts under ``<run_dir>/mlartifacts``;
view it with ``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``.
Any tracking URI (``http://host:5000``, ``databricks``, ...) can be set with
``TrackingConfig.tracking_uri``.

Robustness: only rank 0 logs. Every metric row is always appended to
``<run_dir>/metrics.jsonl`` (``{"step": int, "time": unix s, <key>: float}``;
appended, so a resumed run adds rows after the old ones) so a run keeps its numbers even if MLflow fails. If the tracking server cannot
be reached (at start or later) training continues: one warning is logged and
from then on metrics go to the JSONL file only (texts to ``<run_dir>/texts/``).
To keep MLflow from blocking training, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and
``MLFLOW_HTTP_REQUEST_TIMEOUT`` are set (unless already set by the user) from
the config before the client is created.

Design: docs/design.md §1 step 8 (bookkeeping) and §7 (the run directory).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

MAX_PARAM_VALUE_CHARS = 6000  # MLflow's limit on a param value
MLFLOW_BATCH_LIMIT = 100  # params per log_batch call


@dataclass
class TrackingConfig:
    """Tracking settings (``tracking.*``)."""

    tracking_uri: str | None = None
    """MLflow tracking URI; ``None`` means ``sqlite:///<run_dir>/mlflow.db``. The MLflow experiment
    is ``trainer.project_name`` and the run name ``trainer.experiment_name`` (verl's mapping)."""
    run_id: str | None = None
    """continue this existing MLflow run (store ``Tracker.run_id`` in the trainer checkpoint and
    pass it back on resume); ``None`` starts a new run."""
    use_mlflow: bool = True
    """``False`` writes only the JSONL file."""
    http_max_retries: int = 0
    """value for ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (HTTP URIs)."""
    http_timeout_s: int = 5
    """value for ``MLFLOW_HTTP_REQUEST_TIMEOUT`` in seconds."""
    metrics_file: str = "metrics.jsonl"
    """JSONL file name inside the run directory."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field."""
        for name in ("tracking_uri", "run_id"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name}={value!r} must be non-empty, or null ({_NULL_MEANS[name]})")
        if self.http_max_retries < 0:
            raise ValueError(f"http_max_retries={self.http_max_retries} must be >= 0")
        if self.http_timeout_s < 1:
            raise ValueError(f"http_timeout_s={self.http_timeout_s} must be >= 1 second")
        name = self.metrics_file
        if not name.strip() or os.sep in name or (os.altsep and os.altsep in name) or name in (".", ".."):
            raise ValueError(f"metrics_file={name!r} must be a plain file name (it is written inside the run "
                             "directory), e.g. metrics.jsonl")


_NULL_MEANS = {"tracking_uri": "null: sqlite:///<run_dir>/mlflow.db", "run_id": "null: a new run"}


_MLFLOW_NAME_BAD = re.compile(r"[^0-9A-Za-z_\-. :/]")


def mlflow_metric_name(name: str) -> str:
    """The MLflow-legal spelling of a metric name.

    MLflow accepts only alphanumerics, ``_ - . : /`` and spaces in metric names, so
    ``val/avg@32`` is stored as ``val/avg_at_32`` (``@`` → ``_at_``); any other
    character becomes ``_``. The JSONL file keeps the original names.
    """
    return _MLFLOW_NAME_BAD.sub("_", name.replace("@", "_at_"))


def flatten_dict(d: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]} -> {"a.b": 1, "c": [1, 2]}``; dataclasses become dicts."""
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(d) and not isinstance(d, type):
        d = dataclasses.asdict(d)
    for key, value in d.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, Mapping):
            out.update(flatten_dict(value, name, sep))
        else:
            out[name] = value
    return out


def _default_rank() -> int:
    # no process group exists before torch.distributed is imported: the config (TrackingConfig)
    # loads this module without torch (tests/unit/config/test_torch_free.py)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _to_float(key: str, value: Any) -> float:
    if hasattr(value, "item"):  # torch / numpy scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"log_metrics: metric '{key}' must be a number, got {type(value).__name__} {value!r}")
    return float(value)


class Tracker:
    """Log params, metrics and texts of one training run (rank 0 only).

    Args:
        run_dir: the run directory (created); holds ``metrics.jsonl`` and, by
            default, the MLflow sqlite store and artifacts.
        config: :class:`TrackingConfig`.
        rank: global rank; ``None`` reads ``torch.distributed`` or ``$RANK``.
            Ranks other than 0 do nothing.
        experiment_name: the MLflow experiment (created if missing); the trainer passes
            ``trainer.project_name``, as verl's ``Tracking`` does (``mlflow.set_experiment(project_name)``,
            verl/utils/tracking.py).
        run_name: the MLflow run name (``MlflowClient.create_run(run_name=...)``); the trainer
            passes ``trainer.experiment_name`` (verl: ``start_run(run_name=experiment_name)``).
            A continued run (``config.run_id``) keeps its name.

    Attributes:
        mlflow_active: whether metrics still go to MLflow.
        run_id: MLflow run id (``None`` without MLflow).
    """

    def __init__(self, run_dir: str, config: TrackingConfig | None = None, rank: int | None = None, *,
                 experiment_name: str = "dapo-megatron", run_name: str | None = None):
        self.config = config or TrackingConfig()
        self.experiment_name, self.run_name = experiment_name, run_name
        self.run_dir = os.path.abspath(run_dir)
        self.rank = _default_rank() if rank is None else rank
        self.enabled = self.rank == 0
        self.mlflow_active = False
        self.run_id: str | None = None
        self._client = None
        self._mlflow: Any = None  # the mlflow module, once a run is started
        self._jsonl = None
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.run_dir, self.config.metrics_file)
        self._jsonl = open(self.metrics_path, "a", encoding="utf-8")
        if self.config.use_mlflow:
            self._start_mlflow()

    @property
    def tracking_uri(self) -> str:
        """The MLflow tracking URI in use (the sqlite default if unset)."""
        return self.config.tracking_uri or f"sqlite:///{os.path.join(self.run_dir, 'mlflow.db')}"

    def _start_mlflow(self) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(self.config.http_max_retries))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(self.config.http_timeout_s))
        try:
            # mlflow (2 s to import) only where tracking.use_mlflow is on: runs and tests without it skip it
            import mlflow

            self._mlflow = mlflow
            client = mlflow.tracking.MlflowClient(tracking_uri=self.tracking_uri)
            if self.config.run_id is not None:
                run = client.get_run(self.config.run_id)  # raises if it does not exist
                client.update_run(run.info.run_id, status="RUNNING")
                self._client, self.run_id, self.mlflow_active = client, run.info.run_id, True
                return
            exp = client.get_experiment_by_name(self.experiment_name)
            if exp is not None:
                exp_id = exp.experiment_id
            elif self.config.tracking_uri is None:
                artifacts = "file://" + os.path.join(self.run_dir, "mlartifacts")
                exp_id = client.create_experiment(self.experiment_name, artifact_location=artifacts)
            else:
                exp_id = client.create_experiment(self.experiment_name)
            run = client.create_run(exp_id, run_name=self.run_name)
        except Exception as exc:  # unreachable server, bad URI, DB error: never stop training
            self._disable_mlflow(exc)
            return
        self._client = client
        self.run_id = run.info.run_id
        self.mlflow_active = True

    def _disable_mlflow(self, exc: BaseException) -> None:
        logger.warning(
            "MLflow tracking at %s failed (%s: %s); continuing, metrics go to %s only",
            self.tracking_uri,
            type(exc).__name__,
            str(exc).splitlines()[0][:300] if str(exc) else "",
            self.metrics_path,
        )
        self.mlflow_active = False
        self._client = None

    # ------------------------------------------------------------------ logging

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log a (nested) dict or dataclass of hyper-parameters, flattened to ``a.b.c`` keys.

        Values are stored as strings (truncated to MLflow's 6000 characters) and
        also written to ``<run_dir>/params.json``.
        """
        if not self.enabled:
            return
        flat = {k: v if isinstance(v, (int, float, bool, type(None))) else str(v) for k, v in flatten_dict(params).items()}
        path = os.path.join(self.run_dir, "params.json")
        existing = {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                existing = json.load(f)
        existing.update(flat)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(existing, f, indent=1, sort_keys=True)
        if not self.mlflow_active:
            return
        items = [self._mlflow.entities.Param(k, str(v)[:MAX_PARAM_VALUE_CHARS]) for k, v in flat.items()]
        try:
            for i in range(0, len(items), MLFLOW_BATCH_LIMIT):
                self._client.log_batch(self.run_id, params=items[i : i + MLFLOW_BATCH_LIMIT])
        except Exception as exc:
            self._disable_mlflow(exc)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log scalar metrics at a training step.

        Args:
            metrics: ``{name: number}`` (python/numpy/torch scalars). NaN/inf are
                kept in the JSONL file (as ``NaN``/``Infinity``) and passed to MLflow.
            step: the global training step (int >= 0).

        Raises:
            TypeError: a value is not a number (names the metric).
            ValueError: ``step`` is negative.
        """
        if not self.enabled:
            return
        if int(step) != step or step < 0:
            raise ValueError(f"log_metrics: step must be an int >= 0, got {step!r}")
        values = {str(k): _to_float(str(k), v) for k, v in metrics.items()}
        now = time.time()
        self._jsonl.write(json.dumps({"step": int(step), "time": now, **values}) + "\n")
        self._jsonl.flush()
        if not self.mlflow_active or not values:
            return
        ts = int(now * 1000)
        items = [self._mlflow.entities.Metric(mlflow_metric_name(k), v, ts, int(step)) for k, v in values.items()]
        try:
            for i in range(0, len(items), MLFLOW_BATCH_LIMIT * 10):  # MLflow allows 1000 metrics per batch
                self._client.log_batch(self.run_id, metrics=items[i : i + MLFLOW_BATCH_LIMIT * 10])
        except Exception as exc:
            self._disable_mlflow(exc)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store a text artifact (e.g. sample generations) at ``artifact_file``
        (relative path such as ``"samples/step_10.txt"``). Without MLflow it is
        written to ``<run_dir>/texts/<artifact_file>``.

        Raises:
            ValueError: ``artifact_file`` is absolute or leaves the directory.
        """
        if not self.enabled:
            return
        norm = os.path.normpath(artifact_file)
        if os.path.isabs(norm) or norm.startswith(".."):
            raise ValueError(f"log_text: artifact_file must be a relative path inside the run, got {artifact_file!r}")
        if self.mlflow_active:
            try:
                self._client.log_text(self.run_id, text, norm)
                return
            except Exception as exc:
                self._disable_mlflow(exc)
        path = os.path.join(self.run_dir, "texts", norm)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def finish(self, status: str = "FINISHED") -> None:
        """End the MLflow run (``status`` ``"FINISHED"``/``"FAILED"``/``"KILLED"``) and close the JSONL file.
        Safe to call twice."""
        if not self.enabled:
            return
        if self.mlflow_active:
            try:
                self._client.set_terminated(self.run_id, status=status)
            except Exception as exc:
                self._disable_mlflow(exc)
            self.mlflow_active = False
        if self._jsonl is not None and not self._jsonl.closed:
            self._jsonl.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish("FAILED" if exc_type is not None else "FINISHED")


class ProgressBar:
    """A tqdm progress bar over training steps, on rank 0 only (silent elsewhere).

    Args:
        total: number of steps.
        rank: global rank; ``None`` reads ``torch.distributed`` or ``$RANK``.
        keys: metrics shown after each step, labelled by their last ``/`` part without a
            ``_mean`` suffix (default :data:`PROGRESS_KEYS`: accuracy ``gen_acc`` and shaped
            reward ``gen_reward`` of the responses the step generated); a key the step did not
            log (a step that trained carried groups only generated nothing) is not shown.
        desc: bar label.

    ``update(step, metrics)`` moves the bar to ``step`` (1-based count of finished steps)
    and shows the chosen metrics, plus the last validation score seen: the overall
    ``val/avg@k`` of the latest ``metrics`` that held one stays on the bar (as
    ``val_avg@k``) until the next validation replaces it.
    """

    PROGRESS_KEYS = ("rollout/gen_acc_mean", "rollout/gen_reward_mean")
    _VAL_SCORE = re.compile(r"^val/avg@\d+$")

    def __init__(self, total: int, rank: int | None = None, keys: tuple[str, ...] | None = None, desc: str = "train"):
        self.rank = _default_rank() if rank is None else rank
        self.keys = self.PROGRESS_KEYS if keys is None else tuple(keys)
        self._last_val: dict[str, str] = {}
        self._bar = None
        if self.rank == 0:
            self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True)

    @staticmethod
    def _format(v: Any) -> Any:
        v = v.item() if hasattr(v, "item") else v
        return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else v

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Set the bar to ``step`` steps done and show ``metrics`` (no-op off rank 0)."""
        if self._bar is None:
            return
        if metrics:
            shown = {}
            for k in self.keys:
                if k in metrics:
                    shown[k.split("/")[-1].removesuffix("_mean")] = self._format(metrics[k])
            val = {f"val_{k[4:]}": self._format(v) for k, v in metrics.items() if self._VAL_SCORE.match(k)}
            if val:
                self._last_val = val
            self._bar.set_postfix({**shown, **self._last_val}, refresh=False)
        self._bar.update(max(0, step - self._bar.n))

    def close(self) -> None:
        """Close the bar (no-op off rank 0)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

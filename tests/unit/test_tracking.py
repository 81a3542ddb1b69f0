"""Tracker over MLflow (sqlite default, unreachable server fallback) and ProgressBar."""

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field

import pytest

from dapo_megatron.tracking import ProgressBar, Tracker, TrackingConfig, flatten_dict


@dataclass
class _Opt:
    lr: float = 1e-6
    betas: tuple = (0.9, 0.999)


@dataclass
class _Cfg:
    optim: _Opt = field(default_factory=_Opt)
    clip_ratio_low: float = 0.2


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_flatten_dict():
    flat = flatten_dict({"actor": {"optim": {"lr": 1e-6}, "ppo_epochs": 1}, "seed": 3, "cfg": _Cfg()})
    assert flat == {
        "actor.optim.lr": 1e-6,
        "actor.ppo_epochs": 1,
        "seed": 3,
        "cfg.optim.lr": 1e-6,
        "cfg.optim.betas": (0.9, 0.999),
        "cfg.clip_ratio_low": 0.2,
    }


def test_sqlite_default_roundtrip(tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    tr = Tracker(str(run_dir), TrackingConfig(), rank=0, experiment_name="exp", run_name="r1")
    assert tr.mlflow_active and tr.tracking_uri == f"sqlite:///{run_dir}/mlflow.db"
    tr.log_params({"actor": {"optim": {"lr": 1e-6}}, "data": _Cfg()})
    steps = {0: {"loss": 0.5, "reward/mean": -0.25}, 1: {"loss": 0.25, "reward/mean": 0.125}}
    for step, m in steps.items():
        tr.log_metrics(m, step)
    tr.log_text("prompt: 1+1\nresponse: 2", "samples/step_1.txt")
    tr.finish()
    tr.finish()  # idempotent

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    exp = client.get_experiment_by_name("exp")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_id == tr.run_id and run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.params["actor.optim.lr"] == "1e-06"
    assert run.data.params["data.optim.betas"] == "(0.9, 0.999)"
    assert run.data.params["data.clip_ratio_low"] == "0.2"
    for key in ("loss", "reward/mean"):
        hist = sorted(client.get_metric_history(tr.run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in hist] == [(s, steps[s][key]) for s in steps]
    local = client.download_artifacts(tr.run_id, "samples/step_1.txt", str(tmp_path / "dl"))
    assert open(local).read() == "prompt: 1+1\nresponse: 2"
    assert str(run_dir) in exp.artifact_location  # artifacts live in the run directory
    # the JSONL mirror is always written
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["step"], r["loss"], r["reward/mean"]) for r in rows] == [(0, 0.5, -0.25), (1, 0.25, 0.125)]


def test_resume_continues_the_same_run(tmp_path):
    from mlflow.tracking import MlflowClient

    first = Tracker(str(tmp_path), TrackingConfig(), rank=0)
    first.log_metrics({"loss": 3.0}, 0)
    first.finish()
    again = Tracker(str(tmp_path), TrackingConfig(run_id=first.run_id), rank=0)
    assert again.run_id == first.run_id
    again.log_metrics({"loss": 2.0}, 1)
    again.finish()
    client = MlflowClient(tracking_uri=again.tracking_uri)
    hist = sorted(client.get_metric_history(first.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in hist] == [(0, 3.0), (1, 2.0)]
    assert client.get_run(first.run_id).info.status == "FINISHED"
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


def test_unreachable_server_falls_back_to_jsonl(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dapo_megatron.tracking"):
        tr = Tracker(str(tmp_path), TrackingConfig(tracking_uri="http://127.0.0.1:1", http_timeout_s=2), rank=0)
        tr.log_params({"a": {"b": 1}})
        for step in range(3):
            tr.log_metrics({"loss": 1.0 / (step + 1)}, step)
        tr.log_text("sample", "samples/s.txt")
        tr.finish()
    elapsed = time.monotonic() - t0
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "2"
    assert not tr.mlflow_active and tr.run_id is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "127.0.0.1:1" in warnings[0].getMessage()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    assert (tmp_path / "texts" / "samples" / "s.txt").read_text() == "sample"
    assert json.loads((tmp_path / "params.json").read_text()) == {"a.b": 1}
    print(f"unreachable-server tracker finished in {elapsed:.2f} s")


def test_only_rank0_logs(tmp_path):
    tr = Tracker(str(tmp_path / "r1"), TrackingConfig(), rank=1)
    tr.log_params({"a": 1})
    tr.log_metrics({"loss": 1.0}, 0)
    tr.log_text("x", "x.txt")
    tr.finish()
    assert not (tmp_path / "r1").exists()


def test_metric_values_and_errors(tmp_path):
    import numpy as np
    import torch

    tr = Tracker(str(tmp_path), TrackingConfig(use_mlflow=False), rank=0)
    tr.log_metrics({"t": torch.tensor(2.5), "n": np.float32(0.5), "i": 3, "nan": float("nan")}, 7)
    with pytest.raises(TypeError, match="metric 'bad'"):
        tr.log_metrics({"bad": "high"}, 8)
    with pytest.raises(ValueError, match="step"):
        tr.log_metrics({"x": 1.0}, -1)
    with pytest.raises(ValueError, match="relative path"):
        tr.log_text("x", "../escape.txt")
    tr.finish()
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["step"] == 7 and row["t"] == 2.5 and row["n"] == 0.5 and row["i"] == 3.0 and math.isnan(row["nan"])


def test_progress_bar_rank0_only(capsys):
    bar = ProgressBar(4, rank=0, keys=("actor/loss",), desc="train")
    bar.update(1, {"actor/loss": 0.123456, "other": 1.0})
    bar.update(3, {"actor/loss": 0.5})
    assert bar._bar.n == 3
    bar.close()
    err = capsys.readouterr().err
    assert "loss=0.5" in err and "other" not in err and "3/4" in err
    # the default: accuracy and reward of the step's generated responses, and the last validation
    # score, kept; a step that generated nothing (carried groups only) shows no accuracy, not NaN
    bar = ProgressBar(4, rank=0)
    bar.update(0, {"val/avg@4": 0.125, "val/pass@4": 0.5, "val/aime/avg@4": 0.9})
    bar.update(1, {"rollout/gen_acc_mean": 0.25, "rollout/gen_reward_mean": -0.5, "actor/pg_loss": 0.1})
    postfix = bar._bar.postfix
    bar.update(2, {"train/acc_mean": 0.5, "actor/pg_loss": 0.2})
    carried_only = bar._bar.postfix
    bar.update(3, {"rollout/gen_acc_mean": 0.5, "rollout/gen_reward_mean": 0.0, "val/avg@4": 0.375})
    bar.close()
    assert postfix == "gen_acc=0.25, gen_reward=-0.5, val_avg@4=0.125"
    assert carried_only == "val_avg@4=0.125"
    err = capsys.readouterr().err
    assert "gen_acc=0.5, gen_reward=0, val_avg@4=0.375" in err and "pass" not in err and "aime" not in err
    assert "nan" not in err.lower()
    quiet = ProgressBar(4, rank=1)
    quiet.update(2, {"actor/loss": 1.0})
    quiet.close()
    assert capsys.readouterr().err == ""


def test_metric_names_with_at_sign_reach_mlflow(tmp_path):
    """avg@k / pass@k are stored under MLflow-legal names; the JSONL keeps the originals."""
    import json

    from mlflow.tracking import MlflowClient

    from dapo_megatron.tracking import Tracker, mlflow_metric_name

    assert mlflow_metric_name("val/avg@32") == "val/avg_at_32"
    tracker = Tracker(str(tmp_path), rank=0)
    tracker.log_metrics({"val/avg@4": 0.25, "val/pass@4": 0.5}, step=3)
    assert tracker.mlflow_active
    tracker.finish()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    hist = client.get_metric_history(tracker.run_id, "val/avg_at_4")
    assert [(m.step, m.value) for m in hist] == [(3, 0.25)]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["val/pass@4"] == 0.5

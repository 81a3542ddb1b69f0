"""How a run starts in its run directory (dapo_megatron/run_dir.py) on real trainer checkpoints of a
tiny model: resume, fall back, refuse a damaged checkpoint naming the file, move a previous run
aside, stop a finished run; and the end-of-run summary."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import write_tiny_trainer_run

from dapo_megatron import checkpointing as ckpt
from dapo_megatron.checkpointing import CheckpointError
from dapo_megatron.config import DAPOConfig
from dapo_megatron.run_dir import plan_start, prepare_run_dir, read_val_history, summary
from dapo_megatron.config.trainer import TrainerConfig


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Checkpoints of steps 1 and 2 (``latest`` = 2) and metrics rows of steps 1, 2."""
    return write_tiny_trainer_run(str(tmp_path_factory.mktemp("tiny") / "run"), (1, 2))


@pytest.fixture
def run(tiny_run, tmp_path):
    """A private copy of ``tiny_run`` (hundreds of KB)."""
    dst = str(tmp_path / "run")
    shutil.copytree(tiny_run, dst)
    return dst


def _trainer(run_dir, **kw) -> TrainerConfig:
    return TrainerConfig(default_local_dir=run_dir, total_training_steps=kw.pop("total", 5), **kw)


def _cfg(run_dir, **kw) -> DAPOConfig:
    cfg = DAPOConfig()
    cfg.trainer = _trainer(run_dir, **kw)
    return cfg


def _shard(step_dir: str) -> str:
    """The largest ``.distcp`` data file of a checkpoint (megatron-core writes several per rank)."""
    files = [os.path.join(step_dir, f) for f in os.listdir(step_dir) if f.endswith(".distcp")]
    return max(files, key=os.path.getsize)


def test_auto_resumes_from_latest(run):
    start = plan_start(_trainer(run))
    assert start.checkpoint_dir == ckpt.step_dir(run, 2) and start.step == 2
    assert not start.finished and start.warning is None and start.move_aside == ()


def test_truncated_shard_is_named_with_the_resume_mode_to_set(run):
    """A shard cut short (full disk, interrupted copy) is found from the DCP index and file sizes
    alone, named, and the error says which trainer.resume_mode to set (the older whole one)."""
    shard = _shard(ckpt.step_dir(run, 2))
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError) as err:
        plan_start(_trainer(run))
    msg = str(err.value)
    assert f"{shard} is truncated: {size - 100} bytes, the checkpoint index .metadata needs {size}" in msg
    assert f"trainer.resume_mode={ckpt.step_dir(run, 1)}" in msg and "trainer.resume_mode=disable" in msg
    assert "\n" not in msg
    # the explicit path of the damaged checkpoint: the same file named
    with pytest.raises(CheckpointError, match="is truncated.*point trainer.resume_mode at another step_<k> dir"):
        plan_start(_trainer(run, resume_mode=ckpt.step_dir(run, 2)))
    # the older checkpoint it names is whole and resumes
    assert plan_start(_trainer(run, resume_mode=ckpt.step_dir(run, 1))).step == 1


def test_missing_shard_index_and_rng_file_are_named(run):
    step2 = ckpt.step_dir(run, 2)
    os.remove(os.path.join(step2, "rng", "rank_0.pt"))
    with pytest.raises(CheckpointError, match=r"rng/rank_0.pt is missing"):
        ckpt.validate_checkpoint(step2)
    step1 = ckpt.step_dir(run, 1)
    with open(os.path.join(step1, ".metadata"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable"):
        ckpt.validate_checkpoint(step1)
    with pytest.raises(CheckpointError) as err:  # neither checkpoint is whole: no older one to name
        plan_start(_trainer(run))
    assert "no older whole checkpoint is left" in str(err.value)


def test_latest_naming_a_missing_step_falls_back_with_a_warning(run):
    ckpt._update_latest(ckpt.checkpoints_dir(run), 7)
    start = plan_start(_trainer(run))
    assert start.step == 2 and start.checkpoint_dir == ckpt.step_dir(run, 2)
    assert start.warning == (f"{ckpt.checkpoints_dir(run)}/latest names step 7 but {ckpt.step_dir(run, 7)} is "
                             "missing: resuming from the newest complete checkpoint, step 2")


def test_latest_naming_a_missing_step_with_none_left_is_an_error_not_step_0(run):
    for k in (1, 2):
        shutil.rmtree(ckpt.step_dir(run, k))
    with pytest.raises(CheckpointError) as err:
        plan_start(_trainer(run))
    assert str(err.value) == (
        f"{ckpt.checkpoints_dir(run)}/latest names step 2 but {ckpt.step_dir(run, 2)} is missing and no other "
        f"checkpoint is left in {ckpt.checkpoints_dir(run)}: restore it, or set trainer.resume_mode=disable to "
        "start a new run (the old run's files are moved aside)")
    open(os.path.join(ckpt.checkpoints_dir(run), "latest"), "w").write("two\n")
    with pytest.raises(CheckpointError, match="must hold an integer step, found 'two'"):
        plan_start(_trainer(run))


def test_disable_moves_the_previous_run_aside(run):
    """resume_mode=disable in a used run directory: the new run gets an empty metrics file and no
    `latest`; the old run's checkpoints and metrics are kept, moved, not deleted."""
    from dapo_megatron.tracking import Tracker, TrackingConfig

    old_rows = open(os.path.join(run, "metrics.jsonl")).read()
    assert old_rows.count("\n") == 2
    start = prepare_run_dir(_cfg(run, resume_mode="disable"))
    assert not start.resuming and start.step == 0
    assert start.move_aside == ("checkpoints", "metrics.jsonl")
    assert os.path.dirname(start.moved_to) == os.path.join(run, "previous_runs")
    assert ckpt.read_latest_step(run) is None and not os.path.exists(os.path.join(run, "metrics.jsonl"))
    assert open(os.path.join(start.moved_to, "metrics.jsonl")).read() == old_rows
    assert ckpt.read_latest_step(start.moved_to) == 2
    tracker = Tracker(run, TrackingConfig(use_mlflow=False), rank=0)  # the new run logs step 1
    tracker.log_metrics({"rollout/gen_acc_mean": 0.5}, step=1)
    tracker.finish()
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1] and rows[0]["rollout/gen_acc_mean"] == 0.5
    assert "new run from step 0 (the previous run's files moved to" in start.describe()


def test_auto_without_a_checkpoint_is_a_new_run_that_moves_old_metrics(run):
    shutil.rmtree(ckpt.checkpoints_dir(run))
    start = prepare_run_dir(_cfg(run))
    assert not start.resuming and start.move_aside == ("metrics.jsonl",)
    assert not os.path.exists(os.path.join(run, "metrics.jsonl"))
    fresh = prepare_run_dir(_cfg(str(os.path.join(run, "elsewhere"))))  # an unused directory: nothing moved
    assert fresh.move_aside == () and fresh.moved_to is None


@pytest.mark.parametrize("total,finished", [(2, True), (1, True), (3, False)])
def test_finished_when_the_checkpoint_reaches_total_steps(run, total, finished):
    assert plan_start(_trainer(run, total=total)).finished is finished


def test_summary_reports_final_and_best_validation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "val/avg@4": 0.25, "val/pass@4": 0.5, "val/arithmetic/avg@4": 0.25},
            {"step": 1, "rollout/gen_acc_mean": 0.1},
            {"step": 2, "val/avg@4": 0.75, "val/pass@4": 0.75},
            {"step": 3, "val/avg@4": 0.5, "val/pass@4": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "val/av')  # a line cut by a kill
    assert read_val_history(str(path)) == {"val/avg@4": [(0, 0.25), (2, 0.75), (3, 0.5)],
                                          "val/pass@4": [(0, 0.5), (2, 0.75), (3, 1.0)]}
    text = summary("/r", str(path), 3, 3, 3725.0, "sqlite:////r/mlflow.db")
    assert text.splitlines() == [
        "done: 3 of 3 steps in 1h02m05s; run directory /r",
        "val/avg@4: final 0.5 (step 3), best 0.75 (step 2)",
        "val/pass@4: final 1 (step 3), best 1 (step 3)",
        f"curves: {path}; mlflow ui --backend-store-uri sqlite:////r/mlflow.db",
    ]


def test_common_state_in_the_index_or_in_a_legacy_common_pt(run):
    """megatron-core 0.19 keeps the common (non-tensor) state as the ``common_state`` item of the
    torch_dist index; 0.16 wrote ``common.pt``. A checkpoint with either validates; one with
    neither (the index rewritten without the item) is named."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    step2 = ckpt.step_dir(run, 2)
    assert not os.path.exists(os.path.join(step2, "common.pt"))  # written by megatron-core >= 0.19
    ckpt.validate_checkpoint(step2)
    metadata = FileSystemReader(step2).read_metadata()
    common = [k for k in metadata.state_dict_metadata if k.split("/", 1)[0] == "common_state"]
    assert len(common) == 1
    for key in common:
        del metadata.state_dict_metadata[key]
    with open(os.path.join(step2, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError, match=r"holds no common state \(neither common.pt nor the 'common_state'"):
        ckpt.validate_checkpoint(step2)
    # the 0.16 layout: the common state in its own file (megatron-core 0.19 reads it first)
    with open(os.path.join(step2, "common.pt"), "wb") as f:
        f.write(b"\x80")
    ckpt.validate_checkpoint(step2)

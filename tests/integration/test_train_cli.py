"""The dapo-train CLI and config: keys documented, bad keys/values rejected by name, broken
dataset rows stop the run with their index (or are skipped and counted), and a GSM8K file
converted by tools/prepare_gsm8k.py goes through a training step (its data path: every
advantage and the gradient are 0 there)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

CPU_YAML = os.path.join(REPO, "examples", "configs", "dapo_smollm2_cpu.yaml")


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "dapo_megatron.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_every_config_key_is_documented():
    from dapo_megatron.config import DAPOConfig, assert_all_documented, documented_keys

    assert_all_documented(DAPOConfig)
    keys = {k.key for k in documented_keys(DAPOConfig)}
    for key in ("actor.clip_ratio_high", "actor.optim.lr", "buffer.max_num_gen_batches",
                "buffer.overlong.overlong_buffer_len", "rollout.response_length", "trainer.total_training_steps",
                "parallel.tensor_model_parallel_size", "model.fp8", "tracking.tracking_uri"):
        assert key in keys


def test_unknown_key_and_bad_values_are_rejected_by_name():
    out = _cli("--config", CPU_YAML, "--print-config", "model.hf_path=/x", "trainer.total_steps=3")
    assert out.returncode != 0
    assert "trainer.total_steps" in out.stderr and "trainer.total_training_steps" in out.stderr

    out = _cli("--config", CPU_YAML, "--print-config", "model.hf_path=/x", "buffer.max_num_gen_batches=0")
    assert out.returncode != 0 and "max_num_gen_batches" in out.stderr

    out = _cli("--config", CPU_YAML, "--print-config", "model.hf_path=/x", "rollout.response_length=64")
    assert out.returncode != 0
    assert "buffer.overlong.max_response_length" in out.stderr and "rollout.response_length" in out.stderr

    out = _cli("--config", CPU_YAML, "--print-config", "model.hf_path=/x", "actor.optim.lr=fast")
    assert out.returncode != 0 and "actor.optim.lr" in out.stderr


def test_config_error_under_torchrun_is_one_line_printed_once_by_rank_0():
    """A real 2-process torchrun launch with a bad override: each rank loads the config and
    exits with status 2; only rank 0 prints, one line, and no rank prints a traceback. (The
    only traceback left is torchrun's own ChildFailedError report of the failed launch.)"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")  # this environment's, not PATH's
    out = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "-m", "dapo_megatron.train",
                          "--config", CPU_YAML, "model.hf_path=/x", "buffer.n=1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    line = ("dapo-train: error: buffer.n=1: dynamic sampling (filter_groups) needs n >= 2 responses per prompt, "
            "else every group has constant accuracy and is dropped\n")
    assert out.stderr.count("buffer.n=1") == 1 and line in out.stderr, out.stderr[-3000:]
    assert "buffer.n=1" not in out.stdout
    assert "dapo_megatron/" not in out.stderr and "ConfigError" not in out.stderr  # no frame of ours
    tracebacks = out.stderr.count("Traceback (most recent call last)")
    assert tracebacks == out.stderr.count("errors.ChildFailedError:") <= 1, out.stderr[-3000:]
    assert "exitcode  : 2" in out.stderr  # the first rank to exit: the usage-error status


def test_world_size_that_does_not_fit_is_a_config_error():
    env = dict(os.environ, WORLD_SIZE="3", RANK="0")
    out = subprocess.run([sys.executable, "-m", "dapo_megatron.train", "--config", CPU_YAML, "model.hf_path=/x"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr == ("dapo-train: error: parallel.tensor_model_parallel_size=2 × pipeline_model_parallel_size=1 "
                          "does not divide the world size 3: launch torchrun with --nproc_per_node a multiple of 2, "
                          "or change the parallel sizes\n")
    env.update(WORLD_SIZE="4", RANK="1")  # DP = 2 does not divide 13 prompts; rank 1 stays silent
    out = subprocess.run([sys.executable, "-m", "dapo_megatron.train", "--config", CPU_YAML, "model.hf_path=/x",
                          "buffer.gen_batch_size=13"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr == ""


def test_print_config_resolves_yaml_and_overrides():
    out = _cli("--config", CPU_YAML, "--print-config", "model.hf_path=/x", "actor.optim.lr=3e-6")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lr: 3.0e-06" in out.stdout and "tensor_model_parallel_size: 2" in out.stdout


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Real trainer checkpoints of a tiny model at steps 1 and 2 (``latest`` = 2) and their metrics."""
    from conftest import write_tiny_trainer_run

    return write_tiny_trainer_run(str(tmp_path_factory.mktemp("tiny") / "run"), (1, 2))


def _run_dir_cli(run_dir, smollm2_gguf, *overrides):
    return _cli("--config", CPU_YAML, f"model.hf_path={smollm2_gguf[0]}", "parallel.tensor_model_parallel_size=1",
                f"trainer.default_local_dir={run_dir}", *overrides, timeout=300)


def test_finished_run_says_so_in_one_line_before_loading_a_model(tiny_run, smollm2_gguf, tmp_path):
    """Resuming a run whose checkpoint is at trainer.total_training_steps: one line, exit 0, and
    nothing built (the trainer writes the task data to <run dir>/data before loading the model)."""
    import shutil

    run_dir = shutil.copytree(tiny_run, tmp_path / "run")
    metrics = (run_dir / "metrics.jsonl").read_text()
    out = _run_dir_cli(run_dir, smollm2_gguf, "trainer.total_training_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == (f"dapo-train: {run_dir} is already done: its checkpoint of step 2 ({run_dir}/checkpoints/"
                          "step_2) reaches trainer.total_training_steps=2; raise it to train on, or set "
                          "trainer.resume_mode=disable to start a new run\n")
    assert not (run_dir / "data").exists() and (run_dir / "metrics.jsonl").read_text() == metrics
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "metrics.jsonl"]


def test_damaged_checkpoint_is_one_line_naming_the_file_and_the_resume_mode(tiny_run, smollm2_gguf, tmp_path):
    import shutil

    run_dir = shutil.copytree(tiny_run, tmp_path / "run")
    step2 = run_dir / "checkpoints" / "step_2"
    shard = max((p for p in step2.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 1)
    out = _run_dir_cli(run_dir, smollm2_gguf, "trainer.total_training_steps=3")
    assert out.returncode == 2
    assert out.stderr == (f"dapo-train: error: cannot resume: {shard} is truncated: {size - 1} bytes, the checkpoint "
                          f"index .metadata needs {size}; resume from the newest whole one with "
                          f"trainer.resume_mode={run_dir}/checkpoints/step_1, or set trainer.resume_mode=disable to "
                          "start a new run (the old run's files are moved aside)\n")
    assert not (run_dir / "data").exists()


@pytest.fixture(scope="module")
def gsm8k_with_broken_row(tmp_path_factory):
    src = os.path.join(REPO, "..", "shared", "data", "gsm8k_train.jsonl")
    if not os.path.isfile(src):
        pytest.skip("../shared/data/gsm8k_train.jsonl is not available")
    d = tmp_path_factory.mktemp("gsm8k")
    head = d / "head.jsonl"
    with open(src) as f, open(head, "w") as g:
        for _ in range(16):
            g.write(f.readline())
    out = d / "gsm8k.jsonl"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_gsm8k.py"), "--input", str(head),
                    "--output", str(out)], check=True, cwd=REPO)
    rows = out.read_text().splitlines()
    assert len(rows) == 16 and json.loads(rows[0])["data_source"] == "openai/gsm8k"
    broken = json.loads(rows[5])
    del broken["reward_model"]  # row 5 loses its ground truth
    rows[5] = json.dumps(broken)
    out.write_text("\n".join(rows) + "\n")
    return str(out)


def _hf_copy(smollm2_hf_dir: str) -> tuple[str, str]:
    """SmolLM2 from the session's de-quantised HF copy (tests/conftest.py: the GGUF's weights and
    tokenizer bit for bit, tests/integration/test_convert.py) instead of the README's GGUF, which a
    run converts again (tokenizer ~9 s, weights ~30 s); the trainer's GGUF path runs end to end in
    tests/integration/test_server_sync.py."""
    return f"model.hf_path={smollm2_hf_dir}", "model.gguf_file=null"


GSM8K_STEP = [
    "parallel.tensor_model_parallel_size=1", "trainer.total_training_steps=1", "trainer.save_freq=-1",
    "trainer.test_freq=-1", "buffer.train_batch_size=2", "buffer.gen_batch_size=2",
    "buffer.filter_groups=false", "actor.ppo_mini_batch_size=2", "actor.ppo_max_token_len_per_gpu=1024",
    "actor.optim.lr_warmup_steps=0", "rollout.response_length=24", "buffer.overlong.max_response_length=24",
    "buffer.overlong.overlong_buffer_len=8", "data.max_prompt_length=256", "buffer.n=2",
]


@pytest.mark.slow
def test_broken_row_stops_the_run_with_its_index(gsm8k_with_broken_row, smollm2_hf_dir, tmp_path):
    out = _cli("--config", CPU_YAML, *_hf_copy(smollm2_hf_dir), f"trainer.default_local_dir={tmp_path}",
               f"data.train_files=[{gsm8k_with_broken_row}]", f"data.val_files=[{gsm8k_with_broken_row}]",
               *GSM8K_STEP)
    assert out.returncode == 2
    assert "row 5" in out.stderr and "reward_model" in out.stderr, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if "row 5" in x]  # one line, no traceback
    assert line.startswith("dapo-train: error: ") and "Traceback" not in out.stderr


@pytest.mark.slow
def test_converted_gsm8k_data_path_runs_a_zero_advantage_step_skipping_and_counting_the_broken_row(
        gsm8k_with_broken_row, smollm2_hf_dir, tmp_path):
    """Data handling only: a converted GSM8K file goes through rollout, the openai/gsm8k grader,
    the buffer and an optimizer step, but every group is constant (24 tokens never reach the
    answer), so the advantages and the gradient are exactly 0; the DAPO update itself is
    tested on groups with a gradient by test_trainer_e2e and test_trainer_parallel_parity."""
    from mlflow.tracking import MlflowClient

    out = _cli("--config", CPU_YAML, *_hf_copy(smollm2_hf_dir), f"trainer.default_local_dir={tmp_path}",
               f"data.train_files=[{gsm8k_with_broken_row}]", f"data.val_files=[{gsm8k_with_broken_row}]",
               "data.skip_invalid_rows=true", *GSM8K_STEP)
    assert out.returncode == 0, out.stderr[-3000:]
    # rank 0's start-up banner and end-of-run summary
    for line in (f"\nrun directory {tmp_path}\n",
                 "\nworld 1: actor TP 1 x PP 1 x DP 1; rollout colocated hf, 1 engine(s) of TP 1\n",
                 "\nsteps 1 (checkpoint never, validation never); new run from step 0\n",
                 f"curves: {tmp_path}/metrics.jsonl; mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db\n"):
        assert out.stderr.count(line) == 1, (line, out.stderr[-3000:])
    assert re.search(rf"done: 1 of 1 steps in \d+m\d\ds; run directory {re.escape(str(tmp_path))}\n", out.stderr)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    # verl's names: experiment = trainer.project_name (default), run name = trainer.experiment_name
    (run,) = client.search_runs([client.get_experiment_by_name("dapo-megatron").experiment_id])
    assert run.info.run_name == "dapo_smollm2_cpu"
    assert run.data.params["data_stats.train.invalid_rows_skipped"] == "1"
    assert run.data.params["data_stats.train.prompts"] == "15"
    m = run.data.metrics
    # the whole step ran on GSM8K rows: rollout, the openai/gsm8k grader, the buffer (no filtering),
    # advantages, an optimizer step that was not skipped, the weight sync
    assert m["rollout/kept_groups"] == 2 and m["actor/num_tokens"] == 2 * 2 * 24 and m["actor/skipped"] == 0
    # 24 tokens never reach "#### N": every response is wrong (-1) and truncated (Eq. 13: -1), so every
    # group is constant, its advantages are exactly 0 and so is the gradient (not NaN, not noise)
    assert m["rollout/gen_score_mean"] == -1.0 and m["train/truncation_ratio"] == 1.0
    assert m["rollout/gen_reward_mean"] == -2.0 and m["actor/pg_loss"] == 0.0 and m["actor/grad_norm"] == 0.0


def test_check_config_and_input_errors_are_one_line_with_status_2(tmp_path):
    """Issue 23 items 1-3 at the CLI: a bad YAML file, a missing model directory or GGUF file,
    and a bad value each print one line (no traceback) and exit 2 before torch.distributed
    starts; --check-config says ok and exits 0 when everything is in place."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"trainer:\n\tsave_freq: 3\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "m.gguf").write_bytes(b"")
    cases = [
        (["--config", str(bad)], f"dapo-train: error: {bad}, line 2, column 1: not valid YAML"),
        (["--check-config", "--nproc-per-node", "2", "--config", CPU_YAML, "model.hf_path=/nonexistent/model"],
         "dapo-train: error: model.hf_path='/nonexistent/model' is not a directory"),
        (["--check-config", "--nproc-per-node", "2", "--config", CPU_YAML, f"model.hf_path={model}",
          "model.gguf_file=n.gguf"],
         f"dapo-train: error: model.gguf_file='n.gguf' is not a file in model.hf_path='{model}'; did you mean 'm.gguf'?"),
        (["--check-config", "--nproc-per-node", "2", "--config", CPU_YAML, f"model.hf_path={model}",
          "model.gguf_file=m.gguf", "rollout.top_p=2"], "dapo-train: error: rollout.top_p=2.0 must be in (0, 1]"),
    ]
    for args, start in cases:
        out = _cli(*args, timeout=120)
        assert out.returncode == 2 and out.stderr.startswith(start), (args, out.stderr[-2000:])
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    out = _cli("--check-config", "--nproc-per-node", "2", "--config", CPU_YAML, f"model.hf_path={model}",
               "model.gguf_file=m.gguf", timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("dapo-train: config ok"), out.stderr[-2000:]

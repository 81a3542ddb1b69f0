"""End to end: the README main job on SmolLM2-135M-Instruct, TP=2 on 2 CPU processes.

One reference run (the README command with small-batch overrides, 3 steps) is shared by
the tests of this module: MLflow read back with ``MlflowClient``, the checkpoint, and the
reference for the kill-and-resume test, which SIGKILLs a second run during step 2 and
resumes it; the resumed steps must equal the uninterrupted ones exactly (deterministic
CPU: seeded sampling, fixed reduction order).

Every run here reads SmolLM2 from the session's de-quantised HF copy (``smollm2_hf_dir``,
tests/conftest.py: the GGUF's weights and tokenizer, bit for bit, tests/integration/test_convert.py)
instead of de-quantising the GGUF on each rank of each launch (~40 s a launch). The trainer's
GGUF path (``model.gguf_file``, the README default) still runs end to end in
tests/integration/test_server_sync.py (dapo-train on the GGUF at PP=2, server mode), the bridge's
GGUF import at TP=2 in tests/integration/test_weight_sync.py, and HFEngine's GGUF load, built by
the engine factory as the colocated trainer builds it, in tests/integration/test_eval.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from dapo_megatron.platform import reaper

SCRIPT = os.path.join(REPO, "examples", "run_dapo_smollm2_cpu.sh")

# Small enough for CI (~15 s a step), large enough for dynamic sampling to keep groups.
SMALL = [
    "trainer.total_training_steps=3",
    "trainer.save_freq=1",  # the kill test resumes from step 1 (the reference run saves at its last step only)
    "trainer.max_ckpt_to_keep=1",  # 2.2 GB a save; the resume test still resumes from step 1
    "trainer.test_freq=3",
    "buffer.train_batch_size=2",
    "buffer.n=4",
    "buffer.gen_batch_size=4",
    "buffer.max_num_gen_batches=3",
    "actor.ppo_mini_batch_size=1",
    "actor.ppo_max_token_len_per_gpu=512",
    "actor.optim.lr_warmup_steps=0",
    "rollout.response_length=16",
    "buffer.overlong.max_response_length=16",
    "buffer.overlong.overlong_buffer_len=4",
    "rollout.val_n=2",
    "rollout.val_max_prompts=4",
    "data.arithmetic.num_train_problems=64",
    "data.arithmetic.num_val_problems=8",
]
COMPARED = ("actor/pg_loss", "actor/grad_norm", "rollout/gen_reward_mean", "rollout/gen_acc_mean", "rollout/gen_tokens",
            "rollout/kept_groups", "actor/entropy", "rollout/logprob_diff_fresh_max")
# Rollout-vs-actor logprob gap on the responses generated in the step (carried-over surplus
# groups were sampled by the previous policy): the fp32 HF engine holds the actor's weights
# after every sync, so only round-off separates them (2.6e-5 max over tokens here); an engine
# one update behind is off by up to ~1 nat (the all-samples max of steps 2-3 with one stale group).
FRESH_GAP_MAX = 1e-4


def _env() -> dict:
    env = dict(os.environ)
    # The README command, minus tools/setup_cpu.sh (the environment running this test is the installed
    # one: its venv is the launcher's python3 and torchrun, tools/cpu_env.sh).
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", SKIP_SETUP="1",
               DAPO_VENV=os.path.dirname(os.path.dirname(sys.executable)))
    return env


def _start(run_dir: str, log_path: str, *extra: str) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(
        ["bash", SCRIPT, f"trainer.default_local_dir={run_dir}", *SMALL, *extra],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True,
    )


def _tail(path: str, n: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def _ranks_of(run_dir: str) -> list[str]:
    """``"<pid> <command line>"`` of each live process training into ``run_dir`` (its override is on
    every rank's command line)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and name != str(os.getpid()):
            line = reaper.cmdline(int(name))
            if "dapo_megatron.train" in line and f"trainer.default_local_dir={run_dir} " in line + " ":
                out.append(f"{name} {line}")
    return out


def _metrics(run_dir: str) -> dict[int, dict]:
    rows = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows[row["step"]] = row  # a resumed run appends: the last row of a step wins
    return rows


def _hf_copy(smollm2_hf_dir: str) -> tuple[str, str]:
    """The overrides that point a run at SmolLM2's de-quantised HF copy (module docstring)."""
    return f"model.hf_path={smollm2_hf_dir}", "model.gguf_file=null"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, smollm2_hf_dir):
    run_dir = str(tmp_path_factory.mktemp("ref") / "run")
    log = run_dir + ".log"
    # one save, at the last step (what the checkpoint and conversion tests read): the kill test's
    # runs save every step, so a save that changed the training would part them from this run
    proc = _start(run_dir, log, *_hf_copy(smollm2_hf_dir), "trainer.save_freq=3")
    assert proc.wait(timeout=1500) == 0, _tail(log)
    yield run_dir
    shutil.rmtree(os.path.dirname(run_dir), ignore_errors=True)  # module-scoped: free its GBs now


@pytest.mark.slow
@pytest.mark.dist
def test_main_job_logs_to_mlflow_and_checkpoints(reference_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{reference_run}/mlflow.db")
    # verl's names: experiment = trainer.project_name (default), run name = trainer.experiment_name
    exp = client.get_experiment_by_name("dapo-megatron")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "dapo_smollm2_cpu"
    assert run.data.params["parallel.tensor_model_parallel_size"] == "2"
    assert run.data.params["data_stats.train.prompts"] == "64"
    for key in ("rollout/gen_acc_mean", "rollout/gen_reward_mean", "train/acc_mean", "train/reward_mean", "rollout/kept_groups", "rollout/num_gen_batches",
                "train/response_length_mean", "train/truncation_ratio", "actor/entropy",
                "actor/pg_clipfrac_upper", "actor/pg_clipfrac_lower", "actor/grad_norm", "actor/lr",
                "rollout/logprob_diff_mean", "time/gen_s", "perf/gen_tokens_per_s"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert steps == [1, 2, 3], (key, steps)
    history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in ("rollout/kept_groups", "rollout/hit_cap", "rollout/logprob_diff_fresh_max")}
    for step in (1, 2, 3):
        # exactly N = 2 groups kept (fewer only when the cap was hit, and then logged)
        assert history["rollout/kept_groups"][step] == 2 or (
            history["rollout/hit_cap"][step] == 1 and history["rollout/kept_groups"][step] < 2), step
        # the engine generated with the weights the actor had: weight sync at start-up and after each update
        assert history["rollout/logprob_diff_fresh_max"][step] < FRESH_GAP_MAX, (step, history)
    val = client.get_metric_history(run.info.run_id, "val/avg_at_2")  # before training and at the end
    assert [m.step for m in val] == [0, 3] and all(0.0 <= m.value <= 1.0 for m in val)
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert "samples/step_000003.txt" in artifacts

    ckpt = os.path.join(reference_run, "checkpoints")
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "3"
    assert os.path.isdir(os.path.join(ckpt, "step_3"))
    assert not [d for d in os.listdir(ckpt) if ".tmp" in d]


@pytest.mark.slow
@pytest.mark.dist
def test_trainer_checkpoint_converts_to_hf(reference_run, smollm2_hf_dir, tmp_path):
    """The conversion tool reads a trainer checkpoint (TP=2, with optimizer state) at TP=1 and
    writes, bit for bit, the HF export of the actor at that step: the export of the checkpoint
    loaded at the training layout (TP=2, no resharding; the same gather the weight sync feeds the
    engine with, whose logprobs the main-job test checks against the actor's)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step_dir = os.path.join(reference_run, "checkpoints", "step_3")
    tool = os.path.join(REPO, "tools", "convert_megatron_to_hf.py")
    out, at_tp2 = tmp_path / "hf", tmp_path / "hf_tp2"
    # the two conversions side by side (3 processes on 2 cores): they read the same checkpoint, write apart
    procs = [subprocess.Popen([sys.executable, tool, "--ckpt", step_dir, "--out", str(out)], cwd=REPO, env=_env(),
                              start_new_session=True),
             subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               tool, "--ckpt", step_dir, "--out", str(at_tp2), "--tp", "2"], cwd=REPO,
                              env=dict(_env(), OMP_NUM_THREADS="1"), start_new_session=True)]
    try:
        for proc in procs:
            assert proc.wait(timeout=900) == 0, proc.args
    finally:
        for proc in procs:  # a failed or timed-out conversion leaves none running: torchrun's workers too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # each in its own session
            proc.wait()
    expected = load_file(str(at_tp2 / "model.safetensors"))
    assert sorted(load_file(str(out / "model.safetensors"))) == sorted(expected)
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name in expected:
        assert expected[name].dtype == torch.float32 and torch.equal(trained[name], expected[name]), name
    # the run's initial weights: SmolLM2's HF copy (the GGUF de-quantised, read in ~1 s instead of ~30 s)
    original = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).state_dict()
    assert trained.keys() == original.keys()
    assert all(trained[k].shape == original[k].shape for k in trained)  # vocab/query-group padding trimmed
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained[name], original[name])  # 3 optimizer steps changed the weights
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("Compute 3 + 4.")["input_ids"]) == "Compute 3 + 4."


@pytest.mark.slow
@pytest.mark.dist
def test_kill_during_step_and_resume_matches_uninterrupted(reference_run, smollm2_hf_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    log = run_dir + ".log"
    before = set(reaper.child_pids())
    model = _hf_copy(smollm2_hf_dir)  # as the reference run
    proc = _start(run_dir, log, *model)
    latest = os.path.join(run_dir, "checkpoints", "latest")
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(latest) and open(latest).read().strip() == "1":
            break
        time.sleep(0.5)
    assert proc.poll() is None, "run ended before its first checkpoint:\n" + _tail(log)
    time.sleep(4.0)  # inside step 2 (a step takes ~10-20 s here)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: bash and torchrun, not the ranks (below)
    proc.wait()
    # torchrun runs each rank in a session of its own; the ranks must die with their agent
    # (train.py: die_with_parent), not train on into the run directory the resume reads.
    deadline = time.time() + 30
    while _ranks_of(run_dir) and time.time() < deadline:
        time.sleep(0.2)
    assert not _ranks_of(run_dir), f"ranks outlived their killed torchrun: {_ranks_of(run_dir)}"
    reaper.reap_children(keep=before)  # the dead ranks were adopted by this (subreaper) session
    assert open(latest).read().strip() == "1", "the kill landed after step 2 was saved; make it earlier"
    assert 2 not in _metrics(run_dir)

    resumed = _start(run_dir, log + ".resume", *model)
    assert resumed.wait(timeout=1500) == 0, _tail(log + ".resume")
    got, want = _metrics(run_dir), _metrics(reference_run)
    for step in (1, 2, 3):
        # the resumed engine generates with the checkpoint's weights, not its random init
        assert got[step]["rollout/logprob_diff_fresh_max"] < FRESH_GAP_MAX, (step, got[step])
        for key in COMPARED:
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
    assert got[3]["val/avg@2"] == want[3]["val/avg@2"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

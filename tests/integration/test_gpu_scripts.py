"""The GPU scripts stay runnable: tests/gpu/h200_check.sh's dry run on CPU (every check but
the CUDA specifics), and tests/gpu/full_image_check.sh's structure (it needs the image and
two GPUs; its model builder runs here)."""

import os
import re
import subprocess
import sys

from conftest import REPO

GPU = os.path.join(REPO, "tests", "gpu")


def _env(**extra):
    """The test's environment, with this interpreter's bin first (the script calls ``python3``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def test_h200_check_dry_run_on_cpu():
    out = subprocess.run(["bash", os.path.join(GPU, "h200_check.sh"), "--cpu"], capture_output=True, text=True,
                         timeout=600, env=_env(), cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln and not ln.startswith("#")]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert lines[-1] == f"{len(lines) - 1} passed, 0 failed", lines
    names = [ln.split(":")[0].split()[1] for ln in lines[:-1]]
    assert all(ln.startswith("PASS ") for ln in lines[:-1]), lines
    for fam in ("llama_tied", "qwen2_bias"):
        assert {f"logprobs_fp32_{fam}", f"logprobs_bf16_{fam}", f"train_step_{fam}", f"sync_parity_{fam}"} <= set(names)
    assert {"collectives", "device_index", "sglang_torchrun", "fp8_sp_shapes"} <= set(names)
    # the CUDA IPC probe runs first (the rest depend on it), here sharing a CPU tensor the same way
    assert names[0] == "cuda_ipc" and "change is visible here" in lines[0], lines[0]


def test_h200_check_goes_on_when_the_ipc_probe_times_out():
    """A machine whose runtime hangs in CUDA IPC: the probe is killed at H200_IPC_TIMEOUT_S, the
    script says so, skips the checks that need IPC, runs the others and exits 0. A timeout of
    10 ms kills the probe before its interpreter has even imported torch: the same path as a hang."""
    cmd = ["bash", os.path.join(GPU, "h200_check.sh"), "--cpu", "--only", "cuda_ipc", "--only", "sglang_torchrun",
           "--only", "device_index"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(H200_IPC_TIMEOUT_S="0.01"),
                         cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln and not ln.startswith("#")]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert lines[0].startswith("SKIP cuda_ipc: timed out after 0.01 s"), lines
    assert lines[1].startswith("PASS device_index"), lines
    assert lines[2] == "SKIP sglang_torchrun: needs CUDA IPC, which cuda_ipc found unavailable on this machine", lines
    assert lines[-1] == "1 passed, 0 failed, 2 skipped", lines


def test_full_image_check_runs_only_known_subcommands(tmp_path):
    sys.path.insert(0, GPU)
    import full_image_check

    script = open(os.path.join(GPU, "full_image_check.sh")).read()
    assert subprocess.run(["bash", "-n", os.path.join(GPU, "full_image_check.sh")]).returncode == 0
    used = set(re.findall(r"full_image_check\.py (\S+)", script))
    assert used and used <= set(full_image_check.SUBCOMMANDS), used
    # the DAPO step's model: a tokenizer with a chat template and EOS, built without a download
    full_image_check.make_model(str(tmp_path))
    from transformers import AutoConfig, AutoTokenizer

    tok, cfg = AutoTokenizer.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Compute 3 + 4."}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert len(tok) <= cfg.vocab_size and cfg.eos_token_id == tok.eos_token_id
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")

"""A real ``dapo-rollout-server`` (``python -m dapo_megatron.rollout_server``) for the tests: its
own process on 127.0.0.1, its output in a log file (uvicorn's access lines name every call)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from dapo_megatron.platform.distributed import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the async tests' model stops at about one token in three (tiny_async_model's num_stop_ids)
ASYNC_NUM_STOP_IDS = 16384


def save_tiny_model(out_dir, family: str = "qwen2_bias", seed: int = 1, **overrides) -> str:
    """A random tiny HF model (``conftest.tiny_hf_config``, EOS id 2) saved in ``out_dir``."""
    from conftest import random_hf_model, tiny_hf_config

    cfg = tiny_hf_config(family, **{"eos_token_id": 2, **overrides})
    random_hf_model(cfg, seed=seed).save_pretrained(out_dir)
    return str(out_dir)


def tiny_async_model(smollm2_gguf, out_dir, num_stop_ids: int = 0) -> str:
    """The async tests' model in ``out_dir``: a random Llama (hidden 32, 1 layer, 2 heads, 1 KV head)
    with SmolLM2's tokenizer (``conftest.tiny_llama_with_smollm2_tokenizer_dir``). ``num_stop_ids``
    > 0: it also stops at ids 1000 .. 1000 + num_stop_ids - 2, so responses end at varied lengths."""
    from transformers import AutoConfig

    from conftest import tiny_llama_with_smollm2_tokenizer_dir

    hf_dir = tiny_llama_with_smollm2_tokenizer_dir(smollm2_gguf, out_dir, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    if num_stop_ids:
        config = AutoConfig.from_pretrained(hf_dir)
        config.eos_token_id = [config.eos_token_id] + list(range(1000, 1000 + num_stop_ids - 1))
        config.save_pretrained(hf_dir)
    return hf_dir


def forget_weight_update_groups() -> int:
    """Destroy this process's ends of the weight-update groups (``dapo_weights*``) that closed runs
    left registered; returns how many. A gloo sender's abort (bridge.servers.ServerWeightSender.abort)
    only drops its reference, so torch keeps the name and refuses a group of the same name
    (``_new_process_group_helper``: "The specified group name has already been created"): the
    state a fresh process starts from, for tests that run several trainers in one process."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    stale = [pg for pg, name in list(c10d._world.pg_names.items()) if name.startswith("dapo_weights")]
    for pg in stale:
        dist.destroy_process_group(pg)
    return len(stale)


def log_calls(log: str) -> list[str]:
    """Every route an access log (a server's output) names, in order (``"POST /generate"``)."""
    return [f"{m} {p}" for m, p in re.findall(r'"(GET|POST|PUT) (/[a-z_]*)[^"]* HTTP/1\.1"', log)]


class RolloutServer:
    """Start a server on ``model_path`` and wait until ``/health`` answers 200.

    Args:
        model_path: HF directory or ``.gguf`` file.
        log_path: where its stdout / stderr go.
        flags: extra command-line flags.
    """

    def __init__(self, model_path: str, log_path, *flags: str, startup_s: float = 180.0, wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = str(log_path)
        cmd = [sys.executable, "-m", "dapo_megatron.rollout_server", "--model-path", str(model_path),
               "--port", str(self.port), "--num-threads", "1", *flags]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.startup_s = startup_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "RolloutServer":
        """Block until ``/health`` answers 200 (servers started with ``wait=False`` load in parallel)."""
        startup_s = self.startup_s
        deadline = time.monotonic() + startup_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"dapo-rollout-server exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dapo-rollout-server did not come up in {startup_s} s:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        return self

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def calls(self) -> list[str]:
        """Every route called so far, in order (``"POST /generate"``), from the access log."""
        return log_calls(self.log())

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()

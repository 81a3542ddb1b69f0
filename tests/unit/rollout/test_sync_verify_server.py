"""Weight-sync verification (issue 39) into servers: a ``dapo-rollout-server`` that acknowledges every
``/update_weights_from_distributed`` but does not apply it (its copies land in throwaway tensors) is
caught in the same sync, by reading the checked tensors back with ``/get_weights_by_name`` (what real
SGLang servers offer), naming the tensor, the server and the version; the servers stay paused (they
do not generate with that version). Without verification (the sync as it was) the sync succeeds and
the server keeps serving its old weights. An honest server next to it passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from rollout_server import REPO, RolloutServer, free_port, save_tiny_model

BUCKET = 20_000

# the plant, run in the server's process before its main(): Scheduler.update_weights copies into clones
_LAZY = """
import sys
import dapo_megatron.rollout_server as server
real = server.Scheduler.update_weights
def update_weights(self, req):
    held = self.params
    self.params = {n: p.detach().clone() for n, p in held.items()}
    try:
        return real(self, req)
    finally:
        self.params = held
server.Scheduler.update_weights = update_weights
server.main(sys.argv[1:])
"""


class LazyServer(RolloutServer):
    """A dapo-rollout-server with the plant above (same flags, log and shutdown as RolloutServer)."""

    def __init__(self, model_path: str, log_path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = str(log_path)
        cmd = [sys.executable, "-c", _LAZY, "--model-path", str(model_path), "--port", str(self.port),
               "--num-threads", "1", *flags]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.startup_s = 180.0


def _worker(urls, out_dir):
    from conftest import random_hf_model, tiny_hf_config
    from dapo_megatron.bridge import iter_hf_weights, load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.bridge.receiver import hf_param_specs
    from dapo_megatron.bridge.servers import connect_servers, query_server, sync_servers
    from dapo_megatron.bridge.verify import SyncDigest

    parallel = init_distributed(ParallelConfig(1, 1), seed=0)
    hf_config = tiny_hf_config("qwen2_bias")
    model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=parallel)
    load_hf_weights(model, random_hf_model(hf_config, seed=1).state_dict(), parallel=parallel)
    servers = [query_server(u, 30) for u in urls]
    res = {}
    sender = connect_servers(servers, stage=0, num_stages=1, is_sender=True, device="cpu", timeout_s=30,
                             bucket_bytes=BUCKET, backend="gloo", parallel=parallel)
    # version 3: the readback of a tensor's head rows (rollout.check_weight_update_readback_elements),
    # 192 elements: the embedding (250 x 64 here) is read as its first 3 rows, which the sender
    # checksums alike (an honest server passes), the lazy server's stale head is still caught
    for version, verify in ((1, False), (2, True), (3, "head")):
        digest = SyncDigest(version, 1, readback_elements=192 if verify == "head" else None) if verify else None
        try:
            sync_servers(iter_hf_weights(model, parallel=parallel, bucket_bytes=BUCKET, pp_broadcast=False,
                                         digest=digest),
                         sender=sender, urls=urls, timeout_s=30, param_specs=hf_param_specs(hf_config),
                         version=version, coordinator=True, parallel=parallel, digest=digest)
            error = None
        except RuntimeError as err:
            error = str(err)
        states = [json.load(urllib.request.urlopen(u + "/server_info", timeout=10))["internal_states"][0]
                  for u in urls]
        res[str(verify)] = {"error": error, "paused": [s["paused"] for s in states],
                            "first": next(n for n, _ in iter_hf_weights(model, parallel=parallel))}
        with torch_no_grad():
            for p in model.parameters():
                p.add_(0.01)  # the next version differs
    sender.destroy()
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump(res, f)


def torch_no_grad():
    import torch

    return torch.no_grad()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_server_that_acknowledges_but_does_not_apply_is_caught_in_the_same_sync(tmp_path):
    from dapo_megatron.platform import spawn

    model = save_tiny_model(tmp_path / "model", seed=2)
    flags = ("--skip-tokenizer-init", "--weight-sync-timeout-s", "20")
    honest = RolloutServer(model, tmp_path / "honest.log", *flags, wait=False)
    lazy = LazyServer(model, tmp_path / "lazy.log", *flags)
    try:
        honest.wait_ready()
        lazy.wait_ready()
        urls = [honest.url, lazy.url]
        spawn(_worker, 1, urls, str(tmp_path))
    finally:
        honest.stop()
        lazy.stop()
    res = json.load(open(tmp_path / "rank0.json"))
    before, after = res["False"], res["True"]
    # unverified: accepted, both servers resumed (the lazy one serving its old weights)
    assert before["error"] is None and before["paused"] == [False, False]
    # verified: one error naming the lazy server, the first tensor and the version; nobody resumed
    assert after["error"].startswith(f"weight sync to version 2: SGLang server {lazy.url} holds a different "
                                     f"{after['first']!r} than the trainer sent"), after["error"]
    assert after["paused"] == [True, True]
    head = res["head"]
    assert head["error"].startswith(f"weight sync to version 3: SGLang server {lazy.url} holds a different "
                                    f"{head['first']!r} than the trainer sent"), head["error"]
    assert head["paused"] == [True, True]
    # the honest server's head rows matched every checksum (a false alarm would name it first)
    assert honest.url not in head["error"]


def test_the_readback_reads_a_tensors_head_rows_within_the_budget_and_the_sender_checksums_the_same():
    import torch

    from dapo_megatron.bridge.verify import SyncDigest, checksum, readback_rows, readback_shape

    assert readback_rows((250, 64), 192) == 3  # 3 whole rows of 64 fit in 192 elements
    assert readback_rows((64,), 192) == 64  # a bias within the budget: whole
    assert readback_rows((1000,), 192) == 192
    assert readback_rows((10, 1000), 192) == 1  # a row longer than the budget: still one row
    assert readback_rows((250, 64), 0) == readback_rows((250, 64), None) == 250  # 0 / None: whole tensors
    assert readback_shape((250, 64), 192) == (3, 64) and readback_shape((), 192) == ()
    t = torch.arange(250 * 64, dtype=torch.float32).reshape(250, 64)
    head = SyncDigest(1, 1, readback_elements=192)
    assert checksum(head.checked_part(t)) == checksum(t[:3].clone())
    assert checksum(SyncDigest(1, 1).checked_part(t)) == checksum(t)
    t2 = t.clone()
    t2[200, 5] += 1  # past the head: what a head readback cannot see (docs/design.md, the readback row)
    assert checksum(head.checked_part(t2)) == checksum(head.checked_part(t))

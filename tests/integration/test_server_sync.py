"""rollout.mode=server: weights from one rank per pipeline stage into separate SGLang servers.

Two stand-in servers (tests/sglang_standin.py: real HTTP servers on 127.0.0.1 in their own
processes, joining real gloo groups and receiving the flattened-bucket broadcast as SGLang's
``_update_bucketed_weights_from_distributed`` does) take the sync of a TP=1/PP=2 actor (two
stages, two senders, two groups) and of a TP=2 actor (one sender, its TP peer in step); what
each server received must equal the HF export bit for bit. Then the failure paths: a server
that refuses an update stops every rank with its URL (no hang: the TP peer keeps the
bridge's collectives in step), and a dead, hung or unhealthy server fails the health check
naming its URL within the timeout.
"""

from __future__ import annotations

import base64
import json
import os
import time

import pytest
import torch

from dapo_megatron.platform import spawn
from dapo_megatron.rollout.sglang_engine import http_post
from sglang_standin import StandIn

BUCKET = 20_000


def _sync_worker(tp, pp, urls, out_dir, fail_url=None, timeout_s=60):
    import torch.distributed as dist

    from conftest import random_hf_model, tiny_hf_config
    from dapo_megatron.bridge import ExportBuffers, export_hf_state_dict, iter_hf_weights, load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.rollout.engine import hf_param_specs
    from dapo_megatron.rollout.server_sync import check_health, connect_servers, query_server, sync_servers

    parallel = init_distributed(ParallelConfig(tp, pp), seed=0)
    rank = dist.get_rank()
    hf_config = tiny_hf_config("qwen2_bias")
    model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=parallel)
    load_hf_weights(model, random_hf_model(hf_config, seed=1).state_dict(), parallel=parallel)
    export = export_hf_state_dict(model, parallel=parallel)
    servers = [query_server(u, 30) for u in urls]
    stage, stages = parallel.pp_rank, parallel.pp_size
    sender = connect_servers(servers, stage=stage, num_stages=stages,
                             is_sender=parallel.tp_rank == 0 and parallel.dp_rank == 0,
                             device="cpu", timeout_s=timeout_s, bucket_bytes=BUCKET, backend="gloo")
    check_health(urls, 10)
    if fail_url is not None and rank == 0:
        http_post(fail_url, "/control", {"fail_next_update": "Failed to update parameter online: boom"}, 10)
    dist.barrier()
    result = {"rank": rank}

    class CountingBuffers(ExportBuffers):
        allocations = 0

        def bucket(self, like, numel, capacity):
            before = self._bucket
            flat = super().bucket(like, numel, capacity)
            self.allocations += self._bucket is not before
            return flat

    buffers = CountingBuffers()
    try:
        stream = iter_hf_weights(model, parallel=parallel, bucket_bytes=BUCKET, pp_broadcast=False, buffers=buffers)
        result["bytes"] = sync_servers(stream, sender=sender,
                                       urls=urls, timeout_s=timeout_s, param_specs=hf_param_specs(hf_config), version=1,
                                       coordinator=rank == 0, stage=stage, num_stages=stages)
    except RuntimeError as err:
        result["error"] = str(err)
    result["bucket_allocations"] = buffers.allocations
    if rank == 0:
        result["export"] = {n: base64.b64encode(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).decode()
                            for n, t in export.items()}
        result["export_shapes"] = {n: list(t.shape) for n, t in export.items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def _servers():
    servers = [StandIn(), StandIn()]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture()
def two_servers(_servers):
    for s in _servers:
        http_post(s.url, "/control", {"reset": True}, 10)
    return _servers


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1)], ids=["actor_pp2", "actor_tp2"])
def test_each_server_receives_the_hf_export_bitwise(tp, pp, two_servers, tmp_path):
    urls = [s.url for s in two_servers]
    spawn(_sync_worker, 2, tp, pp, urls, str(tmp_path))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in range(2))
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    export = r0["export"]
    for url in urls:
        got = http_post(url, "/received", None, 30)
        names = [r[0] for r in got["received"]]
        assert sorted(names) == sorted(export), "every HF tensor once per server"
        for name, raw, shape, _, group in got["received"]:
            assert raw == export[name] and shape == r0["export_shapes"][name], name
        groups = {r[4] for r in got["received"]}
        assert groups == ({"dapo_weights_pp0", "dapo_weights_pp1"} if pp == 2 else {"dapo_weights_pp0"})
        if pp == 2:  # each stage sent its own layers: the embedding from stage 0, the LM head from stage 1
            group_of = {r[0]: r[4] for r in got["received"]}
            assert group_of["model.embed_tokens.weight"] == "dapo_weights_pp0"
            assert group_of["lm_head.weight"] == group_of["model.norm.weight"] == "dapo_weights_pp1"
        assert got["flat_broadcasts"] >= 3, "one broadcast per bucket, several buckets"
        assert got["flushes"] == 1 and got["control"] == [["/pause_generation", "abort"],
                                                          ["/continue_generation", None]]
    # the sender's loop and the TP peer's drain drop each bucket: one buffer for all of them
    assert r0["bucket_allocations"] == r1["bucket_allocations"] == 1, (r0["bucket_allocations"],
                                                                       r1["bucket_allocations"])
    total = sum(len(base64.b64decode(v)) for v in export.values())
    assert r0["bytes"] + r1["bytes"] == total, "each byte sent once (per stage, not broadcast over PP)"
    if tp == 2:
        assert r1["bytes"] == 0, "the TP peer only takes part in the bridge's TP gathers"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_server_that_refuses_an_update_stops_every_rank_naming_it(two_servers, tmp_path):
    urls = [s.url for s in two_servers]
    # a 10 s bound: the broadcast the refusing server never joins ends there (gloo), so the ranks exit
    spawn(_sync_worker, 2, 2, 1, urls, str(tmp_path), urls[1], 10)
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in range(2))
    assert r0["error"] == r1["error"]
    assert f"SGLang server {urls[1]}/update_weights_from_distributed returned HTTP 400" in r0["error"]
    assert "Failed to update parameter online: boom" in r0["error"]
    assert http_post(urls[0], "/received", None, 30)["flushes"] == 0, "no flush after a failed sync"


def test_health_check_names_a_dead_a_hung_and_an_unhealthy_server():
    from dapo_megatron.rollout.server_sync import check_health, query_server

    alive, hung, sick, dead = StandIn(), StandIn(), StandIn(), StandIn()
    try:
        dead.stop()
        http_post(hung.url, "/control", {"hang_health": True}, 10)
        http_post(sick.url, "/control", {"healthy": False}, 10)
        check_health([alive.url], 5)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            check_health([alive.url, hung.url, sick.url, dead.url], 1.0)
        assert time.monotonic() - t0 < 10, "every server checked at once, each within the timeout"
        msg = str(err.value)
        assert f"{hung.url}/health did not answer within 1 s" in msg
        assert f"{sick.url}/health returned HTTP 503" in msg
        assert f"{dead.url}/health unreachable" in msg
        assert alive.url + "/" not in msg

        info = query_server(alive.url, 5)
        assert info.tp_size == 1 and info.enable_memory_saver and info.version == "0.5.11"
        http_post(alive.url, "/control", {"server_info": {"dp_size": 2}}, 10)
        with pytest.raises(RuntimeError, match=rf"{alive.url} runs with dp_size=2: rollout.mode=server needs one "
                                               "server per replica"):
            query_server(alive.url, 5)
    finally:
        http_post(hung.url, "/control", {"hang_health": False}, 10)
        for s in (alive, hung, sick):
            s.stop()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(1500)
def test_trainer_in_server_mode_checks_health_generates_and_syncs_every_step(tmp_path, smollm2_gguf):
    """dapo-train (SmolLM2, PP=2 on 2 gloo ranks) with rollout.mode=server against two
    stand-in servers: each step starts with /health of both, the generation batch is dealt
    over the two servers (rank e drives server e), and both receive every HF tensor of both
    stages at start and after the step.
    Then a dead server stops the run at start naming its URL."""
    import subprocess
    import sys

    from integration.test_trainer_parallel_parity import REPO, STEP

    servers = [StandIn(), StandIn()]
    try:
        urls = [s.url for s in servers]
        for url in urls:
            http_post(url, "/control", {"digest_only": True}, 10)

        def run(run_dir, *extra):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "-m", "dapo_megatron.train", "--config", os.path.join(REPO, "examples/configs/dapo_smollm2_cpu.yaml"),
                   f"model.hf_path={smollm2_gguf[0]}", f"trainer.default_local_dir={run_dir}",
                   "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2", *STEP,
                   "buffer.filter_groups=false",
                   "rollout.name=sglang", "rollout.mode=server", f"rollout.server_urls=[{','.join(urls)}]",
                   "rollout.server_timeout_s=30", "rollout.update_weights_bucket_megabytes=64", *extra]
            env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)

        out = run(tmp_path / "run")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        with open(tmp_path / "run" / "metrics.jsonl") as f:
            (row,) = [json.loads(line) for line in f]
        assert row["rollout/num_gen_batches"] >= 1 and row["perf/sync_GBps"] > 0
        got = [http_post(url, "/received", None, 30) for url in urls]
        for g in got:
            calls = [c for c in g["calls"] if c != "/update_weights_from_distributed"]
            # start: info, both stages' groups, the first sync; step 1: health, generate(s), the sync
            assert calls[:3] == ["/server_info", "/init_weights_update_group", "/init_weights_update_group"], calls
            sync = ["/pause_generation", "/flush_cache", "/continue_generation"]
            assert calls[3:6] == sync and calls[6] == "/health" and calls[-3:] == sync, calls
            assert "/generate" in calls[7:-3], "each server generated part of the batch"
            names = [r[0] for r in g["received"]]
            half = len(names) // 2
            assert names[:half] == names[half:] and len(set(names[:half])) == half, "two full syncs, each once"
            assert {r[4] for r in g["received"]} == {"dapo_weights_pp0", "dapo_weights_pp1"}
            # the stand-ins' responses all earn the same reward, so every advantage is 0 and the
            # step leaves the weights as they were: the second sync sends the same bytes
            assert row["actor/grad_norm"] == 0.0
            assert [r[1] for r in g["received"][:half]] == [r[1] for r in g["received"][half:]]
        assert got[0]["received"] == got[1]["received"], "both servers received the same bytes"

        servers[1].stop()
        out = run(tmp_path / "dead")
        assert out.returncode != 0
        assert f"SGLang server {urls[1]}/server_info unreachable" in out.stdout + out.stderr
    finally:
        for s in servers:
            s.stop()

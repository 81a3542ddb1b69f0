"""rollout.mode=server: weights from one rank per pipeline stage into separate rollout servers.

Two real ``dapo-rollout-server`` s (tests/rollout_server.py: the HF engine behind SGLang's HTTP API,
each in its own process, joining real gloo groups and receiving the flattened-bucket broadcast
as SGLang's ``_update_bucketed_weights_from_distributed`` does), started on OTHER random weights
than the actor's, take the sync of a TP=1/PP=2 actor (two stages, two senders, two groups) and
of a TP=2 actor (one sender, its TP peer in step); each server's parameters must then equal the
HF export bit for bit, and its greedy generation the HF model's on those weights. Then the
failure paths: a server serving another model refuses an update (a real shape check, before it
joins the broadcast) and that stops every rank with its URL (no hang: the TP peer keeps the
bridge's collectives in step); a dead, hung or unhealthy server fails the health check naming
its URL within the timeout (the stand-in of tests/sglang_standin.py, which can be made to hang
or answer 503 on demand).

The three syncs run in ONE 2-rank world, one after the other (a world costs more than a sync);
rank 0 reads back what the servers hold after each, before the next sync (each actor on other
weights than the last) overwrites it, and each server's calls during each sync.
"""

from __future__ import annotations

import base64
import json
import os
import time

import pytest
import torch

from dapo_megatron.platform import spawn
from dapo_megatron.platform.http import http_post
from rollout_server import RolloutServer, forget_weight_update_groups, free_port, save_tiny_model
from sglang_standin import StandIn

BUCKET = 20_000


def _calls_settled(log_paths) -> list[list[str]]:
    """Each log's calls once two reads 0.3 s apart agree (uvicorn writes an access line as it answers)."""
    from rollout_server import log_calls

    def read():
        return [log_calls(open(p).read()) for p in log_paths]

    last = read()
    for _ in range(20):
        time.sleep(0.3)
        now = read()
        if now == last:
            break
        last = now
    return last


def _probe(url, export, prompts):
    """What a server holds after a sync, read back through SGLang's API: every exported tensor's
    values (``/get_weights_by_name``), its greedy generation of ``prompts`` and its weight-update groups."""
    from dapo_megatron.platform.http import http_get

    weights = {name: http_post(url, "/get_weights_by_name", {"name": name, "truncate_size": tensor.shape[0]}, 30)
               for name, tensor in export.items()}
    out = http_post(url, "/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": 8,
                                                                                "temperature": 0}}, 60)
    groups = http_get(url, "/server_info", 10)["internal_states"][0]["weight_update_groups"]
    return {"weights": weights, "generated": [o["output_ids"] for o in out], "groups": list(groups)}


PROMPTS = [[5, 17, 33, 8], [100, 3, 41]]
# the layouts of the sync test, each with its own actor weights (so each sync moves every weight)
CASES = {"actor_pp2": (1, 2, 1), "actor_tp2": (2, 1, 3)}


def _world(urls, logs, refuse_urls, refuse_logs, out_root):
    """Every sync of this file in ONE 2-rank world (a world costs more than a sync): the TP=1/PP=2
    and TP=2 actors into ``urls`` (each followed by rank 0's read-back of what the servers hold,
    before the next sync overwrites it), then the TP=2 actor into ``refuse_urls`` (one server of
    another model: the sync fails). Per case each rank writes ``<case>/rank<r>.json``, rank 0
    with the calls each server (``logs``) answered during the sync."""
    import torch.distributed as dist

    for name, (tp, pp, seed) in CASES.items():
        _sync_case(tp, pp, urls, os.path.join(out_root, name), logs=logs, seed=seed, probe=True)
    _sync_case(2, 1, refuse_urls, os.path.join(out_root, "refuse"), timeout_s=10, logs=refuse_logs)
    dist.barrier()


def _sync_case(tp, pp, urls, out_dir, timeout_s=60, logs=(), seed=1, probe=False):
    import torch.distributed as dist

    from conftest import random_hf_model, tiny_hf_config
    from dapo_megatron.bridge import ExportBuffers, export_hf_state_dict, iter_hf_weights, load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.bridge.receiver import hf_param_specs
    from dapo_megatron.rollout.engines.row_client import check_health
    from dapo_megatron.bridge.servers import connect_servers, query_server, sync_servers

    os.makedirs(out_dir, exist_ok=True)
    # a new layout in the same world: init_distributed rebuilds megatron-core's groups (distributed.py)
    parallel = init_distributed(ParallelConfig(tp, pp), seed=0)
    rank = dist.get_rank()
    before = [len(c) for c in _calls_settled(logs)] if rank == 0 else None
    hf_config = tiny_hf_config("qwen2_bias")
    model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=parallel)
    load_hf_weights(model, random_hf_model(hf_config, seed=seed).state_dict(), parallel=parallel)
    export = export_hf_state_dict(model, parallel=parallel)
    servers = [query_server(u, 30) for u in urls]
    stage, stages = parallel.pp_rank, parallel.pp_size
    sender = connect_servers(servers, stage=stage, num_stages=stages,
                             is_sender=parallel.tp_rank == 0 and parallel.dp_rank == 0,
                             device="cpu", timeout_s=timeout_s, bucket_bytes=BUCKET, backend="gloo",
                             parallel=parallel)
    check_health(urls, 10)
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
                                       coordinator=rank == 0, stage=stage, num_stages=stages, parallel=parallel)
    except RuntimeError as err:
        result["error"] = str(err)
    result["bucket_allocations"] = buffers.allocations
    if rank == 0:
        result["export"] = {n: base64.b64encode(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).decode()
                            for n, t in export.items()}
        result["export_shapes"] = {n: list(t.shape) for n, t in export.items()}
        result["calls"] = [c[skip:] for c, skip in zip(_calls_settled(logs), before)]
        if probe:
            result["servers"] = [_probe(u, export, PROMPTS) for u in urls]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # rank 0's reads done before any group goes (and before the next sync overwrites)
    if sender is not None:  # the next case forms its own groups, as a new world would
        sender.destroy()
    forget_weight_update_groups()
    dist.barrier()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers of the actor's architecture on other random weights (seed 2; the actor's are seed
    1), and one of another model (intermediate size 80, not 96), all loading at once."""
    root = tmp_path_factory.mktemp("rollout_servers")
    same = save_tiny_model(root / "same", seed=2)
    other = save_tiny_model(root / "other", seed=2, intermediate_size=80)
    started = [RolloutServer(path, root / f"server{i}.log", "--skip-tokenizer-init", "--weight-sync-timeout-s", "20",
                             wait=False) for i, path in enumerate([same, same, other])]
    try:
        yield [s.wait_ready() for s in started]
    finally:
        for s in started:
            s.stop()


def _greedy(model, prompt, steps):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == 2:  # save_tiny_model's EOS
                break
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def world(servers, tmp_path_factory):
    """Rank 0's and rank 1's results of :func:`_world` per case (``actor_pp2``, ``actor_tp2``, ``refuse``)."""
    root = tmp_path_factory.mktemp("server_sync_world")
    two, refuse = servers[:2], [servers[0], servers[2]]
    spawn(_world, 2, [s.url for s in two], [s.log_path for s in two], [s.url for s in refuse],
          [servers[0].log_path], str(root))
    return {case: [json.load(open(root / case / f"rank{r}.json")) for r in range(2)]
            for case in (*CASES, "refuse")}


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1)], ids=["actor_pp2", "actor_tp2"])
def test_each_server_holds_the_hf_export_bitwise_and_generates_with_it(tp, pp, servers, world):
    from transformers import AutoModelForCausalLM

    from conftest import tiny_hf_config

    case = f"actor_{'pp2' if pp == 2 else 'tp2'}"
    assert CASES[case][:2] == (tp, pp)
    r0, r1 = world[case]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    # what the trainer called, from each server's access log (info and health checks aside)
    called = [[c for c in calls if c not in ("GET /health", "GET /server_info")] for calls in r0["calls"]]
    export = {n: torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.float32).reshape(r0["export_shapes"][n])
              for n, v in r0["export"].items()}
    reference = AutoModelForCausalLM.from_config(tiny_hf_config("qwen2_bias", eos_token_id=2)).float().eval()
    reference.load_state_dict(export, strict=True)
    expected = [_greedy(reference, p, 8) for p in PROMPTS]
    # each case's actor has other weights than what the servers held before its sync (the start's
    # seed 2, the previous case's seed): a tensor the sync missed keeps them
    embed = [world[c][0]["export"]["model.embed_tokens.weight"] for c in CASES]
    assert len(set(embed)) == len(embed)
    for held, calls in zip(r0["servers"], called):
        for name, tensor in export.items():  # bit for bit, read back through SGLang's /get_weights_by_name
            got = torch.tensor(held["weights"][name], dtype=torch.float32)
            assert torch.equal(got.view(torch.int32), tensor.view(torch.int32)), (case, name)
        assert held["generated"] == expected, "the server generates with the synced weights"
        stages = [f"dapo_weights_pp{i}" for i in range(pp)]  # one group per stage
        assert set(stages) <= set(held["groups"])
        sync = calls[pp:]
        assert calls[:pp] == ["POST /init_weights_update_group"] * pp, calls
        assert sync[0] == "POST /pause_generation" and sync[-2:] == ["POST /flush_cache", "POST /continue_generation"]
        updates = sync[1:-2]
        assert set(updates) == {"POST /update_weights_from_distributed"} and len(updates) >= 3, "several buckets"
    # the sender's loop and the TP peer's drain drop each bucket: one buffer for all of them
    assert r0["bucket_allocations"] == r1["bucket_allocations"] == 1, (r0["bucket_allocations"],
                                                                       r1["bucket_allocations"])
    total = sum(t.numel() * 4 for t in export.values())
    assert r0["bytes"] + r1["bytes"] == total, "each byte sent once (per stage, not broadcast over PP)"
    if tp == 2:
        assert r1["bytes"] == 0, "the TP peer only takes part in the bridge's TP gathers"
    else:  # each stage sent its own layers: the embedding from stage 0, the norm and LM head from stage 1
        assert r1["bytes"] >= sum(export[n].numel() * 4 for n in ("lm_head.weight", "model.norm.weight"))
        assert r0["bytes"] >= export["model.embed_tokens.weight"].numel() * 4


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_server_that_refuses_an_update_stops_every_rank_naming_it(servers, world):
    other = servers[2]
    # a 10 s bound: the broadcast the refusing server never joins ends there (gloo), so the ranks go on
    r0, r1 = world["refuse"]
    assert r0["error"] == r1["error"]
    assert f"SGLang server {other.url}/update_weights_from_distributed returned HTTP 400" in r0["error"]
    assert "has shape [96, 64] but the served model's parameter has [80, 64]" in r0["error"], r0["error"]
    (good_calls,) = r0["calls"]  # the good server's calls during this sync
    assert "POST /flush_cache" not in good_calls, "no flush after a failed sync"


@pytest.mark.timeout(300)
def test_set_members_destroys_the_old_group_on_every_server_before_forming_the_new(servers):
    """Issue 36 item 7: re-forming the weight-update group over new members first destroys the old
    one on each server (``/destroy_weights_update_group``, SGLang's endpoint), so no server keeps a
    communicator per membership change; the dropped server too, while it answers."""
    from dapo_megatron.rollout.engines.server_sync import ServerRollout
    from dapo_megatron.platform.http import http_get

    a, b = servers[0], servers[1]
    eng = ServerRollout([a.url, b.url], None, stage=0, num_stages=1, is_sender=True, device="cpu", timeout_s=20,
                        silence_timeout_s=20, bucket_bytes=BUCKET, backend="gloo", one_driver=True)

    def groups(server):
        return {g for g in http_get(server.url, "/server_info", 10)["internal_states"][0]["weight_update_groups"]
                if g.startswith("dapo_weights_pp0")}

    def weight_calls(server, since):
        return [c for c in server.calls()[since:] if c.endswith("weights_update_group")]

    assert groups(a) == groups(b) == {"dapo_weights_pp0"}
    before = [len(a.calls()), len(b.calls())]
    eng.set_members([0])  # b dropped
    assert groups(a) == {"dapo_weights_pp0_m1"} and groups(b) == set()
    assert weight_calls(a, before[0]) == ["POST /destroy_weights_update_group", "POST /init_weights_update_group"]
    assert weight_calls(b, before[1]) == ["POST /destroy_weights_update_group"]
    before = [len(a.calls()), len(b.calls())]
    eng.set_members([0, 1])  # b back
    assert groups(a) == groups(b) == {"dapo_weights_pp0_m2"}
    assert weight_calls(a, before[0]) == ["POST /destroy_weights_update_group", "POST /init_weights_update_group"]
    assert weight_calls(b, before[1]) == ["POST /init_weights_update_group"]
    eng.sender.destroy()


def test_health_check_names_a_dead_a_hung_and_an_unhealthy_server():
    from dapo_megatron.rollout.engines.row_client import check_health
    from dapo_megatron.bridge.servers import query_server

    # started at once (a start is most of this test's time); a dead server is a port nobody listens on
    alive, hung, sick = (s.wait_ready() for s in [StandIn(wait=False) for _ in range(3)])
    dead_url = f"http://127.0.0.1:{free_port()}"
    try:
        http_post(hung.url, "/control", {"hang_health": True}, 10)
        http_post(sick.url, "/control", {"healthy": False}, 10)
        check_health([alive.url], 5)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            check_health([alive.url, hung.url, sick.url, dead_url], 1.0)
        assert time.monotonic() - t0 < 10, "every server checked at once, each within the timeout"
        msg = str(err.value)
        assert f"{hung.url}/health did not answer within 1 s" in msg
        assert f"{sick.url}/health returned HTTP 503" in msg
        assert f"{dead_url}/health unreachable" in msg
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
def test_trainer_in_server_mode_checks_health_generates_and_syncs_every_step(tmp_path, smollm2_gguf,
                                                                             smollm2_hf_dir, tiny_async_hf_dir):
    """dapo-train (SmolLM2, PP=2 on 2 gloo ranks) with rollout.mode=server against two real
    dapo-rollout-servers on the same GGUF: each step starts with /health of both, the generation
    batch is dealt over the two servers (rank e drives server e) and really generated there (the
    actor's recomputed logprobs match the servers' to float32 noise), and both servers hold the
    same weights after the sync that ends the step (moved off the GGUF's iff the step trained).
    Then the streamed rollout on the same servers keeps the streamed metrics, and a dead server
    stops the run at start naming its URL."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from conftest import FIRST_STEP as STEP
    from conftest import REPO
    from integration.test_trainer_parallel_parity import LOGPROB_GAP_MAX

    gguf = os.path.join(*smollm2_gguf)
    servers = [RolloutServer(gguf, tmp_path / f"server{i}.log", "--skip-tokenizer-init", wait=False) for i in range(2)]
    try:
        for s in servers:
            s.wait_ready()
        urls = [s.url for s in servers]

        def run(run_dir, *extra):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "-m", "dapo_megatron.train", "--config", os.path.join(REPO, "examples/configs/dapo_smollm2_cpu.yaml"),
                   f"model.hf_path={smollm2_gguf[0]}", f"trainer.default_local_dir={run_dir}",
                   "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2", *STEP,
                   "buffer.filter_groups=false",
                   "rollout.name=sglang", "rollout.mode=server", f"rollout.server_urls=[{','.join(urls)}]",
                   "rollout.server_timeout_s=60", "rollout.update_weights_bucket_megabytes=64", *extra]
            env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)

        before = [len(s.calls()) for s in servers]
        out = run(tmp_path / "run")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        with open(tmp_path / "run" / "metrics.jsonl") as f:
            (row,) = [json.loads(line) for line in f]
        assert row["rollout/num_gen_batches"] >= 1 and row["perf/sync_GBps"] > 0
        assert row["train/response_length_mean"] > 0 and row["rollout/gen_response_length_mean"] > 0
        # the servers sampled with the actor's weights: the actor's recomputed logprobs are theirs
        assert row["rollout/logprob_diff_max"] <= LOGPROB_GAP_MAX, row["rollout/logprob_diff_max"]
        for s, skip in zip(servers, before):
            calls = [c for c in s.calls()[skip:] if c != "POST /update_weights_from_distributed"]
            # every sync is verified before the server generates again (rollout.check_weight_update):
            # its sampled tensors are read back between the flush and /continue_generation
            syncs = "".join("p" if c == "POST /pause_generation" else "r" if c == "POST /get_weights_by_name" else
                            "c" if c == "POST /continue_generation" else "" for c in calls)
            assert syncs.count("p") == 2 and all(set(x) == {"r"} for x in
                                                 syncs.replace("c", "").split("p")[1:]), (syncs, calls)
            calls = [c for c in calls if c != "POST /get_weights_by_name"]
            # start: info, both stages' groups, the first sync; step 1: health, generate(s), the sync
            assert calls[:3] == ["GET /server_info", "POST /init_weights_update_group",
                                 "POST /init_weights_update_group"], calls
            sync = ["POST /pause_generation", "POST /flush_cache", "POST /continue_generation"]
            assert calls[3:6] == sync and calls[6] == "GET /health" and calls[-3:] == sync, calls
            assert "POST /generate" in calls[7:-3], "each server generated part of the batch"
        # the GGUF's weights as the session's HF copy holds them, bit for bit (test_convert), read
        # in ~1 s instead of de-quantising the GGUF again (~30 s)
        initial = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).state_dict()
        changed = False
        for name, tensor in initial.items():  # the first rows of every tensor, read back from both servers
            rows = [torch.tensor(http_post(s.url, "/get_weights_by_name", {"name": name, "truncate_size": 8}, 60))
                    for s in servers]
            assert torch.equal(rows[0].view(torch.int32), rows[1].view(torch.int32)), name
            changed |= not torch.equal(rows[0], tensor[:8].float())
        assert changed == (row["actor/grad_norm"] > 0), (changed, row["actor/grad_norm"])

        # the streamed rollout on the same servers (issue 20): group g on server g % 2, rounds of
        # records, the tokens sent once from the rank that drove the server to the ranks that train
        # them. Filtering off: the keep rate's prior (1) submits exactly N = 2 prompts, both kept
        # when they finish, nothing left to abort. The trainer reads SmolLM2's HF copy (the GGUF's
        # weights and tokenizer, bit for bit) instead of de-quantising the GGUF on both ranks again
        # (~30 s); the run above covers the GGUF, and the start-up sync rewrites the servers' weights
        before = [len(s.calls()) for s in servers]
        out = run(tmp_path / "streamed", "rollout.streaming=true", "rollout.stream_poll_tokens=4",
                  f"model.hf_path={smollm2_hf_dir}", "model.gguf_file=null")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        with open(tmp_path / "streamed" / "metrics.jsonl") as f:
            (row,) = [json.loads(line) for line in f]
        assert row["rollout/kept_groups"] == 2 and row["rollout/prompts_submitted"] == 2
        assert row["rollout/num_gen_batches"] == 1 and row["rollout/rounds"] >= 1 and row["rollout/keep_rate"] == 1
        assert row["rollout/aborted_rows"] == row["rollout/aborted_tokens"] == row["rollout/skipped_prompts"] == 0
        assert row["rollout/partial_in"] == row["rollout/partial_out"] == 0
        assert row["rollout/gen_tokens"] == row["train/response_length_mean"] * 2 * 4  # every response trains
        assert row["rollout/gen_response_length_mean"] == row["train/response_length_mean"] > 0
        assert row["rollout/logprob_diff_max"] <= LOGPROB_GAP_MAX, row["rollout/logprob_diff_max"]
        for s, skip in zip(servers, before):
            assert "POST /generate" in s.calls()[skip:], "each server streamed one of the two groups"

        # the servers are queried once the actor is built: the dead-server run loads the tiny model
        # (SmolLM2's tokenizer, 1 layer: PP=1, so DP=2 over the same two servers), not SmolLM2 twice
        servers[1].kill()
        out = run(tmp_path / "dead", f"model.hf_path={tiny_async_hf_dir}", "model.gguf_file=null",
                  "parallel.pipeline_model_parallel_size=1")
        assert out.returncode != 0
        assert f"SGLang server {urls[1]}/server_info unreachable" in out.stdout + out.stderr
    finally:
        for s in servers:
            s.stop()

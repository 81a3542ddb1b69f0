"""Issue 36 item 1: ranks that generate nothing outwait a generation longer than the collective timeout.

``parallel.distributed_timeout_minutes`` is the timeout of every process group the package or
megatron-core builds; while an engine generates, the ranks with nothing to generate (the other
rank of a rollout-TP group, a rank that drives no server, ranks 1..N of the async mode) wait on
the gloo generation-wait group instead of inside a collective that the timeout (NCCL's watchdog
on a GPU) would end. Two gloo ranks, the key at 0.05 minutes (3 s), generation 4.5 s:

* every group of the world but the generation-wait group times out after exactly 3 s (the key
  reached them: torch's gloo default would be 30 minutes);
* colocated, rollout TP 2: rank 0 leads the engine (a test engine that sleeps, then answers),
  rank 1 serves it; ``Rollout.collect`` returns on both with the engine's responses;
* server mode with one server (the stand-in of ``tests/sglang_standin.py``, answering
  ``/generate`` after 4.5 s): rank 1 drives no server; ``Rollout.collect`` returns on both;
* async mode on that server: rank 1 waits for rank 0's controller; ``Rollout.collect`` (the background driver's)
  returns on both with the same records.
"""

from __future__ import annotations

import time
from datetime import timedelta

from dapo_megatron.platform import spawn
from dapo_megatron.platform.http import http_post
from sglang_standin import StandIn

TIMEOUT_MIN, DELAY_S = 0.05, 4.5  # 3 s collective timeout, generation past it
NUM_PROMPTS, GEN_BATCH, N = 8, 2, 2


def _records():
    from dapo_megatron.data.dataset import PromptRecord

    return [PromptRecord(index=k, data_source="arithmetic", prompt_ids=[5, k + 10], messages=[], ground_truth=str(k),
                         extra_info={"index": k}) for k in range(NUM_PROMPTS)]


def _cfg(mode: str, urls=()):
    from dapo_megatron.config import DAPOConfig

    cfg = DAPOConfig()  # the model is never loaded: the parallel, rollout and buffer sections are read
    cfg.parallel.distributed_timeout_minutes = TIMEOUT_MIN
    b = cfg.buffer
    b.gen_batch_size, b.train_batch_size, b.n, b.filter_groups = GEN_BATCH, GEN_BATCH, N, False
    b.max_num_gen_batches = 1
    cfg.rollout.response_length = b.overlong.max_response_length = 3
    b.overlong.overlong_buffer_len = 1
    cfg.rollout.mode, cfg.rollout.server_urls = mode, list(urls)
    cfg.async_training.enable = mode == "async"
    if mode == "async":
        cfg.rollout.mode = "server"
    return cfg


def _slow_engine():
    from dapo_megatron.rollout.engines.engine import Completion, RolloutEngine

    class SlowEngine(RolloutEngine):
        """Sleeps past the collective timeout, then answers: response j of a prompt ending in t is
        ``[t + 1 + j, 2]`` (2 ends it)."""

        def generate(self, prompt_ids, params, prompt_seeds=None):
            time.sleep(DELAY_S)
            return [[Completion([p[-1] + 1 + j, 2], [-0.5, -0.25], "stop") for j in range(params.n)]
                    for p in prompt_ids]

        def sleep(self, keep_weights=False):
            pass

        def wake_up(self):
            pass

        def _param_specs(self):
            return {}, {}

    return SlowEngine()


def _rollout(cfg, parallel, engine, num_engines, engine_index):
    from dapo_megatron.data.stream import PromptStream
    from dapo_megatron.rewards import RewardPool
    from dapo_megatron.rollout.build import compose_rollout
    from dapo_megatron.rewards.distributed import DistributedGrader
    from dapo_megatron.rollout.sampling.buffer import RolloutBuffer

    records = _records()
    pool = RewardPool(num_workers=1, timeout_s=10)
    pool.wait_ready()

    def decode(ids):
        return " ".join(map(str, ids))

    buffer = RolloutBuffer(cfg.buffer, DistributedGrader(pool, parallel), decode)
    stream = PromptStream(records, GEN_BATCH // parallel.dp_size, parallel.dp_rank, parallel.dp_size, seed=3)
    rollout = compose_rollout(cfg, parallel, engine=engine, num_engines=num_engines, engine_index=engine_index,
                              train_data=records, val_data=None, stream=stream, reward_pool=pool, decode=decode,
                              buffer=buffer, collector=None, prompt_queue=None)
    parallel.wait_for_generation()  # the reward pools started: both ranks enter collect together
    return rollout


def _timeouts(parallel) -> dict:
    """Every process group this process holds → its timeout; the generation-wait group apart."""
    import torch
    import torch.distributed as dist

    out = {}
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is parallel.wait_group:
            continue
        name = dist.distributed_c10d._world.pg_group_ranks.get(pg)
        out[f"{pg.group_desc or 'world'} {sorted(name) if name else ''}"] = pg._get_backend(
            torch.device("cpu")).options._timeout
    return out


def _worker(mode, urls, out_dir):
    import json

    import torch.distributed as dist

    from dapo_megatron.platform import init_distributed
    from dapo_megatron.rollout.engines.engine_group import EngineGroupMember, RolloutGroup
    from dapo_megatron.rollout.engines.server_sync import ServerRollout

    # the world exists before init_distributed with a generous store timeout, so the group
    # creations of a loaded machine cannot time out; init_distributed gives it the key's timeout
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    dist.barrier()
    cfg = _cfg(mode, urls)
    rollout_tp = 2 if mode == "colocated" else 1
    parallel = init_distributed(cfg.parallel, seed=0, rollout_tp=rollout_tp)
    rank = parallel.rank
    result = {"rank": rank, "timeouts": {k: v.total_seconds() for k, v in _timeouts(parallel).items()},
              "wait_timeout": parallel.wait_group._get_backend(__import__("torch").device("cpu")).options._timeout
              .total_seconds()}
    if mode == "colocated":
        if parallel.is_rollout_leader:
            engine, index = _slow_engine(), 0
        else:
            group = RolloutGroup(parallel.rollout_group_ranks, rank, parallel.rollout_group)
            engine, index = EngineGroupMember(group, ({}, {}), transport=None), None
        num_engines = 1
    else:
        engine = ServerRollout(urls, ({}, {}), stage=0, num_stages=1, is_sender=False, device="cpu", timeout_s=30,
                               silence_timeout_s=60, bucket_bytes=2**20, backend="gloo", parallel=parallel,
                               one_driver=mode == "async")
        num_engines, index = engine.num_engines, engine.engine_index
    rollout = _rollout(cfg, parallel, engine, num_engines, index)
    t0 = time.monotonic()
    try:
        batch = rollout.collect(0)
    finally:
        rollout.close()
    result["collect_s"] = time.monotonic() - t0
    result["engine_index"] = index
    result["groups"] = [[g.samples[0].prompt_index, [s.num_response_tokens or len(s.response_ids or [])
                                                    for s in g.samples], [s.finish_reason for s in g.samples]]
                        for g in batch.groups]
    result["held_here"] = [[s.response_ids for s in g.samples] for g in batch.groups
                           if all(s.response_ids is not None for s in g.samples)]
    with open(f"{out_dir}/{mode}_{rank}.json", "w") as f:
        json.dump(result, f)


def _results(tmp_path, mode):
    import json

    return [json.load(open(tmp_path / f"{mode}_{r}.json")) for r in range(2)]


def _check_timeouts(res):
    for r in res:
        assert r["timeouts"], r
        assert {k: t for k, t in r["timeouts"].items() if t != TIMEOUT_MIN * 60} == {}
        assert r["wait_timeout"] >= 86400  # the generation-wait group: days, not the key


def test_colocated_rollout_tp2_outwaits_the_timeout(tmp_path):
    spawn(_worker, 2, "colocated", [], str(tmp_path))
    res = _results(tmp_path, "colocated")
    _check_timeouts(res)
    # the groups megatron-core built are among them (TP, PP, DP, their gloo twins, ...)
    assert any("DATA_PARALLEL_GROUP_GLOO" in k for k in res[0]["timeouts"]), res[0]["timeouts"]
    assert [r["engine_index"] for r in res] == [0, None]
    for r in res:
        assert r["collect_s"] >= DELAY_S
        assert len(r["groups"]) == GEN_BATCH
        # every response: [last prompt token + 1 + j, 2], finished by its stop token
        assert all(lengths == [2] * N and finish == ["stop"] * N for _, lengths, finish in r["groups"]), r["groups"]
    assert res[0]["groups"] == res[1]["groups"]
    assert res[1]["held_here"] == []  # rank 1 generated nothing: records only
    prompts = [pi for pi, _, _ in res[0]["groups"]]
    assert res[0]["held_here"] == [[[pi + 10 + 1 + j, 2] for j in range(N)] for pi in prompts]


def _server_test(tmp_path, mode):
    server = StandIn()
    try:
        http_post(server.url, "/control", {"generate_delay_s": DELAY_S}, 10)
        spawn(_worker, 2, mode, [server.url], str(tmp_path))
    finally:
        server.stop()
    res = _results(tmp_path, mode)
    _check_timeouts([{**r, "timeouts": {k: v for k, v in r["timeouts"].items()}} for r in res])
    for r in res:
        assert r["collect_s"] >= DELAY_S
        assert len(r["groups"]) == GEN_BATCH
        # the stand-in's rows run to max_new_tokens (response_length 3): "length"
        assert all(lengths == [3] * N and finish == ["length"] * N for _, lengths, finish in r["groups"]), r["groups"]
    assert res[0]["groups"] == res[1]["groups"]
    return res


def test_server_mode_rank_without_server_outwaits_the_timeout(tmp_path):
    res = _server_test(tmp_path, "server")
    assert [r["engine_index"] for r in res] == [0, None]


def test_async_mode_ranks_wait_for_rank_0s_controller(tmp_path):
    res = _server_test(tmp_path, "async")
    assert res[1]["held_here"] == []  # the token lists stay on rank 0

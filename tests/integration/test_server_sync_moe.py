"""Server mode at EP = 2 (issue 39 item 6): a tiny random Qwen3-MoE actor (4 experts, TP 1, PP 1,
EP 2 over a DP 2 world of gloo processes) syncs into a real ``dapo-rollout-server`` through
``ServerRollout``, the trainer's server-mode engine, with verification on (period 1: every tensor's
checksum compared with the server's ``/get_weights_by_name`` read-back).

- each EP owner sends its own experts in a weight-update group of its own (``dapo_weights_pp0`` from
  rank 0 with every non-expert tensor and experts 0-1, ``dapo_weights_pp0_ep1`` from rank 1 with
  experts 2-3): the bytes each rank sent are exactly those tensors' bytes, and the server lists both
  groups;
- the server then holds the actor's HF export bitwise (every tensor read back in full) and generates
  what transformers greedy-decodes from the export;
- a bit flipped in one of rank 1's expert tensors after its checksum was taken (the payload the
  server receives differs from what the owner signed) fails that sync on both ranks, naming the
  tensor, the server and the version;
- through the trainer (the factory's senders, the rollout's streams): 2 steps at EP 2 against a
  server that returns routes, every tensor verified at every sync: the actor's recomputed logprobs
  are the server's (it samples with the synced weights) and the actor replays its routes.
  (Asynchronous training takes the same sync, with routing replay: tests/integration/test_async_routes_moe.py.)
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dapo_megatron.platform import spawn
from rollout_server import RolloutServer

BUCKET = 6_000  # bytes: several buckets per owner
PROMPTS = [[5, 17, 33, 8], [100, 3, 41]]


def _config():
    from conftest import tiny_moe_config

    return tiny_moe_config("qwen3_moe", eos_token_id=2)


def _world(url: str, out_dir: str) -> None:
    import torch.distributed as dist

    from conftest import random_hf_model
    from dapo_megatron.bridge import export_hf_state_dict, iter_hf_weights, load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.bridge.receiver import checkpoint_parameters, hf_param_specs
    from dapo_megatron.platform.http import http_get, http_post
    from dapo_megatron.rollout.engines.server_sync import ServerRollout
    from dapo_megatron.bridge.verify import SyncDigest

    parallel = init_distributed(ParallelConfig(1, 1, 2), seed=0)
    rank = dist.get_rank()
    cfg = _config()
    model = build_gpt_model(cfg, ModelConfig(transformer_impl="local"), parallel=parallel)
    # the checkpoint's per-expert names (transformers 5 holds the experts fused)
    load_hf_weights(model, dict(checkpoint_parameters(random_hf_model(cfg, seed=1))), parallel=parallel)
    export = export_hf_state_dict(model, parallel=parallel)
    owner = parallel.expert_owner
    server = ServerRollout([url], hf_param_specs(cfg), stage=0, num_stages=1,
                           is_sender=owner is not None and parallel.etp_rank == 0, expert_turns=2,
                           expert_turn=owner or 0, num_experts=cfg.num_experts, device="cpu", timeout_s=60,
                           silence_timeout_s=60, bucket_bytes=BUCKET, backend="gloo", parallel=parallel)
    result: dict = {"rank": rank, "owner": owner, "group": server.sender.group_name}

    def stream(version, flip=None):
        digest = SyncDigest(version, 1)
        it = iter_hf_weights(model, parallel=parallel, bucket_bytes=BUCKET, pp_broadcast=False, digest=digest,
                             expert_owners=True)

        def planted():
            for name, t in it:
                if name == flip:  # after the owner's checksum, before the transport
                    t.view(torch.int32).view(-1)[0] ^= 1
                yield name, t
                del t
        return (planted() if flip else it), digest

    s, digest = stream(1)
    result["bytes"] = server.sync(s, version=1, digest=digest)
    if rank == 0:
        result["held"] = {n: http_post(url, "/get_weights_by_name", {"name": n, "truncate_size": t.shape[0]}, 30)
                          for n, t in export.items()}
        result["export"] = {n: t.tolist() for n, t in export.items()}
        out = http_post(url, "/generate", {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 6,
                                                                                    "temperature": 0}}, 60)
        result["generated"] = [o["output_ids"] for o in out]
        result["groups"] = list(http_get(url, "/server_info", 10)["internal_states"][0]["weight_update_groups"])
    dist.barrier()
    s, digest = stream(2, flip="model.layers.1.mlp.experts.3.down_proj.weight" if rank == 1 else None)
    try:
        server.sync(s, version=2, digest=digest)
    except RuntimeError as err:
        result["flip_error"] = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


@pytest.fixture(scope="module")
def moe_world(tmp_path_factory):
    from conftest import random_hf_model

    root = tmp_path_factory.mktemp("server_sync_moe")
    random_hf_model(_config(), seed=2).save_pretrained(root / "model")  # other weights than the actor's
    server = RolloutServer(str(root / "model"), root / "server.log", "--skip-tokenizer-init",
                           "--weight-sync-timeout-s", "20")
    try:
        spawn(_world, 2, server.url, str(root))
    finally:
        server.stop()
    return [json.load(open(root / f"rank{r}.json")) for r in range(2)]


def _expert(name: str):
    """The routed expert index of an HF name, None for other tensors."""
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_each_expert_owner_sends_its_experts_in_a_group_of_its_own(moe_world):
    a, b = moe_world
    assert (a["owner"], b["owner"]) == (0, 1)
    assert (a["group"], b["group"]) == ("dapo_weights_pp0", "dapo_weights_pp0_ep1")
    assert {"dapo_weights_pp0", "dapo_weights_pp0_ep1"} <= set(a["groups"])
    export = {n: torch.tensor(v) for n, v in a["export"].items()}
    nbytes = {r: sum(t.numel() * t.element_size() for n, t in export.items()
                     if (e := _expert(n)) is not None and e // 2 == r or (e is None and r == 0)) for r in (0, 1)}
    assert (a["bytes"], b["bytes"]) == (nbytes[0], nbytes[1]) and nbytes[1] > 0


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_the_server_holds_the_export_bitwise_and_generates_with_it(moe_world):
    from transformers import AutoModelForCausalLM

    from dapo_megatron.bridge.receiver import checkpoint_parameters

    a = moe_world[0]
    export = {n: torch.tensor(v) for n, v in a["export"].items()}
    for name, t in export.items():
        assert torch.equal(torch.tensor(a["held"][name], dtype=t.dtype).view(t.shape), t), name
    model = AutoModelForCausalLM.from_config(_config()).float().eval()
    with torch.no_grad():  # by checkpoint name (views into transformers' fused expert parameters)
        for name, t in checkpoint_parameters(model):
            t.copy_(export[name])
    for prompt, got in zip(PROMPTS, a["generated"]):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                if ids[-1] == 2:
                    break
        assert got == ids[len(prompt):], (prompt, got, ids[len(prompt):])


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_bit_flipped_in_an_owners_expert_fails_the_sync_naming_it(moe_world):
    for res in moe_world:
        err = res.get("flip_error")
        assert err is not None, res["rank"]
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in err and "version 2" in err, err
        assert "SGLang server http://127.0.0.1:" in err, err


# ------------------------------------------------------------------ through the trainer (the factory's senders)
TRAIN = [
    "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
    "buffer.train_batch_size=2", "buffer.n=2", "buffer.gen_batch_size=4", "buffer.max_num_gen_batches=4",
    "buffer.on_cap=train_on_kept", "buffer.filter_metric=reward",
    "actor.ppo_mini_batch_size=1", "actor.ppo_max_token_len_per_gpu=512", "actor.optim.lr=1e-3",
    "actor.optim.lr_warmup_steps=0", "actor.routing_replay=rollout",
    "rollout.response_length=8", "buffer.overlong.max_response_length=8", "buffer.overlong.overlong_buffer_len=4",
    "rollout.name=sglang", "rollout.mode=server", "rollout.server_timeout_s=60",
    "rollout.check_weight_update=true", "rollout.check_weight_update_period=1",
    "data.arithmetic.num_train_problems=16", "data.arithmetic.num_val_problems=2", "model.params_dtype=float32",
    "model.transformer_impl=local", "reward.num_workers=1", "tracking.use_mlflow=false",
    "parallel.expert_model_parallel_size=2",
]


def _train_worker(hf_dir, url, run_dir, out):
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.trainer import DAPOTrainer

    cfg = load_config(DAPOConfig, None, TRAIN + [f"model.hf_path={hf_dir}", f"trainer.default_local_dir={run_dir}",
                                                 f"rollout.server_urls=[{url}]"])
    trainer = DAPOTrainer(cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))
    rows = []
    try:
        for _ in range(cfg.trainer.total_training_steps):
            rows.append({k: v for k, v in trainer.train_step().items() if isinstance(v, (int, float))})
    finally:
        trainer.rollout.close()
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_trainer_at_ep2_in_server_mode_syncs_verified_and_replays_the_servers_routes(smollm2_gguf, tmp_path):
    """dapo-train's path (the factory picks the senders, the rollout streams each owner's experts):
    2 steps of a tiny Qwen3-MoE (SmolLM2's tokenizer) at EP 2 against a dapo-rollout-server that
    returns routes, every tensor verified at every sync (period 1): the servers sample with the
    actor's weights (the actor's recomputed logprobs are theirs), the actor replays their routes."""
    import math

    from transformers import AutoTokenizer

    from conftest import random_hf_model, smollm2_tokenizer_dir, tiny_moe_config
    from integration.test_trainer_parallel_parity import LOGPROB_GAP_MAX

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(smollm2_gguf))
    # a random model never stops: a third of the ids stop it, so responses vary in length
    cfg = tiny_moe_config("qwen3_moe", vocab_size=len(tok), max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                          eos_token_id=[tok.eos_token_id] + list(range(1000, 1000 + 16383)))
    hf_dir = tmp_path / "model"
    random_hf_model(cfg, seed=0).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    server = RolloutServer(str(hf_dir), tmp_path / "server.log", "--skip-tokenizer-init",
                           "--enable-return-routed-experts")
    try:
        spawn(_train_worker, 2, str(hf_dir), server.url, str(tmp_path / "run"), str(tmp_path / "metrics.json"))
    finally:
        server.stop()
    rows = json.load(open(tmp_path / "metrics.json"))
    assert len(rows) == 2
    for step, row in enumerate(rows, 1):
        assert all(math.isfinite(v) for v in row.values()), (step, row)
        assert row["rollout/logprob_diff_max"] <= LOGPROB_GAP_MAX, (step, row["rollout/logprob_diff_max"])
        assert row["moe/route_agreement"] >= 0.98 and row["perf/sync_GBps"] > 0, (step, row)

"""Routing replay under asynchronous training (issue 37 item 5; issue 39's acceptance "an async run
of the CPU MoE model at EP = 2 against a dapo-rollout-server, routes replayed, weights verified every
sync").

A tiny random Qwen3-MoE (SmolLM2's tokenizer, routers far from ties) trains 2 steps at EP 2 (2 gloo
processes) with ``async_training.enable``, η = ``buffer.max_staleness`` = 1, partial rollouts, a sync
every step, every tensor verified at every sync (``rollout.check_weight_update_period=1``), against
one ``dapo-rollout-server`` launched with ``--enable-return-routed-experts``. As in
test_async_partial, each generation batch after the first waits until a sync starts, and the sync
0.15 s longer (the server decodes a step per 5 ms at least: a row takes longer than that), so the
sync's ``/pause_generation`` aborts rows mid-decode and they continue on the
new weights (asking for their routes from where their sample's end: ``routed_experts_start_len``).
The learning rate is real, so the versions' routes differ.

Checked, independently of the rollout: every trained sample's routes (what ``send_tokens`` carries
to the actor) equal, position by position, the top-k of a full-sequence transformers forward of the
weights that sampled the next token (the actor's HF export at each sync; version 0 the checkpoint),
including the continued rows; the replay ran (``moe/*`` metrics), every sync was verified, and
validation (the same row client, routes asked for) runs.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from dapo_megatron.platform import spawn
from rollout_server import RolloutServer

STEPS, LENGTH = 2, 64
CONFIG = [
    f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "trainer.save_freq=-1", "buffer.train_batch_size=2", "buffer.n=2", "buffer.gen_batch_size=2",
    "buffer.max_num_gen_batches=1", "buffer.on_cap=train_on_kept", "buffer.filter_groups=false",
    "buffer.max_staleness=1", "async_training.enable=true", "rollout.partial_rollout=true",
    "actor.ppo_mini_batch_size=1", "actor.ppo_max_token_len_per_gpu=1024", "actor.optim.lr=1e-2",
    "actor.optim.lr_warmup_steps=0", "actor.routing_replay=rollout",
    f"rollout.response_length={LENGTH}", f"buffer.overlong.max_response_length={LENGTH}",
    "buffer.overlong.overlong_buffer_len=16",
    "rollout.name=sglang", "rollout.mode=server", "rollout.server_timeout_s=60",
    "rollout.check_weight_update=true", "rollout.check_weight_update_period=1",
    "data.arithmetic.num_train_problems=16", "data.arithmetic.num_val_problems=2", "model.params_dtype=float32",
    "model.transformer_impl=local", "reward.num_workers=1", "tracking.use_mlflow=false",
    "parallel.expert_model_parallel_size=2",
]


def _worker(hf_dir, url, run_dir, out_path):
    import torch.distributed as dist

    from dapo_megatron.bridge import export_hf_state_dict
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.trainer import DAPOTrainer

    cfg = load_config(DAPOConfig, None, CONFIG + [f"model.hf_path={hf_dir}", f"trainer.default_local_dir={run_dir}",
                                                  f"rollout.server_urls=[{url}]"])
    trainer = DAPOTrainer(cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))
    rank = dist.get_rank()
    rollout, ctrl, collected, weights = trainer.rollout, trainer.rollout.controller, {}, {}
    real_sync, real_collect, real_digest = rollout.sync_weights, rollout.collect, rollout.new_digest
    digests = []

    def new_digest(version):  # every sync's verification record, to count what it checked
        digests.append(real_digest(version))
        return digests[-1]
    go, state = threading.Event(), {"calls": 0, "aborted": False}
    if ctrl is not None:  # rank 0: a generation batch after the first waits for the next sync to start
        real_generate = ctrl._generate

        def generate(rows, version):
            if state["calls"] and not state["aborted"]:
                assert go.wait(120), "no weight sync came"
                go.clear()
            state["calls"] += 1
            res = real_generate(rows, version)
            state["aborted"] = any(isinstance(r, tuple) and r[2] == "abort" for r in res)
            return res
        ctrl._generate = generate

    def sync_weights(actor, version):
        if rollout.background.started and ctrl is not None:
            go.set()
            time.sleep(0.15)  # the /generate reaches the server and decodes
        nbytes = real_sync(actor, version)
        export = export_hf_state_dict(actor.model_chunks, parallel=trainer.parallel)  # collective: the weights sent
        if rank == 0:
            weights[version] = export
        return nbytes

    def collect(step):
        batch = real_collect(step)
        collected["groups"] = batch.groups
        return batch

    rollout.sync_weights, rollout.collect, rollout.new_digest = sync_weights, collect, new_digest
    steps = {}
    try:
        while trainer.step < STEPS:
            metrics = trainer.train_step()
            steps[trainer.step] = {"metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                                   "samples": [] if rank else [  # rank 0 holds every sample's tokens and routes
                                       (list(s.prompt_ids), list(s.response_ids), s.token_versions(),
                                        None if s.routes is None else s.routes.clone())
                                       for g in collected["groups"] for s in g.samples]}
        if ctrl is not None:  # the harness lets go: no sync will come for the batch generated ahead
            ctrl._generate = real_generate
            go.set()
        val = trainer.validate()  # validation rows go through the same row client, routes asked for too
    finally:
        rollout.close()
    checked = [None] * dist.get_world_size()  # per rank: (version, tensors checksummed, tensors sent) per sync
    dist.all_gather_object(checked, [(d.version, len(d.sums), len(d.sent)) for d in digests if d is not None])
    if rank == 0:
        torch.save({"steps": steps, "weights": weights, "checked": checked, "val": val}, out_path)


@pytest.fixture(scope="module")
def run(smollm2_gguf, tmp_path_factory):
    from transformers import AutoTokenizer

    from conftest import random_hf_model, smollm2_tokenizer_dir, tiny_moe_config
    from conftest import hf_router_modules

    root = tmp_path_factory.mktemp("async_routes_moe")
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(smollm2_gguf))
    cfg = tiny_moe_config("qwen3_moe", vocab_size=len(tok), max_position_embeddings=512,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = random_hf_model(cfg, seed=0)
    with torch.no_grad():  # routers far from ties: the engine's batched decode and a full forward agree
        for g in hf_router_modules(model):
            g.weight.normal_(0.0, 0.5)
    hf_dir = root / "model"
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    # 5 ms per decode step: a row of LENGTH tokens decodes >= 0.32 s, so the sync's pause (0.15 s after
    # the /generate) always finds it decoding
    server = RolloutServer(str(hf_dir), root / "server.log", "--skip-tokenizer-init", "--enable-return-routed-experts",
                           "--step-delay-s", "0.005")
    try:
        spawn(_worker, 2, str(hf_dir), server.url, str(root / "run"), str(root / "out.pt"))
    finally:
        server.stop()
    out = torch.load(root / "out.pt", weights_only=False)
    out["checkpoint"] = str(hf_dir)
    return out


def _models(out):
    """The HF model of every weight version: 0 the checkpoint, ``v`` the actor's export at sync ``v``."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.bridge.receiver import checkpoint_parameters

    first = AutoModelForCausalLM.from_pretrained(out["checkpoint"], dtype=torch.float32).eval()
    models = {0: first}
    for v, export in out["weights"].items():
        if v == 0:
            continue
        m = AutoModelForCausalLM.from_config(first.config).float().eval()
        with torch.no_grad():  # by checkpoint name (views into transformers' fused expert parameters)
            for name, t in checkpoint_parameters(m):
                t.copy_(export[name])
        models[v] = m
    return models


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_async_routes_at_ep2_equal_the_sampling_versions_token_for_token(run):
    models = _models(run)
    k = models[0].config.num_experts_per_tok
    continued = discriminating = 0
    for step, st in run["steps"].items():
        for prompt, response, per_token, routes in st["samples"]:
            ids, P = prompt + response, len(prompt)
            assert routes is not None and tuple(routes.shape) == (len(ids) - 1, 2, k), step
            full = {}
            for v in sorted(set(per_token)):
                with torch.no_grad():
                    logits = models[v](torch.tensor([ids]), output_router_logits=True).router_logits
                full[v] = torch.stack([torch.topk(torch.softmax(lg.float(), -1), k, -1).indices for lg in logits], 1)
            want = torch.stack([full[per_token[max(0, t + 1 - P)]][t] for t in range(len(ids) - 1)])
            wrong = (routes.long() != want).flatten(1).any(1).nonzero().flatten().tolist()
            assert not wrong, f"step {step}: positions {wrong[:8]} of {len(ids) - 1} (prompt {P}, versions {per_token[0]}..{per_token[-1]}) routed otherwise"
            if len(set(per_token)) > 1:
                continued += 1
                discriminating += not torch.equal(full[per_token[-1]][:len(ids) - 1], want)
    assert continued >= 2, "no sync landed on a row"
    assert discriminating >= 1, "the versions' routes never differ: the test could not tell them apart"


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_async_run_at_ep2_replays_routes_and_verifies_every_sync(run):
    for step, st in run["steps"].items():
        m = st["metrics"]
        assert "moe/route_agreement" in m, (step, sorted(m))
        assert m["train/staleness_max"] <= 1, (step, m["train/staleness_max"])
    assert run["val"] and all(v == v for v in run["val"].values()), run["val"]  # validation ran with routes on
    synced = sorted(run["weights"])
    assert synced[-STEPS:] == list(range(1, STEPS + 1)), synced
    for rank, records in enumerate(run["checked"]):  # every sync checksummed every tensor each owner sent
        assert [v for v, _, _ in records] == synced, (rank, records)
        assert all(n_sums == n_sent > 0 for _, n_sums, n_sent in records), (rank, records)

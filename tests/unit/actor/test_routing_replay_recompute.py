"""Routing replay under full activation recompute (issue 36, item 5), fp32, CPU, PP 2.

``recompute_granularity: full`` runs each layer's first forward without grad and runs it again
in the backward (megatron-core ``tensor_parallel.checkpoint``); with 1F1B the backward of a
micro-batch comes after the forwards of later ones. The replayed routes must be that
micro-batch's in the recomputed forward too (megatron-core's ``REPLAY_BACKWARD`` queue,
``moe/router_replay.py``). One 2-process gloo world (PP 2, three micro-batches so that the
stages interleave) runs the same step with and without recompute, routes random (far from
the routers' own choices): logprobs, every gradient, the loss and the balancing-loss metric
must be those of the run without recompute, and the routing metrics count each router call
once (not again in the recomputed forward).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import hf_checkpoint_state, random_hf_model, tiny_moe_config
from dapo_megatron.platform import ParallelConfig, spawn

L, K, E = 4, 2, 4
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _samples():
    from dapo_megatron.rollout.engines.routes import num_route_tokens
    from dapo_megatron.rollout.types import Sample

    g = torch.Generator().manual_seed(11)
    out = []
    for p, r in ((4, 6), (3, 2), (5, 4), (2, 7), (6, 3), (3, 5)):
        n = num_route_tokens(p, r)
        routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * L)]).view(n, L, K)
        out.append(Sample(prompt_ids=torch.randint(1, 250, (p,), generator=g).tolist(),
                          response_ids=torch.randint(1, 250, (r,), generator=g).tolist(),
                          rollout_logprobs=[-1.0] * r, finish_reason="stop", routes=routes.to(torch.uint8)))
    return out


def _worker(out_path: str, cfg, state) -> None:
    import torch.distributed as dist

    from dapo_megatron.actor import ActorConfig, MegatronActor
    from dapo_megatron.bridge import load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import init_distributed

    torch.use_deterministic_algorithms(True)
    par = init_distributed(ParallelConfig(1, 2), seed=0)  # PP 2: two layers per stage
    res = {}
    for name, extra in (("plain", {}), ("recompute", RECOMPUTE)):
        model = build_gpt_model(cfg, ModelConfig(extra_transformer_config=dict(extra)), parallel=par,
                                routing_replay=True)
        load_hf_weights(model, state, parallel=par)
        acfg = ActorConfig(ppo_mini_batch_size=1, ppo_max_token_len_per_gpu=256, micro_batch_layout="thd",
                           shared_prompt="off", routing_replay="rollout")
        actor = MegatronActor(model, acfg, total_steps=4, vocab_size=cfg.vocab_size, parallel=par)
        samples = _samples()
        mbs = [samples[:2], samples[2:4], samples[4:]]
        lp = actor.compute_logprobs(mbs)
        g = torch.Generator().manual_seed(2)
        for s, x in zip(samples, lp):
            s.old_logprobs = (x + 0.1 * torch.randn(x.shape, generator=g)).tolist()
            s.advantage = float(torch.randn((), generator=g))
        out = actor.forward_backward(mbs, return_logprobs=True)
        grads = {n: p.main_grad.detach().clone() for n, p in actor.model_chunks[0].module.named_parameters()}
        queued = [len(r.router_replay.replay_backward_list) for r in actor.routing.routers]
        res[name] = {"lp": lp, "train_lp": out.logprobs, "metrics": out.metrics, "grads": grads,
                     "routing": actor.pop_routing_metrics(), "queued": queued,
                     "recompute": actor.config.recompute_granularity}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if dist.get_rank() == 0:
        torch.save(gathered, out_path)


@pytest.mark.dist
def test_replay_under_full_recompute_equals_replay_without(tmp_path):
    cfg = tiny_moe_config("qwen3_moe", num_hidden_layers=L, router_aux_loss_coef=0.01)
    model = random_hf_model(cfg, seed=5)
    state = hf_checkpoint_state(model, tmp_path / "hf")
    spawn(_worker, 2, str(tmp_path / "out.pt"), cfg, state)
    ranks = torch.load(tmp_path / "out.pt", weights_only=False)
    for rank, res in enumerate(ranks):
        plain, rec = res["plain"], res["recompute"]
        assert plain["recompute"] is None and rec["recompute"] == "full"
        for a, b in zip(rec["lp"], plain["lp"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for a, b in zip(rec["train_lp"], plain["train_lp"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert set(rec["grads"]) == set(plain["grads"])
        for n, g in plain["grads"].items():
            assert float(g.abs().max()) > 0, n  # every parameter of the stage gets a gradient
            torch.testing.assert_close(rec["grads"][n], g, rtol=1e-5, atol=1e-8, msg=f"rank {rank} {n}")
        for key in ("loss", "pg_loss", "num_tokens", "moe/load_balancing_loss"):
            assert rec["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-6), key
        assert rec["routing"] == pytest.approx(plain["routing"], rel=1e-9)  # each call counted once
        assert rec["queued"] == [0, 0] and plain["queued"] == [0, 0]  # every queued route replayed

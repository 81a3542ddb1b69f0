"""Routing replay (R3) for DeepSeek-V3 and GLM-4.5: a sigmoid router whose choice adds the
score-correction bias and is limited to ``topk_group`` of ``n_group`` groups, behind a dense first
layer (tests/conftest.py ``tiny_mla_config``, ``tiny_glm_config``), each check run for both
families (the replay of both in ONE spawned world).

- HFEngine's recorded routes equal an independent full-sequence computation of DeepSeek-V3's
  routing (sigmoid + bias, top-2 sum per group, top group, top-k in it) for every MoE layer, and
  are 0 for the dense layer; without the bias (or without the group limit) some routes differ,
  so both are really in what the engine records;
- at EP=2 with replay on (the actor's routers perturbed), the actor's routers use the engine's
  experts for every routed token, old-logprob and training forwards alike, and its logprobs are
  transformers' with its routers forced to those experts (weights: the chosen sigmoid scores,
  renormalised, times ``routed_scaling_factor``).

DeepSeek-V2 (``tiny_v2_config``: V2-Lite's softmax router, greedy top-2 never renormalised; and
``V2_GROUPED``: ``group_limited_greedy``, a group ranked by its best softmax score) runs the same
checks in the same world: the engine's routes are the softmax routing written out here (no bias;
the group limit changes some routes of the grouped config only), and replay at EP=2 uses them
token for token with transformers' forced logprobs (weights: the softmax over all experts at the
replayed experts, not renormalised, times ``routed_scaling_factor``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from conftest import V2_GROUPED, hf_checkpoint_state, random_hf_model, tiny_glm_config, tiny_mla_config, tiny_v2_config
from dapo_megatron.platform import ParallelConfig, spawn
from unit.actor.test_routing_replay import _full_routes, _logprobs_with_hooks, _my_samples, _samples


def _is_v2(cfg) -> bool:
    return cfg.model_type == "deepseek_v2"


def _deepseek_routes(model, ids: list[int], *, bias: bool = True, groups: bool = True) -> torch.Tensor:
    """Int64 ``[T, L, K]`` routes of one full sequence, computed here from the routers' logits
    (transformers' ``router_logits`` per MoE layer; DeepSeek-V3 routing written out: sigmoid,
    + bias for the choice, groups ranked by their top-2 sum, the top ``topk_group`` groups kept,
    top-k of those; DeepSeek-V2's: softmax, no bias, with ``group_limited_greedy`` groups ranked by
    their best score); dense layers 0."""
    from dapo_megatron.rollout.engines.routes import hf_routers_by_layer

    cfg = model.config
    k, E, G, TG = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.n_group, cfg.topk_group
    logits = {}
    gates = hf_routers_by_layer(model)
    handles = [g.register_forward_hook(lambda m, a, o, i=i: logits.__setitem__(i, o[0].detach()))
               for i, g in enumerate(gates) if g is not None]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    out = torch.zeros(len(ids), len(gates), k, dtype=torch.long)
    for i, g in enumerate(gates):
        if g is None:
            continue
        if _is_v2(cfg):
            s = torch.softmax(logits[i].float(), dim=-1)
            rank = s.view(-1, G, E // G).max(dim=-1).values
            groups = groups and cfg.topk_method == "group_limited_greedy"
        else:
            s = torch.sigmoid(logits[i].float()) + (g.e_score_correction_bias.float() if bias else 0.0)
            rank = s.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
        if groups and TG < G:
            keep = torch.zeros_like(rank).scatter_(1, rank.topk(TG, dim=-1).indices, 1.0)
            s = s.masked_fill(keep.repeat_interleave(E // G, dim=1) == 0, float("-inf"))
        out[:, i] = s.topk(k, dim=-1).indices.sort(-1).values
    return out


def _forced_logprobs(model, ids: list[int], prompt_len: int, forced: torch.Tensor) -> torch.Tensor:
    """Response logprobs with every MoE router forced to ``forced`` ([T, L, K]): weights the
    sigmoid scores at those experts, renormalised, times ``routed_scaling_factor`` (DeepSeek-V2: the
    softmax over all experts at those experts, not renormalised, times the factor), what
    megatron-core's REPLAY_FORWARD computes for this router."""
    from dapo_megatron.rollout.engines.routes import hf_routers_by_layer

    scale = model.config.routed_scaling_factor
    v2 = _is_v2(model.config)

    def hook_for(layer):
        def hook(mod, args, out):
            idx = forced[:, layer].long()
            if v2:
                w = torch.softmax(out[0].float(), dim=-1).gather(1, idx)
            else:
                w = torch.sigmoid(out[0].float()).gather(1, idx)
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            return out[0], (w * scale).to(out[1].dtype), idx
        return hook

    handles = [g.register_forward_hook(hook_for(i)) for i, g in enumerate(hf_routers_by_layer(model)) if g is not None]
    return _logprobs_with_hooks(model, ids, prompt_len, handles)


FAMILIES = {"v3": tiny_mla_config, "glm": tiny_glm_config, "v2": tiny_v2_config,
            "v2_grouped": lambda: tiny_v2_config(**V2_GROUPED)}


def _worker(out_dir: str, cases: dict) -> None:
    from dapo_megatron.platform import init_distributed

    rank = int(os.environ["RANK"])
    par = init_distributed(ParallelConfig(1, 1, 2), seed=3)
    out = {name: _replay(par, rank, *case) for name, case in cases.items()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _replay(par, rank: int, cfg, state, samples) -> dict:
    """One family's replay at EP=2: old-logprob and training forwards with the engine's routes."""
    from dapo_megatron.actor import ActorConfig, MegatronActor
    from dapo_megatron.actor.routing_replay import micro_batch_routes
    from dapo_megatron.bridge import load_hf_weights
    from dapo_megatron.models import build_gpt_model

    mine = _my_samples(samples, rank, 2)
    mbs_in = [mine[:len(mine) // 2], mine[len(mine) // 2:]]
    model = build_gpt_model(cfg, parallel=par, routing_replay=True)
    load_hf_weights(model, state, parallel=par)
    acfg = ActorConfig(ppo_mini_batch_size=1, ppo_max_token_len_per_gpu=256, micro_batch_layout="thd",
                       shared_prompt="auto", routing_replay="rollout")
    acfg.optim.lr, acfg.optim.weight_decay = 1e-3, 0.0
    actor = MegatronActor(model, acfg, total_steps=4, vocab_size=cfg.vocab_size, parallel=par)
    actor.routing.keep = True
    mbs, _ = actor._make_micro_batches(mbs_in)
    engine_mb = [micro_batch_routes(mb, num_layers=cfg.num_hidden_layers, topk=cfg.num_experts_per_tok,
                                    num_experts=cfg.n_routed_experts) for mb in mbs]
    lp = actor.compute_logprobs(mbs_in)
    old_records, actor.routing.records = actor.routing.records, []
    for s, x in zip(mine, lp):
        s.old_logprobs, s.advantage = x.tolist(), 1.0
    trained = actor.train_mini_batch(mbs_in, return_logprobs=True)
    return {"lp": lp, "train_lp": trained.logprobs, "skipped": trained.metrics["skipped"], "old": old_records,
            "train": actor.routing.records, "engine_mb": engine_mb}


@pytest.fixture(scope="module")
def mla_engines():
    from dapo_megatron.rollout.engines.hf_engine import HFEngine

    out = {}
    for name, make in FAMILIES.items():
        model = random_hf_model(make(), seed=11)
        out[name] = model, _samples(HFEngine(model, eos_token_ids=[0], record_routes=True), seed=2)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_engine_routes_are_deepseek_routing_with_bias_and_groups(mla_engines, family):
    model, samples = mla_engines[family]
    cfg = model.config
    k, L = cfg.num_experts_per_tok, cfg.num_hidden_layers
    no_bias = no_groups = 0
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        assert tuple(s.routes.shape) == (len(ids) - 1, L, k)
        got = s.routes.long().sort(-1).values
        assert torch.equal(got, _deepseek_routes(model, ids)[:len(ids) - 1]), s.prompt_ids
        assert not got[:, 0].any()  # the dense layer: no routes
        no_bias += int((got != _deepseek_routes(model, ids, bias=False)[:len(ids) - 1]).any(-1).sum())
        no_groups += int((got != _deepseek_routes(model, ids, groups=False)[:len(ids) - 1]).any(-1).sum())
    # DeepSeek-V2 has no bias, and V2-Lite's greedy top-k no group limit
    has_bias, has_groups = not _is_v2(cfg), cfg.n_group > cfg.topk_group
    assert (no_bias > 0) == has_bias and (no_groups > 0) == has_groups, (no_bias, no_groups)


@pytest.fixture(scope="module")
def replay_results(tmp_path_factory, mla_engines):
    from conftest import hf_router_modules

    out = tmp_path_factory.mktemp("routing_replay_mla")
    cases, actors = {}, {}
    for name, (engine_model, samples) in mla_engines.items():
        actor_model = copy.deepcopy(engine_model)  # routers nudged: some tokens would route elsewhere
        g = torch.Generator().manual_seed(101)
        with torch.no_grad():
            for gate in hf_router_modules(actor_model):
                gate.weight.add_(0.3 * torch.randn(gate.weight.shape, generator=g))
        cases[name] = (engine_model.config, hf_checkpoint_state(actor_model, out / name), samples)
        actors[name] = actor_model, samples
    spawn(_worker, 2, str(out), cases)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {name: ([res[name] for res in ranks], *actors[name]) for name in cases}


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_replay_at_ep2_routes_every_token_as_the_engine_and_gives_its_logprobs(replay_results, family):
    ranks, actor_model, samples = replay_results[family]
    cfg = actor_model.config
    moe_layers = [layer for layer in range(cfg.num_hidden_layers) if layer >= cfg.first_k_dense_replace]
    natural_differs = 0
    for rank, res in enumerate(ranks):
        for records in (res["old"], res["train"]):
            assert len(records) == len(res["engine_mb"]) * len(moe_layers)
            for j, rec in enumerate(records):
                routes, routed = res["engine_mb"][j // len(moe_layers)]
                assert rec["layer"] == moe_layers[j % len(moe_layers)]
                eng = routes[:, rec["layer"]][routed].sort(-1).values
                assert torch.equal(rec["used"][routed], eng), (rank, j)
        for s, lp, tlp in zip(_my_samples(samples, rank, 2), res["lp"], res["train_lp"]):
            ids = s.prompt_ids + s.response_ids
            forced = _full_routes(s, cfg.num_experts_per_tok)
            want = _forced_logprobs(actor_model, ids, len(s.prompt_ids), forced)
            assert (lp - want).abs().max().item() <= 1e-5
            assert (tlp - want).abs().max().item() <= 1e-5
            own = _deepseek_routes(actor_model, ids)[:len(ids) - 1]
            natural_differs += int((own != s.routes.long().sort(-1).values).any(-1).sum())
        assert res["skipped"] == 0.0
    assert natural_differs > 0  # the perturbed routers alone would have routed some tokens elsewhere

"""The MoE balancing loss and z-loss in the actor's gradient (issue 36, item 2), fp32, CPU.

With every advantage 0 the DAPO loss has no gradient, so the routers' gradient is that of their
auxiliary losses alone. It must be (docs/design.md §3.4, ``actor/moe_loss.py``)

    ∇ Σ_g (n_g / N) · Σ_l (α · aux_{g,l} + β · z_{g,l})

over the micro-batches ``g`` the actor ran on all DP ranks (``n_g`` their rows, ``N`` the sum),
whatever the cut: one micro-batch, four, an uneven 1 + 3, and DP 2 (two gloo processes, one
world for all its cases). The reference is computed here from transformers' own router logits of
the same weights (``output_router_logits``), the Switch loss and z-loss written out; the metrics
``moe/load_balancing_loss`` and ``moe/z_loss`` are the same weighted means without α, β.
Before the fix the gradient was ``Σ_g ∇ aux_g``: 4× at four micro-batches, 2× at DP 2.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import hf_checkpoint_state, random_hf_model, tiny_moe_config
from dapo_megatron.platform import ParallelConfig, spawn

ALPHA, BETA = 0.1, 0.01
P, R = 4, 6  # every sample 10 tokens: no padding in the BSHD rows
# the cuts, in global sample indices; DP 2: rank r holds samples 2r, 2r+1
CUTS = {1: {"one": [[0, 1, 2, 3]], "four": [[0], [1], [2], [3]], "uneven": [[0], [1, 2, 3]]},
        2: {"dp_one": [[0, 1]], "dp_two": [[0], [1]]}}


def _samples():
    from dapo_megatron.rollout.types import Sample

    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(4):
        out.append(Sample(prompt_ids=torch.randint(1, 250, (P,), generator=g).tolist(),
                          response_ids=torch.randint(1, 250, (R,), generator=g).tolist(),
                          rollout_logprobs=[-1.0] * R, finish_reason="stop"))
    return out


def _hf():
    from conftest import hf_router_modules

    cfg = tiny_moe_config("qwen3_moe", router_aux_loss_coef=ALPHA)
    model = random_hf_model(cfg, seed=21)
    with torch.no_grad():  # routers with real preferences (the default init is nearly uniform)
        for gate in hf_router_modules(model):
            gate.weight.normal_(0.0, 0.5)
    return cfg, model


def _worker(out_dir: str, cfg, state) -> None:
    import torch.distributed as dist

    from dapo_megatron.actor import ActorConfig, MegatronActor
    from dapo_megatron.bridge import load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import init_distributed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    par = init_distributed(ParallelConfig(1, 1), seed=0)  # DP = world
    model = build_gpt_model(cfg, ModelConfig(extra_transformer_config={"moe_z_loss_coeff": BETA}), parallel=par)
    load_hf_weights(model, state, parallel=par)
    acfg = ActorConfig(ppo_mini_batch_size=1, ppo_max_token_len_per_gpu=256, micro_batch_layout="bshd",
                       shared_prompt="off")
    actor = MegatronActor(model, acfg, total_steps=4, vocab_size=cfg.vocab_size, parallel=par)
    samples = _samples()
    for s in samples:
        s.old_logprobs, s.advantage = [-1.0] * R, 0.0
    res = {}
    for name, cut in CUTS[world].items():
        mbs = [[samples[2 * rank + i if world == 2 else i] for i in mb] for mb in cut]
        run, _ = actor._make_micro_batches(mbs)
        metrics = actor.forward_backward(mbs).metrics
        grads = {}
        for n, p in actor.model_chunks[0].module.named_parameters():
            if n.endswith("mlp.router.weight"):
                g = p.main_grad.detach().clone()
                if world > 1:  # the distributed optimizer's reduce-scatter: every rank its shard, gather them
                    g = _gathered(actor, p)
                grads[int(n.split(".")[2])] = g
        groups = [[samples.index(s) for s in mb.samples] for mb in run]
        all_groups = [None] * world
        dist.all_gather_object(all_groups, groups)
        res[name] = {"metrics": metrics, "grads": grads, "groups": [g for r in all_groups for g in r]}
    if world == 1:
        late = build_gpt_model(cfg, ModelConfig(extra_transformer_config={"calculate_per_token_loss": False}),
                               parallel=par)
        try:
            MegatronActor(late, acfg, total_steps=4, vocab_size=cfg.vocab_size, parallel=par)
            res["refused"] = ""
        except ValueError as e:
            res["refused"] = str(e)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _gathered(actor, param):
    """The DP-reduced gradient of ``param`` (the reduce-scatter leaves each rank its shard)."""
    import torch.distributed as dist

    group = actor.parallel.dp_group
    dp = dist.get_world_size(group)
    ddp = actor.model_chunks[0]
    for buf in ddp.buffers:
        for bucket in buf.buckets:
            g = bucket.grad_data
            shards = list(g.view(dp, -1).clone().unbind(0))
            dist.all_gather(shards, shards[dist.get_rank(group)].clone(), group=group)
            g.copy_(torch.cat(shards))
    return param.main_grad.detach().clone()


def _reference(model, groups):
    """Router gradients and metrics of ``Σ_g (n_g/N) Σ_l (α aux + β z)`` from transformers' router
    logits: per micro-batch ``g`` (its samples as one [B, T] batch) and layer, the Switch loss
    ``E Σ_e f_e P_e`` (``f_e`` the share of the top-k choices of the softmax, ``P_e`` its mean) and
    the z-loss ``mean(logsumexp(logits)²)``."""
    from conftest import hf_router_modules

    samples = _samples()
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    model.zero_grad()
    total = sum(len(g) * (P + R) for g in groups)
    loss, aux_m, z_m = 0.0, 0.0, 0.0
    for g in groups:
        ids = torch.tensor([samples[i].prompt_ids + samples[i].response_ids for i in g])
        logits = model(ids, output_router_logits=True).router_logits
        w = ids.numel() / total
        L = len(logits)
        for lg in logits:
            lg = lg.float().reshape(-1, E)
            probs = torch.softmax(lg, -1)
            f = torch.zeros(E).index_add_(0, torch.topk(probs, k, -1).indices.reshape(-1),
                                          torch.ones(lg.shape[0] * k)) / (lg.shape[0] * k)
            aux = E * (f * probs.mean(0)).sum()
            z = torch.logsumexp(lg, -1).square().mean()
            loss = loss + w * (ALPHA * aux + BETA * z)
            aux_m += w * float(aux) / L
            z_m += w * float(z) / L
    loss.backward()
    grads = {i: gate.weight.grad.detach().clone() for i, gate in enumerate(hf_router_modules(model))}
    return grads, {"moe/load_balancing_loss": aux_m, "moe/z_loss": z_m}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_aux")
    cfg, model = _hf()
    state = hf_checkpoint_state(model, out / "hf")
    res = {}
    for world in (1, 2):
        d = out / f"dp{world}"
        d.mkdir()
        spawn(_worker, world, str(d), cfg, state)
        res[world] = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return model, res


CASES = [(1, n) for n in CUTS[1]] + [(2, n) for n in CUTS[2]]


@pytest.mark.dist
@pytest.mark.parametrize("world,name", CASES)
def test_router_gradient_and_metrics_are_the_token_weighted_mean(results, world, name):
    model, res = results
    for rank, r in enumerate(res[world]):
        got = r[name]
        want_groups = [[2 * d + i if world == 2 else i for i in mb] for d in range(world) for mb in CUTS[world][name]]
        assert got["groups"] == want_groups  # the actor ran the cut as given (no re-cut, no padding)
        assert got["metrics"]["tokens_padding"] == 0
        grads, metrics = _reference(model, got["groups"])
        for layer, g in grads.items():
            torch.testing.assert_close(got["grads"][layer], g, rtol=1e-4, atol=1e-7, msg=f"{name} layer {layer}")
        for key, v in metrics.items():
            assert got["metrics"][key] == pytest.approx(v, rel=1e-5), (name, rank, key)


@pytest.mark.dist
def test_split_changes_the_reference_but_not_its_scale(results):
    """The reference itself: the four cuts differ only by the micro-batch statistics (f, P per
    micro-batch), within 30 % of one another, not by the 2×-4× of a sum over micro-batches / DP."""
    model, res = results
    norms = {}
    for world in (1, 2):
        for name in CUTS[world]:
            g = res[world][0][name]["grads"]
            norms[name] = sum(float(x.norm() ** 2) for x in g.values()) ** 0.5
    assert max(norms.values()) / min(norms.values()) < 1.3, norms
    # DP 2 with one sample per micro-batch is the DP 1 four-way cut, gradient for gradient
    for layer, g in res[1][0]["four"]["grads"].items():
        torch.testing.assert_close(res[2][0]["dp_two"]["grads"][layer], g, rtol=1e-5, atol=1e-8)


@pytest.mark.dist
def test_actor_refuses_routers_built_without_per_token_loss(results):
    """Routers built from a config without calculate_per_token_loss attach the plain per-micro-batch
    loss (router.py:72): the actor names the fix instead of mis-scaling it."""
    _, res = results
    assert "built with calculate_per_token_loss=False" in res[1][0]["refused"]
    assert "before the model is built" in res[1][0]["refused"]

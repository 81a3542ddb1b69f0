"""Routing replay across a continued row (issue 37 item 5), the streamed rollout's path on the
in-process HF engine (tiny random Qwen3-MoE, fp32, CPU, ~3 s).

The streamed collector's rows (``EngineClient.submit`` / ``poll`` / ``abort``, ``row_request``,
``extend_sample`` → ``Sample.append_tokens``) run a few tokens with weights version 0, are aborted,
the weights change (version 1: other router weights, so many tokens route elsewhere), and the rows
continue from their prefix. A continued row asks for its routes from where its sample's end
(``RowRequest.routes_start``, SGLang's ``routed_experts_start_len``), so every position keeps the
route of the weights that forwarded it to sample the next token. Expected routes are computed
independently: position ``t`` of ``prompt + response`` is routed by a full-sequence transformers
forward of the version that sampled token ``t + 1`` (the prompt's positions: the first version),
top-k of the softmax of its router logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from conftest import random_hf_model, tiny_moe_config

PROMPTS = [[5, 17, 33, 8, 91], [120, 7, 64]]
N, MAX_NEW, FIRST = 2, 10, 4


def _model(seed: int):
    from conftest import hf_router_modules

    model = random_hf_model(tiny_moe_config("qwen3_moe"), seed=3)
    torch.manual_seed(seed)
    with torch.no_grad():  # routers far from ties, and different per version
        for g in hf_router_modules(model):
            g.weight.normal_(0.0, 0.5)
    return model.eval()


def _top_k(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return torch.stack([torch.topk(torch.softmax(lg.float(), -1), k, -1).indices for lg in logits], 1)  # [T, L, K]


def _aborted_after_first_tokens():
    """Every row of :data:`PROMPTS` streamed on an HF engine with weights version 0 (routes
    recorded) for :data:`FIRST` tokens, then aborted: ``(engine, client, groups, rows, versions)``."""
    from dapo_megatron.rollout.engines.engine import SamplingParams
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.rollout.sampling.streaming import EngineClient, extend_sample, new_group

    versions = {0: _model(seed=0), 1: _model(seed=1)}
    engine = HFEngine(_model(seed=0), eos_token_ids=[0], record_routes=True)
    client = EngineClient(engine, SamplingParams(n=N, max_new_tokens=MAX_NEW, seed=11, temperature=1.0))
    groups = [new_group(SimpleNamespace(prompt_ids=p, index=i, data_source="", ground_truth="", extra_info=None), i, N)
              for i, p in enumerate(PROMPTS)]
    rows = [(g, j) for g in groups for j in range(N)]
    client.submit(rows)
    for u in client.poll(FIRST):
        extend_sample(groups[u.key[0]].samples[u.key[1]], u)
    for u in client.abort():
        extend_sample(groups[u.key[0]].samples[u.key[1]], u)
    return engine, client, groups, rows, versions


def test_streamed_rows_keep_each_positions_route_across_a_continued_row():
    from dapo_megatron.bridge.receiver import checkpoint_parameters
    from dapo_megatron.rollout.sampling.streaming import PENDING, extend_sample

    engine, client, groups, rows, versions = _aborted_after_first_tokens()
    assert all(s.finish_reason == PENDING and s.response_ids for g in groups for s in g.samples)
    engine.update_weights(checkpoint_parameters(versions[1]), version=1)
    client.submit(rows)  # every row continued from its prefix: routes from where its sample's end
    while client.engine.num_in_flight:
        for u in client.poll(MAX_NEW):
            extend_sample(groups[u.key[0]].samples[u.key[1]], u)

    continued = discriminating = 0
    for g in groups:
        for s in g.samples:
            ids, P = s.prompt_ids + s.response_ids, len(s.prompt_ids)
            per_token = s.token_versions()
            assert per_token[0] == 0 and per_token[-1] == 1, s.versions  # aborted once, continued with version 1
            continued += 1
            full = {v: _top_k(m, ids) for v, m in versions.items()}
            want = torch.stack([full[per_token[max(0, t + 1 - P)]][t] for t in range(len(ids) - 1)])
            assert s.routes.dtype == torch.uint8 and tuple(s.routes.shape) == tuple(want.shape)
            assert torch.equal(s.routes.long(), want), (g.prompt_seed, s.versions)
            # the rule is observable: version 1 alone (a continued row's whole-sequence routes) differs
            discriminating += not torch.equal(full[1][:len(ids) - 1], want)
    assert continued == len(PROMPTS) * N and discriminating > 0


def test_a_trajectorys_context_keeps_the_held_routes_and_takes_its_own_from_the_next_rows_prefill():
    """Issue 38 item 3: a multi-turn sample's first turn (version 0), a context append (a tool's
    output, mask 0) through ``settle_row``, a weight sync, the next turn (version 1). The positions
    of the first turn keep version 0's routes; the turn's last token, the context's positions and
    the second turn's take version 1's, from the continuation's prefill and decode."""
    from dapo_megatron.bridge.receiver import checkpoint_parameters
    from dapo_megatron.rollout.sampling.streaming import PENDING, extend_sample
    from dapo_megatron.rollout.trajectory import Trajectory, settle_row

    context = [40, 41, 42]

    class ToolOutput(Trajectory):
        multi_turn = True

        def on_row_finished(self, sample, finish_reason, budget):
            return context if sample.num_context_tokens == 0 else None

    trajectory = ToolOutput()
    engine, client, groups, rows, versions = _aborted_after_first_tokens()
    held = {}
    for g in groups:
        for j, s in enumerate(g.samples):
            assert s.finish_reason == PENDING and s.response_ids
            held[(g.prompt_seed, j)] = first = int(s.routes.shape[0])
            # the first turn ends at a call: the trajectory appends its output as context
            assert settle_row(s, "stop", trajectory, version=0, max_new_tokens=MAX_NEW)
            assert s.response_mask[-len(context):] == [0] * len(context) and int(s.routes.shape[0]) == first
    engine.update_weights(checkpoint_parameters(versions[1]), version=1)
    client.submit(rows)  # the second turns: routes from where each sample's end
    while client.engine.num_in_flight:
        for u in client.poll(MAX_NEW):
            extend_sample(groups[u.key[0]].samples[u.key[1]], u, trajectory, MAX_NEW)

    discriminating = 0
    for g in groups:
        for j, s in enumerate(g.samples):
            assert s.finish_reason != PENDING and s.num_context_tokens == len(context)
            ids, first = s.prompt_ids + s.response_ids, held[(g.prompt_seed, j)]
            full = {v: _top_k(m, ids) for v, m in versions.items()}
            want = torch.cat([full[0][:first], full[1][first:len(ids) - 1]])
            assert tuple(s.routes.shape) == tuple(want.shape)
            assert torch.equal(s.routes.long(), want), (g.prompt_seed, j, s.versions)
            discriminating += not torch.equal(full[1][:len(ids) - 1], want)  # the first turn's routes were kept
    assert discriminating > 0

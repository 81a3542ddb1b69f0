"""Routing replay in server mode: a real ``dapo-rollout-server`` (tiny random Qwen3-MoE) launched
with ``--enable-return-routed-experts`` answers ``return_routed_experts`` with SGLang's
``meta_info.routed_experts`` (base64 int32 ``[seqlen - 1, L, K]``), which the client parser
(``parse_generate_output(routes_shape=...)``, what ``ServerRollout.generate`` runs) turns into
each completion's routes: equal to the top-k of a full-sequence transformers forward of the served
weights; with ``routed_experts_start_len`` the rows from that position on (a continued row's). A
server launched without the flag refuses the field in one 400 naming it."""

from __future__ import annotations

import pytest
import torch

from conftest import random_hf_model, tiny_moe_config
from rollout_server import RolloutServer

PROMPTS = [[5, 17, 33, 8, 91], [120, 7, 64]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from conftest import hf_router_modules

    d = tmp_path_factory.mktemp("moe_server_model")
    model = random_hf_model(tiny_moe_config("qwen3_moe", eos_token_id=2), seed=4)
    with torch.no_grad():
        for g in hf_router_modules(model):
            g.weight.normal_(0.0, 0.5)
    model.save_pretrained(d)
    return str(d)


def test_server_returns_sglang_routed_experts_that_the_client_parses(moe_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from dapo_megatron.rollout.engines.engine import RowRequest, SamplingParams
    from dapo_megatron.platform.http import http_post
    from dapo_megatron.rollout.engines.row_client import RowClient
    from dapo_megatron.rollout.engines.sglang_io import build_generate_request, parse_generate_output

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    cfg = model.config
    L, K, E = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts
    params = SamplingParams(n=2, max_new_tokens=6, seed=3)
    server = RolloutServer(moe_dir, tmp_path / "server.log", "--skip-tokenizer-init", "--enable-return-routed-experts")
    plain = RolloutServer(moe_dir, tmp_path / "plain.log", "--skip-tokenizer-init")
    try:
        req = {**build_generate_request(PROMPTS, params), "return_routed_experts": True}
        out = http_post(server.url, "/generate", req, 120.0)
        assert all(isinstance(o["meta_info"]["routed_experts"], str) for o in out)  # SGLang's base64 payload
        comps = parse_generate_output(out, len(PROMPTS), params.n, prompt_lens=[len(p) for p in PROMPTS],
                                      routes_shape=(L, K, E))
        for p, cs in zip(PROMPTS, comps):
            for c in cs:
                ids = p + c.response_ids
                with torch.no_grad():
                    logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
                want = torch.stack([torch.topk(torch.softmax(lg.float(), -1), K, -1).indices for lg in logits], 1)
                assert c.routes.dtype == torch.uint8 and tuple(c.routes.shape) == (len(ids) - 1, L, K)
                assert torch.equal(c.routes.long(), want[:len(ids) - 1])
        # without the field the answer carries no routes; a server without the flag refuses it
        assert "routed_experts" not in http_post(server.url, "/generate", build_generate_request(PROMPTS, params),
                                                 120.0)[0]["meta_info"]
        with pytest.raises(RuntimeError, match="return_routed_experts=true needs the server launched with "
                                               "--enable-return-routed-experts"):
            http_post(plain.url, "/generate", req, 120.0)
        # routed_experts_start_len = s (SGLang's, one per request): rows [s, seqlen - 1) only, those of
        # the whole sequence from s on (the same seeds: the same tokens); outside [0, input length]: a 400
        start = 3
        tail = http_post(server.url, "/generate", {**req, "routed_experts_start_len": start}, 120.0)
        tails = parse_generate_output(tail, len(PROMPTS), params.n, prompt_lens=[len(p) - start for p in PROMPTS],
                                      routes_shape=(L, K, E))
        for cs, ts in zip(comps, tails):
            for c, t in zip(cs, ts):
                assert t.response_ids == c.response_ids and torch.equal(t.routes, c.routes[start:])
        with pytest.raises(RuntimeError, match=r"routed_experts_start_len=4 must be in \[0, prompt_tokens\]"):
            http_post(server.url, "/generate", {**req, "routed_experts_start_len": 4}, 120.0)  # PROMPTS[1]: 3 tokens
        # the streamed rollout's rows (RowClient.submit / poll with routes): a new row's routes from 0, a
        # row continued after 3 tokens from where its sample's end (P + 3 - 1), each one request
        client = RowClient([server.url], silence_timeout_s=60, timeout_s=60, routes_shape=(L, K, E))
        try:
            c = comps[0][0]
            p = PROMPTS[0]
            client.submit([RowRequest("new", p, params, 0, 0),
                           RowRequest("cont", p, params, 0, 0, prefix_ids=c.response_ids[:3], routes_start=len(p) + 2)])
            got = {r.key: r for r in client.poll(None)}
            assert got["new"].response_ids == c.response_ids and torch.equal(got["new"].routes, c.routes)
            assert got["cont"].response_ids == c.response_ids[3:]  # the same seed: the same draws
            assert torch.equal(got["cont"].routes, c.routes[len(p) + 2:])
        finally:
            client.close()
    finally:
        server.stop()
        plain.stop()

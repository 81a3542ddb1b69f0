"""Routing replay (R3, ``actor.routing_replay: rollout``) on tiny random MoE models, fp32, CPU.

- HFEngine's recorded routes (prefill + one row per decode step, continuous batching with left
  padding) equal the top-k of an independent full-sequence transformers forward
  (``output_router_logits=True``), prompt and response tokens;
- the actor's routers (perturbed away from the engine's, so that on their own they route some
  tokens elsewhere) with replay on use exactly the engine's experts, token for token, in the
  old-logprob forward and in the training forward, at EP=1 and EP=2 (2 gloo processes, each
  its own samples), padded (BSHD) and packed (THD, shared prompt) micro-batches; their logprobs
  equal transformers' with its routers forced to the engine's experts (an independent replay);
- with replay off the same actor routes some tokens differently and its logprobs are those of
  transformers' own (perturbed) routing, not the engine-routed ones;
- the metrics (agreement, per-layer expert load, aux loss) equal values computed here from
  transformers' router logits;
- the config errors (dense model, unknown mode, an engine that cannot return routes).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from conftest import hf_checkpoint_state, random_hf_model, tiny_hf_config, tiny_moe_config
from dapo_megatron.platform import ParallelConfig, spawn

FAMILIES = ("qwen3_moe", "qwen2_moe")  # renormalised top-k (softmax of the k logits) / pre-softmax top-k
LAYOUTS = (("bshd", "off"), ("thd", "on"))  # padded rows; one packed row with shared prompts
PROMPTS = [[5, 17, 33, 8, 91], [120, 7, 64], [44, 45, 46, 47, 48, 49, 2], [200, 13]]
N, MAX_NEW = 2, 7


def _samples(engine, seed: int):
    from dapo_megatron.rollout.engines.engine import SamplingParams, completions_to_group

    out = engine.generate(PROMPTS, SamplingParams(n=N, max_new_tokens=MAX_NEW, seed=seed, temperature=1.0))
    return [s for i, (p, cs) in enumerate(zip(PROMPTS, out)) for s in completions_to_group(i, p, cs).samples]


def _norm_topk(cfg) -> bool:
    return cfg.model_type == "mixtral" or bool(cfg.norm_topk_prob)


def _hf_routing(model, ids: list[int], forced=None):
    """transformers' own routing of one full sequence: per layer the top-k of the fp32 softmax
    of ``router_logits`` (int64 ``[T, L, K]``) and that softmax (``[T, L, E]``); with ``forced``
    ([T, L, K]) every layer runs those experts (:func:`_forcing`), so the later layers' routers
    see the hidden states of the replayed network."""
    k = model.config.num_experts_per_tok
    handles = [] if forced is None else _forcing(model, forced)
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_router_logits=True)
    finally:
        for h in handles:
            h.remove()
    probs = torch.stack([torch.softmax(lg.float(), -1) for lg in out.router_logits], dim=1)  # [T, L, E]
    return torch.topk(probs, k, dim=-1).indices, probs


def _forcing(model, forced: torch.Tensor) -> list:
    """Forward hooks that force every router of ``model`` to ``forced`` ([T, L, K]): the
    router's probabilities gathered at those experts (renormalised where the model does), as
    megatron-core's REPLAY_FORWARD does; an independent replay on the transformers side."""
    from conftest import hf_router_modules

    norm = _norm_topk(model.config)

    def hook_for(layer):
        def hook(mod, args, out):
            logits = out[0]
            idx = forced[:, layer].long()
            w = torch.softmax(logits.float(), -1).gather(1, idx)
            if norm:
                w = w / w.sum(-1, keepdim=True)
            return logits, w.to(logits.dtype), idx
        return hook

    return [g.register_forward_hook(hook_for(i)) for i, g in enumerate(hf_router_modules(model))]


def _forced_logprobs(model, ids: list[int], prompt_len: int, forced: torch.Tensor) -> torch.Tensor:
    """Response logprobs of ``model`` with its routers forced to ``forced`` (:func:`_forcing`)."""
    return _logprobs_with_hooks(model, ids, prompt_len, _forcing(model, forced))


def _logprobs_with_hooks(model, ids: list[int], prompt_len: int, handles) -> torch.Tensor:
    """Response logprobs of ``model`` (one no-grad forward of ``ids``) with the forward hooks
    ``handles`` in place, removed afterwards."""
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return torch.log_softmax(logits[prompt_len - 1:-1], -1).gather(-1, torch.tensor(ids[prompt_len:])[:, None])[:, 0]


def _natural_logprobs(model, ids: list[int], prompt_len: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[prompt_len - 1:-1], -1).gather(-1, torch.tensor(ids[prompt_len:])[:, None])[:, 0]


def _full_routes(s, k: int) -> torch.Tensor:
    """The engine routes of the first P + R - 1 tokens plus a last row (never used: it feeds no label)."""
    r = s.routes.long()
    return torch.cat([r, torch.arange(k).expand(1, r.shape[1], k)], 0)


# --------------------------------------------------------------------------- the spawned actor
def _my_samples(samples, rank: int, world: int):
    return samples[rank::world] if world > 1 else samples


def _worker(out_dir: str, cases: dict, world: int) -> None:
    from dapo_megatron.actor import ActorConfig, MegatronActor
    from dapo_megatron.actor.routing_replay import RoutingReplay, micro_batch_routes
    from dapo_megatron.bridge import load_hf_weights
    from dapo_megatron.models import build_gpt_model
    from dapo_megatron.platform import init_distributed

    rank = int(os.environ["RANK"])
    par = init_distributed(ParallelConfig(1, 1, world), seed=3)
    res = {}
    for family, (cfg, state, samples) in cases.items():
        mine = _my_samples(samples, rank, world)
        mbs_in = [mine[:len(mine) // 2], mine[len(mine) // 2:]]
        for layout, shared in LAYOUTS:
            out = {}
            for mode in ("rollout", "off"):
                model = build_gpt_model(cfg, parallel=par, routing_replay=mode == "rollout")
                load_hf_weights(model, state, parallel=par)
                acfg = ActorConfig(ppo_mini_batch_size=1, ppo_max_token_len_per_gpu=256, micro_batch_layout=layout,
                                   shared_prompt=shared, routing_replay=mode)
                acfg.optim.lr, acfg.optim.weight_decay = 1e-3, 0.0
                actor = MegatronActor(model, acfg, total_steps=4, vocab_size=cfg.vocab_size, parallel=par)
                if mode == "off":  # the actor routes on its own; an observer measures it against the engine
                    actor.routing = RoutingReplay(actor.model_chunks[0], replay=False)
                actor.routing.keep = True
                mbs, _ = actor._make_micro_batches(mbs_in)
                engine_mb = [micro_batch_routes(mb, num_layers=cfg.num_hidden_layers, topk=cfg.num_experts_per_tok,
                                                num_experts=cfg.num_experts)
                             for mb in mbs]
                lp = actor.compute_logprobs(mbs_in)
                old_records = actor.routing.records
                actor.routing.records = []
                metrics = actor.pop_routing_metrics()
                for s, x in zip(mine, lp):
                    s.old_logprobs, s.advantage = x.tolist(), 1.0
                trained = actor.train_mini_batch(mbs_in, return_logprobs=True)
                train, train_lp = trained.metrics, trained.logprobs
                train_records = actor.routing.records
                actor.routing.records = []
                out[mode] = {"lp": lp, "train_lp": train_lp, "metrics": metrics, "skipped": train["skipped"],
                             "old_records": old_records, "train_records": train_records,
                             "engine_mb": engine_mb, "layers": cfg.num_hidden_layers}
            res[(family, layout)] = out
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def replay_results(tmp_path_factory):
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from conftest import hf_router_modules

    out = tmp_path_factory.mktemp("routing_replay")
    cases, refs = {}, {}
    for i, family in enumerate(FAMILIES):
        cfg = tiny_moe_config(family)
        engine_model = random_hf_model(cfg, seed=10 + i)
        with torch.no_grad():  # routers with real preferences (the default init is nearly uniform)
            for g in hf_router_modules(engine_model):
                g.weight.normal_(0.0, 0.5)
        samples = _samples(HFEngine(engine_model, eos_token_ids=[0], record_routes=True), seed=i)
        # the actor's model: the engine's with routers nudged, so that some tokens route elsewhere
        actor_model = copy.deepcopy(engine_model)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for gate in hf_router_modules(actor_model):
                gate.weight.add_(0.15 * torch.randn(gate.weight.shape, generator=g))
        state = hf_checkpoint_state(actor_model, out / family)
        refs[family] = {"engine_model": engine_model, "actor_model": actor_model, "samples": samples}
        cases[family] = (cfg, state, samples)
    results = {}
    for world in (1, 2):
        d = out / f"ep{world}"
        d.mkdir()
        spawn(_worker, world, str(d), cases, world)
        results[world] = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return results, refs


# --------------------------------------------------------------------------- 1. the engine's routes
@pytest.mark.parametrize("family", FAMILIES + ("mixtral",))
def test_hf_engine_routes_equal_an_independent_full_forward(family):
    from dapo_megatron.rollout.engines.hf_engine import HFEngine

    cfg = tiny_moe_config(family)
    model = random_hf_model(cfg, seed=3)
    samples = _samples(HFEngine(model, eos_token_ids=[0], record_routes=True), seed=5)
    k, L = cfg.num_experts_per_tok, cfg.num_hidden_layers
    assert {len(s.prompt_ids) for s in samples} == {len(p) for p in PROMPTS}
    assert any(len(s.response_ids) > 1 for s in samples)
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        assert s.routes.dtype == torch.uint8 and tuple(s.routes.shape) == (len(ids) - 1, L, k)
        own, _ = _hf_routing(model, ids)
        assert torch.equal(s.routes.long(), own[:len(ids) - 1]), (family, s.prompt_ids)
    # and without record_routes nothing is recorded
    plain = _samples(HFEngine(model, eos_token_ids=[0]), seed=5)
    assert all(s.routes is None for s in plain)
    assert [s.response_ids for s in plain] == [s.response_ids for s in samples]


# --------------------------------------------------------------------------- 2. replay on
def _check_records(records, engine_mb, layers: int, equal: bool) -> int:
    """The routes the routers used against the engine's, call by call (micro-batch-major,
    layer-minor: a forward runs its layers in order). Returns the engine-routed (token, layer)
    pairs that differ; with ``equal``, asserts there are none."""
    assert len(records) == len(engine_mb) * layers
    differ = 0
    for j, rec in enumerate(records):
        routes, routed = engine_mb[j // layers]
        assert rec["layer"] == j % layers
        eng = routes[:, rec["layer"]][routed].sort(-1).values
        used = rec["used"][routed]
        differ += int((used != eng).any(-1).sum())
    if equal:
        assert differ == 0
    return differ


@pytest.mark.dist
@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", [lay for lay, _ in LAYOUTS])
def test_replay_on_routes_every_token_as_the_engine_and_gives_its_logprobs(replay_results, world, family, layout):
    results, refs = replay_results
    ref = refs[family]
    for rank, res in enumerate(results[world]):
        on = res[(family, layout)]["rollout"]
        _check_records(on["old_records"], on["engine_mb"], on["layers"], equal=True)
        _check_records(on["train_records"], on["engine_mb"], on["layers"], equal=True)
        mine = _my_samples(ref["samples"], rank, world)
        k = ref["actor_model"].config.num_experts_per_tok
        for s, lp, tlp in zip(mine, on["lp"], on["train_lp"]):
            want = _forced_logprobs(ref["actor_model"], s.prompt_ids + s.response_ids, len(s.prompt_ids),
                                    _full_routes(s, k))
            assert (lp - want).abs().max().item() <= 1e-5, (world, family, layout, rank)
            assert (tlp - want).abs().max().item() <= 1e-5
        assert on["skipped"] == 0.0


@pytest.mark.dist
@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("family", FAMILIES)
def test_replay_off_routes_some_tokens_elsewhere_and_gives_other_logprobs(replay_results, world, family):
    results, refs = replay_results
    ref = refs[family]
    k = ref["actor_model"].config.num_experts_per_tok
    for layout, _ in LAYOUTS:
        differ, far = 0, 0.0
        for rank, res in enumerate(results[world]):
            off = res[(family, layout)]["off"]
            differ += _check_records(off["old_records"], off["engine_mb"], off["layers"], equal=False)
            for s, lp in zip(_my_samples(ref["samples"], rank, world), off["lp"]):
                ids = s.prompt_ids + s.response_ids
                # its own routing: transformers' logprobs of the same (perturbed) weights
                natural = _natural_logprobs(ref["actor_model"], ids, len(s.prompt_ids))
                assert (lp - natural).abs().max().item() <= 1e-5
                forced = _forced_logprobs(ref["actor_model"], ids, len(s.prompt_ids), _full_routes(s, k))
                far = max(far, (lp - forced).abs().max().item())
        assert differ > 0, (family, layout)  # the perturbation really moves tokens to other experts
        assert far > 1e-4, (family, layout)  # 10x the tolerance above: the logprobs follow the routes


# --------------------------------------------------------------------------- 5. the metrics
def _expected_metrics(actor_model, samples, replay: bool) -> dict:
    """The metrics from transformers' router logits of the actor's weights, over every sample's
    first P + R - 1 tokens (each sample its own sequence: the padded layout); ``replay``: the
    routers forced to the engine's experts (the routes used), else their own (used = own)."""
    E, k, L = actor_model.config.num_experts, actor_model.config.num_experts_per_tok, actor_model.config.num_hidden_layers
    n, agree, exact = 0, 0.0, 0
    used, own_c, prob = torch.zeros(L, E), torch.zeros(L, E), torch.zeros(L, E, dtype=torch.float64)
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        own, probs = _hf_routing(actor_model, ids, _full_routes(s, k) if replay else None)
        T = len(ids) - 1
        own, probs, eng = own[:T], probs[:T], s.routes.long()
        ran = eng if replay else own
        for t in range(T):
            for layer in range(L):
                a, b = set(own[t, layer].tolist()), set(eng[t, layer].tolist())
                agree += len(a & b) / k
                exact += a == b
                for e in ran[t, layer].tolist():
                    used[layer, e] += 1
                for e in a:
                    own_c[layer, e] += 1
        prob += probs.double().sum(0)
        n += T
    out = {"moe/route_agreement": agree / (n * L), "moe/route_exact_frac": exact / (n * L)}
    aux = []
    for layer in range(L):
        out[f"moe/expert_load_max/l{layer}"] = float(used[layer].max() / used[layer].sum() * E)
        a = float(E * ((own_c[layer] / (n * k)) * (prob[layer] / n)).sum())
        out[f"moe/aux_loss/l{layer}"] = a
        aux.append(a)
    out["moe/aux_loss"] = sum(aux) / L
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("family", FAMILIES)
def test_routing_metrics_equal_values_computed_from_transformers(replay_results, world, family):
    results, refs = replay_results
    for mode in ("rollout", "off"):  # replayed, and the observer of an actor routing on its own
        want = _expected_metrics(refs[family]["actor_model"], refs[family]["samples"], replay=mode == "rollout")
        assert 0.0 < want["moe/route_agreement"] < 1.0
        for res in results[world]:  # pooled over DP: every rank reports the whole batch
            got = res[(family, "bshd")][mode]["metrics"]
            assert set(got) == set(want)
            for key, v in want.items():
                assert got[key] == pytest.approx(v, rel=1e-6, abs=1e-9), (mode, key)


# --------------------------------------------------------------------------- 4. config errors
def test_config_errors_name_the_key_and_the_fix():
    from dapo_megatron.actor import ActorConfig
    from dapo_megatron.models.config import hf_to_transformer_config
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.rollout.engines.routes import decode_sglang_routes

    with pytest.raises(ValueError, match=r"routing_replay='r3' must be one of \('off', 'rollout'\)"):
        ActorConfig(routing_replay="r3").validate()
    assert ActorConfig(routing_replay=False).routing_replay == "off"  # YAML's `off`
    dense = tiny_hf_config("qwen3_qknorm")
    with pytest.raises(ValueError, match="actor.routing_replay=rollout needs a mixture-of-experts model.*"
                                         "set actor.routing_replay=off"):
        hf_to_transformer_config(dense, ParallelConfig(), routing_replay=True)
    with pytest.raises(ValueError, match="has no MoE routers.*set actor.routing_replay=off"):
        HFEngine(random_hf_model(dense), eos_token_ids=[0], record_routes=True)
    with pytest.raises(RuntimeError, match="no meta_info.routed_experts.*enable_return_routed_experts"):
        decode_sglang_routes({"output_token_logprobs": []}, num_tokens=3, num_layers=2, topk=2, num_experts=4)


def test_run_config_refuses_replay_with_an_engine_that_cannot_return_routes():
    from dapo_megatron.config.run import DAPOConfig

    def cfg(**rollout):
        c = DAPOConfig()
        c.model.hf_path = "x"
        c.buffer.overlong.max_response_length = c.rollout.response_length
        c.actor.routing_replay = "rollout"
        for k, v in rollout.items():
            setattr(c.rollout, k, v)
        return c

    cfg().validate()  # the HF engine records them
    cfg(mode="server", name="sglang", server_urls=["http://h:1"]).validate()  # servers with the flag return them
    c = cfg(mode="server", name="sglang", server_urls=["http://h:1"])
    c.async_training.enable = True
    c.validate()  # async rows carry routes (a continued row from where its sample's end)
    cfg(streaming=True).validate()  # and so do streamed rows
    with pytest.raises(ValueError, match="rollout.engine_kwargs.enable_return_routed_experts=false"):
        cfg(name="sglang", engine_kwargs={"enable_return_routed_experts": False}).validate()


def test_actor_without_routes_names_the_fix():
    from dapo_megatron.actor.routing_replay import micro_batch_routes
    from dapo_megatron.rollout.types import Sample

    class _MB:
        from dapo_megatron.actor.packing import pack_samples as _p
        samples = [Sample(prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[0.0], finish_reason="stop")]
        batch = _p(samples)

    with pytest.raises(ValueError, match=r"routes None, need \[2, 2, 2\].*needs an engine that records routes"):
        micro_batch_routes(_MB(), num_layers=2, topk=2, num_experts=4)


# --------------------------------------------------------------------------- compact routes, SGLang format
def test_sglang_routed_experts_round_trip_and_dtypes():
    from dapo_megatron.rollout.engines.routes import (
        compact_routes,
        decode_sglang_routes,
        encode_sglang_routes,
        route_dtype,
    )

    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 128, (9, 3, 8), generator=g)
    meta = {"routed_experts": encode_sglang_routes(r)}
    got = decode_sglang_routes(meta, num_tokens=9, num_layers=3, topk=8, num_experts=128)
    assert got.dtype == torch.uint8 and torch.equal(got.long(), r)
    assert torch.equal(decode_sglang_routes(meta, num_tokens=7, num_layers=3, topk=8, num_experts=128).long(), r[:7])
    assert route_dtype(256) == torch.uint8 and route_dtype(257) == torch.int16
    import base64

    import numpy as np

    meta16 = {"routed_experts": base64.b64encode(r.numpy().astype(np.int16).tobytes()).decode(),
              "routed_experts_dtype": "int16"}
    assert torch.equal(decode_sglang_routes(meta16, num_tokens=9, num_layers=3, topk=8, num_experts=300).long(), r)
    with pytest.raises(ValueError, match=r"shape \(9, 3, 8\), need \[>= 10, 3, 8\]"):
        compact_routes(r, num_tokens=10, num_layers=3, topk=8, num_experts=128)
    with pytest.raises(ValueError, match=r"outside \[0, 100\)"):
        compact_routes(r, num_tokens=9, num_layers=3, topk=8, num_experts=100)


# --------------------------------------------------------------------------- the routes travel with the tokens
def _route_samples(dtype):
    from dapo_megatron.rollout.engines.routes import num_route_tokens
    from dapo_megatron.rollout.types import Sample

    g = torch.Generator().manual_seed(7)
    out = []
    for i, (p, r) in enumerate(((3, 4), (2, 0), (5, 1), (1, 6), (4, 3))):  # odd byte counts: padded words
        n = num_route_tokens(p, r)
        out.append(Sample(prompt_ids=list(range(1, p + 1)), response_ids=torch.randint(1, 99, (r,), generator=g).tolist(),
                          rollout_logprobs=torch.randn(r, generator=g).tolist(), finish_reason="stop",
                          routes=torch.randint(0, 300 if dtype == torch.int16 else 255, (n, 3, 3), generator=g).to(dtype)))
    return out


def _send_worker(out_dir: str) -> None:
    import torch.distributed as dist

    from dapo_megatron.platform import init_distributed
    from dapo_megatron.rollout.plan.step_data import send_tokens

    par = init_distributed(ParallelConfig(1, 1), seed=0)
    rank = dist.get_rank()
    res = {}
    for dtype in (torch.uint8, torch.int16):
        samples = _route_samples(dtype)
        for i, s in enumerate(samples):
            s.holder = i % 2
            if s.holder != rank:  # the record without its token lists
                s.num_response_tokens = len(s.response_ids)
                s.response_ids = s.rollout_logprobs = s.routes = None
        send_tokens(samples, [(1 - i % 2,) for i in range(len(samples))], parallel=par, routes=(3, 3, dtype))
        res[str(dtype)] = [(s.response_ids, s.rollout_logprobs, s.routes) for s in samples]
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.dist
def test_send_tokens_delivers_the_routes_bitwise(tmp_path):
    spawn(_send_worker, 2, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for dtype in (torch.uint8, torch.int16):
            for s, (ids, lps, routes) in zip(_route_samples(dtype), res[str(dtype)]):
                assert ids == s.response_ids and lps == pytest.approx(s.rollout_logprobs, abs=0)
                assert routes.dtype == dtype and torch.equal(routes, s.routes)


def test_sglang_generate_output_gives_each_completion_its_routes():
    from dapo_megatron.rollout.engines.routes import encode_sglang_routes
    from dapo_megatron.rollout.engines.sglang_io import parse_generate_output

    g = torch.Generator().manual_seed(1)
    prompts, n, L, K, E = [[1, 2, 3], [4, 5]], 2, 3, 2, 8
    items, want = [], []
    for p in prompts:
        for j in range(n):
            R = 2 + j
            r = torch.randint(0, E, (len(p) + R - 1, L, K), generator=g)  # SGLang: seqlen - 1 rows
            want.append(r)
            items.append({"output_ids": list(range(10, 10 + R)), "meta_info": {
                "finish_reason": {"type": "stop"}, "routed_experts": encode_sglang_routes(r),
                "output_token_logprobs": [(-0.5, t, None) for t in range(10, 10 + R)]}})
    out = parse_generate_output(items, len(prompts), n, prompt_lens=[len(p) for p in prompts], routes_shape=(L, K, E))
    got = [c.routes for cs in out for c in cs]
    assert all(torch.equal(a.long(), b) for a, b in zip(got, want))
    assert parse_generate_output(items, len(prompts), n)[0][0].routes is None  # replay off: not decoded
    del items[1]["meta_info"]["routed_experts"]
    with pytest.raises(RuntimeError, match="row 1 has no meta_info.routed_experts"):
        parse_generate_output(items, len(prompts), n, prompt_lens=[3, 2], routes_shape=(L, K, E))


# --------------------------------------------------------------------------- 6. fill and device counters
def test_positions_without_a_route_are_spread_over_all_experts():
    """Padding and each sample's last token: K distinct experts per row, every expert used, both
    halves of E (the two EP ranks at EP = 2) an even share (issue 36 item 6: all went to 0..K-1)."""
    from dapo_megatron.actor.packing import pack_samples
    from dapo_megatron.actor.routing_replay import micro_batch_routes
    from dapo_megatron.rollout.engines.routes import num_route_tokens
    from dapo_megatron.rollout.types import Sample

    L, K, E = 2, 2, 8
    g = torch.Generator().manual_seed(3)
    samples = []
    for p, r in ((3, 9), (2, 1), (5, 4), (1, 2), (4, 0)):
        samples.append(Sample(prompt_ids=list(range(1, p + 1)), response_ids=list(range(1, r + 1)),
                              rollout_logprobs=[0.0] * r, finish_reason="stop",
                              routes=torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(
                                  num_route_tokens(p, r) * L)]).view(-1, L, K).to(torch.uint8)))

    class _MB:
        pass

    mb = _MB()
    mb.samples, mb.batch = samples, pack_samples(samples, layout="bshd")  # rows padded to the longest
    routes, routed = micro_batch_routes(mb, num_layers=L, topk=K, num_experts=E)
    fill = routes[~routed]  # [F, L, K]
    assert fill.shape[0] >= 30  # plenty of padding in this batch
    assert bool((fill.sort(-1).values.diff(dim=-1) > 0).all())  # K distinct experts per row
    counts = torch.bincount(fill.reshape(-1), minlength=E).float()
    assert bool((counts > 0).all()), counts
    assert counts.max() / counts.mean() < 1.5, counts
    ep0 = float(counts[:E // 2].sum() / counts.sum())
    assert 0.4 < ep0 < 0.6, ep0
    # the engine's routes stay where they were
    want = torch.cat([s.routes.long() for s in samples])
    assert routed.sum() == want.shape[0]


def test_route_counters_stay_on_the_device():
    """RouteStats.add on meta tensors (no data: any read of values on the host, nonzero,
    bincount, boolean indexing, .cpu(), float(), fails) and the same sums on CPU against a
    direct count (issue 36 item 6: the observer synchronised the host on every router call)."""
    from dapo_megatron.actor.routing_replay import RouteStats

    g = torch.Generator().manual_seed(0)
    N, L, E, K = 12, 3, 6, 2
    logits = torch.randn(N, E, generator=g)
    probs = torch.softmax(logits, -1)
    own = torch.topk(logits, K, -1).indices
    engine = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    used = torch.zeros(N, E, dtype=torch.bool).scatter_(1, engine, True)
    mask = torch.rand(N, generator=g) > 0.3
    meta = RouteStats(L, E, device="meta")
    meta.add(1, used.to("meta"), own.to("meta"), probs.to("meta"), engine.to("meta"), mask.to("meta"))
    meta.add(2, used.to("meta"), own.to("meta"), probs.to("meta"), None, None)
    stats = RouteStats(L, E)
    stats.add(1, used, own, probs, engine, mask)
    t = stats.table[:, 1]
    m = mask.nonzero().squeeze(1)
    assert t[0] == len(m)
    agree = sum(len(set(own[i].tolist()) & set(engine[i].tolist())) / K for i in m.tolist())
    exact = sum(set(own[i].tolist()) == set(engine[i].tolist()) for i in m.tolist())
    assert float(t[1]) == pytest.approx(agree) and float(t[2]) == exact
    assert torch.equal(t[3:3 + E], torch.bincount(engine[m].reshape(-1), minlength=E).double())
    assert torch.equal(t[3 + E:3 + 2 * E], torch.bincount(own[m].reshape(-1), minlength=E).double())
    torch.testing.assert_close(t[3 + 2 * E:], probs[m].double().sum(0))
    assert float(stats.table[:, 0].abs().sum()) == 0.0 and float(stats.table[:, 2].abs().sum()) == 0.0

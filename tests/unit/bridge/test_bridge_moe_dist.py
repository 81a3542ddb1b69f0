"""Mixture-of-experts bridge on 2 gloo processes: Qwen3-MoE, Qwen2-MoE (shared expert) and
Mixtral, tiny and random (tests/conftest.py ``tiny_moe_config``).

- logprobs equal transformers' (fp32, <= 1e-5) at EP=1 and EP=2 (every family), TP=2 with the
  experts split over TP (ETP=2) and over nobody (ETP=1), ETP=2 at TP=1 (the expert-TP group is
  not the TP group), and PP=2 (Qwen3-MoE);
- the export is bitwise the HF checkpoint (``save_pretrained``'s per-expert tensors) at every
  layout, every expert under its own name, in the same order on every rank;
- HFEngine, started from other random weights, synced from the EP=2 model, holds the
  checkpoint bitwise (its fused expert parameters filled through per-expert names) and gives the
  same logprobs; a stream without one expert is refused, naming it; after one optimizer step of
  the EP=2 actor (2 DP ranks, each its own samples) the synced engine gives the actor's logprobs;
- EP=2 with the all-to-all dispatcher really moves tokens: the two EP ranks forward different
  sequences, each checked against transformers on its own;
- a dense Llama upcycled into a Mixtral (tools/upcycle_moe.py's functions) imports at EP=1 and
  EP=2 with the *dense* model's transformers logprobs (the step-0 MoE is the dense model);
- layouts that cannot work fail with one line naming the key.

One spawned world runs every layout (the spawn costs more than the models). The oracle
(transformers' logprobs and checkpoint tensors) is computed in the parent; the workers report.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import TINY_MOE_FAMILIES, hf_checkpoint_state, random_hf_model, tiny_moe_config
from dapo_megatron.platform import ParallelConfig, spawn
from unit.bridge.test_bridge_dist import _mismatches, record_errors
from unit.bridge.test_bridge_dist import megatron_logprobs as _logprobs

# (name, TP, PP, EP, ETP); the EP=2 layout's two ranks are its two DP ranks
LAYOUTS = (("ep1", 1, 1, 1, None), ("ep2", 1, 1, 2, None), ("tp2", 2, 1, 1, None), ("tp2_etp1", 2, 1, 1, 1),
           ("etp2_tp1", 1, 1, 1, 2), ("pp2", 1, 2, 1, None))  # etp2_tp1: experts split, attention whole
ALL_FAMILIES_AT = ("ep1", "ep2")  # Qwen2-MoE, Mixtral and the upcycled Llama here; Qwen3-MoE at every layout
UPCYCLED = "upcycled"  # a tiny dense Llama upcycled into a 4-expert top-2 Mixtral
SEQ = 16


def _cases_at(layout: str) -> tuple[str, ...]:
    return (*TINY_MOE_FAMILIES, UPCYCLED) if layout in ALL_FAMILIES_AT else ("qwen3_moe",)


def _synced_engine(model, cfg, par, rank: int, my_ids):
    """An HFEngine built from other random weights (seed 50 + rank), then synced from ``model``
    (every tensor by checkpoint name, 4 KiB buckets): ``(engine, {name: tensor it holds},
    logprobs of my_ids[:, 1:] under it)``."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.bridge import iter_hf_weights
    from dapo_megatron.bridge.receiver import checkpoint_parameters
    from dapo_megatron.rollout.engines.hf_engine import HFEngine

    torch.manual_seed(50 + rank)
    engine = HFEngine(AutoModelForCausalLM.from_config(cfg).float(), eos_token_ids=[0])
    engine.update_weights(iter_hf_weights(model, parallel=par, bucket_bytes=4096), version=1)
    held = {n: t.detach().clone() for n, t in checkpoint_parameters(engine.model)}
    with torch.no_grad():
        logits = engine.model(my_ids).logits.float()
    return engine, held, torch.log_softmax(logits[:, :-1], -1).gather(-1, my_ids[:, 1:, None])[..., 0]


def _train_then_sync(model, cfg, par, engine, rank: int) -> dict:
    """One DAPO optimizer step of the EP=2 model (megatron-core DDP and distributed optimizer:
    expert gradients reduced over the expert-DP group, the rest over DP; each rank trains its own
    samples), then the sync: the engine's logprobs must equal the actor's, as in
    tests/integration/test_weight_sync.py for dense models."""
    from dapo_megatron.actor import ActorConfig, MegatronActor
    from dapo_megatron.bridge import iter_hf_weights
    from dapo_megatron.rollout.types import Sample

    acfg = ActorConfig(ppo_mini_batch_size=1, ppo_max_token_len_per_gpu=64)
    acfg.optim.lr, acfg.optim.weight_decay = 1e-2, 0.0
    actor = MegatronActor(model, acfg, total_steps=4, vocab_size=cfg.vocab_size, parallel=par)
    g = torch.Generator().manual_seed(rank)
    samples = [Sample(prompt_ids=torch.randint(1, 250, (p,), generator=g).tolist(),
                      response_ids=torch.randint(1, 250, (r,), generator=g).tolist(), rollout_logprobs=[0.0] * r,
                      finish_reason="length", group_id=i // 2, advantage=1.0 if i % 2 else -1.0)
               for i, (p, r) in enumerate(((5, 7), (9, 3), (4, 11), (12, 6)))]
    before = actor.compute_logprobs([samples], 1.0)
    for s, lp in zip(samples, before):
        s.old_logprobs = lp.tolist()
    metrics = actor.train_mini_batch([samples[:2], samples[2:]], 1.0).metrics
    after = actor.compute_logprobs([samples], 1.0)
    engine.update_weights(iter_hf_weights(actor.model_chunks, parallel=par, bucket_bytes=4096), version=3)
    diff = 0.0
    with torch.no_grad():
        for s, lp in zip(samples, after):
            x = torch.tensor([s.prompt_ids + s.response_ids])
            logits = engine.model(input_ids=x).logits[0].float()[len(s.prompt_ids) - 1:-1]
            got = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            diff = max(diff, float((got - lp).abs().max()))
    moved = max(float((a - b).abs().max()) for a, b in zip(before, after))
    return {"grad_norm": float(metrics["grad_norm"]), "skipped": metrics["skipped"], "engine_vs_actor": diff,
            "moved": moved}


def _worker(out_dir: str, cases: dict, ids: dict) -> None:
    import torch.distributed as dist

    from dapo_megatron.bridge import export_hf_state_dict, iter_hf_weights, load_hf_weights
    from dapo_megatron.models import build_gpt_model
    from dapo_megatron.platform import init_distributed

    rank = int(os.environ["RANK"])
    res: dict = {"lp": {}, "export": {}, "order": {}, "experts": {}, "sync": {}, "errors": {}}
    for layout, tp, pp, ep, etp in LAYOUTS:
        par = init_distributed(ParallelConfig(tp, pp, ep, etp), seed=3)
        # EP=2: each EP (= DP) rank forwards its own sequences, so the all-to-all moves real tokens
        my_ids = ids[rank] if ep > 1 else ids[0]
        for name in _cases_at(layout):
            cfg, state = cases[name]
            model = build_gpt_model(cfg, parallel=par).eval()
            load_hf_weights(model, state, parallel=par)
            lp = _logprobs(model, my_ids, cfg.vocab_size, par)
            if lp is not None:
                res["lp"][(layout, name)] = lp
            # which global experts this rank holds (per layer, from megatron-core's MoE layer)
            res["experts"][(layout, name)] = [list(layer.mlp.local_expert_indices) for layer in model.decoder.layers]
            exported = export_hf_state_dict(model, bucket_bytes=4096, parallel=par)  # several buckets per layer
            res["export"][(layout, name)] = _mismatches(exported, state)
            res["order"][(layout, name)] = list(exported)
            if layout == "ep2":
                engine, held, eng_lp = _synced_engine(model, cfg, par, rank, my_ids)
                dropped = f"model.layers.1.{'block_sparse_moe' if cfg.model_type == 'mixtral' else 'mlp'}.experts.3." + \
                    ("w2" if cfg.model_type == "mixtral" else "down_proj") + ".weight"
                try:
                    engine.update_weights(((n, t) for n, t in iter_hf_weights(model, parallel=par) if n != dropped),
                                          version=2)
                    incomplete = None
                except RuntimeError as e:
                    incomplete = str(e)
                res["sync"][name] = {"held": _mismatches(held, state), "lp": eng_lp, "incomplete": incomplete,
                                     "dropped": dropped, "valid_after_incomplete": engine.weights_valid}
                if name == "qwen3_moe":
                    res["trained"] = _train_then_sync(model, cfg, par, engine, rank)

    # layouts that cannot work: one line naming the key (raised before any model is built)
    from dapo_megatron.models import ModelConfig
    from dapo_megatron.models.config import hf_to_transformer_config

    cfg = cases["qwen3_moe"][0]
    dense = cases["dense"][0]
    attempts = {
        "experts_not_divisible": lambda: hf_to_transformer_config(
            tiny_moe_config("qwen3_moe", num_experts=3), ParallelConfig(1, 1, 2)),
        "etp_not_dividing_ffn": lambda: hf_to_transformer_config(cfg, ParallelConfig(1, 1, 1, 3)),
        "ep_on_dense": lambda: hf_to_transformer_config(dense, ParallelConfig(1, 1, 2)),
        "moe_key_on_dense": lambda: hf_to_transformer_config(dense, ParallelConfig(), ModelConfig(moe_aux_loss_coeff=0.1)),
        "world_too_small": lambda: ParallelConfig(1, 1, 4).check_world_size(2),
        "grouped_gemm_local": lambda: hf_to_transformer_config(
            cfg, ParallelConfig(), ModelConfig(transformer_impl="local", moe_grouped_gemm=True)),
        "bad_dispatcher": lambda: hf_to_transformer_config(cfg, ParallelConfig(), ModelConfig(moe_token_dispatcher_type="flexx")),
        "mixed_dense_layers": lambda: hf_to_transformer_config(tiny_moe_config("qwen3_moe", mlp_only_layers=[1]),
                                                               ParallelConfig()),
        "server_export_ep2": lambda: next(iter_hf_weights(model, parallel=par, pp_broadcast=False)),
    }
    par = init_distributed(ParallelConfig(1, 1, 2), seed=4)
    model = build_gpt_model(cfg, parallel=par)
    res["errors"].update(record_errors(attempts))
    dist.barrier()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory):
    from conftest import tiny_hf_config

    out = tmp_path_factory.mktemp("bridge_moe")
    g = torch.Generator().manual_seed(0)
    ids = {r: torch.randint(0, 250, (2, SEQ), generator=g) for r in range(2)}  # rank r's sequences at EP=2
    ids[0][0, 3] = 249  # the last real token id, next to the vocabulary padding rows
    cases, ref_lp = {}, {}
    for i, name in enumerate(TINY_MOE_FAMILIES):
        cfg = tiny_moe_config(name)
        hf = random_hf_model(cfg, seed=i)
        cases[name] = (cfg, hf_checkpoint_state(hf, out / name))
        with torch.no_grad():
            for r, x in ids.items():
                logits = hf(x).logits.float()
                ref_lp[(name, r)] = torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
    # the upcycled Llama: its oracle is the dense model's logprobs
    from dapo_megatron.models.upcycle import upcycle_config, upcycle_state_dict

    dense_cfg = tiny_hf_config("llama_tied")
    dense = random_hf_model(dense_cfg, seed=9)
    moe_cfg = upcycle_config(dense_cfg, 4, 2)
    cases[UPCYCLED] = (moe_cfg, upcycle_state_dict(dense.state_dict(), moe_cfg, router_init_std=0.5, seed=1))
    with torch.no_grad():
        for r, x in ids.items():
            logits = dense(x).logits.float()
            ref_lp[(UPCYCLED, r)] = torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
    cases["dense"] = (tiny_hf_config("qwen3_qknorm"), {})
    spawn(_worker, 2, str(out), cases, ids)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks, ref_lp, cases


def _layout_family():
    return [(layout, family) for layout, *_ in LAYOUTS for family in _cases_at(layout)]


@pytest.mark.dist
@pytest.mark.parametrize("layout,family", _layout_family())
def test_moe_logprobs_equal_transformers_fp32(moe_results, layout, family):
    ranks, ref_lp, _ = moe_results
    got = [(r, res["lp"][(layout, family)]) for r, res in enumerate(ranks) if (layout, family) in res["lp"]]
    assert got, "no rank produced logprobs"
    for r, lp in got:
        ref = ref_lp[(family, r if layout == "ep2" else 0)]
        assert lp.shape == ref.shape
        assert (lp - ref).abs().max().item() <= 1e-5, (layout, family, r)
    if layout == "ep2":  # the EP ranks forwarded different sequences, and each got its own answer
        assert len(got) == 2 and not torch.allclose(got[0][1], got[1][1])


@pytest.mark.dist
@pytest.mark.parametrize("layout,family", _layout_family())
def test_moe_export_is_the_hf_checkpoint_bitwise_on_every_rank(moe_results, layout, family):
    ranks, _, cases = moe_results
    for res in ranks:
        assert res["export"][(layout, family)] == [], (layout, family)
    # every expert of every layer under its own checkpoint name, in one order on every rank
    names = ranks[0]["order"][(layout, family)]
    assert names == ranks[1]["order"][(layout, family)] == ranks[0]["order"][("ep1", family)]
    cfg = cases[family][0]
    per_expert = [n for n in names if ".experts." in n]
    assert len(per_expert) == cfg.num_hidden_layers * 4 * 3  # layers × experts × (gate, up, down)


@pytest.mark.dist
def test_upcycled_llama_gives_the_dense_logprobs_at_ep1_and_ep2(moe_results):
    ranks, ref_lp, cases = moe_results
    assert cases[UPCYCLED][0].model_type == "mixtral" and cases[UPCYCLED][0].tie_word_embeddings
    ep1, ep2 = ranks[0]["lp"][("ep1", UPCYCLED)], ranks[0]["lp"][("ep2", UPCYCLED)]  # rank 0: the same sequences
    assert (ep1 - ref_lp[(UPCYCLED, 0)]).abs().max().item() <= 1e-5
    assert (ep2 - ep1).abs().max().item() <= 1e-5
    assert (ranks[1]["lp"][("ep2", UPCYCLED)] - ref_lp[(UPCYCLED, 1)]).abs().max().item() <= 1e-5
    assert ranks[1]["experts"][("ep2", UPCYCLED)][0] == [2, 3]  # EP=2 really split the experts


@pytest.mark.dist
def test_experts_are_sharded_over_ep_with_global_indices(moe_results):
    ranks, _, _ = moe_results
    for layer in range(2):
        assert ranks[0]["experts"][("ep2", "qwen3_moe")][layer] == [0, 1]
        assert ranks[1]["experts"][("ep2", "qwen3_moe")][layer] == [2, 3]
        assert ranks[0]["experts"][("ep1", "qwen3_moe")][layer] == [0, 1, 2, 3]


@pytest.mark.dist
@pytest.mark.parametrize("family", TINY_MOE_FAMILIES)
def test_sync_into_hf_engine_fills_every_expert(moe_results, family):
    ranks, ref_lp, _ = moe_results
    for r, res in enumerate(ranks):
        sync = res["sync"][family]
        assert sync["held"] == [], sync["held"][:5]
        assert (sync["lp"] - ref_lp[(family, r)]).abs().max().item() <= 1e-5
        # the completeness check counts experts: one missing expert tensor fails the sync, named
        assert sync["incomplete"] and "never updated" in sync["incomplete"] and sync["dropped"] in sync["incomplete"]
        assert not sync["valid_after_incomplete"]


@pytest.mark.dist
def test_ep2_training_step_then_sync_gives_the_engine_the_actors_logprobs(moe_results):
    ranks, _, _ = moe_results
    a, b = ranks[0]["trained"], ranks[1]["trained"]
    assert a["skipped"] == 0.0 and a["grad_norm"] > 0
    assert a["grad_norm"] == b["grad_norm"]  # one global norm: expert and dense gradients reduced over every rank
    for r in (a, b):
        assert r["moved"] > 1e-3, r  # the step changed the weights (experts included)
        assert r["engine_vs_actor"] <= 1e-5, r


@pytest.mark.dist
def test_impossible_moe_layouts_fail_with_one_line_naming_the_key(moe_results):
    err = moe_results[0][0]["errors"]
    expect = {
        "experts_not_divisible": "parallel.expert_model_parallel_size=2 does not divide the 3 experts",
        "etp_not_dividing_ffn": "parallel.expert_tensor_parallel_size=3 does not divide the expert FFN size 16",
        "ep_on_dense": "parallel.expert_model_parallel_size=2 needs a mixture-of-experts model",
        "moe_key_on_dense": "model.moe_aux_loss_coeff=0.1 applies to mixture-of-experts models only",
        "world_too_small": "expert_tensor_parallel_size=1 × expert_model_parallel_size=4 × "
                           "pipeline_model_parallel_size=1 = 4 does not divide the world size 2",
        "grouped_gemm_local": "model.moe_grouped_gemm=true needs transformer_impl='transformer_engine'",
        "bad_dispatcher": "model.moe_token_dispatcher_type='flexx'",
        "mixed_dense_layers": "hf_config.mlp_only_layers=[1]",
        "server_export_ep2": "pp_broadcast=False) at expert_model_parallel_size=2",
    }
    for key, text in expect.items():
        assert err[key] is not None and text in err[key], (key, err[key])
        assert "\n" not in err[key], key

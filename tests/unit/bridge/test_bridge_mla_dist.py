"""DeepSeek-V3 (multi-head latent attention, sigmoid router with score-correction bias and
grouped top-k, shared expert, a dense first layer) and GLM-4.5 (the same MoE side behind GQA
attention with a q/k/v bias, q/k norm and RoPE on half of each head) through the bridge on 2 gloo
processes, tiny and random (tests/conftest.py ``tiny_mla_config`` / ``tiny_glm_config``, 2 layers:
layer 0 dense, layer 1 MoE). Both families run in ONE spawned world (the suite's time, issue 35):
GLM at the layouts :data:`GLM_LAYOUTS` (EP=2, TP=2 with ETP=2 and ETP=1, PP=2), DeepSeek-V3 at
all of :data:`LAYOUTS`.

- logprobs equal transformers' (fp32, <= 1e-5) at EP=1, EP=2, TP=2 with ETP=2 and ETP=1, ETP=2 at
  TP=1 and PP=2 (the dense and the MoE layer on different stages), and with YaRN RoPE; the bias
  matters in this config (transformers with the bias zeroed gives other logprobs), and so does
  the group limit (all groups kept gives other logprobs);
- the export is bitwise the HF checkpoint (``save_pretrained``'s tensors, the bias included) at
  every layout, in one order on every rank;
- HFEngine, started from other random weights, synced from the EP=2 model, holds the checkpoint
  bitwise (its score-correction biases too) and gives the same logprobs; the stream cut into
  SGLang-sized buckets (``iter_buckets``) carries the same tensors, and every bucket holding a
  ``q_a_proj`` holds its ``kv_a_proj_with_mqa`` (SGLang fuses the pair within one load call);
- one DAPO optimizer step at EP=2 with the aux-loss-free bias update on (megatron-core's
  ``moe_router_bias_update_rate``) moves the bias, and the sync hands the engine the new bias
  (the engine then gives the actor's logprobs).

DeepSeek-V2 (``deepseek_v2``, tests/conftest.py ``tiny_v2_config``): V2-Lite's router (softmax over all
experts, greedy top-2, the weights never renormalised, times ``routed_scaling_factor``) behind MLA
without a query LoRA and YaRN with V2-Lite's mscale, at EP=2, TP=2 and PP=2; and DeepSeek-V2's
``group_limited_greedy`` (``V2_GROUPED``: 8 experts in 4 groups, 2 kept, top-3) at EP=2. Logprobs
equal transformers' (<= 1e-5), the export is the checkpoint bitwise (no score-correction bias in
either), the EP=2 sync into HFEngine and SGLang-sized buckets carries the checkpoint; renormalising,
dropping the scale or (grouped) the group limit gives other logprobs in these configs. What the
mapping cannot reproduce (a renormalised V2 router, sigmoid scoring, greedy with a group limit,
DeepSeek-V2's own 6-of-3-groups ranking) fails in one line.

GLM: logprobs equal transformers' (<= 1e-5) and the export is the checkpoint bitwise at every GLM
layout, the checkpoint's MTP layer (``num_nextn_predict_layers``, layer 2 here) skipped on import
and never exported; the EP=2 sync into HFEngine and into 2 KiB SGLang-sized buckets carries the
checkpoint bitwise (the score-correction biases too), and the engine then gives transformers'
logprobs. GLM's partial rotary matters in this config (full rotary gives other logprobs).

One spawned world runs every layout; the oracle is computed in the parent.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import V2_GROUPED, hf_checkpoint_state, random_hf_model, tiny_glm_config, tiny_mla_config, tiny_v2_config
from dapo_megatron.platform import ParallelConfig, spawn
from unit.bridge.test_bridge_dist import _mismatches, record_errors
from unit.bridge.test_bridge_dist import megatron_logprobs as _logprobs
from unit.bridge.test_bridge_moe_dist import _synced_engine, _train_then_sync

LAYOUTS = (("ep1", 1, 1, 1, None), ("ep2", 1, 1, 2, None), ("tp2", 2, 1, 1, None), ("tp2_etp1", 2, 1, 1, 1),
           ("etp2_tp1", 1, 1, 1, 2), ("pp2", 1, 2, 1, None))
YARN = "yarn"  # the same model with YaRN RoPE (DeepSeek-V3's own scaling), at EP=1
GLM = "glm"  # GLM-4.5 (tiny_glm_config), at the layouts below
GLM_LAYOUTS = ("ep2", "tp2", "tp2_etp1", "pp2")
NOQ = "no_q_lora"  # q_lora_rank None (DeepSeek-V2-Lite, Moonlight): one q_proj, no q norm
NOQ_LAYOUTS = ("ep1", "tp2")
V2 = "v2"  # DeepSeek-V2-Lite style (tiny_v2_config): softmax router, greedy top-k not renormalised, no q LoRA, YaRN
V2G = "v2_grouped"  # DeepSeek-V2's group_limited_greedy (V2_GROUPED), with a q LoRA
V2_LAYOUTS = {V2: ("ep2", "tp2", "pp2"), V2G: ("ep2",)}
# the layout each family's export order is compared with (all layouts export in one order)
FIRST_LAYOUT = {GLM: "ep2", V2: "ep2", V2G: "ep2"}
SEQ = 16
# the GLM checkpoint's MTP layer (num_nextn_predict_layers=1 after the 2 decoder layers): a few of its
# tensors, which transformers does not build; import must skip them as SGLang does
GLM_MTP = {"model.layers.2.eh_proj.weight": (64, 128), "model.layers.2.enorm.weight": (64,),
           "model.layers.2.self_attn.q_proj.weight": (64, 64), "model.layers.2.mlp.gate.e_score_correction_bias": (4,)}


def _yarn_config():
    return tiny_mla_config(max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def _worker(out_dir: str, configs: dict, ids: dict) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from dapo_megatron.bridge import export_hf_state_dict, iter_hf_weights, load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.models.config import hf_to_transformer_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.bridge.buckets import iter_buckets
    from dapo_megatron.bridge.receiver import checkpoint_parameters

    rank = int(os.environ["RANK"])
    # each case's checkpoint from the file the parent wrote: the tensors of six cases passed as
    # arguments would need more file descriptors than the fork server sends (multiprocessing MAXFDS_TO_SEND)
    cases = {name: (cfg, load_file(os.path.join(out_dir, name, "model.safetensors")))
             for name, cfg in configs.items()}
    res: dict = {"lp": {}, "export": {}, "order": {}, "sync": {}}
    for layout, tp, pp, ep, etp in LAYOUTS:
        par = init_distributed(ParallelConfig(tp, pp, ep, etp), seed=3)
        my_ids = ids[rank] if ep > 1 else ids[0]
        names = ["v3", YARN] if layout == "ep1" else ["v3"]
        names += [GLM] if layout in GLM_LAYOUTS else []
        names += [NOQ] if layout in NOQ_LAYOUTS else []
        names += [v2 for v2, at in V2_LAYOUTS.items() if layout in at]
        for name in names:
            cfg, state = cases[name]
            model = build_gpt_model(cfg, parallel=par).eval()
            load = dict(state, **{n: torch.zeros(shape) for n, shape in GLM_MTP.items()}) if name == GLM else state
            load_hf_weights(model, load, parallel=par)
            lp = _logprobs(model, my_ids, cfg.vocab_size, par)
            if lp is not None:
                res["lp"][(layout, name)] = lp
            exported = export_hf_state_dict(model, bucket_bytes=4096, parallel=par)
            res["export"][(layout, name)] = _mismatches(exported, state)
            res["order"][(layout, name)] = list(exported)
            if layout != "ep2":
                continue
            engine, held, eng_lp = _synced_engine(model, cfg, par, rank, my_ids)
            # SGLang-shaped buckets: 2 KiB, smaller than q_a_proj (32 × 64 fp32 = 8 KiB)
            buckets = [[(n, t.clone()) for n, t in b]
                       for b in iter_buckets(iter_hf_weights(model, parallel=par, bucket_bytes=4096), 2048)]
            res["sync"][name] = {"held": _mismatches(held, state), "lp": eng_lp,
                                 "buckets": [[n for n, _ in b] for b in buckets],
                                 "bucketed": _mismatches({n: t for b in buckets for n, t in b}, state)}
            if name == "v3":
                v3_engine = engine
        if layout == "ep2":
            cfg, state = cases["v3"]
            engine = v3_engine
            # one step with the bias update on: the bias moves, and the sync carries it
            model = build_gpt_model(cfg, ModelConfig(moe_router_bias_update_rate=0.05), parallel=par)
            load_hf_weights(model, state, parallel=par)
            res["trained"] = _train_then_sync(model, cfg, par, engine, rank)
            bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
            res["trained"]["bias_before"] = state[bias_name]
            res["trained"]["bias_actor"] = model.decoder.layers[1].mlp.router.expert_bias.detach().clone()
            res["trained"]["bias_engine"] = dict(checkpoint_parameters(engine.model))[bias_name].detach().clone()

    attempts = {
        "norm_topk_false": lambda: hf_to_transformer_config(tiny_mla_config(norm_topk_prob=False), ParallelConfig()),
        "group_topk_not_2": lambda: hf_to_transformer_config(
            tiny_mla_config(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2), ParallelConfig()),
        "rope_not_interleaved": lambda: hf_to_transformer_config(tiny_mla_config(rope_interleave=False),
                                                                 ParallelConfig()),
        "tp_not_dividing_kv_down": lambda: hf_to_transformer_config(tiny_mla_config(kv_lora_rank=15),
                                                                    ParallelConfig(2, 1)),
        "bias_rate_on_qwen": lambda: hf_to_transformer_config(
            __import__("conftest").tiny_moe_config("qwen3_moe"), ParallelConfig(),
            ModelConfig(moe_router_bias_update_rate=0.1)),
        "glm_partial_with_yarn": lambda: hf_to_transformer_config(tiny_glm_config(rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.5}), ParallelConfig()),
        "glm_partial_odd": lambda: hf_to_transformer_config(tiny_glm_config(partial_rotary_factor=0.3125),
                                                            ParallelConfig()),
        "llama_partial": lambda: hf_to_transformer_config(__import__("transformers").LlamaConfig(
            vocab_size=250, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            partial_rotary_factor=0.5), ParallelConfig()),
        "glm_norm_topk_false": lambda: hf_to_transformer_config(tiny_glm_config(norm_topk_prob=False),
                                                                ParallelConfig()),
        "v2_norm_topk_true": lambda: hf_to_transformer_config(tiny_v2_config(norm_topk_prob=True), ParallelConfig()),
        "v2_sigmoid": lambda: hf_to_transformer_config(tiny_v2_config(scoring_func="sigmoid"), ParallelConfig()),
        "v2_noaux_tc": lambda: hf_to_transformer_config(tiny_v2_config(topk_method="noaux_tc"), ParallelConfig()),
        "v2_greedy_with_groups": lambda: hf_to_transformer_config(
            tiny_v2_config(n_routed_experts=8, n_group=4, topk_group=2), ParallelConfig()),
        # DeepSeek-V2 / V2.5: top-6 of 3 of 8 groups; megatron-core would rank a group by its top-2 sum
        "v2_group_rank_top2": lambda: hf_to_transformer_config(
            tiny_v2_config(**dict(V2_GROUPED, n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=6)),
            ParallelConfig()),
    }
    res["errors"] = record_errors(attempts)
    dist.barrier()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _hf_logprobs(model, x):
    with torch.no_grad():
        logits = model(x).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def mla_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge_mla")
    g = torch.Generator().manual_seed(0)
    ids = {r: torch.randint(0, 250, (2, SEQ), generator=g) for r in range(2)}
    ids[0][0, 3] = 249  # the last real token id, next to the vocabulary padding rows
    cases, ref_lp, alt_lp = {}, {}, {}
    for i, (name, cfg) in enumerate((("v3", tiny_mla_config()), (YARN, _yarn_config()), (GLM, tiny_glm_config()),
                                       (NOQ, tiny_mla_config(q_lora_rank=None)), (V2, tiny_v2_config()),
                                       (V2G, tiny_v2_config(**V2_GROUPED)))):
        hf = random_hf_model(cfg, seed=i)
        cases[name] = (cfg, hf_checkpoint_state(hf, out / name))
        for r, x in ids.items():
            ref_lp[(name, r)] = _hf_logprobs(hf, x)
        if name == "v3":
            # what the bias and the group limit change in this config (their checks can fail)
            bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
            kept = bias.clone()
            bias.zero_()
            alt_lp["no_bias"] = _hf_logprobs(hf, ids[0])
            bias.copy_(kept)
            hf.model.layers[1].mlp.gate.topk_group = 2  # every group kept: plain top-k
            alt_lp["no_groups"] = _hf_logprobs(hf, ids[0])
        if name == GLM:  # what partial rotary changes: the same weights with RoPE on the whole head
            full = random_hf_model(tiny_glm_config(partial_rotary_factor=1.0), seed=i)
            full.load_state_dict(hf.state_dict())
            alt_lp["glm_full_rotary"] = _hf_logprobs(full, ids[0])
        if name in (V2, V2G):  # what not renormalising, the scale and (V2G) the group limit change here
            gate = hf.model.layers[1].mlp.gate
            handle = gate.register_forward_hook(lambda m, a, o: (
                o[0], o[1] / o[1].sum(-1, keepdim=True) * m.routed_scaling_factor, o[2]))
            alt_lp[f"{name}_renormalised"] = _hf_logprobs(hf, ids[0])
            handle.remove()
            gate.routed_scaling_factor = 1.0
            alt_lp[f"{name}_unscaled"] = _hf_logprobs(hf, ids[0])
            gate.routed_scaling_factor = cfg.routed_scaling_factor
            if name == V2G:
                gate.topk_method = "greedy"
                alt_lp["v2_no_groups"] = _hf_logprobs(hf, ids[0])
                gate.topk_method = cfg.topk_method
    spawn(_worker, 2, str(out), {name: cfg for name, (cfg, _) in cases.items()}, ids)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks, ref_lp, alt_lp, cases


def _cases():
    return ([(layout, "v3") for layout, *_ in LAYOUTS] + [("ep1", YARN)] + [(layout, GLM) for layout in GLM_LAYOUTS]
            + [(layout, NOQ) for layout in NOQ_LAYOUTS]
            + [(layout, name) for name, at in V2_LAYOUTS.items() for layout in at])


@pytest.mark.dist
@pytest.mark.parametrize("layout,name", _cases())
def test_mla_logprobs_equal_transformers_fp32(mla_results, layout, name):
    ranks, ref_lp, _, _ = mla_results
    got = [(r, res["lp"][(layout, name)]) for r, res in enumerate(ranks) if (layout, name) in res["lp"]]
    assert got, "no rank produced logprobs"
    for r, lp in got:
        ref = ref_lp[(name, r if layout == "ep2" else 0)]
        assert lp.shape == ref.shape
        assert (lp - ref).abs().max().item() <= 1e-5, (layout, name, r)
    if layout == "ep2":
        assert len(got) == 2 and not torch.allclose(got[0][1], got[1][1])


@pytest.mark.dist
def test_the_bias_and_the_group_limit_change_this_configs_logprobs(mla_results):
    # without this, the parity above would not show that Megatron routes with the bias and groups
    _, ref_lp, alt_lp, _ = mla_results
    assert (alt_lp["no_bias"] - ref_lp[("v3", 0)]).abs().max().item() > 1e-3
    assert (alt_lp["no_groups"] - ref_lp[("v3", 0)]).abs().max().item() > 1e-3
    assert (alt_lp["glm_full_rotary"] - ref_lp[(GLM, 0)]).abs().max().item() > 1e-3


@pytest.mark.dist
@pytest.mark.parametrize("name", [V2, V2G])
def test_v2_renormalising_the_scale_and_the_group_limit_change_this_configs_logprobs(mla_results, name):
    # without this, the V2 parity would not show that Megatron keeps the top-k softmax weights as they
    # are, scales them, and (grouped) limits the groups as transformers does
    _, ref_lp, alt_lp, _ = mla_results
    for what in ("renormalised", "unscaled"):
        assert (alt_lp[f"{name}_{what}"] - ref_lp[(name, 0)]).abs().max().item() > 1e-3, what
    if name == V2G:
        assert (alt_lp["v2_no_groups"] - ref_lp[(V2G, 0)]).abs().max().item() > 1e-3


@pytest.mark.dist
@pytest.mark.parametrize("layout,name", _cases())
def test_mla_export_is_the_hf_checkpoint_bitwise(mla_results, layout, name):
    ranks, _, _, cases = mla_results
    for res in ranks:
        assert res["export"][(layout, name)] == [], (layout, name)
    names = ranks[0]["order"][(layout, name)]
    first = (FIRST_LAYOUT.get(name, "ep1"), name)
    assert names == ranks[1]["order"][(layout, name)] == ranks[0]["order"][first]
    # the dense layer has an MLP and no router; the MoE layer a router, its bias and a shared expert
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    # DeepSeek-V2's softmax router has no score-correction bias (nor has its HF checkpoint)
    assert ("model.layers.1.mlp.gate.e_score_correction_bias" in names) == (name not in (V2, V2G))
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert not any(n.startswith("model.layers.2.") for n in names)  # no MTP layer
    if name == GLM:  # qkv bias and q/k norm per layer (attention_bias, use_qk_norm)
        for layer in range(2):
            for t in ("q_proj.bias", "k_proj.bias", "v_proj.bias", "q_norm.weight", "k_norm.weight"):
                assert f"model.layers.{layer}.self_attn.{t}" in names
        return
    if name in (NOQ, V2):  # one query projection, no query latent and no q norm (transformers' q_proj branch)
        for layer in range(2):
            assert f"model.layers.{layer}.self_attn.q_proj.weight" in names
            assert not any(n.startswith(f"model.layers.{layer}.self_attn.q_a") for n in names)
        return
    # q_a_proj is followed by kv_a_proj_with_mqa (SGLang fuses the two)
    for layer in range(2):
        i = names.index(f"model.layers.{layer}.self_attn.q_a_proj.weight")
        assert names[i + 1] == f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"


@pytest.mark.dist
@pytest.mark.parametrize("name", ["v3", GLM, V2, V2G])
def test_sync_into_hf_engine_and_sglang_buckets_equal_the_checkpoint(mla_results, name):
    ranks, ref_lp, _, _ = mla_results
    for r, res in enumerate(ranks):
        sync = res["sync"][name]
        assert sync["held"] == [], sync["held"][:5]
        assert sync["bucketed"] == [], sync["bucketed"][:5]
        assert (sync["lp"] - ref_lp[(name, r)]).abs().max().item() <= 1e-5
        for bucket in sync["buckets"]:
            for n in bucket:
                if n.endswith("q_a_proj.weight"):
                    assert n.replace("q_a_proj", "kv_a_proj_with_mqa") in bucket, bucket
        assert len(sync["buckets"]) > 10  # the 2 KiB buckets really cut the stream


@pytest.mark.dist
def test_bias_update_moves_the_bias_and_the_sync_carries_it(mla_results):
    ranks, _, _, _ = mla_results
    a, b = ranks[0]["trained"], ranks[1]["trained"]
    assert a["skipped"] == 0.0 and a["grad_norm"] > 0 and a["grad_norm"] == b["grad_norm"]
    for t in (a, b):
        assert t["engine_vs_actor"] <= 1e-5, t
        moved = (t["bias_actor"] - t["bias_before"]).abs()
        # megatron-core: bias += rate · sign(mean load − load), so each entry moves by 0 or ±0.05
        assert moved.max().item() == pytest.approx(0.05, abs=1e-6), moved
        assert torch.equal(t["bias_engine"], t["bias_actor"])
    assert torch.equal(a["bias_actor"], b["bias_actor"])  # the load is reduced over every rank


@pytest.mark.dist
def test_what_the_mla_mapping_cannot_build_fails_in_one_line(mla_results):
    err = mla_results[0][0]["errors"]
    expect = {
        "norm_topk_false": "hf_config.norm_topk_prob=False is not supported with the sigmoid router",
        "group_topk_not_2": "num_experts_per_tok=2 / topk_group=2 must be 2",
        "rope_not_interleaved": "hf_config.rope_interleave=False is not supported",
        "tp_not_dividing_kv_down": "kv_lora_rank + qk_rope_head_dim=19 is not divisible by tensor_model_parallel_size=2",
        "bias_rate_on_qwen": "model.moe_router_bias_update_rate=0.1 needs a router with a score-correction bias",
        "glm_partial_with_yarn": "rope_type='yarn' with partial_rotary_factor=0.5 is not supported",
        "glm_partial_odd": "partial_rotary_factor=0.3125 rotates 5.0 of head_dim=16 channels",
        "llama_partial": "hf_config.partial_rotary_factor != 1 is not supported",
        "glm_norm_topk_false": "hf_config.norm_topk_prob=False is not supported with the sigmoid router",
        "v2_norm_topk_true": "hf_config.norm_topk_prob=True is not supported for deepseek_v2",
        "v2_sigmoid": "hf_config.scoring_func='sigmoid': DeepSeek-V2's router is softmax",
        "v2_noaux_tc": "hf_config.topk_method='noaux_tc': deepseek_v2 supports 'greedy' and 'group_limited_greedy'",
        "v2_greedy_with_groups": "hf_config.topk_method='greedy' with n_group=4, topk_group=2",
        "v2_group_rank_top2": "hf_config.num_experts_per_tok=6 // topk_group=3 must be 1",
    }
    for key, text in expect.items():
        assert err[key] is not None and text in err[key], (key, err[key])
        assert "\n" not in err[key], key

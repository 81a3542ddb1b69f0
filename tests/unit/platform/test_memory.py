"""The per-GPU memory estimate on the H100 examples: the verdict its arithmetic gives.

Expected numbers are computed here from the parameter count of the transformers model
(built on the meta device) and the layout, term by term as the estimate's docstring
states them, not with the estimator's helpers.
"""

import pytest
import torch

from dapo_megatron.config import ConfigError, DAPOConfig, load_config
from dapo_megatron.platform.memory import GB, H100_80GB, ModelShape, check_memory, estimate_from_config
from integration.test_examples import GPUS, H100, QWEN2_5


def _qwen(name):
    from transformers import Qwen2Config

    # published Qwen2.5 config.json: vocab 152064, untied embeddings, q/k/v biases
    return Qwen2Config(vocab_size=152064, tie_word_embeddings=False, **QWEN2_5[name])


def _meta(hf):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


def _counts(hf):
    """(all parameters, split-over-TP parameters of one layer, norm parameters of one layer)."""
    model = _meta(hf)
    total = sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    norms = sum(p.numel() for n, p in layer.named_parameters() if "norm" in n)
    return total, sum(p.numel() for p in layer.parameters()) - norms, norms


def _cfg(name, *overrides):
    return load_config(DAPOConfig, H100[name], ["model.hf_path=/models/x", *overrides])


@pytest.mark.parametrize("family", ["llama_tied", "llama_untied", "qwen2_bias", "qwen3_qknorm"])
def test_parameter_count_matches_transformers(tiny_hf_configs, family):
    hf = tiny_hf_configs[family]
    assert ModelShape.from_hf(hf).total_params() == _counts(hf)[0]


def test_7b_example_fits_an_80gb_h100():
    cfg, hf = _cfg("7b"), _qwen("7b")
    total, layer_split, layer_norms = _counts(hf)
    h, L, tp, dp = 3584, 28, 4, GPUS["7b"] // 4
    assert 152064 % (128 * tp) == 0  # no vocabulary padding at TP=4
    # PP=1: every layer, the embedding and the untied LM head on one stage, split over TP
    P = L * (layer_split // tp + layer_norms) + 2 * 152064 * h // tp + h
    resident_at_start = 2 * P + 4 * P + 4 * P // dp + 2 * P  # bf16 params, fp32 grads, fp32 main, FP8 copies
    free = H100_80GB - resident_at_start - 4 * GB
    static = int(0.5 * free)  # rollout.gpu_memory_utilization = 0.5 of the memory free at the engine's start
    assert cfg.rollout.tensor_model_parallel_size == 2  # one engine per 2 GPUs
    weights = 2 * total // 2  # half the bf16 weights per GPU
    kv_tokens = (static - weights) // (2 * L * 2 * 128 * 2)  # K and V, 4 KV heads of 128 over 2 GPUs, bf16
    T = 22528
    activations = L * 2 * h * T + 2 * (4 * h + ((28 + 8) * 128 + 28 * 128 + 3 * 18944) // tp) * T  # full recompute
    logits = 16 * T * 152064 // tp

    est = estimate_from_config(cfg, hf, GPUS["7b"])
    assert est.parts["actor_params"] == 2 * P and est.parts["actor_adam"] == 8 * P // dp
    assert est.parts["engine_weights"] == weights and est.kv_tokens == kv_tokens
    assert est.parts["activations"] == activations and est.parts["logits"] == logits
    assert est.phases["train"] == resident_at_start + 8 * P // dp + activations + logits + 4 * GB
    assert est.fits, est.problems
    assert kv_tokens > 30 * est.max_sequence_tokens == 30 * (2048 + 20480)
    assert est.phases["rollout"] == resident_at_start + 8 * P // dp + 4 * GB + static + 3 * GB < H100_80GB
    check_memory(cfg, hf, GPUS["7b"])  # no error


def test_32b_example_fits_with_its_rollout_tp_and_not_without():
    cfg, hf = _cfg("32b"), _qwen("32b")
    total, layer_split, layer_norms = _counts(hf)
    h, tp, dp = 5120, 8, GPUS["32b"] // 16  # PP=2: 32 layers per stage
    padded_vocab = 149 * 1024  # 152064 rows padded to a multiple of 128 x TP = 1024
    # the last stage holds the most: 32 layers, the LM head and the final norm
    P = 32 * (layer_split // tp + layer_norms) + padded_vocab * h // tp + h
    resident_at_start = 2 * P + 4 * P + 4 * P // dp + 2 * P  # as for the 7B
    free = H100_80GB - resident_at_start - 4 * GB
    static = int(0.6 * free)
    assert 2 * total > static, "a full bf16 copy of the 32B weights exceeds the engine's whole static pool"

    # one engine per GPU (rollout TP 1): a full bf16 copy per GPU does not fit
    est = estimate_from_config(cfg, hf, GPUS["32b"], rollout_tp=1)
    assert est.parts["actor_params"] == 2 * P and est.parts["engine_weights"] == 2 * total
    assert not est.fits and est.kv_tokens == 0
    assert any("KV cache holds 0 tokens" in p and "rollout tensor parallel size" in p for p in est.problems)
    assert any(p.startswith("weight sync") for p in est.problems)
    with pytest.raises(ConfigError, match=r"do not fit one GPU(.|\n)*rollout\.gpu_memory_utilization"):
        check_memory(cfg, hf, GPUS["32b"], rollout_tp=1)
    # the example's own rollout TP (8: one engine per node) passes the check the trainer runs
    assert cfg.rollout.tensor_model_parallel_size == 8
    est = check_memory(cfg, hf, GPUS["32b"])
    assert est.parts["engine_weights"] == 2 * total // 8 and est.fits
    # sync: the bridge's bucket (the full padded bf16 embedding, larger than the 512 MiB buckets), the
    # payload's bucket and the bridge's two scratch copies of a layer's full bf16 gate/up weight
    assert est.parts["sync_buffers"] == padded_vocab * h * 2 + 512 * 2**20 + 2 * (2 * 27648 * h * 2)

    for rollout_tp, kv_heads in ((8, 1), (4, 2)):  # 8 KV heads over the engine's GPUs
        est = estimate_from_config(cfg, hf, GPUS["32b"], rollout_tp=rollout_tp)
        assert est.parts["engine_weights"] == 2 * total // rollout_tp
        assert est.kv_tokens == (static - 2 * total // rollout_tp) // (2 * 64 * kv_heads * 128 * 2)
        assert est.fits, (rollout_tp, est.problems)


def test_a_micro_batch_too_large_names_the_token_budget():
    cfg = _cfg("7b", "actor.ppo_max_token_len_per_gpu=131072", "model.extra_transformer_config={}")
    est = estimate_from_config(cfg, _qwen("7b"), GPUS["7b"])
    assert not est.fits
    assert any(p.startswith("train") and "actor.ppo_max_token_len_per_gpu (now 131,072)" in p
               and "recompute_granularity=full" in p for p in est.problems)


@pytest.mark.parametrize("name", ["7b", "32b"])
def test_cuda_graphs_kept_by_sleep_count_in_train_and_sync(name, monkeypatch):
    """Issue 18 item 4: sglang 0.5.11 releases its CUDA graphs on sleep only when the scheduler
    captured them with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 (the colocated engine sets it unless the
    user set it); a user's 0 keeps them resident while the actor trains and during the sync."""
    from dapo_megatron.platform.memory import DEFAULT_CUDA_GRAPH

    cfg, hf = _cfg(name), _qwen(name)
    monkeypatch.delenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", raising=False)
    released = estimate_from_config(cfg, hf, GPUS[name])
    assert released.parts["cuda_graphs_resident"] == 0
    monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "0")
    kept = estimate_from_config(cfg, hf, GPUS[name])
    assert kept.parts["cuda_graphs_resident"] == DEFAULT_CUDA_GRAPH == 1 * GB
    for phase in ("train", "sync"):
        assert kept.phases[phase] == released.phases[phase] + DEFAULT_CUDA_GRAPH, phase
    assert kept.phases["rollout"] == released.phases["rollout"], "awake, the graphs are in the runtime term"
    monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "true")  # sglang's get_bool_env_var spelling
    assert estimate_from_config(cfg, hf, GPUS[name]).phases == released.phases
    # a GPU just large enough for the released train phase: the kept graphs tip it over, named
    tight = estimate_from_config(cfg, hf, GPUS[name], gpu_bytes=released.phases["train"] + 1,
                                 cuda_graphs_released=False)
    assert any(p.startswith("train:") and "SGLANG_MEMORY_SAVER_CUDA_GRAPH=1" in p for p in tight.problems)


def test_the_engine_sizes_its_kv_pool_after_the_allocator_cache_is_emptied():
    """Issue 18 item 6: F0 (the memory free at the engine's start) is the GPU minus the actor's
    resident state and the overhead because the engine starts after empty_cache; blocks the
    allocator kept would come off F0 and, times gpu_memory_utilization, off the KV pool."""
    cfg, hf = _cfg("7b"), _qwen("7b")
    base = estimate_from_config(cfg, hf, GPUS["7b"])
    cached = estimate_from_config(cfg, hf, GPUS["7b"], allocator_cache_bytes=10 * GB)
    assert base.parts["allocator_cache"] == 0 and cached.parts["allocator_cache"] == 10 * GB
    assert abs((base.parts["kv_cache"] - cached.parts["kv_cache"]) - 5 * GB) <= 1  # 0.5 x 10 GB, int() rounding


QWEN3_30B_A3B = dict(  # the published Qwen3-30B-A3B config.json
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6)
MOE_YAML = H100["7b"].replace("dapo_qwen2_5_7b_h100", "dapo_qwen3_30b_a3b_h100")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_parameter_count_matches_transformers(family):
    from conftest import tiny_moe_config

    hf = tiny_moe_config(family)
    assert ModelShape.from_hf(hf).total_params() == _counts(hf)[0]


def test_qwen3_30b_a3b_example_fits_16_h100_with_ep8_and_not_without_ep():
    """Expected terms from the transformers model's own parameter counts (meta device): the
    routed experts split over EP × ETP = 8 GPUs with their optimizer shards over
    EDP = 16 / (1 × 8 × 2) = 1, the rest over TP = 2 with its shards over DP = 4."""
    from transformers import Qwen3MoeConfig

    from dapo_megatron.models import ModelConfig
    from dapo_megatron.models.config import hf_to_transformer_config

    hf = Qwen3MoeConfig(**QWEN3_30B_A3B)
    cfg = load_config(DAPOConfig, MOE_YAML, ["model.hf_path=/models/x"])
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size,
            p.expert_tensor_parallel_size) == (2, 2, 8, 1)
    world, tp, dp, edp = 16, 2, 16 // 4, 16 // (1 * 8 * 2)
    cfg.check_world_size(world, 8)
    assert cfg.actor.routing_replay == "rollout"  # R3 on, under the full recompute (issue 36 item 5)
    model = _meta(hf)
    total = sum(x.numel() for x in model.parameters())
    assert 30.4e9 < total < 30.6e9
    layer = model.model.layers[0]
    experts = sum(x.numel() for n, x in layer.named_parameters() if ".experts." in n)
    norms_router = sum(x.numel() for n, x in layer.named_parameters() if "norm" in n or n == "mlp.gate.weight")
    split = sum(x.numel() for x in layer.parameters()) - experts - norms_router
    h, padded_vocab = 2048, 594 * 256  # 151936 rows padded to a multiple of 128 x TP = 256
    # the last stage holds the most: 24 layers, the untied LM head and the final norm
    P_dense = 24 * (split // tp + norms_router) + padded_vocab * h // tp + h
    P_experts = 24 * experts // 8
    est = estimate_from_config(cfg, hf, world)
    assert est.parts["actor_params"] == 2 * (P_dense + P_experts)
    assert est.parts["actor_grads"] == 4 * (P_dense + P_experts)
    assert est.parts["actor_adam"] == 8 * P_dense // dp + 8 * P_experts // edp
    assert est.parts["engine_weights"] == 2 * total // 4  # rollout TP 4
    assert est.fits, est.problems
    check_memory(cfg, hf, world)
    # the experts unsplit (EP = 1): a GPU holds all 128 experts of its stage, far over 80 GB
    no_ep = load_config(DAPOConfig, MOE_YAML, ["model.hf_path=/models/x", "parallel.expert_model_parallel_size=1"])
    assert not estimate_from_config(no_ep, hf, world).fits
    # the same MoE mapping the actor uses, on CPU (local spec): EP / ETP / TP fit the model
    tc = hf_to_transformer_config(hf, cfg.parallel, ModelConfig(transformer_impl="local"))
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (128, 8, 768)
    assert (tc.expert_model_parallel_size, tc.expert_tensor_parallel_size) == (8, 1)
    assert tc.moe_router_pre_softmax is False  # norm_topk_prob: softmax over the top 8
    assert tc.moe_token_dispatcher_type == "alltoall" and tc.moe_aux_loss_coeff == 0.001


# ---------------------------------------------------------------- DeepSeek-V3 architecture (MLA)
MOONLIGHT_16B_A3B = dict(  # the published moonshotai/Moonlight-16B-A3B config.json (model_type deepseek_v3)
    vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
    routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=6, first_k_dense_replace=1,
    norm_topk_prob=True, max_position_embeddings=8192, rope_theta=50000.0, tie_word_embeddings=False,
    rms_norm_eps=1e-5)
MOONLIGHT_YAML = H100["7b"].replace("dapo_qwen2_5_7b_h100", "dapo_moonlight_16b_a3b_h100")


def test_mla_parameter_count_matches_transformers():
    from conftest import V2_GROUPED, tiny_glm_config, tiny_mla_config, tiny_v2_config

    for hf in (tiny_mla_config(), tiny_mla_config(q_lora_rank=None), tiny_glm_config(),
               tiny_glm_config(attention_bias=False, use_qk_norm=False), tiny_v2_config(),
               tiny_v2_config(**V2_GROUPED)):
        model = _meta(hf)
        # transformers keeps the score-correction bias as a buffer; the estimate counts it as a weight
        bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
        assert ModelShape.from_hf(hf).total_params() == _counts(hf)[0] + bias


def test_mla_kv_cell_is_the_latent_and_the_rope_key_on_every_tp_rank():
    from transformers import DeepseekV3Config

    shape = ModelShape.from_hf(DeepseekV3Config(**MOONLIGHT_16B_A3B))
    # SGLang's MLA pool: kv_lora_rank + qk_rope_head_dim bf16 values per token and layer, not split over TP
    assert shape.kv_bytes_per_token(1) == shape.kv_bytes_per_token(8) == 27 * (512 + 64) * 2
    # what a GQA formula would have said (16 heads of K and V, head 192/128): 5.3x more
    assert 2 * 27 * 16 * 128 * 2 > 5 * shape.kv_bytes_per_token(2)


def test_moonlight_example_fits_16_h100_and_not_at_tp1_or_on_one_node():
    from transformers import DeepseekV3Config

    from dapo_megatron.models import ModelConfig
    from dapo_megatron.models.config import hf_to_transformer_config

    hf = DeepseekV3Config(**MOONLIGHT_16B_A3B)
    cfg = load_config(DAPOConfig, MOONLIGHT_YAML, ["model.hf_path=/models/x"])
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size,
            p.expert_tensor_parallel_size) == (2, 1, 8, 1)
    cfg.check_world_size(16, 8)
    est = estimate_from_config(cfg, hf, 16)
    assert est.fits, est.problems
    assert est.parts["kv_cache"] // ModelShape.from_hf(hf).kv_bytes_per_token(2) > 300_000
    assert est.parts["logits"] == 16 * 22528 * 163840 // 2
    check_memory(cfg, hf, 16)
    for world, over in ((16, "parallel.tensor_model_parallel_size=1"), (8, "parallel.tensor_model_parallel_size=2")):
        other = load_config(DAPOConfig, MOONLIGHT_YAML, ["model.hf_path=/models/x", over])
        assert not estimate_from_config(other, hf, world).fits, (world, over)
    # the mapping the actor uses, on CPU (local spec): MLA without a query LoRA, the bias, dense layer 0
    tc = hf_to_transformer_config(hf, cfg.parallel, ModelConfig(transformer_impl="local"))
    assert tc.multi_latent_attention and tc.q_lora_rank is None and (tc.kv_lora_rank, tc.qk_pos_emb_head_dim) == (512, 64)
    assert tc.moe_router_score_function == "sigmoid" and tc.moe_router_enable_expert_bias
    assert tc.moe_router_bias_update_rate == 0.0 and tc.moe_router_num_groups is None
    assert tc.moe_router_topk_scaling_factor == 2.446 and tc.moe_shared_expert_intermediate_size == 2 * 1408
    assert tc.moe_layer_freq == [0] + [1] * 26 and tc.ffn_hidden_size == 11264


DEEPSEEK_V2_LITE = dict(  # deepseek-ai/DeepSeek-V2-Lite's config.json (model_type deepseek_v2), its model fields
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
    norm_topk_prob=False, first_k_dense_replace=1, moe_layer_freq=1, max_position_embeddings=163840,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def test_deepseek_v2_lite_maps_to_megatron_cores_softmax_router_without_renormalisation():
    from transformers import DeepseekV2Config

    from dapo_megatron.models import ModelConfig
    from dapo_megatron.models.config import hf_to_transformer_config
    from dapo_megatron.platform import ParallelConfig

    hf = DeepseekV2Config(**DEEPSEEK_V2_LITE)
    assert 15.5e9 < ModelShape.from_hf(hf).total_params() < 16.0e9  # "16B total params" (15.7 B)
    # SGLang's MLA pool, as Moonlight: 27 layers of (512 + 64) bf16 values per token
    assert ModelShape.from_hf(hf).kv_bytes_per_token(2) == 27 * (512 + 64) * 2
    tc = hf_to_transformer_config(hf, ParallelConfig(1, 1, 8, 1), ModelConfig(transformer_impl="local"))
    # softmax over all 64 experts before the top 6, the 6 probabilities kept as they are: pre-softmax, no
    # renormalisation, routed_scaling_factor 1 (no scaling), greedy (no groups), no score-correction bias
    assert tc.moe_router_score_function == "softmax" and tc.moe_router_pre_softmax is True
    assert tc.moe_router_topk_scaling_factor is None and tc.moe_router_num_groups is None
    assert tc.moe_router_group_topk is None and not tc.moe_router_enable_expert_bias
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (64, 6, 1408)
    assert tc.moe_shared_expert_intermediate_size == 2 * 1408 and tc.moe_layer_freq == [0] + [1] * 26
    assert tc.multi_latent_attention and tc.q_lora_rank is None and tc.rope_type == "yarn"
    assert (tc.rotary_scaling_factor, tc.mscale, tc.mscale_all_dim) == (40.0, 0.707, 0.707)


# ---------------------------------------------------------------- GLM-4.5-Air (glm4_moe)
GLM4_5_AIR = dict(  # slime's scripts/models/glm4.5-106B-A12B.sh and transformers' Glm4MoeConfig defaults
    # (the zai-org config.json was not available here; routed_scaling_factor, groups, eps and max
    # positions are the defaults: see examples/configs/dapo_glm4_5_air_h100.yaml)
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
    num_attention_heads=96, num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5, attention_bias=True,
    use_qk_norm=False, n_shared_experts=1, n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1,
    first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True, max_position_embeddings=131072,
    rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=1)
GLM_AIR_YAML = H100["7b"].replace("dapo_qwen2_5_7b_h100", "dapo_glm4_5_air_h100")


def test_glm4_5_air_example_fits_64_h100_and_not_on_fewer_or_at_tp4():
    from transformers import Glm4MoeConfig

    from dapo_megatron.models import ModelConfig
    from dapo_megatron.models.config import hf_to_transformer_config

    hf = Glm4MoeConfig(**GLM4_5_AIR)
    assert 106e9 < ModelShape.from_hf(hf).total_params() < 108e9  # "106B total parameters"
    cfg = load_config(DAPOConfig, GLM_AIR_YAML, ["model.hf_path=/models/x"])
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size,
            p.expert_tensor_parallel_size) == (8, 2, 32, 1)
    cfg.check_world_size(64, 8)
    est = check_memory(cfg, hf, 64)
    assert est.kv_tokens > 200_000
    # GQA's cell at TP 8: one of the 8 KV heads per GPU, K and V of 128 per layer
    assert ModelShape.from_hf(hf).kv_bytes_per_token(8) == 2 * 46 * 1 * 128 * 2
    for world, overs in ((32, ["parallel.expert_model_parallel_size=16"]),
                         (64, ["parallel.tensor_model_parallel_size=4", "parallel.expert_model_parallel_size=16"]),
                         (64, ["parallel.expert_model_parallel_size=8"])):
        other = load_config(DAPOConfig, GLM_AIR_YAML, ["model.hf_path=/models/x", *overs])
        assert not estimate_from_config(other, hf, world).fits, (world, overs)
    # at the default static fraction 0.5 the KV pool holds about one longest sequence
    half = load_config(DAPOConfig, GLM_AIR_YAML, ["model.hf_path=/models/x", "rollout.gpu_memory_utilization=0.5"])
    assert estimate_from_config(half, hf, 64).kv_tokens < 2 * (2048 + 20480)
    # the mapping the actor uses, on CPU (local spec): partial rotary, qkv bias, no q/k norm, the bias, dense layer 0
    tc = hf_to_transformer_config(hf, cfg.parallel, ModelConfig(transformer_impl="local"))
    assert tc.add_qkv_bias and not tc.qk_layernorm and tc.kv_channels == 128 and tc.num_query_groups == 8
    assert tc.moe_router_score_function == "sigmoid" and tc.moe_router_enable_expert_bias
    assert tc.moe_router_num_groups is None and tc.moe_router_topk_scaling_factor is None
    assert tc.moe_shared_expert_intermediate_size == 1408 and tc.moe_shared_expert_gate is False
    assert tc.moe_layer_freq == [0] + [1] * 45 and tc.ffn_hidden_size == 10944
    from dapo_megatron.models.config import gpt_rope_kwargs

    assert gpt_rope_kwargs(hf)["rotary_percent"] == 0.5 and gpt_rope_kwargs(hf)["rotary_base"] == 1e6

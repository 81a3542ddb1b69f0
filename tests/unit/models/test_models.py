"""Model builder config mapping: HF config → TransformerConfig / GPTModel RoPE args, vocab
padding, and the FP8 validation logic (capability and TE version monkeypatched: the logic,
not the kernels)."""

from __future__ import annotations

import pytest
import torch

import dapo_megatron.models.config as mc
from conftest import tiny_hf_config
from dapo_megatron.models import (
    ModelConfig,
    gpt_rope_kwargs,
    hf_to_transformer_config,
    megatron_attention_heads,
    padded_vocab_size,
    resolve_transformer_impl,
    validate_fp8,
)
from dapo_megatron.platform import ParallelConfig


@pytest.mark.parametrize(
    "vocab,div,tp,want",
    [(250, 128, 1, 256), (250, 128, 2, 256), (257, 128, 2, 512), (49152, 128, 2, 49152),
     (151936, 128, 8, 152576), (32000, 64, 1, 32000), (1, 1, 1, 1)],
)
def test_padded_vocab_size(vocab, div, tp, want):
    assert padded_vocab_size(vocab, div, tp) == want


def test_padded_vocab_size_rejects_nonpositive():
    with pytest.raises(ValueError, match="positive"):
        padded_vocab_size(0, 128, 1)


def test_transformer_config_fields_per_family():
    llama = hf_to_transformer_config(tiny_hf_config("llama_untied", rms_norm_eps=1e-5), ParallelConfig(2, 1))
    assert (llama.num_layers, llama.hidden_size, llama.ffn_hidden_size) == (2, 64, 96)
    assert (llama.num_attention_heads, llama.num_query_groups, llama.kv_channels) == (4, 2, 16)
    assert llama.normalization == "RMSNorm" and llama.layernorm_epsilon == 1e-5
    assert llama.gated_linear_unit and llama.activation_func is torch.nn.functional.silu
    assert not llama.add_bias_linear and not llama.add_qkv_bias and not llama.qk_layernorm
    assert llama.tensor_model_parallel_size == 2 and llama.params_dtype == torch.float32
    assert llama.hidden_dropout == 0.0 and llama.attention_dropout == 0.0
    assert llama.transformer_impl == "local"  # no CUDA here
    qwen2 = hf_to_transformer_config(tiny_hf_config("qwen2_bias"), ParallelConfig())
    assert qwen2.add_qkv_bias and not qwen2.add_bias_linear
    qwen3 = hf_to_transformer_config(tiny_hf_config("qwen3_qknorm"), ParallelConfig())
    assert qwen3.qk_layernorm and qwen3.kv_channels == 24  # explicit head_dim, not 64/4
    bf16 = hf_to_transformer_config(tiny_hf_config("llama_tied"), ParallelConfig(), ModelConfig(params_dtype="bfloat16"))
    assert bf16.bf16 and bf16.params_dtype == torch.bfloat16


def test_layouts_that_cannot_be_split_name_the_field():
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor_model_parallel_size=4"):
        hf_to_transformer_config(tiny_hf_config("llama_tied"), ParallelConfig(4, 1), ModelConfig(pad_query_groups=False))
    with pytest.raises(ValueError, match="intermediate_size=96 is not divisible by tensor_model_parallel_size=64"):
        hf_to_transformer_config(tiny_hf_config("llama_tied", num_key_value_heads=4), ParallelConfig(64, 1))
    with pytest.raises(ValueError, match="num_hidden_layers=2 is not divisible by pipeline_model_parallel_size=4"):
        hf_to_transformer_config(tiny_hf_config("llama_tied"), ParallelConfig(1, 4))
    with pytest.raises(ValueError, match="model.params_dtype"):
        hf_to_transformer_config(tiny_hf_config("llama_tied"), ParallelConfig(), ModelConfig(params_dtype="fp8"))


@pytest.mark.parametrize(
    "heads,groups,tp,multiple,want",
    [(4, 2, 2, None, (4, 2)), (4, 2, 4, None, (8, 4)), (9, 3, 2, None, (12, 4)), (9, 3, 3, None, (9, 3)),
     (9, 3, 1, 4, (12, 4)), (9, 3, 4, 4, (12, 4)), (8, 8, 2, None, (8, 8))],
)
def test_query_groups_are_zero_padded_to_a_multiple_of_tp(heads, groups, tp, multiple, want):
    cfg = tiny_hf_config("llama_untied", hidden_size=heads * 8, num_attention_heads=heads, num_key_value_heads=groups)
    assert megatron_attention_heads(cfg, tp, ModelConfig(query_groups_multiple=multiple)) == want
    if want[1] != groups:
        tc = hf_to_transformer_config(cfg, ParallelConfig(tp, 1), ModelConfig(query_groups_multiple=multiple))
        assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (*want, 8)


def test_unsupported_hf_configs_name_the_field():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type='gpt2'"):
        hf_to_transformer_config(GPT2Config(), ParallelConfig())
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        hf_to_transformer_config(tiny_hf_config("llama_tied", hidden_act="gelu"), ParallelConfig())
    with pytest.raises(ValueError, match="attention_bias=True is not supported for llama"):
        hf_to_transformer_config(tiny_hf_config("llama_tied", attention_bias=True), ParallelConfig())
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf_to_transformer_config(tiny_hf_config("qwen2_bias", use_sliding_window=True), ParallelConfig())


def _megatron_angles(kwargs: dict, dim: int, seq: int) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=dim, use_cpu_initialization=True, **kwargs)
    return rope.get_freqs_non_repeated(seq)  # [seq, dim/2] rotation angles (what forward() repeats)


def _hf_angles(hf_config, seq: int) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = hf_config.rope_parameters["rope_type"]
    if kind == "default":
        dim = hf_config.head_dim
        theta = hf_config.rope_parameters["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    else:
        inv, scale = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
        assert scale == 1.0
    return torch.outer(torch.arange(seq, dtype=torch.float64), inv.double())


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 5000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    ],
)
def test_rope_angles_match_transformers(rope):
    cfg = tiny_hf_config("llama_untied", rope_parameters=rope, max_position_embeddings=16384)
    kwargs = gpt_rope_kwargs(cfg)
    ours = _megatron_angles(kwargs, cfg.head_dim, 4096).double()
    ref = _hf_angles(cfg, 4096)
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-3)
    if rope["rope_type"] == "llama3":
        assert kwargs["rope_scaling"] and kwargs["rope_scaling_factor"] == 8.0
        # the scaling really changes low frequencies (so the comparison is meaningful)
        plain = _megatron_angles({**kwargs, "rope_scaling": False}, cfg.head_dim, 4096).double()
        assert not torch.allclose(plain, ref, rtol=1e-5, atol=1e-3)


def test_rope_scaling_that_megatron_cannot_reproduce_names_the_field():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    with pytest.raises(ValueError, match="rope_parameters.low_freq_factor"):
        gpt_rope_kwargs(tiny_hf_config("llama_untied", rope_parameters=llama3, max_position_embeddings=16384))
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        gpt_rope_kwargs(tiny_hf_config("qwen2_bias", rope_parameters=yarn))


# ---- FP8 / Transformer Engine selection (capability and TE version monkeypatched) ----

@pytest.fixture
def gpu(monkeypatch):
    """Pretend to run on a GPU with the given capability and TE version."""
    def set_(cc, te):
        monkeypatch.setattr(mc, "_cuda_capability", lambda: cc)
        monkeypatch.setattr(mc, "_te_version", lambda: te)
    return set_


def test_fp8_on_cpu_is_rejected_naming_model_fp8(gpu):
    gpu(None, None)
    with pytest.raises(ValueError, match=r"model\.fp8 needs a CUDA GPU"):
        validate_fp8(ModelConfig(fp8="e4m3"), num_layers=4)
    validate_fp8(ModelConfig(fp8=None), num_layers=4)  # no FP8: nothing to check


@pytest.mark.parametrize(
    "cc,te,cfg,match",
    [
        ((8, 0), "2.4.0", dict(fp8="hybrid"), "compute capability >= 8.9, this GPU has 8.0"),
        ((9, 0), None, dict(fp8="hybrid"), "needs Transformer Engine"),
        ((9, 0), "2.4.0", dict(fp8="e5m2"), r"model\.fp8='e5m2'"),
        ((9, 0), "2.4.0", dict(fp8="hybrid", fp8_recipe="nvfp4"), r"model\.fp8_recipe='nvfp4'"),
        ((9, 0), "2.1.0", dict(fp8="hybrid", fp8_recipe="tensorwise"), r"Transformer Engine >= 2\.2\.0\.dev0, installed 2\.1\.0"),
        ((9, 0), "2.2.0", dict(fp8="e4m3", fp8_recipe="blockwise"), r"Transformer Engine >= 2\.3\.0\.dev0"),
        ((9, 0), "2.8.0", dict(fp8="e4m3", fp8_recipe="mxfp8"), r"fp8_recipe='mxfp8' needs compute capability >= 10\.0"),
        ((8, 9), "2.8.0", dict(fp8="e4m3", fp8_recipe="blockwise"), r"needs compute capability >= 9\.0"),
        ((9, 0), "2.8.0", dict(fp8="e4m3", transformer_impl="local"), "transformer_impl='transformer_engine'"),
        ((9, 0), "2.8.0", dict(fp8="e4m3", fp8_recipe="delayed", first_last_layers_bf16=True), "first_last_layers_bf16"),
        ((9, 0), "2.8.0", dict(fp8="e4m3", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                               num_layers_at_start_in_bf16=5), "num_layers_at_start_in_bf16=5"),
        ((9, 0), "2.8.0", dict(fp8="e4m3", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                               num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=2), "leaves no FP8 layer"),
    ],
)
def test_fp8_settings_that_cannot_run_are_rejected(gpu, cc, te, cfg, match):
    gpu(cc, te)
    with pytest.raises(ValueError, match=match):
        validate_fp8(ModelConfig(**cfg), num_layers=4)


@pytest.mark.parametrize(
    "cc,te,recipe",
    [((8, 9), "1.12.0", "delayed"), ((9, 0), "2.2.0", "tensorwise"), ((9, 0), "2.3.0", "blockwise"),
     ((10, 0), "2.1.0", "mxfp8")],
)
def test_supported_fp8_maps_onto_transformer_config(gpu, cc, te, recipe):
    gpu(cc, te)
    cfg = ModelConfig(fp8="hybrid", fp8_recipe=recipe, first_last_layers_bf16=recipe != "delayed",
                      num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    tc = hf_to_transformer_config(tiny_hf_config("llama_untied", num_hidden_layers=4), ParallelConfig(), cfg)
    assert tc.fp8 == "hybrid" and tc.fp8_recipe == recipe
    assert tc.first_last_layers_bf16 == (recipe != "delayed")
    assert tc.num_layers_at_start_in_bf16 == 1 and tc.num_layers_at_end_in_bf16 == 1
    assert tc.transformer_impl == "transformer_engine"  # "auto" picks TE on a (pretend) GPU with TE


def test_transformer_impl_choice(gpu):
    gpu(None, None)
    assert resolve_transformer_impl(ModelConfig()) == "local"
    with pytest.raises(ValueError, match="model.transformer_impl='transformer_engine' needs CUDA"):
        resolve_transformer_impl(ModelConfig(transformer_impl="transformer_engine"))
    with pytest.raises(ValueError, match="model.transformer_impl='te'"):
        resolve_transformer_impl(ModelConfig(transformer_impl="te"))
    gpu((9, 0), "2.8.0")
    assert resolve_transformer_impl(ModelConfig()) == "transformer_engine"
    assert resolve_transformer_impl(ModelConfig(transformer_impl="local")) == "local"

"""HF config → megatron-core TransformerConfig + layer spec + GPTModel (local on CPU, TE/FP8 on GPU).

Design: docs/design.md §2 (parallel layouts) and §2.1 (mixtures of experts).
"""

from .builder import build_gpt_model, layer_spec, load_hf_config
from .config import (
    ModelConfig,
    check_hf_config,
    gpt_rope_kwargs,
    head_dim,
    hf_to_transformer_config,
    megatron_attention_heads,
    padded_vocab_size,
    resolve_transformer_impl,
    rope_parameters,
    validate_fp8,
)

__all__ = [
    "ModelConfig",
    "build_gpt_model",
    "check_hf_config",
    "gpt_rope_kwargs",
    "head_dim",
    "hf_to_transformer_config",
    "layer_spec",
    "load_hf_config",
    "megatron_attention_heads",
    "padded_vocab_size",
    "resolve_transformer_impl",
    "rope_parameters",
    "validate_fp8",
]

"""HF config → megatron-core TransformerConfig + layer spec + GPTModel (local on CPU, TE/FP8 on GPU).

The names below load their submodule on first use (PEP 562), so that loading a config (which
reads :class:`~.config.ModelConfig`) does not load torch and megatron-core through :mod:`.builder`.

Design: docs/design.md §2 (parallel layouts) and §2.1 (mixtures of experts).
"""

from __future__ import annotations

from dapo_megatron.lazy import lazy_exports

# public name -> its submodule
_EXPORTS = {
    "build_gpt_model": "builder",
    "layer_spec": "builder",
    "load_hf_config": "builder",
    "ModelConfig": "config",
    "check_hf_config": "config",
    "gpt_rope_kwargs": "config",
    "head_dim": "config",
    "hf_to_transformer_config": "config",
    "megatron_attention_heads": "config",
    "padded_vocab_size": "config",
    "resolve_transformer_impl": "config",
    "rope_parameters": "config",
    "validate_fp8": "config",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

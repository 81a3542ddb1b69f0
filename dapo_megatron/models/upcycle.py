"""Sparse upcycling: a dense Llama checkpoint → a Mixtral mixture of experts whose step-0
outputs are the dense model's (Komatsuzaki et al. 2023, "Sparse Upcycling"; Megatron-LM's
``megatron/core/transformer/moe/upcycling_utils.py`` does the same inside megatron-core).

Why Mixtral: Mixtral *is* Llama with the MLP replaced by ``MixtralSparseMoeBlock`` (same
attention, norms, RoPE, embeddings), and its router renormalises the top-k softmax weights to
sum to 1 (transformers ``MixtralTopKRouter``; megatron-core ``moe_router_pre_softmax=False``
with softmax after top-k, :func:`dapo_megatron.models.config.moe_layout`). With every expert a
copy of the dense MLP, a token's MoE output is ``sum_k w_k · MLP(x) = MLP(x)`` whatever the
router picks, so the router can start random: small random weights break the symmetry (tokens
go to different experts, which then receive different gradients and diverge) without changing
the step-0 model beyond fp32 rounding of the weighted sum.

Tensor names are HF checkpoint names (``model.layers.{l}.block_sparse_moe.experts.{e}.w1/w3/w2``
and ``...block_sparse_moe.gate.weight``, as Mixtral checkpoints on the Hub hold them and
transformers 5 writes them; it fuses the experts on load, ``conversion_mapping.py`` "mixtral").

Design: docs/design.md §2.1 (mixtures of experts).
"""

from __future__ import annotations

from typing import Mapping

import torch

# the dense-MLP checkpoint leaf → Mixtral's expert leaf (MixtralBlockSparseTop2MLP: w1 gate, w3 up, w2 down)
DENSE_TO_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# LlamaConfig fields that Mixtral's config and modules read the same way (attention, norms, RoPE,
# embeddings, special tokens). Anything else of the dense config is checked in upcycle_config.
CARRIED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
                  "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
                  "tie_word_embeddings", "rope_parameters", "attention_dropout")
MIXTRAL_DEFAULT_AUX_LOSS_COEF = 0.001  # transformers MixtralConfig.router_aux_loss_coef


def upcycle_config(dense_config, num_experts: int, top_k: int,
                   router_aux_loss_coef: float = MIXTRAL_DEFAULT_AUX_LOSS_COEF):
    """The ``MixtralConfig`` of the upcycled model: every field of :data:`CARRIED_FIELDS` from
    ``dense_config``, ``num_local_experts`` = ``num_experts`` experts of the dense
    ``intermediate_size``, ``num_experts_per_tok`` = ``top_k``, no sliding window, no router
    jitter.

    Args:
        dense_config: a transformers ``LlamaConfig`` (``model_type == "llama"``).
        num_experts: experts per layer, >= 1.
        top_k: experts per token, 1..num_experts.
        router_aux_loss_coef: ``router_aux_loss_coef`` (megatron-core ``moe_aux_loss_coeff``).

    Raises:
        ValueError: naming the field: a non-Llama model, a Llama whose attention or MLP
            Mixtral cannot hold (``attention_bias``, ``mlp_bias``, an activation other than
            silu), or ``top_k`` outside 1..num_experts.
    """
    # transformers here, not at the top: models/ holds a config section, and the config loads without it
    from transformers import MixtralConfig

    model_type = getattr(dense_config, "model_type", None)
    if model_type != "llama":
        raise ValueError(f"model_type={model_type!r}: upcycling maps a Llama model onto Mixtral "
                         "(same attention and norms); only model_type 'llama' (e.g. SmolLM2) is supported")
    if getattr(dense_config, "attention_bias", False):
        raise ValueError("attention_bias=True: Mixtral's q/k/v/o projections have no bias")
    if getattr(dense_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True: Mixtral's experts have no bias")
    if getattr(dense_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={dense_config.hidden_act!r}: only 'silu' (SwiGLU) is supported")
    if int(getattr(dense_config, "pretraining_tp", 1) or 1) != 1:
        raise ValueError(f"pretraining_tp={dense_config.pretraining_tp}: only 1 is supported (Mixtral has no split MLP)")
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    fields = {k: getattr(dense_config, k) for k in CARRIED_FIELDS if getattr(dense_config, k, None) is not None}
    # architectures: SGLang and vLLM pick the model class from config.json (models.config.with_architectures)
    return MixtralConfig(**fields, num_local_experts=int(num_experts), num_experts_per_tok=int(top_k),
                         router_aux_loss_coef=float(router_aux_loss_coef), router_jitter_noise=0.0,
                         sliding_window=None, output_router_logits=False, architectures=["MixtralForCausalLM"])


def upcycle_state_dict(dense_state: Mapping[str, torch.Tensor], moe_config, router_init_std: float,
                       seed: int = 0) -> dict[str, torch.Tensor]:
    """The upcycled checkpoint tensors, under Mixtral's HF checkpoint names.

    Every non-MLP tensor is the dense one; ``model.layers.{l}.mlp.{gate,up,down}_proj.weight``
    becomes ``model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` for each of the
    ``moe_config.num_local_experts`` experts (independent copies, contiguous), and each layer
    gains a router ``block_sparse_moe.gate.weight`` [E, hidden] drawn from
    N(0, router_init_std²) with ``torch.Generator().manual_seed(seed)`` (layer by layer, so the
    same seed gives the same routers). A tied ``lm_head.weight`` is dropped (transformers ties it
    to ``model.embed_tokens.weight`` on load). Dtypes are kept; the router takes the dtype of
    the layer's dense ``gate_proj``.

    Raises:
        KeyError: a layer of ``moe_config.num_hidden_layers`` lacks one of its three MLP tensors,
            or a tensor outside the Llama names would be silently copied (named).
    """
    experts, hidden = moe_config.num_local_experts, moe_config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in dense_state.items():
        if ".mlp." in name:
            continue  # expanded per layer below
        if name == "lm_head.weight" and moe_config.tie_word_embeddings:
            continue
        if not (name.startswith("model.") or name == "lm_head.weight"):
            raise KeyError(f"{name}: not a Llama checkpoint tensor (expected model.* or lm_head.weight)")
        out[name] = t.detach().clone()
    for layer in range(moe_config.num_hidden_layers):
        dense_prefix, moe_prefix = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.block_sparse_moe."
        for leaf, expert_leaf in DENSE_TO_EXPERT.items():
            key = f"{dense_prefix}{leaf}.weight"
            if key not in dense_state:
                raise KeyError(f"{key}: missing from the dense checkpoint (layer {layer} has no dense MLP to copy)")
            for e in range(experts):
                out[f"{moe_prefix}experts.{e}.{expert_leaf}.weight"] = dense_state[key].detach().clone().contiguous()
        dtype = dense_state[f"{dense_prefix}gate_proj.weight"].dtype
        router = torch.randn(experts, hidden, generator=gen, dtype=torch.float32) * router_init_std
        out[f"{moe_prefix}gate.weight"] = router.to(dtype)
    mapped = {f"model.layers.{l}.mlp.{leaf}.weight" for l in range(moe_config.num_hidden_layers) for leaf in DENSE_TO_EXPERT}
    stray = [n for n in dense_state if ".mlp." in n and n not in mapped]
    if stray:
        raise KeyError(f"{stray[0]}: a dense MLP tensor the upcycling does not map (only gate/up/down_proj.weight)")
    return out

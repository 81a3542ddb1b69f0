"""Build a megatron-core ``GPTModel`` from an HF config for one rank of a parallel layout.

Design: docs/design.md §2 (parallel layouts) and §5 (megatron-core on CPU).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from .config import ATTENTION_FAMILY, has_qk_norm, moe_grouped_gemm, moe_layout
from .config import (
    ModelConfig,
    check_hf_config,
    gpt_rope_kwargs,
    hf_to_transformer_config,
    padded_vocab_size,
    resolve_transformer_impl,
    with_architectures,
)
from dapo_megatron.platform import ParallelConfig

if TYPE_CHECKING:
    from dapo_megatron.platform import ParallelDims


def load_hf_config(path: str, gguf_file: Optional[str] = None):
    """Read an HF ``PretrainedConfig`` from a model directory (config.json) or a GGUF file.

    Args:
        path: directory with config.json, or with the GGUF file named by ``gguf_file``.
        gguf_file: GGUF file name inside ``path``.

    Raises:
        FileNotFoundError: ``path`` (or the GGUF file) does not exist.
        ValueError: the config's model_type is not supported (see ``check_hf_config``).
    """
    # transformers here, not at the top: models/ holds a config section, and the config loads without it
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF model directory {path!r} does not exist")
    if gguf_file is not None and not os.path.isfile(os.path.join(path, gguf_file)):
        raise FileNotFoundError(f"gguf_file {gguf_file!r} not found in {path!r}")
    cfg = AutoConfig.from_pretrained(path, gguf_file=gguf_file) if gguf_file else AutoConfig.from_pretrained(path)
    check_hf_config(cfg)
    # a GGUF file's config names no class: every config.json written from it must (with_architectures)
    return with_architectures(cfg)


def layer_spec(hf_config, model_cfg: ModelConfig):
    """The megatron-core transformer layer spec for this model: local or Transformer Engine.

    With the local spec the pre-attention / pre-MLP RMSNorms are separate modules
    (``input_layernorm``, ``pre_mlp_layernorm``); with the TE spec they are fused into
    ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``. The bridge
    handles both parameter name sets.

    Both spec functions take these keywords in megatron-core 0.16.1 and 0.19.2
    (models/gpt/gpt_layer_specs.py: 0.19.2 wraps ``get_gpt_layer_with_transformer_engine_submodules``
    :179 and ``get_gpt_layer_local_submodules`` :359 at :351 and :467, where core_v0.16.1 defined
    them at :171 and :306; 0.19 dropped ``moe_use_legacy_grouped_gemm``, which is not passed here).
    MoE models (megatron-core models/gpt/gpt_layer_specs.py with ``num_experts``, and
    models/gpt/moe_module_specs.py): the MLP is an ``MoELayer`` (``TopKRouter``, the experts,
    ``SharedExpertMLP`` when the model has one) behind a separate ``pre_mlp_layernorm`` in both
    specs. The local spec runs the experts as ``SequentialMLP`` (one ``MLP`` per local expert,
    ``experts.local_experts.{i}``), the TE spec with ``moe_grouped_gemm`` as ``TEGroupedMLP``
    (``experts.linear_fc1.weight{i}``, one grouped GEMM per rank); TE is imported only then.
    """
    check_hf_config(hf_config)
    qk_norm = has_qk_norm(hf_config)
    moe = moe_layout(hf_config)
    if ATTENTION_FAMILY[hf_config.model_type] == "mla" or (moe is not None and moe.dense_layers):
        raise ValueError(f"hf_config.model_type={hf_config.model_type!r} mixes dense and MoE layers or uses MLA: its "
                         "spec is per layer, build it with decoder_block_spec")
    moe_kwargs = {} if moe is None else dict(num_experts=moe.num_experts, moe_grouped_gemm=moe_grouped_gemm(model_cfg))
    if resolve_transformer_impl(model_cfg) == "transformer_engine":
        # megatron-core here, not at the top: models/ and actor/ hold config sections, and the config loads without it
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm, **moe_kwargs)
    # megatron-core here, not at the top: models/ and actor/ hold config sections, and the config loads without it
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm", **moe_kwargs)


def decoder_block_spec(config, model_cfg: ModelConfig, *, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """The per-layer spec of a model whose layers differ (DeepSeek-V3: ``first_k_dense_replace``
    dense layers, then MoE ones; multi-head latent attention), sliced to this pipeline stage:
    megatron-core's ``get_gpt_decoder_block_spec`` (models/gpt/gpt_layer_specs.py:676), which reads
    ``config.moe_layer_freq`` and ``config.multi_latent_attention``. On the local spec the MLA
    layer is ``MLASelfAttention`` with ``ColumnParallelLinear`` down/up projections and
    ``q_layernorm`` / ``kv_layernorm`` torch RMSNorms (gpt_layer_specs.py:413-431); every MLA layer
    is :class:`~.mla.HFMLASelfAttention` (without a query LoRA, a plain q projection as transformers')."""
    # megatron-core here, not at the top: models/ and actor/ hold config sections, and the config loads without it
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = resolve_transformer_impl(model_cfg) == "transformer_engine"
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    if config.multi_latent_attention:
        # here, not at the top: models/mla.py imports megatron-core, which the config loads without
        from .mla import use_hf_mla_attention

        for spec in block.layer_specs:
            use_hf_mla_attention(spec.submodules.self_attention, config.q_lora_rank, local_core_attention=not use_te)
    return block


def build_gpt_model(
    hf_config,
    model_cfg: Optional[ModelConfig] = None,
    *,
    parallel: ParallelDims,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    routing_replay: bool = False,
):
    """Build the ``GPTModel`` (this rank's TP shard of this rank's PP stage).

    Megatron's parallel state must be initialised
    (:func:`dapo_megatron.platform.init_distributed`, which returns ``parallel``). Weights are
    randomly initialised (``init_method_std`` = HF ``initializer_range``); load real ones with
    :func:`dapo_megatron.bridge.load_hf_weights` or
    :func:`dapo_megatron.bridge.load_model_checkpoint`.

    Args:
        hf_config: HF LlamaConfig / Qwen2Config / Qwen3Config, or the MoE Qwen3MoeConfig /
            Qwen2MoeConfig / MixtralConfig.
        model_cfg: dtype, vocab padding, spec and FP8 choices; ``ModelConfig()`` if None.
        parallel: this rank's layout (TP size and PP stage; EP and ETP sizes for an MoE model,
            whose rank holds experts ``ep_rank · E/EP … (ep_rank + 1) · E/EP - 1``).
        pre_process / post_process: whether this stage holds the embedding / the final
            norm and output layer; default from the PP rank (first / last stage).
        vp_stage: virtual pipeline stage index (None without interleaving); with it,
            pass ``pre_process`` and ``post_process`` (``parallel`` has no VP size).
        routing_replay: an MoE model whose routers can replay given routes
            (``TransformerConfig.moe_enable_routing_replay``: each ``TopKRouter`` gets a
            megatron-core ``RouterReplay``; ``actor.routing_replay: rollout``).

    Returns:
        ``megatron.core.models.gpt.GPTModel`` with ``vocab_size`` =
        :func:`padded_vocab_size` (real vocab padded to ``make_vocab_size_divisible_by × TP``),
        ``share_embeddings_and_output_weights`` = ``hf_config.tie_word_embeddings`` (with
        PP > 1 megatron-core keeps a copy on the last stage, synchronised through the
        embedding group), RoPE from :func:`gpt_rope_kwargs`. The HF config is attached
        as ``model.hf_config``, the real vocab size as ``model.real_vocab_size`` and the layer
        spec it was built with as ``model.transformer_impl``.

    Raises:
        ValueError: see :func:`hf_to_transformer_config`; ``vp_stage`` without
            ``pre_process`` / ``post_process``; ``routing_replay`` on a dense model.
    """
    # megatron-core here, not at the top: models/ and actor/ hold config sections, and the config loads without it
    from megatron.core.models.gpt import GPTModel

    model_cfg = model_cfg or ModelConfig()
    tp = parallel.tp_size
    config = hf_to_transformer_config(
        hf_config, ParallelConfig(tp, parallel.pp_size, parallel.ep_size, parallel.etp_size), model_cfg,
        routing_replay=routing_replay)
    if vp_stage is not None and (pre_process is None or post_process is None):
        raise ValueError("build_gpt_model(vp_stage=...) needs pre_process and post_process: whether a virtual "
                         "stage is first or last depends on the VP size, which the parallel layout does not hold")
    if pre_process is None:
        pre_process = parallel.is_pp_first
    if post_process is None:
        post_process = parallel.is_pp_last
    moe = moe_layout(hf_config)
    per_layer = getattr(config, "multi_latent_attention", False) or (moe is not None and bool(moe.dense_layers))
    spec = decoder_block_spec(config, model_cfg, vp_stage=vp_stage, pp_rank=parallel.pp_rank) if per_layer \
        else layer_spec(hf_config, model_cfg)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, model_cfg.make_vocab_size_divisible_by, tp),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        vp_stage=vp_stage,
        # MLA builds its own rotary embedding from the MLATransformerConfig (config.mla_rope_kwargs)
        **(dict(rotary_base=config.rotary_base) if getattr(config, "multi_latent_attention", False)
           else gpt_rope_kwargs(hf_config)),
    )
    model.hf_config = hf_config
    model.real_vocab_size = hf_config.vocab_size
    model.model_cfg = model_cfg
    model.transformer_impl = resolve_transformer_impl(model_cfg)  # "local" / "transformer_engine", as built
    return model

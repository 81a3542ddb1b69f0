"""Multi-head latent attention on megatron-core's local (CPU) spec.

megatron-core 0.19.2 builds MLA's core attention with ``k_channels`` / ``v_channels``
(transformer/multi_latent_attention.py:207-217: a query/key head of ``qk_head_dim +
qk_pos_emb_head_dim``, a value head of ``v_head_dim``), which only Transformer Engine's
``TEDotProductAttention`` accepts; the local spec's ``DotProductAttention``
(transformer/dot_product_attention.py:42) takes neither. Its computation does not need them:
scores are ``baddbmm`` over whatever head size query and key have, scaled by the
``softmax_scale`` MLA passes (YaRN's ``mscale² / √d``), and the output is ``heads × kv_channels``
wide, with ``kv_channels`` set to ``v_head_dim`` (models/config.py). :class:`MLADotProductAttention`
checks the two sizes against that and runs ``DotProductAttention`` unchanged.

Design: docs/design.md §2.1 (DeepSeek-V3).
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    """``DotProductAttention`` that accepts MLA's ``k_channels`` / ``v_channels``.

    Raises:
        ValueError: ``v_channels`` differs from ``config.kv_channels`` (the output width would be
            wrong), or ``k_channels`` from the MLA query head size.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"MLA v_channels={v_channels} must equal config.kv_channels={config.kv_channels} "
                             "(the local core attention's output is heads × kv_channels wide)")
        q_head = getattr(config, "qk_head_dim", 0) + getattr(config, "qk_pos_emb_head_dim", 0)
        if k_channels is not None and k_channels != q_head:
            raise ValueError(f"MLA k_channels={k_channels} must equal qk_head_dim + qk_pos_emb_head_dim = {q_head}")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)

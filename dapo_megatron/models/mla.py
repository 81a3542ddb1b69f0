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

Without a query LoRA (``q_lora_rank`` None: DeepSeek-V2-Lite, Moonlight) transformers' attention
projects the query with a plain ``q_proj`` and normalises only the KV latent
(``DeepseekV3Attention``: ``q_proj`` when ``q_lora_rank is None``, ``kv_a_layernorm``). megatron-core
0.19.2 ties both norms to ``qk_layernorm``: its ``QKNormConfigResolver``
(transformer/mla_qk_norm_config.py:138-150, :171-172) refuses the local spec's q norm without a
query LoRA (``_raise_unused_q_norm``, :259) and on Transformer Engine makes ``linear_q_proj`` a
fused RMSNorm + linear, a norm the HF model does not have. :class:`HFMLASelfAttention` resolves
that one case as transformers computes it: a plain column-parallel ``linear_q_proj``, no q norm,
the KV side as megatron-core resolves it.

Design: docs/design.md §2.1 (DeepSeek-V3).
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


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


class HFMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` that, without a query LoRA, projects the query as transformers does
    (a plain ``linear_q_proj``, no q norm; the module docstring says why). With a query LoRA, or
    with ``qk_layernorm`` off, megatron-core's resolution is used unchanged.

    Raises:
        RuntimeError / ValueError: as megatron-core's resolver, for the KV side's spec.
    """

    def _resolve_qk_norm_config(self, submodules):
        if self.config.q_lora_rank is not None or not self.config.qk_layernorm:
            return super()._resolve_qk_norm_config(submodules)
        # the resolver's own helpers (mla_qk_norm_config.py:152-167, :209-218, :233-236, :283-292), so the
        # KV side is exactly what megatron-core builds; only the query side differs
        resolver = QKNormConfigResolver(self.config, submodules)
        q_linear = submodules.linear_q_proj
        if q_linear is None or resolver._is_fused_norm_linear(q_linear):
            q_linear = resolver.linear_impl  # the backend's ColumnParallelLinear / TEColumnParallelLinear
        kv_norm = submodules.kv_layernorm or IdentityOp
        if resolver._is_trivial(kv_norm):
            kv_up = resolver._mla_fused_linear_or_default(submodules.linear_kv_up_proj, "linear_kv_up_proj")
        else:
            kv_up = resolver._non_fused_or_default(submodules.linear_kv_up_proj, "linear_kv_up_proj")
        return resolver._result(linear_q_proj=q_linear, linear_q_up_proj=IdentityOp, linear_kv_up_proj=kv_up,
                                q_layernorm=IdentityOp, kv_layernorm=kv_norm)


def use_hf_mla_attention(attention_spec, q_lora_rank, *, local_core_attention: bool) -> None:
    """Point one layer's MLA self-attention ``ModuleSpec`` (megatron-core's
    ``get_gpt_decoder_block_spec``, in place) at :class:`HFMLASelfAttention`; without a query LoRA
    (``q_lora_rank`` None) its ``q_layernorm`` slot is emptied (there is no q latent to normalise;
    megatron-core's resolver refuses a q norm it cannot use). ``local_core_attention``: the local
    spec, whose ``DotProductAttention`` cannot take MLA's k/v channel sizes, gets
    :class:`MLADotProductAttention`."""
    attention_spec.module = HFMLASelfAttention
    if q_lora_rank is None:
        attention_spec.submodules.q_layernorm = IdentityOp
    if local_core_attention:
        attention_spec.submodules.core_attention = MLADotProductAttention

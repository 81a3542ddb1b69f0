"""The one HF ⇄ Megatron parameter table (import, export and live weight sync all use it).

Each supported family has one ordered table of :class:`Rule` s. A rule names one
megatron-core ``GPTModel`` parameter (local-spec name, ``{layer}`` = global 0-based layer
index), the HF tensor(s) it is made of, and how it is laid out across tensor-parallel
ranks:

==============  ============================================================================
split           Megatron layout on TP rank r of T
==============  ============================================================================
replicated      the HF tensor itself (RMSNorm weights, q/k norm)
column          rows ``r·n/T … (r+1)·n/T`` of the HF tensor (output dim split)
row             columns ``r·n/T …`` (input dim split: ``down_proj``)
row_heads       ``o_proj``: as row, after zero columns for padded query groups
vocab           embedding / lm_head rows zero-padded to the padded vocab, then row-split
qkv             per query group g: [q heads of g; k_g; v_g] (``heads/groups × head_dim``,
                ``head_dim``, ``head_dim`` rows), T splits on whole groups (GQA-safe);
                zero groups appended when the model pads query groups to a multiple of T
gate_up         ``[gate_r; up_r]``: each rank holds its slice of gate then its slice of up
mla_down        MLA down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``): ``column`` on the
                local spec (megatron-core builds them as ColumnParallelLinear and gathers the
                output), ``replicated`` on the TE spec (TELinear ``parallel_mode='duplicated'``,
                multi_latent_attention.py:521-530, :572-580); :attr:`ModelLayout.mla_down_split`
==============  ============================================================================

Multi-head latent attention (``deepseek_v3``, ``deepseek_v2``): HF ``q_a_proj`` / ``q_b_proj`` (or ``q_proj``),
``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj`` and the latent norms ``q_a_layernorm`` /
``kv_a_layernorm`` are megatron-core's ``linear_q_down_proj`` / ``linear_q_up_proj`` (or
``linear_q_proj``), ``linear_kv_down_proj``, ``linear_kv_up_proj``, ``linear_proj``, ``q_layernorm``,
``kv_layernorm``, row for row: both lay the up-projections out head by head ([nope; rope] per
query head, [k_nope; v] per KV head: HF ``view(..., -1, qk_head_dim)``, megatron-core
``view(..., n, q_head_dim)`` then ``split``), and ``kv_a_proj_with_mqa``'s rows are [latent; rope
key] in both. The up-projections and ``o_proj`` split over TP by heads (column / row). SGLang
0.5.x's ``DeepseekV2ForCausalLM.load_weights`` takes these per-tensor HF names and fuses
``q_a_proj`` with ``kv_a_proj_with_mqa`` itself (``fused_qkv_a_proj_with_mqa``, caching whichever
arrives first within ONE ``load_weights`` call): the two are exported next to each other, and a
bucket never separates them (:func:`keep_together`).

Rules that exist only on some layers carry ``layers``: ``"dense"`` (the first
``first_k_dense_replace`` layers' MLP) or ``"moe"`` (router, its bias, experts, shared experts).
The router's score-correction bias (HF ``mlp.gate.e_score_correction_bias``) is megatron-core's
``mlp.router.expert_bias`` buffer (fp32), mapped like a parameter so that import, export, the weight
sync and the checkpoint carry it.

GLM-4.5 / 4.6 (``glm4_moe``): llama's GQA rules, plus ``linear_qkv.bias`` (``qkv``, from
``q_proj`` / ``k_proj`` / ``v_proj.bias``) when ``attention_bias`` and ``q_layernorm`` /
``k_layernorm`` (HF ``q_norm`` / ``k_norm``) when ``use_qk_norm``; partial rotary changes no
weight. Its MLP side is DeepSeek-V3's rules under the same HF names (dense first layers, router
and ``e_score_correction_bias``, per-expert ``mlp.experts.{e}``, ``mlp.shared_experts``). SGLang's
``Glm4MoeForCausalLM.load_weights`` (models/glm4_moe.py) takes these per-tensor names: q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj`` by shard id (``stacked_params_mapping``), experts
by ``FusedMoE.make_expert_params_mapping``, the shared expert renamed to expert
``n_routed_experts`` when it fuses it, the bias through ``default_weight_loader``; every shard is
written in place, so no two tensors must share a bucket.

Mixtures of experts (``qwen3_moe``, ``qwen2_moe``, ``mixtral``): the MLP rules become the
router (replicated), the routed experts' ``linear_fc1`` (gate_up) and ``linear_fc2`` (row),
marked ``expert=True``, and for qwen2_moe the shared expert (gate_up / row over TP) and its
sigmoid gate (replicated). An expert rule's Megatron name holds ``{expert}``, the GLOBAL expert
index: expert ``e`` lives on EP rank ``e // (E / EP)`` as its local expert ``e % (E / EP)``
(megatron-core ``MoELayer.local_expert_indices``); its FFN is split over the expert-TP group
(ETP) with the same ``gate_up`` / ``row`` layouts as the dense MLP over TP. HF names are the
checkpoint's per-expert ones (``mlp.experts.{e}.gate_proj.weight``; Mixtral
``block_sparse_moe.experts.{e}.w1.weight``), which SGLang loads and transformers 5 fuses on load
into ``mlp.experts.gate_up_proj`` (transformers/conversion_mapping.py, ``qwen2_moe`` /
``mixtral``).

Transformer Engine layer specs fuse the pre-attention and pre-MLP RMSNorms into the
following linear layer; their parameter names (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``) are mapped to the local names by
:func:`canonical_megatron_name`.

Sources: Megatron-LM ``tools/checkpoint`` loaders/savers (llama/qwen QKV interleave,
SwiGLU fusion), megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding`` partitioning, transformers ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` parameter names.

Design: docs/design.md §1 step 7 (weight sync: the one rule table).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dapo_megatron.models.config import (ATTENTION_FAMILY, DEEPSEEK_ROUTER_TYPES, MLALayout, check_hf_config,
                                         has_qk_norm, has_qkv_bias, head_dim, mla_layout, moe_layout)

SPLITS = ("replicated", "column", "row", "row_heads", "vocab", "qkv", "gate_up", "mla_down")
LAYER_KINDS = ("all", "dense", "moe")


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter ⇄ HF tensor(s) correspondence.

    Attributes:
        megatron: local-spec Megatron name; ``{layer}`` is the global layer index, ``{expert}``
            the global expert index (expert rules).
        hf: HF names (``{layer}`` / ``{expert}`` likewise); several for fused tensors, in fusion order.
        split: how the Megatron tensor is sharded across TP (see module docstring).
        expert: a routed expert's parameter: one per expert, held by one EP rank, split over the
            expert-TP group instead of TP.
        layers: "all", or only the "dense" / "moe" layers of a model that has both.
    """

    megatron: str
    hf: tuple[str, ...]
    split: str
    expert: bool = False
    layers: str = "all"


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

_LLAMA = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), "replicated"),
    Rule(_L + "self_attention.linear_qkv.weight",
         (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"), "qkv"),
    Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), "row_heads"),
    Rule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), "replicated"),
    Rule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "gate_up"),
    Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "row"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab"),
)
_QKV_BIAS = Rule(_L + "self_attention.linear_qkv.bias",
                 (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"), "qkv")
_Q_NORM = Rule(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), "replicated")
_K_NORM = Rule(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), "replicated")


_E = _L + "mlp.experts.local_experts.{expert}."


def _moe_rules(hf_block: str, router: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Router + routed expert rules; HF names ``<layer><hf_block><router>`` and
    ``<layer><hf_block>experts.{expert}.<gate|up|down>.weight``."""
    b = _H + hf_block
    return (
        Rule(_L + "mlp.router.weight", (b + router + ".weight",), "replicated"),
        Rule(_E + "linear_fc1.weight", (b + f"experts.{{expert}}.{gate}.weight", b + f"experts.{{expert}}.{up}.weight"),
             "gate_up", expert=True),
        Rule(_E + "linear_fc2.weight", (b + f"experts.{{expert}}.{down}.weight",), "row", expert=True),
    )


_QWEN_MOE = _moe_rules("mlp.", "gate", "gate_proj", "up_proj", "down_proj")
_MIXTRAL_MOE = _moe_rules("block_sparse_moe.", "gate", "w1", "w3", "w2")  # w1 gate, w3 up, w2 down (HF MixtralBlockSparseTop2MLP)
_SHARED_EXPERT = (
    Rule(_L + "mlp.shared_experts.linear_fc1.weight",
         (_H + "mlp.shared_expert.gate_proj.weight", _H + "mlp.shared_expert.up_proj.weight"), "gate_up"),
    Rule(_L + "mlp.shared_experts.linear_fc2.weight", (_H + "mlp.shared_expert.down_proj.weight",), "row"),
    # HF shared_expert_gate = Linear(hidden, 1): its weight (1, hidden) is megatron-core's
    # SharedExpertMLP.gate_weight, both applied as sigmoid(x · wᵀ) (moe/shared_experts.py)
    Rule(_L + "mlp.shared_experts.gate_weight", (_H + "mlp.shared_expert_gate.weight",), "replicated"),
)
_DENSE_MLP = (_L + "mlp.linear_fc1.weight", _L + "mlp.linear_fc2.weight")

_A = _L + "self_attention."
_HA = _H + "self_attn."
# DeepSeek-V3 attention (MLA); the q rules depend on q_lora_rank (ModelLayout.rules picks them)
_MLA_Q_LORA = (
    Rule(_A + "linear_q_down_proj.weight", (_HA + "q_a_proj.weight",), "mla_down"),
    Rule(_A + "q_layernorm.weight", (_HA + "q_a_layernorm.weight",), "replicated"),
    Rule(_A + "linear_q_up_proj.weight", (_HA + "q_b_proj.weight",), "column"),
)
_MLA_Q = (Rule(_A + "linear_q_proj.weight", (_HA + "q_proj.weight",), "column"),)
_MLA_KV = (
    Rule(_A + "linear_kv_down_proj.weight", (_HA + "kv_a_proj_with_mqa.weight",), "mla_down"),
    Rule(_A + "kv_layernorm.weight", (_HA + "kv_a_layernorm.weight",), "replicated"),
    Rule(_A + "linear_kv_up_proj.weight", (_HA + "kv_b_proj.weight",), "column"),
    Rule(_A + "linear_proj.weight", (_HA + "o_proj.weight",), "row"),
)
_DEEPSEEK_MOE = (
    Rule(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), "replicated", layers="moe"),
    Rule(_L + "mlp.router.expert_bias", (_H + "mlp.gate.e_score_correction_bias",), "replicated", layers="moe"),
    Rule(_E + "linear_fc1.weight", (_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight"),
         "gate_up", expert=True, layers="moe"),
    Rule(_E + "linear_fc2.weight", (_H + "mlp.experts.{expert}.down_proj.weight",), "row", expert=True, layers="moe"),
    Rule(_L + "mlp.shared_experts.linear_fc1.weight",
         (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"), "gate_up", layers="moe"),
    Rule(_L + "mlp.shared_experts.linear_fc2.weight", (_H + "mlp.shared_experts.down_proj.weight",), "row", layers="moe"),
)


def _dense_then_moe(rules: tuple, moe: Sequence[Rule]) -> tuple:
    """``rules`` with its MLP rules kept for the dense layers only (``layers="dense"``) and ``moe``
    (the MoE layers' rules) right after them: DeepSeek-V3's and GLM's first ``first_k_dense_replace``
    layers are dense, the others MoE."""
    out = []
    for r in rules:
        if r.megatron in _DENSE_MLP:
            out.append(Rule(r.megatron, r.hf, r.split, layers="dense"))
            if r.megatron == _DENSE_MLP[1]:
                out.extend(moe)
        else:
            out.append(r)
    return tuple(out)


def _mla_family(q_lora: bool, expert_bias: bool = True) -> tuple:
    """The DeepSeek-V3 table: MLA attention, dense MLP rules for the first layers, MoE rules for the
    others; DeepSeek-V2's (``expert_bias=False``) without the router's score-correction bias, which
    its softmax router does not have (transformers ``DeepseekV2TopkRouter``; SGLang's ``MoEGate``
    creates ``e_score_correction_bias`` only for ``topk_method='noaux_tc'``)."""
    out = []
    for r in _LLAMA:
        if r.megatron == _L + "self_attention.linear_qkv.weight":
            if q_lora:  # q_a_proj then kv_a_proj_with_mqa, adjacent: SGLang fuses the pair within one load call
                out.extend((_MLA_Q_LORA[0], _MLA_KV[0], *_MLA_Q_LORA[1:], *_MLA_KV[1:]))
            else:
                out.extend(_MLA_Q + _MLA_KV)
        elif r.megatron == _L + "self_attention.linear_proj.weight":
            continue
        else:
            out.append(r)
    moe = _DEEPSEEK_MOE if expert_bias else tuple(r for r in _DEEPSEEK_MOE if not r.megatron.endswith(".expert_bias"))
    return _dense_then_moe(tuple(out), moe)


def _glm_family(qkv_bias: bool, qk_norm: bool) -> tuple:
    """The GLM-4.5 table: llama's GQA rules plus the q/k/v bias (``attention_bias``) and the per-head
    q/k norm (``use_qk_norm``, HF ``self_attn.q_norm`` / ``k_norm`` as Qwen3), then DeepSeek-V3's MLP
    side (dense first layers; router, its score-correction bias, routed and shared experts under the
    same HF names: transformers ``Glm4MoeMoE`` has ``gate``, ``experts``, ``shared_experts``).
    SGLang's glm4_moe ``load_weights`` takes every one of these per-tensor names and fuses
    q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` by shard id, each shard written in
    place (``stacked_params_mapping``), so no pair has to share a load call."""
    extra = ([_QKV_BIAS] if qkv_bias else []) + ([_Q_NORM, _K_NORM] if qk_norm else [])
    return _dense_then_moe(_insert_after(_LLAMA, _L + "self_attention.linear_qkv.weight", extra), _DEEPSEEK_MOE)


def _with_moe(rules: tuple, moe: Sequence[Rule]) -> tuple:
    """The dense table with its MLP rules replaced by ``moe`` (at the same place)."""
    out = []
    for r in rules:
        if r.megatron == _DENSE_MLP[0]:
            out.extend(moe)
        elif r.megatron != _DENSE_MLP[1]:
            out.append(r)
    return tuple(out)


def _insert_after(rules: tuple, after: str, new: Sequence[Rule]) -> tuple:
    out = []
    for r in rules:
        out.append(r)
        if r.megatron == after:
            out.extend(new)
    return tuple(out)


# The table: one ordered rule list per HF model_type. The order is the export order.
_QWEN2 = _insert_after(_LLAMA, _L + "self_attention.linear_qkv.weight", [_QKV_BIAS])
_QWEN3 = _insert_after(_LLAMA, _L + "self_attention.linear_qkv.weight", [_Q_NORM, _K_NORM])
FAMILY_RULES: dict[str, tuple[Rule, ...]] = {
    "llama": _LLAMA,
    "qwen2": _QWEN2,
    "qwen3": _QWEN3,
    "qwen3_moe": _with_moe(_QWEN3, _QWEN_MOE),
    "qwen2_moe": _with_moe(_QWEN2, _QWEN_MOE + _SHARED_EXPERT),
    "mixtral": _with_moe(_LLAMA, _MIXTRAL_MOE),
    "deepseek_v2": _mla_family(q_lora=True, expert_bias=False),
    "deepseek_v3": _mla_family(q_lora=True),
    "glm4_moe": _glm_family(qkv_bias=True, qk_norm=False),  # GLM-4.5-Air; GLM-4.5 / 4.6 add the q/k norm
}
# MLA configs without a query LoRA (DeepSeek-V2-Lite; Moonlight, a deepseek_v3 config)
_MLA_NO_Q_LORA_RULES = {"deepseek_v2": _mla_family(q_lora=False, expert_bias=False),
                        "deepseek_v3": _mla_family(q_lora=False)}
# GLM's table per (attention_bias, use_qk_norm)
_GLM_RULES = {(b, n): _glm_family(b, n) for b in (False, True) for n in (False, True)}

# Transformer Engine spec names → local spec names (fused RMSNorm into the next linear).
TE_NAME_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    # MLA on the TE spec: the latent norms fused into the up-projections (TELayerNormColumnParallelLinear)
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclass(frozen=True)
class ModelLayout:
    """The shape facts the mapping needs (from the HF config and the padded vocab).

    Attributes:
        model_type: "llama" | "qwen2" | "qwen3".
        num_layers, hidden_size, ffn_hidden_size: as in HF config.
        num_attention_heads, num_query_groups, head_dim: attention geometry (GQA).
        vocab_size: the real (HF) vocabulary; padded_vocab_size: Megatron rows (≥ vocab_size).
        tie_word_embeddings: lm_head shares the embedding matrix.
        qkv_bias: q/k/v projections have a bias (qwen2; GLM with ``attention_bias``).
        padded_num_query_groups: Megatron's query groups (≥ num_query_groups; the extra ones
            are all-zero, see ``ModelConfig.pad_query_groups``).
        num_experts: routed experts per layer (0: a dense model).
        moe_ffn_hidden_size: one routed expert's FFN size (0 for a dense model).
        shared_ffn_hidden_size: the shared expert's FFN size (0: none).
        dense_layers: the dense layers of a model whose other layers are MoE (DeepSeek-V3's first
            ``first_k_dense_replace``); their rules are the ``layers="dense"`` ones.
        mla: the multi-head latent attention sizes (None: GQA attention).
        mla_down_split: the MLA down-projections are split over TP (local spec) rather than
            replicated (TE spec), see the ``mla_down`` split.
        qk_norm: per-head q/k RMSNorm on GQA attention (qwen3; GLM with ``use_qk_norm``).
        mtp_layers: the checkpoint's multi-token-prediction layers after the decoder
            (``num_nextn_predict_layers``: DeepSeek-V3, GLM-4.5), which the model does not build
            (:meth:`is_mtp_name`).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    padded_num_query_groups: int
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    shared_ffn_hidden_size: int = 0
    dense_layers: tuple[int, ...] = ()
    mla: Optional[MLALayout] = None
    mla_down_split: bool = True
    qk_norm: bool = False
    mtp_layers: int = 0

    @classmethod
    def from_hf_config(
        cls, hf_config, padded_vocab_size: Optional[int] = None, padded_num_query_groups: Optional[int] = None,
        mla_down_split: bool = True,
    ) -> "ModelLayout":
        """Layout of an HF config; the padded sizes default to the real ones."""
        model_type = check_hf_config(hf_config)
        moe = moe_layout(hf_config)
        mla = mla_layout(hf_config)
        groups = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        vocab = hf_config.vocab_size
        padded = padded_vocab_size or vocab
        if padded < vocab:
            raise ValueError(f"padded_vocab_size={padded} is smaller than hf_config.vocab_size={vocab}")
        if padded_num_query_groups is not None and padded_num_query_groups < groups:
            raise ValueError(f"padded_num_query_groups={padded_num_query_groups} is smaller than "
                             f"hf_config.num_key_value_heads={groups}")
        return cls(
            model_type=model_type,
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_query_groups=groups,
            head_dim=head_dim(hf_config),
            vocab_size=vocab,
            padded_vocab_size=padded,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=has_qkv_bias(hf_config),
            padded_num_query_groups=padded_num_query_groups or groups,
            num_experts=moe.num_experts if moe else 0,
            moe_ffn_hidden_size=moe.ffn_hidden_size if moe else 0,
            shared_ffn_hidden_size=moe.shared_ffn_hidden_size if moe else 0,
            dense_layers=moe.dense_layers if moe else (),
            mla=mla,
            mla_down_split=mla_down_split,
            qk_norm=has_qk_norm(hf_config),
            mtp_layers=int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
            if model_type in DEEPSEEK_ROUTER_TYPES else 0,
        )

    def is_mtp_name(self, hf_name: str) -> bool:
        """Whether an HF tensor belongs to a multi-token-prediction layer
        (``model.layers.{i}.`` with ``num_layers <= i < num_layers + mtp_layers``). Those layers
        feed no logprob of the main head; import skips them and export never writes them, as
        SGLang's deepseek_v2 / glm4_moe ``load_weights`` skip ``model.layers`` indices >=
        ``num_hidden_layers`` when not loading the draft model."""
        m = _HF_LAYER_RE.match(hf_name)
        return bool(m) and self.num_layers <= int(m.group(1)) < self.num_layers + self.mtp_layers

    def rules(self) -> tuple[Rule, ...]:
        """The family's rules (from :data:`FAMILY_RULES`)."""
        if self.mla is not None and self.mla.q_lora_rank is None:
            return _MLA_NO_Q_LORA_RULES[self.model_type]
        if ATTENTION_FAMILY[self.model_type] == "glm":
            return _GLM_RULES[(self.qkv_bias, self.qk_norm)]
        return FAMILY_RULES[self.model_type]

    def layer_has(self, rule: Rule, layer: Optional[int]) -> bool:
        """Whether ``layer`` has the parameter of ``rule`` (a dense layer has no router, ...)."""
        if rule.layers == "all" or layer is None:
            return True
        return (layer in self.dense_layers) == (rule.layers == "dense")

    def split_of(self, rule: Rule) -> str:
        """The rule's split with ``mla_down`` resolved for this model's spec."""
        if rule.split == "mla_down":
            return "column" if self.mla_down_split else "replicated"
        return rule.split


# TEGroupedMLP (moe_grouped_gemm with the TE spec) holds local expert i's weights as
# ``experts.linear_fc1.weight{i}`` (megatron-core extensions/transformer_engine.py,
# ``TEGroupedLinear``: one ``weight{i}`` per GEMM); SequentialMLP as ``experts.local_experts.{i}.linear_fc1.weight``
_TE_GROUPED_RE = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")


# An HF tensor that must reach the engine in the same load call as the one exported right after it:
# SGLang 0.5.x DeepseekV2ForCausalLM.load_weights fuses q_a_proj with kv_a_proj_with_mqa into
# fused_qkv_a_proj_with_mqa from a cache local to one call (models/deepseek_v2.py, ``cached_a_proj``).
KEEP_WITH_NEXT = re.compile(r"\.self_attn\.q_a_proj\.weight$")


def keep_together(hf_name: str) -> bool:
    """True when a sync bucket must not end with ``hf_name`` (:data:`KEEP_WITH_NEXT`)."""
    return KEEP_WITH_NEXT.search(hf_name) is not None


def canonical_megatron_name(name: str) -> str:
    """Strip wrapper prefixes (``module.``) and map TE fused-norm names (and TE grouped-GEMM
    expert weights) to local names. Expert indices stay as given (local ones from a module,
    see :func:`dapo_megatron.bridge.local_parameters` for the global ones)."""
    while name.startswith("module."):
        name = name[len("module."):]
    m = _TE_GROUPED_RE.match(name)
    if m:
        return f"{m.group(1)}local_experts.{m.group(3)}.{m.group(2)}.weight"
    for te_suffix, local_suffix in TE_NAME_ALIASES.items():
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def match_rule(layout: ModelLayout, megatron_name: str) -> tuple[Rule, Optional[int], Optional[int]]:
    """The rule, global layer index and global expert index (None but for expert rules) of a
    canonical Megatron name (global layer and expert numbers).

    Raises:
        KeyError: the name matches no rule of this family, or its layer / expert index is out
            of range (naming it).
    """
    m = _LAYER_RE.match(megatron_name)
    layer, key, expert = (int(m.group(1)), _L + m.group(2), None) if m else (None, megatron_name, None)
    if m:
        e = _EXPERT_RE.match(m.group(2))
        if e:
            expert, key = int(e.group(1)), _E + e.group(2)
    for rule in layout.rules():
        if rule.megatron == key and layout.layer_has(rule, layer):
            if layer is not None and not 0 <= layer < layout.num_layers:
                raise KeyError(f"Megatron parameter {megatron_name!r}: layer {layer} is outside "
                               f"0..{layout.num_layers - 1}")
            if expert is not None and not 0 <= expert < layout.num_experts:
                raise KeyError(f"Megatron parameter {megatron_name!r}: expert {expert} is outside "
                               f"0..{layout.num_experts - 1}")
            return rule, layer, expert
    raise KeyError(f"Megatron parameter {megatron_name!r} matches no {layout.model_type} mapping rule")


def hf_names_of(rule: Rule, layer: Optional[int], expert: Optional[int] = None) -> list[str]:
    """HF tensor names of a rule at a layer (and global expert index, for expert rules)."""
    return [n.format(layer=layer, expert=expert) for n in rule.hf]


def megatron_name_of(rule: Rule, layer: Optional[int], expert: Optional[int] = None) -> str:
    """Global Megatron name of a rule at a layer (and global expert index)."""
    return rule.megatron.format(layer=layer, expert=expert)


def exported_entries(layout: ModelLayout) -> list[tuple[Rule, Optional[int], Optional[int]]]:
    """(rule, layer, expert) triples in export order; the output layer is absent when
    embeddings are tied. Within a layer the expert rules run expert by expert (expert 0's
    fc1, fc2, then expert 1's, ...), so each EP rank's experts are consecutive."""
    rules = layout.rules()
    by_name = {r.megatron: r for r in rules}
    out: list[tuple[Rule, Optional[int], Optional[int]]] = [(by_name["embedding.word_embeddings.weight"], None, None)]
    layer_rules = [r for r in rules if r.megatron.startswith(_L)]
    for layer in range(layout.num_layers):
        pending: list[Rule] = []  # a run of expert rules, expanded at its end
        for r in [r for r in layer_rules if layout.layer_has(r, layer)] + [None]:
            if r is not None and r.expert:
                pending.append(r)
                continue
            out.extend((p, layer, e) for e in range(layout.num_experts) for p in pending)
            pending = []
            if r is not None:
                out.append((r, layer, None))
    out.append((by_name["decoder.final_layernorm.weight"], None, None))
    if not layout.tie_word_embeddings:
        out.append((by_name["output_layer.weight"], None, None))
    return out


def expected_hf_names(layout: ModelLayout) -> list[str]:
    """Every HF tensor name a full checkpoint of this layout has (every expert's), in export order."""
    return [n for rule, layer, expert in exported_entries(layout) for n in hf_names_of(rule, layer, expert)]


def hf_shapes(layout: ModelLayout, rule: Rule) -> list[tuple[int, ...]]:
    """Full HF shapes of a rule's tensors (same order as ``rule.hf``)."""
    H, hd = layout.hidden_size, layout.head_dim
    q, kv = layout.num_attention_heads * hd, layout.num_query_groups * hd
    name = rule.megatron
    if rule.split == "vocab":
        return [(layout.vocab_size, H)]
    if name.endswith("mlp.router.weight"):
        return [(layout.num_experts, H)]
    if name.endswith("shared_experts.gate_weight"):
        return [(1, H)]
    if name.endswith("mlp.router.expert_bias"):
        return [(layout.num_experts,)]
    mla = layout.mla
    if mla is not None and ".self_attention." in name:
        n = layout.num_attention_heads
        return {
            "linear_q_down_proj.weight": [(mla.q_lora_rank or 0, H)],
            "q_layernorm.weight": [(mla.q_lora_rank or 0,)],
            "linear_q_up_proj.weight": [(n * mla.q_head_dim, mla.q_lora_rank or 0)],
            "linear_q_proj.weight": [(n * mla.q_head_dim, H)],
            "linear_kv_down_proj.weight": [(mla.kv_lora_rank + mla.qk_rope_head_dim, H)],
            "kv_layernorm.weight": [(mla.kv_lora_rank,)],
            "linear_kv_up_proj.weight": [(n * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)],
            "linear_proj.weight": [(H, n * mla.v_head_dim)],
        }[name.rsplit(".self_attention.", 1)[1]]
    ffn = (layout.moe_ffn_hidden_size if rule.expert else
           layout.shared_ffn_hidden_size if ".shared_experts." in name else layout.ffn_hidden_size)
    if name.endswith("linear_qkv.weight"):
        return [(q, H), (kv, H), (kv, H)]
    if name.endswith("linear_qkv.bias"):
        return [(q,), (kv,), (kv,)]
    if name.endswith("linear_proj.weight"):
        return [(H, q)]
    if name.endswith("linear_fc1.weight"):
        return [(ffn, H)] * 2
    if name.endswith("linear_fc2.weight"):
        return [(H, ffn)]
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return [(hd,)]
    return [(H,)]  # input / pre-MLP / final RMSNorm


def _check_tp(rule: Rule, layout: ModelLayout, tp_rank: int, tp_size: int) -> None:
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} outside 0..{tp_size - 1}")
    if rule.split in ("qkv", "row_heads") and layout.padded_num_query_groups % tp_size:
        raise ValueError(f"Megatron num_query_groups={layout.padded_num_query_groups} is not divisible by "
                         f"TP={tp_size}")
    if rule.split == "vocab" and layout.padded_vocab_size % tp_size:
        raise ValueError(f"padded_vocab_size={layout.padded_vocab_size} is not divisible by TP={tp_size}")


def _heads_per_group(layout: ModelLayout) -> int:
    return layout.num_attention_heads // layout.num_query_groups


def _qkv_full(layout: ModelLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q, k, v → Megatron's per-group interleaved [G·(hpg+2)·hd, ...] tensor, G the padded
    group count (groups beyond the HF ones are zero)."""
    g, hd = layout.num_query_groups, layout.head_dim
    hpg = layout.num_attention_heads // g
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(g, hpg * hd, *tail), k.reshape(g, hd, *tail), v.reshape(g, hd, *tail)], dim=1
    )
    pad = layout.padded_num_query_groups - g
    if pad:
        fused = torch.cat([fused, fused.new_zeros(pad, *fused.shape[1:])], dim=0)
    return fused.reshape((g + pad) * (hpg + 2) * hd, *tail)


def hf_to_megatron_shard(
    layout: ModelLayout,
    megatron_name: str,
    hf_tensors: Sequence[torch.Tensor],
    tp_rank: int = 0,
    tp_size: int = 1,
) -> torch.Tensor:
    """Build TP rank ``tp_rank``'s shard of a Megatron parameter from full HF tensors.

    Args:
        layout: model geometry (:class:`ModelLayout`).
        megatron_name: canonical Megatron name with the GLOBAL layer index.
        hf_tensors: the rule's HF tensors in ``rule.hf`` order, full (unsharded) shapes.
        tp_rank, tp_size: this rank's TP coordinate.

    Returns:
        The shard, same dtype as the inputs (a new tensor, never a view of them).

    Raises:
        KeyError: unknown name. ValueError: wrong number/shape of HF tensors (naming the
        HF tensor), or a layout TP cannot split.
    """
    rule, layer, expert = match_rule(layout, megatron_name)
    names = hf_names_of(rule, layer, expert)
    if len(hf_tensors) != len(names):
        raise ValueError(f"{megatron_name}: expected {len(names)} HF tensors {names}, got {len(hf_tensors)}")
    for name, t, shape in zip(names, hf_tensors, hf_shapes(layout, rule)):
        if tuple(t.shape) != shape:
            raise ValueError(f"HF tensor {name!r} has shape {tuple(t.shape)}, expected {shape} for this config")
    _check_tp(rule, layout, tp_rank, tp_size)
    split = layout.split_of(rule)
    if split == "replicated":
        return hf_tensors[0].clone()
    if split == "column":
        return hf_tensors[0].chunk(tp_size, dim=0)[tp_rank].clone()
    if split == "row":
        return hf_tensors[0].chunk(tp_size, dim=1)[tp_rank].contiguous()
    if split == "row_heads":
        t = hf_tensors[0]
        pad = (layout.padded_num_query_groups - layout.num_query_groups) * _heads_per_group(layout) * layout.head_dim
        if pad:
            t = torch.cat([t, t.new_zeros(t.shape[0], pad)], dim=1)
        return t.chunk(tp_size, dim=1)[tp_rank].contiguous()
    if split == "vocab":
        t = hf_tensors[0]
        pad = layout.padded_vocab_size - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])], dim=0)
        return t.chunk(tp_size, dim=0)[tp_rank].clone()
    if split == "qkv":
        return _qkv_full(layout, *hf_tensors).chunk(tp_size, dim=0)[tp_rank].clone()
    if split == "gate_up":
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in hf_tensors)
        return torch.cat([gate, up], dim=0)
    raise AssertionError(split)


def megatron_shard_shape(layout: ModelLayout, megatron_name: str, tp_size: int = 1) -> tuple[int, ...]:
    """Shape of one TP shard of a Megatron parameter (for strict checks); ``tp_size`` is the
    size of the group that splits it (the expert-TP size for expert rules)."""
    rule, _, _ = match_rule(layout, megatron_name)
    shapes = hf_shapes(layout, rule)
    split = layout.split_of(rule)
    if split == "replicated":
        return shapes[0]
    if split == "row":
        return (shapes[0][0], shapes[0][1] // tp_size)
    if split == "row_heads":
        return (shapes[0][0], layout.padded_num_query_groups * _heads_per_group(layout) * layout.head_dim // tp_size)
    if split == "vocab":
        return (layout.padded_vocab_size // tp_size, shapes[0][1])
    if split == "qkv":
        rows = layout.padded_num_query_groups * (_heads_per_group(layout) + 2) * layout.head_dim // tp_size
        return (rows, *shapes[0][1:])
    rows = sum(s[0] for s in shapes) // tp_size
    return (rows, *shapes[0][1:])


def gathers_in_place(split: str) -> bool:
    """True when the TP shards of a parameter with this ``split``, concatenated in rank order
    along dim 0, ARE its HF tensor (``column``; ``vocab`` up to its trailing padding rows): an
    all-gather into the HF tensor's memory needs no re-layout (:func:`iter_hf_weights`)."""
    return split in ("column", "vocab")


def hf_row_ranges(layout: ModelLayout, megatron_name: str) -> Optional[list[tuple[int, int]]]:
    """Where the HF tensors of an UNSPLIT Megatron parameter (TP = 1 for its group, or a
    replicated one) lie in it, when each is a run of its rows: ``[(start, stop), ...]`` along
    dim 0 in ``rule.hf`` order, every other dim the parameter's own, so that
    ``param[start:stop]`` IS the HF tensor (a view, contiguous when the parameter is; the
    layout rules of :func:`megatron_to_hf_into`, with no copy). None where an HF tensor is not
    such a run: QKV with more than one query group (the groups interleave q, k and v rows),
    ``o_proj`` with padded query groups (zero columns dropped).

    Raises:
        KeyError: unknown name.
    """
    rule, _, _ = match_rule(layout, megatron_name)
    split = layout.split_of(rule)
    shapes = hf_shapes(layout, rule)
    if split == "qkv" and layout.padded_num_query_groups != 1:
        return None
    if split == "row_heads" and layout.padded_num_query_groups != layout.num_query_groups:
        return None
    if split == "vocab":  # the real vocabulary's rows; the padding rows after them are not exported
        return [(0, shapes[0][0])]
    ranges, start = [], 0
    for shape in shapes:  # replicated, column, row (all columns at TP 1), gate_up ([gate; up]), qkv of one group
        ranges.append((start, start + shape[0]))
        start += shape[0]
    return ranges


def megatron_to_hf_into(
    layout: ModelLayout, megatron_name: str, shards: Sequence[torch.Tensor], out: Sequence[torch.Tensor]
) -> None:
    """Write the HF tensors of one Megatron parameter, from its TP shards, into ``out``.

    One copy per element, straight from the shards into the destination (no concatenated
    intermediate): the live weight sync writes into reused bucket memory with it.

    Args:
        layout: model geometry.
        megatron_name: canonical Megatron name with the GLOBAL layer index.
        shards: the parameter's TP shards in TP-rank order (one tensor for replicated
            parameters or TP=1; several replicated copies are accepted and the first used);
            any strides.
        out: one contiguous tensor per HF name of the rule, in ``rule.hf`` order, of the full HF
            shapes (:func:`hf_shapes`); any dtype (the copy casts), must not overlap ``shards``.

    Raises:
        KeyError: unknown name. ValueError: shard or output shapes that do not fit the layout.
    """
    rule, layer, expert = match_rule(layout, megatron_name)
    names = hf_names_of(rule, layer, expert)
    shapes = hf_shapes(layout, rule)
    if len(out) != len(names) or any(tuple(o.shape) != s for o, s in zip(out, shapes)):
        raise ValueError(f"{megatron_name}: outputs of shapes {[tuple(o.shape) for o in out]}, expected {shapes} "
                         f"(HF tensors {names})")
    tp = len(shards)
    split = layout.split_of(rule)
    want = megatron_shard_shape(layout, megatron_name, 1 if split == "replicated" else tp)
    for r, s in enumerate(shards):
        if tuple(s.shape) != want:
            raise ValueError(f"{megatron_name}: TP shard {r} of {tp} has shape {tuple(s.shape)}, expected {want}")
    if split == "replicated":
        out[0].copy_(shards[0])
        return
    if split in ("column", "vocab"):  # rows r·n … of the HF tensor; vocab: its padding rows dropped
        n, rows = want[0], shapes[0][0]
        for r, s in enumerate(shards):
            lo, hi = r * n, min((r + 1) * n, rows)
            if hi > lo:
                out[0][lo:hi].copy_(s[: hi - lo])
        return
    if split in ("row", "row_heads"):  # columns r·c …; row_heads: the padded query groups' columns dropped
        c, cols = want[1], shapes[0][1]
        for r, s in enumerate(shards):
            lo, hi = r * c, min((r + 1) * c, cols)
            if hi > lo:
                out[0][:, lo:hi].copy_(s[:, : hi - lo])
        return
    if split == "gate_up":  # shard r = [gate rows of r; up rows of r]
        f = want[0] // 2
        for r, s in enumerate(shards):
            out[0][r * f:(r + 1) * f].copy_(s[:f])
            out[1][r * f:(r + 1) * f].copy_(s[f:])
        return
    if split == "qkv":  # shard r = whole query groups r·G/T …, each [q heads; k; v]; zero groups dropped
        g, hd = layout.num_query_groups, layout.head_dim
        hpg = _heads_per_group(layout)
        per_rank = layout.padded_num_query_groups // tp
        tail = tuple(shapes[0][1:])
        q = out[0].view(g, hpg * hd, *tail)
        k = out[1].view(g, hd, *tail)
        v = out[2].view(g, hd, *tail)
        for r, s in enumerate(shards):
            lo, hi = r * per_rank, min((r + 1) * per_rank, g)
            if hi <= lo:
                continue
            grouped = s.reshape(per_rank, (hpg + 2) * hd, *tail)[: hi - lo]
            q[lo:hi].copy_(grouped[:, : hpg * hd])
            k[lo:hi].copy_(grouped[:, hpg * hd:(hpg + 1) * hd])
            v[lo:hi].copy_(grouped[:, (hpg + 1) * hd:])
        return
    raise AssertionError(split)


def megatron_to_hf(
    layout: ModelLayout, megatron_name: str, shards: Sequence[torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """HF tensors of one Megatron parameter from its TP shards (new tensors; the layout rules
    are :func:`megatron_to_hf_into`'s).

    Args:
        layout: model geometry.
        megatron_name: canonical Megatron name with the GLOBAL layer index.
        shards: the parameter's TP shards in TP-rank order (one tensor for replicated
            parameters or TP=1; several replicated copies are accepted and the first used).

    Returns:
        ``[(hf_name, full_tensor), ...]`` in ``rule.hf`` order; vocab padding rows removed.
        The tensors are new (contiguous, the shards' dtype and device), never views of ``shards``.

    Raises:
        KeyError: unknown name. ValueError: shard shapes that do not fit the layout.
    """
    rule, layer, expert = match_rule(layout, megatron_name)
    like = shards[0]
    out = [like.new_empty(shape) for shape in hf_shapes(layout, rule)]
    megatron_to_hf_into(layout, megatron_name, shards, out)
    return list(zip(hf_names_of(rule, layer, expert), out))

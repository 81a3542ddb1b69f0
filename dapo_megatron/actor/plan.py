"""How the actor runs: the micro-batch layout (one frozen plan, resolved once per actor) and
where each step's ``log pi_old`` comes from (one frozen plan, resolved once per step).

:class:`ActorPlan` holds every execution choice the actor makes per micro-batch (THD or
BSHD, the attention mask, logits at the labels only, length buckets, the padding
multiples for sequence parallelism and FP8, the shared-prompt form). It is resolved
and checked once, from ``ActorConfig`` + the model (its ``TransformerConfig`` and layer
spec) + the TP size, by :func:`resolve_actor_plan`; every call of the actor then
reads it. None of the choices changes a result: each has a CPU test comparing it to
the plain form (``tests/unit/actor/test_actor.py``, ``tests/unit/actor/test_shared_prompt.py``).

FP8 alignment. Transformer Engine 2.x runs an FP8 GEMM only when the product of all
input dimensions but the last is a multiple of 8 and the last one a multiple of 16
(``transformer_engine/pytorch/utils.py``, ``assert_dim_for_fp8_exec``: v2.11 :439, 2.20
(main at 2.20.0.dev0, d0067d0) :614). In training
the token dimension is also the inner (last) dimension of the weight-gradient GEMM
``dW = dY^T X``, so tokens must be a multiple of 16; megatron-core 0.16.1 and 0.19.2
agree (``megatron/core/fp8_utils.py``, ``get_fp8_align_size``, core_v0.16.1 :168, 0.19.2 :318:
32 for the ``mxfp8`` recipe, whose scales cover blocks of 32 along both dimensions, 16 for
every other recipe). With ``model.fp8`` set, every micro-batch is padded so that ``B * T`` is a
multiple of that size. With sequence parallelism the column-parallel GEMMs
(``LayerNormLinear``, ``LayerNormMLP``'s fc1: qkv, fc1) get each TP rank's LOCAL shard
``[T / TP, B, H]``, checked BEFORE the all-gather (``module/layernorm_linear.py`` and
``module/layernorm_mlp.py``: ``assert_dim_for_fp8_exec(inputmat, ...)``, TE 2.20 :184 and
:356): ``(T / TP) * B`` must be a multiple of 8. The FP8 all-gather also needs it a multiple of
the quantizer's block (its ``is_quantizable``), 32 for ``mxfp8`` (``tensor/mxfp8_tensor.py``,
2.20 :125) and 128 for ``blockwise`` (``tensor/float8_blockwise_tensor.py``, ``block_len =
128``, 2.20 :235). TE 2.11 asserted that too (``assert_dim_for_all_gather``, layernorm_linear.py
:162, layernorm_mlp.py :334); since TE 2.14 (commit 5fd5c35, PR 2637) a shard that is not a
multiple all-gathers in high precision instead, with a warning on every call
(``distributed.py`` :1134 blockwise, :1573 mxfp8, in 2.20), so the padding now keeps the
all-gather in FP8 and the log quiet rather than avoiding an error; :func:`fp8_local_align_size`.
The row-parallel GEMMs (proj, fc2) get the full sequence ``[T, B, h / TP]``. Padding ``T``
to ``lcm(TP, 16)`` alone leaves 4 local tokens at TP = 4 and 2 at TP = 8 (slime pads to
``tp_size × data_pad_size_multiplier`` for the same reason); the multiples are combined in
:func:`dapo_megatron.actor.packing.row_multiple`. Padding tokens sit outside every
label slot, so no logprob, loss, token count or metric sees them (tested).

Old logprobs (:class:`OldLogprobPlan`, :func:`resolve_old_logprob_plan`, docs/design.md §3.7).
A step's ``log pi_old`` is recomputed by a forward-only pass at the weights before its first
update (``RECOMPUTE``), taken from the training forward itself (``FROM_TRAINING``: with one
update per step the weights of that forward are the ones a recompute would use, so
``sg(log pi_theta)`` gives the same values and gradients), or the engine's logprobs
(``ROLLOUT``, ``actor.old_logprob_source: rollout``, verl's bypass mode). The same resolution
decides whether the behaviour-policy correction (``actor.rollout_is`` / ``rollout_rs``) applies.

Shared prompt (``actor.shared_prompt``, Prefix Grouper, arXiv 2506.05433). A GRPO
group's prompt is encoded once per micro-batch; each response attends to the prompt's
keys and values and to its own, at positions continuing the prompt
(:mod:`dapo_megatron.actor.packing`). It runs where the attention takes an explicit
mask and RoPE can follow ``position_ids``: megatron-core's local ``DotProductAttention``
(the mask replaces the causal one) with ``position_embedding_type='rope'`` (the actor
hooks ``rotary_pos_emb``) or learned absolute positions. The Transformer Engine path does
not have it: with ``PackedSeqParams`` TE attends within each ``cu_seqlens`` segment and
megatron-core applies RoPE from each segment's start, so the shared form would need a
second attention call per layer (response queries over ``[prompt KV, own KV]``, varlen,
bottom-right causal) and RoPE offsets per segment; that is GPU-only code which no test
here can run, so ``auto`` resolves to off there (the reason is logged and kept in
:attr:`ActorPlan.shared_prompt_off_reason`) and ``on`` is an error naming it. TE with the
BSHD layout fails the same check: ``TEDotProductAttention`` applies its spec's causal
mask type and ignores an arbitrary mask. Context parallelism, multi-latent attention and
fused RoPE are refused for the same kind of reason.

Design: docs/design.md §1 steps 5-6 (old logprobs, updates) and §3.7 (which logprobs are pi_old).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

SHARED_PROMPT_MODES = ("auto", "on", "off")
MICRO_BATCH_LAYOUTS = ("thd", "bshd")
RECOMPUTE, FROM_TRAINING, ROLLOUT = "recompute", "from_training", "rollout"
OLD_LOGPROB_PLANS = (RECOMPUTE, FROM_TRAINING, ROLLOUT)
"""Where a step's ``log pi_old`` comes from (:class:`OldLogprobPlan`)."""


def fp8_align_size(fp8_recipe) -> int:
    """Token alignment of FP8 GEMMs for a recipe: megatron-core's ``get_fp8_align_size``
    (16, or 32 for ``mxfp8``; module docstring)."""
    # megatron-core here, not at the top: models/ and actor/ hold config sections, and the config loads without it
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    return int(get_fp8_align_size(Fp8Recipe(fp8_recipe)))


#: Token multiple of a sequence-parallel shard that each recipe's column-parallel GEMM input
#: needs before its all-gather (module docstring; TE 2.20 ``utils.py:614`` ``assert_dim_for_fp8_exec``: 8;
#: the all-gather quantizer's ``is_quantizable``, for an all-gather in FP8: MXFP8 blocks of 32, FP8
#: blocks of 128).
FP8_LOCAL_ALIGN = {"delayed": 8, "tensorwise": 8, "mxfp8": 32, "blockwise": 128}


def fp8_local_align_size(fp8_recipe) -> int:
    """Tokens a sequence-parallel shard's FP8 GEMM input must be a multiple of (module docstring).

    Raises:
        ValueError: a recipe this table does not know (naming the known ones).
    """
    name = getattr(fp8_recipe, "value", fp8_recipe)
    if name not in FP8_LOCAL_ALIGN:
        raise ValueError(f"fp8_recipe={name!r}: the sequence-parallel FP8 alignment is known for "
                         f"{sorted(FP8_LOCAL_ALIGN)} only")
    return FP8_LOCAL_ALIGN[name]


@dataclass(frozen=True)
class ActorPlan:
    """The resolved micro-batch execution plan of a :class:`~dapo_megatron.actor.MegatronActor`.

    Attributes:
        layout: ``"thd"`` (one packed row per micro-batch) or ``"bshd"`` (right-padded rows).
        use_packed_seq_params: pass ``PackedSeqParams(qkv_format="thd")`` (TE attention).
        build_attention_mask: build the dense bool mask for every micro-batch (THD on the
            local spec: block-diagonal ``[1, 1, T, T]``). Shared-prompt micro-batches always
            carry their mask.
        logits_at_labels_only: the output layer runs on the ``N`` response label rows only
            (a forward pre-hook selects them from its ``[S, B, H]`` input): needs the whole
            sequence on every TP rank (no sequence parallel), no MTP heads, last PP stage.
        length_buckets: (BSHD) each micro-batch runs as row groups of similar length
            (:func:`~dapo_megatron.actor.packing.group_by_length`).
        length_bucket_overhead_tokens: price of one more model call in token-slots.
        seq_multiple: ``T`` (THD) / ``S`` (BSHD) is a multiple of it (TP with sequence parallel).
        fp8_align: ``B * T`` is a multiple of it (FP8 GEMM alignment; 1 = FP8 off).
        fp8_local_align: ``B * T / seq_multiple`` (one TP rank's sequence-parallel shard) is a
            multiple of it (:func:`fp8_local_align_size`; 1 = FP8 or sequence parallel off).
        shared_prompt: ``"off"``; ``"on"``: the samples of a micro-batch with one prompt share
            its encoding; ``"auto"``: the same, for each micro-batch where it computes fewer
            tokens (padding included) than the copied form.
        shared_prompt_off_reason: why ``actor.shared_prompt=auto`` resolved to off here, or None.

    Raises:
        ValueError: contradictory fields (checked in ``__post_init__``, so also by :meth:`replace`).
    """

    layout: str
    use_packed_seq_params: bool = False
    build_attention_mask: bool = False
    logits_at_labels_only: bool = False
    length_buckets: bool = False
    length_bucket_overhead_tokens: int = 64
    seq_multiple: int = 1
    fp8_align: int = 1
    fp8_local_align: int = 1
    shared_prompt: str = "off"
    shared_prompt_off_reason: Optional[str] = None

    def __post_init__(self) -> None:
        if self.layout not in MICRO_BATCH_LAYOUTS:
            raise ValueError(f"plan.layout={self.layout!r} must be 'thd' or 'bshd'")
        if self.use_packed_seq_params and self.layout != "thd":
            raise ValueError("plan.use_packed_seq_params=True needs layout='thd'")
        if self.use_packed_seq_params and self.build_attention_mask:
            raise ValueError("plan.use_packed_seq_params and build_attention_mask exclude each other")
        if self.length_buckets and self.layout != "bshd":
            raise ValueError("plan.length_buckets needs layout='bshd' (a THD row has no padding to save)")
        if self.shared_prompt not in SHARED_PROMPT_MODES:
            raise ValueError(f"plan.shared_prompt={self.shared_prompt!r} must be one of {SHARED_PROMPT_MODES}")
        if self.shared_prompt != "off" and self.use_packed_seq_params:
            raise ValueError("plan.shared_prompt needs the attention mask; PackedSeqParams cannot express it")
        for name in ("seq_multiple", "fp8_align", "fp8_local_align"):
            if getattr(self, name) < 1:
                raise ValueError(f"plan.{name}={getattr(self, name)} must be >= 1")
        if self.length_bucket_overhead_tokens < 0:
            raise ValueError("plan.length_bucket_overhead_tokens must be >= 0")

    @property
    def padding(self) -> dict[str, int]:
        """The padding multiples of :func:`~dapo_megatron.actor.packing.pack_samples` (keyword arguments)."""
        return dict(pad_to_multiple_of=self.seq_multiple, align_tokens_to=self.fp8_align,
                    align_local_tokens_to=self.fp8_local_align)

    @property
    def shares_prompts(self) -> bool:
        """True when micro-batches may be packed in the shared-prompt form (``on`` or ``auto``)."""
        return self.shared_prompt != "off"

    def replace(self, **changes) -> "ActorPlan":
        """A copy with ``changes`` applied and checked again (tests and benchmarks compare paths)."""
        return dataclasses.replace(self, **changes)


def _shared_prompt_unsupported(model, config, use_packed_seq_params: bool, te_attention: bool) -> Optional[str]:
    """Why this model / layout cannot run the shared-prompt form, or None when it can."""
    if use_packed_seq_params:
        return ("the THD path passes PackedSeqParams to Transformer Engine's attention, which attends within each "
                "cu_seqlens segment and restarts RoPE at every segment start; a shared prompt needs response "
                "queries over [prompt keys, own keys] (a second varlen attention call per layer) and RoPE at "
                "the positions that continue the prompt, which this actor does not implement")
    if te_attention:
        return ("TEDotProductAttention applies the causal mask type of its layer spec and ignores an arbitrary "
                "attention mask, so responses would attend to their sibling responses")
    if getattr(config, "context_parallel_size", 1) > 1:
        return "context parallelism splits the sequence; the shared-prompt mask is not split with it"
    if getattr(config, "multi_latent_attention", False):
        return "multi-latent attention applies RoPE on its own path"
    if getattr(config, "apply_rope_fusion", False):
        return "fused RoPE takes one position per row offset; set apply_rope_fusion=False"
    pos = getattr(model, "position_embedding_type", None)
    if pos not in ("rope", "learned_absolute", "none"):
        return f"position_embedding_type={pos!r} (RoPE at explicit positions is implemented for 'rope' only)"
    if pos == "rope" and getattr(model, "rotary_pos_emb", None) is None:
        return "the model has no rotary_pos_emb module to follow position_ids"
    return None


def gpt_model_of(module):
    """The ``GPTModel`` inside a model chunk (found by its ``decoder`` and ``post_process``; a
    stage before the last one has no ``output_layer``), or None."""
    return next((m for m in module.modules() if hasattr(m, "decoder") and hasattr(m, "post_process")), None)


def resolve_actor_plan(actor_cfg, model, *, tp_size: int, experts_span_dp: bool = False) -> ActorPlan:
    """Resolve and check the :class:`ActorPlan` of one model chunk (called once per actor).

    Args:
        actor_cfg: :class:`~dapo_megatron.actor.ActorConfig` (``micro_batch_layout``,
            ``use_packed_seq_params``, ``shared_prompt``; already validated).
        model: this rank's model chunk (a ``GPTModel``, possibly wrapped); its ``config``
            (``TransformerConfig``) gives sequence parallelism, FP8, MTP and CP.
        tp_size: tensor-parallel size (the sequence-parallel multiple).
        experts_span_dp: the MoE layers' collectives reach other DP ranks
            (:attr:`~dapo_megatron.platform.ParallelDims.experts_span_dp`): no length buckets,
            so that one caller micro-batch is one model call on every DP rank.

    Returns:
        The plan. Auto choices: THD with ``PackedSeqParams`` when the model's core
        attention is ``TEDotProductAttention``, BSHD with length buckets otherwise;
        ``shared_prompt='auto'`` is on where :func:`_shared_prompt_unsupported` finds no reason.

    Raises:
        ValueError: naming the ``actor.*`` key, for ``use_packed_seq_params=True`` without the
            TE spec, ``micro_batch_layout='bshd'`` with ``use_packed_seq_params=True``, and
            ``shared_prompt='on'`` on a path that cannot have it (with the reason).
    """
    config = model.config
    # THD needs Transformer Engine's attention; megatron-core's local DotProductAttention
    # asserts packed_seq_params is None and gets the block-diagonal mask instead.
    te_attention = any(type(m).__name__ == "TEDotProductAttention" for m in model.modules())
    want_psp = actor_cfg.use_packed_seq_params
    if want_psp and not te_attention:
        raise ValueError(
            "actor.use_packed_seq_params=True needs the Transformer Engine layer spec (TEDotProductAttention); "
            "this model uses the local spec: set it to None/False (a block-diagonal mask is used)"
        )
    use_psp = te_attention if want_psp is None else bool(want_psp)
    layout = actor_cfg.micro_batch_layout
    if layout is None:
        layout = "thd" if use_psp else "bshd"
    if layout == "bshd" and want_psp:
        raise ValueError(
            "actor.micro_batch_layout='bshd' contradicts actor.use_packed_seq_params=True (THD only); "
            "set one of them to null"
        )
    if layout == "bshd":
        use_psp = False
    gpt = gpt_model_of(model)
    has_output_layer = gpt is not None and gpt.post_process and getattr(gpt, "output_layer", None) is not None
    mode = actor_cfg.shared_prompt
    reason = None if mode == "off" else _shared_prompt_unsupported(gpt or model, config, use_psp, te_attention)
    if reason is not None and mode == "on":
        raise ValueError(f"actor.shared_prompt='on' cannot run on this path: {reason}; set actor.shared_prompt "
                         "to 'auto' (on where supported) or 'off'")
    if reason is not None:
        logger.info("actor.shared_prompt=auto resolves to off: %s", reason)
    fp8 = getattr(config, "fp8", None)
    return ActorPlan(
        layout=layout,
        use_packed_seq_params=use_psp,
        # bshd rows are right-padded: Megatron's causal mask alone keeps padding out of every
        # real token's attention, so no [n, 1, S, S] mask tensor is built
        build_attention_mask=layout == "thd" and not use_psp,
        # the LM head runs on the response label positions only (~1/4 of the tokens in a rollout):
        # needs the full sequence on every TP rank (no sequence parallel) and no MTP heads
        logits_at_labels_only=(has_output_layer and not config.sequence_parallel
                               and getattr(config, "mtp_num_layers", None) is None),
        # bshd: each micro-batch runs as row groups of similar length (less padding); the loss
        # is scaled by the global token count, so the cut changes no result (tested)
        # Not where the experts span DP (EP all-to-all across DP ranks): every model call is then a
        # collective over DP, and a cut by length could give the DP ranks different call counts
        length_buckets=layout == "bshd" and not experts_span_dp,
        seq_multiple=tp_size if config.sequence_parallel else 1,
        fp8_align=fp8_align_size(config.fp8_recipe) if fp8 else 1,
        fp8_local_align=fp8_local_align_size(config.fp8_recipe) if fp8 and config.sequence_parallel else 1,
        shared_prompt="off" if reason is not None else mode,
        shared_prompt_off_reason=reason if mode == "auto" else None,
    )


@dataclass(frozen=True)
class OldLogprobPlan:
    """Where one step's ``log pi_old`` comes from, and whether the behaviour-policy correction
    applies (module docstring); resolved once per step by :func:`resolve_old_logprob_plan`.

    Attributes:
        source: ``RECOMPUTE``: ``Sample.old_logprobs`` holds a forward-only pass at the weights
            before the step's first update (the trainer fills it); ``FROM_TRAINING``: each
            training forward uses its own detached logprobs, ``Sample.old_logprobs`` is not
            read (exact for the first update after those weights only); ``ROLLOUT``:
            ``Sample.old_logprobs`` holds the engine's logprobs (two-policy form).
        corrects: stale (``rollout_is_scope='stale'``) or all tokens get the ``rollout_is``
            weight / ``rollout_rs`` rejection against ``Sample.rollout_logprobs``.

    Raises:
        ValueError: an unknown ``source``, or ``corrects`` with ``ROLLOUT`` (``pi_old`` is then
            the behaviour policy: every weight would be 1).
    """

    source: str
    corrects: bool = False

    def __post_init__(self) -> None:
        if self.source not in OLD_LOGPROB_PLANS:
            raise ValueError(f"OldLogprobPlan.source={self.source!r} must be one of {OLD_LOGPROB_PLANS}")
        if self.corrects and self.source == ROLLOUT:
            raise ValueError("OldLogprobPlan: the rollout's logprobs as pi_old leave nothing to correct")

    @property
    def recompute(self) -> bool:
        """A forward-only pass at the current weights fills ``Sample.old_logprobs``."""
        return self.source == RECOMPUTE

    @property
    def from_training(self) -> bool:
        """``log pi_old = sg(log pi_theta)`` of the training forward (no ``Sample.old_logprobs``)."""
        return self.source == FROM_TRAINING


def resolve_old_logprob_plan(actor_cfg, num_updates: Optional[int] = None) -> OldLogprobPlan:
    """The :class:`OldLogprobPlan` of one step (docs/design.md §3.7), in this order:

    1. ``actor.old_logprob_source: rollout``: ``ROLLOUT``, no correction;
    2. exactly one update in the step (``num_updates == 1``) and no ``actor.rollout_rs``:
       ``FROM_TRAINING``, corrected when ``actor.rollout_is`` is set (``rollout_rs`` changes the
       loss denominator, which must be known before the forward, so it needs a recompute);
    3. else ``RECOMPUTE``, corrected when ``actor.rollout_is`` or ``actor.rollout_rs`` is set.

    Args:
        actor_cfg: :class:`~dapo_megatron.actor.ActorConfig` (validated).
        num_updates: optimizer updates of the step, ``ppo_epochs`` x its mini-batches; None:
            not known (a caller that fills ``Sample.old_logprobs`` itself), never rule 2.
    """
    rs = actor_cfg.rollout_rs is not None
    if actor_cfg.old_logprob_source == ROLLOUT:
        return OldLogprobPlan(ROLLOUT)
    if num_updates == 1 and not rs:
        return OldLogprobPlan(FROM_TRAINING, corrects=actor_cfg.rollout_is is not None)
    return OldLogprobPlan(RECOMPUTE, corrects=actor_cfg.rollout_is is not None or rs)

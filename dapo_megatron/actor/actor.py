"""The Megatron actor: logprob recomputation and DAPO policy updates under TP / PP / DP.

One class, :class:`MegatronActor`, owns the Megatron-wrapped model chunks (DDP),
the distributed optimizer and the LR scheduler. Every forward and backward runs
through ``megatron.core.pipeline_parallel.get_forward_backward_func()``, so the
same code serves PP = 1 and the 1F1B pipeline schedule.

Loss scaling (docs/design.md §3.4). DAPO's token-level loss of a mini-batch is
``sum over all valid tokens / N`` with ``N`` the valid-token count of the whole
mini-batch (all micro-batches, all DP ranks). megatron-core 0.16.1 would rescale
that in two places, and both are switched off here:

1. ``schedules.forward_step_calc_loss``: when the loss function returns
   ``(loss, num_tokens, reduced)`` and ``config.calculate_per_token_loss`` is False,
   the loss is divided by ``num_tokens`` and by ``num_microbatches``. We set
   ``calculate_per_token_loss = True``: the loss is back-propagated as returned.
2. ``DistributedDataParallel``: without ``calculate_per_token_loss`` the grad buffers
   are pre-scaled by ``1 / DP`` (or averaged in the collective), i.e. gradients are
   *averaged* over DP. With it, ``gradient_scaling_factor = 1``: gradients are
   *summed* over DP (``average_in_collective`` must stay False).
3. ``finalize_model_grads(model, num_tokens)`` would then divide the gradients by
   the all-reduced token count returned by the loss function; we install a
   ``finalize_model_grads_func`` that passes ``num_tokens=None``, because our loss
   is already divided by the global ``N``.

So each micro-batch back-propagates ``sum(loss_t over its tokens) / N`` and
gradients are summed over micro-batches (accumulation) and DP ranks (reduce-scatter):
the total is exactly ``sum over all tokens / N`` however the mini-batch is cut.

Sources: verl ``MegatronPPOActor`` (config names, token-mean with a global token
count), megatron-core 0.16.1 ``pipeline_parallel/schedules.py`` and
``distributed/`` (scaling rules above), ``training/training.py`` (DDP / optimizer /
scheduler wiring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from dapo_megatron.platform import distributed as pdist
from dapo_megatron.rollout.types import Sample

from dapo_megatron.algorithms.policy_loss import ROLLOUT_IS_LEVELS, ROLLOUT_RS_LEVELS

from .logprobs import vocab_parallel_logprobs_and_entropy
from .packing import PackedBatch, group_by_length, pack_samples

SUPPORTED_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
OLD_LOGPROB_SOURCES = ("recompute", "rollout")


@dataclass
class OptimConfig:
    """AdamW (Megatron ``optimizer="adam"``, decoupled weight decay) and LR schedule."""

    lr: float = 1e-6
    """peak learning rate (DAPO: 1e-6)."""
    lr_warmup_steps: int = 0
    """linear warm-up length in optimizer steps (Megatron's ``OptimizerParamScheduler`` counts
    optimizer updates; DAPO's 20 rollout steps with 16 updates each are 320 here)."""
    lr_warmup_init: float = 0.0
    """LR at step 0 of the warm-up (Megatron ``lr_warmup_init``)."""
    lr_decay_style: str = "constant"
    """``"constant"`` (DAPO), ``"linear"``, ``"cosine"`` or ``"inverse-square-root"`` after the
    warm-up."""
    min_lr: float = 0.0
    """floor of the decay styles other than constant."""
    weight_decay: float = 0.1
    """decoupled weight decay (not applied to biases and norms)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """max global grad norm (0 disables clipping; the norm is still logged)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field."""
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(
                f"lr_decay_style={self.lr_decay_style!r} must be constant, linear, cosine or inverse-square-root"
            )
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(f"lr_warmup_init={self.lr_warmup_init} must be in [0, lr={self.lr}]")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        for name in ("weight_decay", "clip_grad"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.eps <= 0:
            raise ValueError(f"eps={self.eps} must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={tuple(self.betas)} must be two numbers in [0, 1)")

    def check_total_steps(self, total_steps: int) -> None:
        """Raise ``ValueError`` unless the warm-up ends within the run's ``total_steps``
        optimizer updates (Megatron's scheduler counts updates, not rollout steps)."""
        if total_steps <= self.lr_warmup_steps:
            raise ValueError(
                f"lr_warmup_steps={self.lr_warmup_steps} must be smaller than the run's {total_steps} "
                "optimizer steps (the warm-up counts optimizer updates, not rollout steps)"
            )


@dataclass
class ActorConfig:
    """Policy-update settings (verl ``actor_rollout_ref.actor`` names)."""

    ppo_mini_batch_size: int = 32
    """prompts per mini-batch (one optimizer step each); a mini-batch holds ``ppo_mini_batch_size ×
    n`` responses. Used by the trainer to cut the rollout batch; the actor trains one mini-batch
    per call."""
    ppo_epochs: int = 1
    """passes over the rollout batch (trainer loop)."""
    ppo_max_token_len_per_gpu: int = 16384
    """token budget (prompt + response) of one micro-batch on one GPU
    (:func:`~dapo_megatron.actor.packing.split_by_token_budget`)."""
    clip_ratio_low: float = 0.2
    """eps_low of DAPO's decoupled clip: the ratio is clipped below at 1 - eps_low (paper: 0.2)."""
    clip_ratio_high: float = 0.28
    """eps_high of DAPO's decoupled clip (clip-higher): the ratio is clipped above at 1 + eps_high
    (paper: 0.28)."""
    clip_ratio_c: Optional[float] = None
    """dual-clip constant (> 1) or None."""
    loss_agg_mode: str = "token-mean"
    """``"token-mean"`` (DAPO) or ``"seq-mean-token-mean"`` (GRPO ablation; each micro-batch
    weighted by its share of sequences)."""
    entropy_coeff: float = 0.0
    """entropy bonus weight (0: entropy is logged only, no gradient)."""
    old_logprob_source: str = "recompute"
    """where ``log pi_old`` comes from (algorithms/policy_loss.py, module docstring).
    ``"recompute"``: the actor recomputes it with the weights before the step's first update
    (three-policy form; tokens sampled by older weights get the ``rollout_is`` correction). The
    recompute is skipped when the step is one mini-batch and one epoch (``pi_old = sg(pi_theta)``
    in the training forward, the same value and gradient). ``"rollout"``: the engine's logprobs
    are ``pi_old`` and no recompute pass runs (verl's bypass mode, two-policy form)."""
    rollout_is: Optional[str] = "token"
    """importance weight against the behaviour policy (verl rollout-correction name):
    ``"token"`` (``min(pi_old / mu, C)`` per token), ``"sequence"`` (product over the response's
    corrected tokens, truncated) or null (none)."""
    rollout_is_threshold: float = 2.0
    """``C``, the truncation of the ``rollout_is`` weight (verl's default 2.0)."""
    rollout_is_scope: str = "stale"
    """which tokens are corrected: ``"stale"`` (sampled by weights older than the actor's:
    carried surplus, partial rollouts; on automatically when a batch holds any, a fresh batch
    trains exactly as without correction) or ``"all"`` (also the train/inference numerics of
    fresh tokens: Yao et al.'s TIS, verl's ``tis_imp_ratio_cap``)."""
    rollout_rs: Optional[str] = None
    """rejection of corrected tokens whose ``pi_old / mu`` is out of range: null (off),
    ``"token"`` or ``"geometric"`` (the whole response, by its geometric-mean ratio). Rejected
    tokens leave the loss and its denominator (slime PR #657)."""
    rollout_rs_threshold: Optional[float] = None
    """upper ratio bound (> 1) of ``rollout_rs``."""
    rollout_rs_threshold_lower: Optional[float] = None
    """lower ratio bound of ``rollout_rs``; null: ``1 / rollout_rs_threshold``."""
    use_packed_seq_params: Optional[bool] = None
    """pass ``PackedSeqParams(qkv_format="thd")`` to the model (TE attention on GPU) instead of a
    block-diagonal ``[1, 1, T, T]`` mask. None: auto (True when the model's core attention is
    ``TEDotProductAttention``)."""
    micro_batch_layout: Optional[str] = None
    """how a micro-batch is laid out for the model. ``"thd"``: all samples packed into one row (with
    ``PackedSeqParams`` on TE, else a dense block-diagonal ``[1, 1, T, T]`` mask whose attention
    cost grows with ``T²`` of the whole micro-batch). ``"bshd"``: one right-padded row per sample
    with Megatron's plain causal mask (no mask tensor; right padding never reaches a real token),
    attention cost ``n · S²`` with ``S`` the longest sample. None: auto, ``"thd"`` with
    packed-sequence params (TE, GPU), ``"bshd"`` otherwise (CPU / local spec;
    ``benchmarks/bench_actor.py`` measures both)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, learning-rate schedule and gradient clipping (:class:`OptimConfig`)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field (``optim`` validates itself)."""
        for name in ("ppo_mini_batch_size", "ppo_epochs", "ppo_max_token_len_per_gpu"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.loss_agg_mode not in SUPPORTED_LOSS_AGG_MODES:
            raise ValueError(
                f"loss_agg_mode={self.loss_agg_mode!r} is not one of {SUPPORTED_LOSS_AGG_MODES} "
                "(the modes whose micro-batch split can be made exact)"
            )
        if self.micro_batch_layout not in (None, "thd", "bshd"):
            raise ValueError(
                f"micro_batch_layout={self.micro_batch_layout!r} must be null (auto), 'thd' (packed) or "
                "'bshd' (padded rows)"
            )
        if self.old_logprob_source not in OLD_LOGPROB_SOURCES:
            raise ValueError(f"old_logprob_source={self.old_logprob_source!r} must be one of {OLD_LOGPROB_SOURCES}")
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"rollout_is={self.rollout_is!r} must be one of {ROLLOUT_IS_LEVELS} or null")
        if not self.rollout_is_threshold > 0:
            raise ValueError(f"rollout_is_threshold={self.rollout_is_threshold} must be > 0")
        if self.rollout_is_scope not in ("stale", "all"):
            raise ValueError(f"rollout_is_scope={self.rollout_is_scope!r} must be 'stale' or 'all'")
        if self.rollout_rs is not None:
            if self.rollout_rs not in ROLLOUT_RS_LEVELS:
                raise ValueError(f"rollout_rs={self.rollout_rs!r} must be one of {ROLLOUT_RS_LEVELS} or null")
            if self.rollout_rs_threshold is None or not self.rollout_rs_threshold > 1:
                raise ValueError(f"rollout_rs_threshold={self.rollout_rs_threshold} must be > 1 when rollout_rs is set")
            lower = self.rollout_rs_threshold_lower
            if lower is not None and not 0 < lower < self.rollout_rs_threshold:
                raise ValueError(f"rollout_rs_threshold_lower={lower} must be in (0, rollout_rs_threshold)")
            if self.old_logprob_source == "rollout":
                raise ValueError("rollout_rs needs the recomputed pi_old (old_logprob_source='recompute'): in bypass "
                                 "mode pi_old is the rollout policy and no token is off it; set rollout_rs: null")

    @property
    def corrects(self) -> bool:
        """Whether stale (or, with ``rollout_is_scope='all'``, all) tokens get the behaviour-policy
        correction: ``rollout_is`` or ``rollout_rs`` set, and ``pi_old`` recomputed (in bypass mode
        ``pi_old`` is the behaviour policy: every weight would be 1)."""
        return self.old_logprob_source == "recompute" and (self.rollout_is is not None or self.rollout_rs is not None)


@dataclass(frozen=True)
class _Targets:
    """What one :meth:`MegatronActor.forward_backward` call trains against (shared by its micro-batches).

    ``old_from_current``: ``log pi_old = sg(log pi_theta)`` of the training forward (no
    ``Sample.old_logprobs`` needed); ``policy_version``: the actor's weights version, tokens
    with an older ``Sample.versions`` entry are stale; ``cfg``: the correction settings.
    """

    cfg: "ActorConfig"
    policy_version: Optional[int]
    old_from_current: bool


class _MicroBatch:
    """A packed micro-batch plus its per-token training targets ([B, T] like the inputs).

    With targets: ``old_logprobs``, ``advantages``, and for the behaviour-policy correction
    ``rollout_logprobs`` and ``corrected`` (the tokens it applies to; None when there are
    none, so an on-policy batch trains exactly as without correction). ``loss_mask`` is the
    packed batch's mask minus the tokens ``rollout_rs`` rejects, ``is_weights`` the detached
    ``rollout_is`` weights (None: 1), both known here unless ``old_from_current`` (then the
    loss function computes the weights from the training forward).
    """

    def __init__(self, samples: Sequence[Sample], layout: str, pad_to: int, build_mask: bool, device,
                 targets: Optional[_Targets]):
        self.samples = list(samples)
        self.batch: PackedBatch = pack_samples(
            samples, layout=layout, pad_to_multiple_of=pad_to, build_attention_mask=build_mask, device=device
        )
        b = self.batch
        B, T = b.input_ids.shape
        # response label positions, row-major over [B, T] (int64 [N]), and the same positions in
        # Megatron's [S, B] hidden-state order: the output layer only needs these N rows
        self.label_index = b.response_mask.reshape(-1).nonzero().squeeze(1)
        self.label_index_sb = (self.label_index % T) * B + self.label_index // T
        if targets is None:
            return
        cfg = targets.cfg
        for i, s in enumerate(samples):
            if not targets.old_from_current and (s.old_logprobs is None or len(s.old_logprobs) != len(s.response_ids)):
                raise ValueError(
                    f"sample {i}: old_logprobs must hold one value per response token (got "
                    f"{None if s.old_logprobs is None else len(s.old_logprobs)}, need {len(s.response_ids)}); "
                    "call MegatronActor.compute_logprobs first and store the result in Sample.old_logprobs"
                )
            if not math.isfinite(s.advantage):
                raise ValueError(f"sample {i}: advantage={s.advantage} is not finite")
        self.old_logprobs = (None if targets.old_from_current
                             else b.scatter_per_sample([s.old_logprobs for s in samples]))
        self.advantages = b.scatter_per_sample([[s.advantage] * len(s.response_ids) for s in samples])
        self.loss_mask = b.loss_mask.float()
        self.is_weights = None
        self.corrected = None
        self.rollout_logprobs = None
        self.corr_metrics: dict[str, torch.Tensor] = {}
        if cfg.corrects:
            if cfg.rollout_is_scope == "all":
                flags = [[1.0] * len(s.response_ids) for s in samples]
            else:  # tokens of weights older than the actor's
                version = targets.policy_version
                flags = [[1.0 if version is not None and v < version else 0.0 for v in s.token_versions()]
                         or [0.0] * len(s.response_ids) for s in samples]
            if any(1.0 in f for f in flags):
                for i, s in enumerate(samples):
                    if len(s.rollout_logprobs) != len(s.response_ids):
                        raise ValueError(f"sample {i}: rollout_logprobs has {len(s.rollout_logprobs)} values, need "
                                         f"{len(s.response_ids)} (the behaviour-policy correction needs them)")
                self.corrected = b.scatter_per_sample(flags) > 0.5
                self.rollout_logprobs = b.scatter_per_sample([s.rollout_logprobs for s in samples])
                if self.old_logprobs is not None:
                    self.is_weights, self.loss_mask, self.corr_metrics = self.correction(self.old_logprobs, cfg)
        self.num_valid_tokens = b.num_loss_tokens  # before rejection
        self.num_loss_tokens = int(self.loss_mask.sum().item())
        self.num_loss_seqs = sum(1 for m in b.unpack(self.loss_mask) if m.sum() > 0)

    def correction(self, old_logprobs: torch.Tensor, cfg: "ActorConfig"):
        """:func:`~dapo_megatron.algorithms.policy_loss.rollout_correction` of this micro-batch."""
        from dapo_megatron.algorithms.policy_loss import rollout_correction

        return rollout_correction(
            old_logprobs, self.rollout_logprobs, self.batch.loss_mask, tokens=self.corrected,
            rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold, rollout_rs=cfg.rollout_rs,
            rollout_rs_threshold=cfg.rollout_rs_threshold, rollout_rs_threshold_lower=cfg.rollout_rs_threshold_lower)


def _per_sample_padded(batch: PackedBatch, values: torch.Tensor) -> torch.Tensor:
    """[B, T] values at label positions -> [n, R_max] right-padded (differentiable)."""
    per = batch.unpack(values)
    r_max = max((x.numel() for x in per), default=0)
    return torch.stack([torch.nn.functional.pad(x, (0, r_max - x.numel())) for x in per])


_SUM_KEYS = ("loss", "pg_loss", "pg_clipfrac_lower", "pg_clipfrac_upper", "ppo_kl", "entropy", "num_tokens",
             "rollout_corr_frac", "rollout_is_mean", "rollout_is_clipfrac", "rollout_rs_masked_frac")


class MegatronActor:
    """DAPO actor over Megatron model chunks (TP / PP / DP, distributed optimizer).

    Args:
        model_chunks: this rank's model: a ``GPTModel`` (or a one-element list); PP
            stages each pass their own stage. Virtual pipeline (several chunks) is not
            supported. Weights must be loaded *before* construction (DDP copies them
            into its contiguous buffers and the optimizer shards them).
        actor_cfg: :class:`ActorConfig`.
        total_steps: optimizer steps of the whole run (the LR schedule's horizon).
        vocab_size: real tokenizer vocabulary; logits columns beyond it (Megatron's
            vocab padding) are excluded from the softmax. None: no padding.

    Side effects on the shared ``TransformerConfig`` (``model.config``):
    ``calculate_per_token_loss=True`` (see module docstring), ``variable_seq_lengths=True``
    and ``pipeline_dtype`` (PP), ``finalize_model_grads_func``, ``no_sync_func``,
    ``grad_scale_func``.

    Attributes exposed for checkpointing: ``model_chunks`` (DDP-wrapped),
    ``optimizer`` (Megatron ``DistributedOptimizer``), ``scheduler``
    (``OptimizerParamScheduler``).

    Execution choices (resolved at construction, read at every call): ``layout``
    (``"thd"`` / ``"bshd"``, see ``ActorConfig.micro_batch_layout``),
    ``build_attention_mask`` (THD on the local spec: block-diagonal ``[1, 1, T, T]`` bool
    mask), ``logits_at_labels_only``: the output layer (LM head, ``[H] -> [V/TP]``) runs on
    the ``N`` response label positions only, selected from its ``[S, B, H]`` input by a
    forward pre-hook, so the ``[T, V/TP]`` fp32 logits and their matmuls shrink to
    ``[N, V/TP]`` (N ≈ T/4 for rollouts with ~50-token prompts and ~18-token responses).
    True on the last PP stage when sequence parallelism is off (the hidden states then
    hold the whole sequence on every TP rank) and the model has no MTP heads.
    ``length_buckets`` (BSHD): every micro-batch is run as row groups of similar length
    (:func:`~dapo_megatron.actor.packing.group_by_length`, one extra model call priced at
    ``length_bucket_overhead_tokens`` = 64 token-slots), so a few long rows do not pad
    the whole micro-batch; results are returned in the caller's order. Every rank of a
    model-parallel group receives the same micro-batches, so all cut them identically.

    Every rank of the model-parallel (TP × PP) group must pass the same
    micro-batches to each call; DP ranks pass their own shard of the mini-batch.
    """

    def __init__(self, model_chunks, actor_cfg: ActorConfig, total_steps: int, *, vocab_size: Optional[int] = None):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if len(chunks) != 1:
            raise ValueError(
                f"got {len(chunks)} model chunks: virtual pipeline parallelism is not supported; pass this "
                "rank's single pipeline stage"
            )
        actor_cfg.validate()
        actor_cfg.optim.validate()
        actor_cfg.optim.check_total_steps(total_steps)
        self.cfg = actor_cfg
        self.vocab_size = vocab_size
        config = chunks[0].config
        self.config = config
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()

        # (1)-(3) of the module docstring: no 1/num_microbatches, no 1/DP, no 1/num_tokens
        config.calculate_per_token_loss = True
        if self.pp_size > 1:
            config.variable_seq_lengths = True  # packed micro-batches have different lengths
            if config.pipeline_dtype is None:
                config.pipeline_dtype = config.params_dtype

        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            average_in_collective=False,
            check_for_nan_in_grad=False,  # a NaN step is skipped by the optimizer instead
        )
        self.model_chunks = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=(i > 0))
            for i, chunk in enumerate(chunks)
        ]
        o = actor_cfg.optim
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=o.clip_grad,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=True,
            # constant scale 1 (exact no-op on values) gives Megatron's found-inf check: a step
            # whose gradients hold NaN/inf is skipped and reported (fp16 keeps the dynamic scaler)
            loss_scale=None if config.fp16 else 1.0,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.model_chunks)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=o.lr_warmup_init,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps,
            lr_decay_steps=total_steps,
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=total_steps,
            wd_incr_style="constant",
        )

        def _finalize(model, num_tokens, pg_collection=None, force_all_reduce=False):
            # the loss is already divided by the global token count: do not divide again
            finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)

        config.finalize_model_grads_func = _finalize
        config.no_sync_func = self.model_chunks[0].no_sync
        config.grad_scale_func = self.optimizer.scale_loss

        # THD needs Transformer Engine's attention; megatron-core's local DotProductAttention
        # asserts packed_seq_params is None and gets the block-diagonal mask instead.
        te_attention = any(type(m).__name__ == "TEDotProductAttention" for m in chunks[0].modules())
        use_thd = actor_cfg.use_packed_seq_params
        if use_thd and not te_attention:
            raise ValueError(
                "actor.use_packed_seq_params=True needs the Transformer Engine layer spec (TEDotProductAttention); "
                "this model uses the local spec: set it to None/False (a block-diagonal mask is used)"
            )
        self.use_packed_seq_params = te_attention if use_thd is None else bool(use_thd)
        layout = actor_cfg.micro_batch_layout
        if layout is None:
            layout = "thd" if self.use_packed_seq_params else "bshd"
        if layout == "bshd" and actor_cfg.use_packed_seq_params:
            raise ValueError(
                "actor.micro_batch_layout='bshd' contradicts actor.use_packed_seq_params=True (THD only); "
                "set one of them to null"
            )
        if layout == "bshd":
            self.use_packed_seq_params = False
        self.layout = layout
        # the LM head runs on the response label positions only (~1/4 of the tokens in a rollout):
        # needs the full sequence on every TP rank (no sequence parallel) and no MTP heads
        gpt = next((m for m in chunks[0].modules() if hasattr(m, "output_layer") and hasattr(m, "decoder")), None)
        self._output_layer = getattr(gpt, "output_layer", None) if gpt is not None and gpt.post_process else None
        self.logits_at_labels_only = (
            self._output_layer is not None and not config.sequence_parallel
            and getattr(config, "mtp_num_layers", None) is None
        )
        # bshd rows are right-padded: Megatron's causal mask alone keeps padding out of every
        # real token's attention, so no [n, 1, S, S] mask tensor is built
        self.build_attention_mask = layout == "thd" and not self.use_packed_seq_params
        # bshd: each micro-batch runs as row groups of similar length (less padding); the loss
        # is scaled by the global token count, so the cut changes no result (tested)
        self.length_buckets = layout == "bshd"
        self.length_bucket_overhead_tokens = 64
        self.pad_to = self.tp_size if config.sequence_parallel else 1
        self.device = pdist.device()
        self.num_model_calls = 0  # micro-batch forward passes run so far (old-logprob and training)

    # ------------------------------------------------------------------ helpers
    def _make_micro_batches(self, micro_batches, targets: Optional[_Targets] = None
                            ) -> tuple[list[_MicroBatch], list[int]]:
        """Pack the caller's micro-batches; with ``length_buckets`` (BSHD) each is first cut into
        rows of similar length (:func:`~dapo_megatron.actor.packing.group_by_length`).

        Returns:
            ``(mbs, order)``: the packed micro-batches as run, and for each of their samples
            (in run order) its index in the caller's flattened micro-batches.
        """
        if len(micro_batches) == 0 or any(len(mb) == 0 for mb in micro_batches):
            raise ValueError("micro_batches must be a non-empty list of non-empty lists of Sample")
        groups, order, start = [], [], 0
        for mb in micro_batches:
            mb = list(mb)
            if self.length_buckets:
                idx_groups = group_by_length([s.total_length for s in mb], pad_to_multiple_of=self.pad_to,
                                             overhead_tokens=self.length_bucket_overhead_tokens)
            else:
                idx_groups = [list(range(len(mb)))]
            for g in idx_groups:
                groups.append([mb[i] for i in g])
                order.extend(start + i for i in g)
            start += len(mb)
        mbs = [
            _MicroBatch(mb, self.layout, self.pad_to, self.build_attention_mask, self.device, targets)
            for mb in groups
        ]
        return mbs, order

    def _forward(self, model, mb: _MicroBatch):
        """Model output of one micro-batch: logits ``[B, T, V/TP]``, or ``[1, N, V/TP]`` at the
        ``N`` response label positions only (``logits_at_labels_only``); earlier PP stages
        return hidden states."""
        b = mb.batch
        psp = b.packed_seq_params if self.use_packed_seq_params else None
        if not self.logits_at_labels_only:
            return model(b.input_ids, b.position_ids, b.attention_mask, packed_seq_params=psp)

        def keep_label_rows(module, args, kwargs):
            hidden = args[0]  # [S, B, H] after the final norm
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.label_index_sb)
            return (rows.unsqueeze(1), *args[1:]), kwargs  # [N, 1, H]

        handle = self._output_layer.register_forward_pre_hook(keep_label_rows, with_kwargs=True)
        try:
            return model(b.input_ids, b.position_ids, b.attention_mask, packed_seq_params=psp)
        finally:
            handle.remove()

    def _logprobs_and_entropy(self, mb: _MicroBatch, output_tensor, temperature: float):
        """Per-token logprob and entropy at the micro-batch's label positions, float32 ``[B, T]``
        (0 elsewhere), differentiable w.r.t. ``output_tensor`` (see :meth:`_forward`)."""
        b = mb.batch
        if not self.logits_at_labels_only:
            return vocab_parallel_logprobs_and_entropy(
                output_tensor, b.labels, vocab_size=self.vocab_size, temperature=temperature
            )
        labels = b.labels.reshape(-1).index_select(0, mb.label_index).unsqueeze(0)  # [1, N]
        lp, ent = vocab_parallel_logprobs_and_entropy(
            output_tensor, labels, vocab_size=self.vocab_size, temperature=temperature
        )
        zeros = lp.new_zeros(b.labels.numel())
        return tuple(zeros.index_copy(0, mb.label_index, x[0]).view(b.labels.shape) for x in (lp, ent))

    def _run_schedule(self, mbs: list[_MicroBatch], forward_step, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.num_model_calls += len(mbs)  # micro-batch forwards through this rank's model (stage)
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=self.model_chunks,
            num_microbatches=len(mbs),
            seq_length=max(mb.batch.input_ids.shape[1] for mb in mbs),
            micro_batch_size=max(mb.batch.input_ids.shape[0] for mb in mbs),
            forward_only=forward_only,
        )

    def _is_last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage()

    def _broadcast_from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        if self.pp_size > 1:
            from megatron.core import parallel_state as ps

            dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=self.pp_group)
        return t

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_logprobs(
        self, micro_batches: Sequence[Sequence[Sample]], temperature: float = 1.0, *, return_entropy: bool = False
    ):
        """Logprobs of every sample's response tokens under the current weights (no grad).

        Runs ``forward_only`` through Megatron's forward-backward schedule; the last
        PP stage computes them and broadcasts to the whole PP group, so every rank
        returns them.

        Args:
            micro_batches: list of micro-batches (lists of Sample), e.g. from
                :func:`~dapo_megatron.actor.packing.split_by_token_budget`.
            temperature: the rollout's sampling temperature (logits are divided by it).
            return_entropy: also return per-token entropies.

        Returns:
            ``list[Tensor[R_i]]`` float32 CPU logprobs (nats) in the order of the
            flattened micro-batches; with ``return_entropy``, a tuple
            ``(logprobs, entropies)`` of two such lists.
        """
        mbs, order = self._make_micro_batches(micro_batches)
        for m in self.model_chunks:
            m.eval()

        def loss_func(mb: _MicroBatch, output_tensor):
            lp, ent = self._logprobs_and_entropy(mb, output_tensor, temperature)
            zero = output_tensor.new_zeros(())
            return zero, torch.tensor(0, dtype=torch.int), {"logprobs": lp, "entropy": ent}

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return self._forward(model, mb), partial(loss_func, mb)

        outs = self._run_schedule(mbs, forward_step, forward_only=True)
        logprobs, entropies = self._per_sample_outputs(mbs, order, outs, ("logprobs", "entropy"))
        return (logprobs, entropies) if return_entropy else logprobs

    def _per_sample_outputs(self, mbs: list[_MicroBatch], order: list[int], outs, keys: Sequence[str]):
        """Per-sample ``[R_i]`` float32 CPU tensors of the ``[B, T]`` outputs ``keys`` of every
        micro-batch, in the caller's flattened order, on every rank (the last PP stage computes
        them and broadcasts them over the PP group)."""
        total = sum(sum(mb.batch.response_lens) for mb in mbs)
        # broadcast over the PP group below: on that group's device (CUDA under NCCL)
        flat = torch.zeros(len(keys), total, dtype=torch.float32, device=pdist.collective_device(self.pp_group))
        if self._is_last_stage() and total:
            for k, key in enumerate(keys):
                flat[k] = torch.cat([x for mb, out in zip(mbs, outs) for x in mb.batch.unpack(out[key])]).float()
        self._broadcast_from_last_stage(flat)
        sizes = [r for mb in mbs for r in mb.batch.response_lens]
        flat = flat.cpu()
        results = []
        for k in range(len(keys)):
            per = [None] * len(order)
            for i, v in zip(order, torch.split(flat[k], sizes)):  # run order -> the caller's order
                per[i] = v
            results.append(per)
        return results

    def forward_backward(
        self, micro_batches: Sequence[Sequence[Sample]], temperature: float = 1.0,
        global_num_tokens: Optional[int] = None, *, policy_version: Optional[int] = None,
        old_from_current: bool = False, return_logprobs: bool = False,
    ) -> dict[str, float]:
        """Accumulate the DAPO policy-gradient of one mini-batch into the DDP grad buffers.

        Zeroes the grad buffers, runs every micro-batch through the schedule and
        finishes the DP grad sync (reduce-scatter). Does not step the optimizer
        (see :meth:`train_mini_batch`).

        Args:
            micro_batches: this DP rank's micro-batches of the mini-batch. Samples need
                ``advantage`` and ``old_logprobs`` (unless ``old_from_current``); the
                behaviour-policy correction (``actor.rollout_is`` / ``rollout_rs``) also reads
                ``rollout_logprobs`` and ``versions`` of the tokens it corrects.
            temperature: the rollout's sampling temperature.
            global_num_tokens: valid loss tokens of the whole mini-batch over all
                micro-batches and DP ranks, before ``rollout_rs`` rejection; checked against
                the actor's own count (which it all-reduces anyway: the denominator is the
                count after rejection). None: not checked.
            policy_version: the actor's weights version (trainer step count): tokens with an
                older ``Sample.versions`` entry are stale and get the correction when
                ``actor.rollout_is_scope == "stale"``; None: no token is stale.
            old_from_current: ``log pi_old = sg(log pi_theta)`` of this forward instead of
                ``Sample.old_logprobs`` (exact when this is the first update since the weights
                that would have recomputed them: one mini-batch, one epoch). Not with
                ``rollout_rs`` (its denominator needs ``pi_old`` before the forward).
            return_logprobs: also return the training forward's detached logprobs.

        Returns:
            metrics over the whole mini-batch (identical on all ranks): ``loss`` (incl.
            entropy bonus), ``pg_loss``, ``pg_clipfrac_lower``, ``pg_clipfrac_upper``,
            ``ppo_kl``, ``entropy`` (token means), ``ratio_min``, ``ratio_max``,
            ``num_tokens`` (after rejection), ``num_micro_batches`` (the caller's),
            ``num_model_calls`` (micro-batches actually run, after ``length_buckets``; this
            DP rank), and the correction's ``rollout_corr_frac``, ``rollout_is_mean``,
            ``rollout_is_clipfrac``, ``rollout_rs_masked_frac`` (fractions of the valid
            tokens; 0, 1, 0, 0 when nothing is corrected). With ``return_logprobs`` the
            tuple ``(metrics, logprobs)``: ``list[Tensor[R_i]]`` in the caller's flattened order.

        Raises:
            ValueError: missing ``old_logprobs``, a ``global_num_tokens`` that differs
                from the count of the samples, empty micro-batches, ``old_from_current``
                with ``rollout_rs``.
        """
        cfg = self.cfg
        if old_from_current and cfg.rollout_rs is not None and cfg.corrects:
            raise ValueError("old_from_current=True with actor.rollout_rs set: the rejection changes the loss "
                             "denominator, which must be known before the forward; recompute old_logprobs first")
        targets = _Targets(cfg=cfg, policy_version=policy_version, old_from_current=old_from_current)
        mbs, order = self._make_micro_batches(micro_batches, targets)
        # counted in python, all-reduced over DP on the group's device (a CPU tensor fails under NCCL)
        counts = torch.tensor([sum(mb.num_valid_tokens for mb in mbs), sum(mb.num_loss_tokens for mb in mbs),
                               sum(mb.num_loss_seqs for mb in mbs)], dtype=torch.float64,
                              device=pdist.collective_device(self.dp_group))
        if dist.is_initialized():
            dist.all_reduce(counts, group=self.dp_group)
        n_valid, n_tok, n_seq = (int(x) for x in counts.tolist())
        if global_num_tokens is not None and int(global_num_tokens) != n_valid:
            raise ValueError(
                f"global_num_tokens={global_num_tokens} but the mini-batch holds {n_valid} loss tokens over all "
                "micro-batches and DP ranks (overlong-filtered samples count 0); pass None to let the actor count"
            )
        for m in self.model_chunks:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        mode = cfg.loss_agg_mode
        from dapo_megatron.algorithms.policy_loss import agg_loss, compute_policy_loss

        def loss_func(mb: _MicroBatch, output_tensor):
            b = mb.batch
            lp, ent = self._logprobs_and_entropy(mb, output_tensor, temperature)
            old, is_w, mask, corr = mb.old_logprobs, mb.is_weights, mb.loss_mask, mb.corr_metrics
            if old is None:  # pi_old = sg(pi_theta): the value of the recompute this forward replaces
                old = lp.detach()
                if mb.corrected is not None:
                    is_w, mask, corr = mb.correction(old, cfg)
            if mode == "token-mean":
                # [B, T] tensors directly: sum(loss * mask) / N is layout-free
                views = (lp, old, mb.advantages, mask, is_w, ent)
                weight, kwargs = 1.0, {"global_num_tokens": max(n_tok, 1)}
            else:  # seq-mean-token-mean: per-sample rows, weighted by the share of sequences
                views = tuple(None if t is None else _per_sample_padded(b, t)
                              for t in (lp, old, mb.advantages, mask, is_w, ent))
                weight, kwargs = mb.num_loss_seqs / max(n_seq, 1), {}
            lp_v, old_v, adv_v, mask_v, w_v, ent_v = views
            pg_loss, m = compute_policy_loss(
                lp_v, old_v, adv_v, mask_v,
                clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=mode, is_weights=w_v, **kwargs,
            )
            ent_term = agg_loss(ent_v if cfg.entropy_coeff else ent_v.detach(), mask_v, mode, **kwargs)
            pg_loss = pg_loss * weight
            ent_term = ent_term * weight
            loss = pg_loss - cfg.entropy_coeff * ent_term if cfg.entropy_coeff else pg_loss
            n_local = float(mb.num_loss_tokens)
            share = n_local / max(n_tok, 1)  # token share of this micro-batch in the mini-batch
            valid_share = mb.num_valid_tokens / max(n_valid, 1)  # the same before rejection
            zero = torch.zeros((), dtype=torch.float32)
            reduced = {
                "loss": loss.detach().float(),
                "pg_loss": pg_loss.detach().float(),
                "pg_clipfrac_lower": m["pg_clipfrac_lower"] * share,
                "pg_clipfrac_upper": m["pg_clipfrac_upper"] * share,
                "ppo_kl": m["ppo_kl"] * share,
                "entropy": (ent.detach().float() * mask.float()).sum() / max(n_tok, 1),
                "num_tokens": torch.tensor(n_local),
                "ratio_min": m["ratio_min"] if n_local else torch.tensor(float("inf")),
                "ratio_max": m["ratio_max"] if n_local else torch.tensor(float("-inf")),
                "rollout_corr_frac": corr.get("rollout_corr_frac", zero) * valid_share,
                "rollout_is_mean": corr.get("rollout_is_mean", torch.ones(())) * valid_share,
                "rollout_is_clipfrac": corr.get("rollout_is_clipfrac", zero) * valid_share,
                "rollout_rs_masked_frac": corr.get("rollout_rs_masked_frac", zero) * valid_share,
            }
            if return_logprobs:
                reduced["logprobs"] = lp.detach()
            return loss, torch.tensor(int(n_local), dtype=torch.int), reduced

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return self._forward(model, mb), partial(loss_func, mb)

        outs = self._run_schedule(mbs, forward_step, forward_only=False)

        # all-reduced over PP and DP below: on the groups' device (NCCL: this rank's GPU)
        dev = pdist.collective_device(self.dp_group)
        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64, device=dev)
        mins = torch.full((1,), float("inf"), dtype=torch.float64, device=dev)
        maxs = torch.full((1,), float("-inf"), dtype=torch.float64, device=dev)
        if self._is_last_stage():
            for out in outs:
                sums += torch.stack([out[k].double().reshape(()) for k in _SUM_KEYS]).to(sums.device)
                mins = torch.minimum(mins, out["ratio_min"].double().reshape(1).to(mins.device))
                maxs = torch.maximum(maxs, out["ratio_max"].double().reshape(1).to(maxs.device))
        if dist.is_initialized():
            # non-last PP stages contribute zeros / +-inf; DP ranks hold disjoint shards
            for group in ([self.pp_group] if self.pp_size > 1 else []) + [self.dp_group]:
                dist.all_reduce(sums, group=group)
                dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
                dist.all_reduce(maxs, op=dist.ReduceOp.MAX, group=group)
        metrics = {k: float(v) for k, v in zip(_SUM_KEYS, sums.tolist())}
        metrics["ratio_min"] = float(mins) if math.isfinite(float(mins)) else 1.0
        metrics["ratio_max"] = float(maxs) if math.isfinite(float(maxs)) else 1.0
        metrics["num_micro_batches"] = float(len(micro_batches))
        metrics["num_model_calls"] = float(len(mbs))
        if n_valid == 0:  # nothing to weight: the correction's neutral values
            metrics["rollout_is_mean"] = 1.0
        if return_logprobs:
            return metrics, self._per_sample_outputs(mbs, order, outs, ("logprobs",))[0]
        return metrics

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step the distributed optimizer, then the LR scheduler (only on success).

        Returns:
            ``grad_norm`` (global, before clipping; NaN when the step was skipped),
            ``lr`` (the LR used by this step), ``skipped`` (1.0 when the gradients held
            NaN/inf: Megatron's found-inf check, weights and scheduler untouched).
        """
        lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            if grad_norm is None or self.cfg.optim.clip_grad == 0:
                grad_norm = self.optimizer.get_grad_norm()
            self.scheduler.step(increment=1)
        return {
            "grad_norm": float(grad_norm) if ok else float("nan"),
            "lr": float(lr),
            "skipped": 0.0 if ok else 1.0,
        }

    def train_mini_batch(
        self, micro_batches: Sequence[Sequence[Sample]], temperature: float = 1.0,
        global_num_tokens: Optional[int] = None, *, policy_version: Optional[int] = None,
        old_from_current: bool = False, return_logprobs: bool = False,
    ):
        """One optimizer step on one mini-batch: :meth:`forward_backward` + :meth:`optimizer_step`
        (the keyword arguments are :meth:`forward_backward`'s).

        Not stepped (``skipped = 1``, weights and scheduler untouched):

        - a mini-batch without any loss token (all samples overlong-filtered): Adam
          would still move the weights with zero gradients;
        - a non-finite loss (e.g. a NaN ``old_logprobs`` entry: the policy loss clamps
          the log-ratio, whose gradient is then 0, so the gradients alone look finite);
        - non-finite gradients (Megatron's found-inf check, see :meth:`optimizer_step`).

        Returns:
            the union of both methods' metrics; with ``return_logprobs`` the tuple
            ``(metrics, logprobs)`` of :meth:`forward_backward`.
        """
        out = self.forward_backward(micro_batches, temperature, global_num_tokens, policy_version=policy_version,
                                    old_from_current=old_from_current, return_logprobs=return_logprobs)
        metrics, logprobs = out if return_logprobs else (out, None)
        if metrics["num_tokens"] == 0 or not math.isfinite(metrics["loss"]):
            lr = self.optimizer.param_groups[0]["lr"]
            grad_norm = 0.0 if metrics["num_tokens"] == 0 else float("nan")
            metrics = {**metrics, "grad_norm": grad_norm, "lr": float(lr), "skipped": 1.0}
        else:
            metrics = {**metrics, **self.optimizer_step()}
        return (metrics, logprobs) if return_logprobs else metrics

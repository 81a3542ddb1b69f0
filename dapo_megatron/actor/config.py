"""The ``actor`` section (:class:`ActorConfig`, its ``optim`` :class:`OptimConfig`): settings of the
policy updates, read by :class:`~dapo_megatron.actor.actor.MegatronActor` and the trainer.

Below the actor's modules (they import it; it imports only the plan's mode names), so the
config loads without megatron-core. docs/design.md §3 for the loss, §3.7 for the off-policy correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from dapo_megatron.algorithms.config import ROLLOUT_IS_LEVELS, ROLLOUT_RS_LEVELS

from .plan import SHARED_PROMPT_MODES

SUPPORTED_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
OLD_LOGPROB_SOURCES = ("recompute", "rollout")
ROUTING_REPLAY_MODES = ("off", "rollout")


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
    """token budget (prompt + response) of one micro-batch on one GPU: the step's plan cuts each DP
    rank's share of a mini-batch by it (:func:`~dapo_megatron.actor.dp_split.split_for_dp`)."""
    clip_ratio_low: float = 0.2
    """eps_low of DAPO's decoupled clip, in [0, 1): the ratio is clipped below at 1 - eps_low (paper: 0.2)."""
    clip_ratio_high: float = 0.28
    """eps_high of DAPO's decoupled clip (clip-higher), >= 0: the ratio is clipped above at 1 + eps_high
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
    are ``pi_old`` and no recompute pass runs (verl's bypass mode, two-policy form). Resolved
    once per step, with whether the correction applies, by
    :func:`~dapo_megatron.actor.plan.resolve_old_logprob_plan`."""
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
    shared_prompt: str = "auto"
    """``"auto"``, ``"on"`` or ``"off"``. On: the responses of a micro-batch that share a prompt (a GRPO
    group) are trained as one segment, the prompt encoded once, each response attending to the
    prompt's keys and values and its own, at positions continuing the prompt (Prefix Grouper, arXiv
    2506.05433): the same logprobs, entropy, loss and gradients as the copied form, fewer tokens.
    The trainer then keeps a group's samples in one micro-batch and counts its prompt once in
    ``ppo_max_token_len_per_gpu``. Auto: on where the path supports it (the local spec; the TE path
    does not, see ``dapo_megatron.actor.plan``) and, per micro-batch, where it computes fewer
    tokens. On where it cannot run: an error at actor construction."""
    routing_replay: str = "off"
    """mixture-of-experts models: ``"rollout"`` (R3) routes every token of the old-logprob and
    training forwards through the experts the rollout engine routed it to (the engine returns
    them: the HF engine from its routers, SGLang through ``return_routed_experts``; megatron-core's
    ``RouterReplay``, :mod:`dapo_megatron.actor.routing_replay`), and logs ``moe/route_agreement``
    (the actor's own routing against the engine's), per-layer expert load and the load-balancing
    loss. ``"off"``: the actor routes on its own. ``rollout`` on a dense model is an error."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, learning-rate schedule and gradient clipping (:class:`OptimConfig`)."""

    def __post_init__(self) -> None:
        # YAML 1.1 reads `on` / `off` as booleans, and OmegaConf hands this str field "True" / "False"
        # (from a file or a `actor.shared_prompt=off` override): take them for what the user wrote
        spelled = {True: "on", False: "off", "True": "on", "False": "off", "true": "on", "false": "off"}
        if isinstance(self.shared_prompt, (bool, str)) and self.shared_prompt in spelled:
            self.shared_prompt = spelled[self.shared_prompt]
        if isinstance(self.routing_replay, (bool, str)) and self.routing_replay in (False, "False", "false"):
            self.routing_replay = "off"  # `routing_replay: off` in YAML 1.1 is the boolean false

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field (``optim`` validates itself)."""
        for name in ("ppo_mini_batch_size", "ppo_epochs", "ppo_max_token_len_per_gpu"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        # the clip range [1 - eps_low, 1 + eps_high] must hold the ratio 1 (policy_loss.py)
        if not 0 <= self.clip_ratio_low < 1:
            raise ValueError(f"clip_ratio_low={self.clip_ratio_low} must be in [0, 1) (the ratio is clipped below at "
                             f"1 - clip_ratio_low; paper: 0.2)")
        if not self.clip_ratio_high >= 0:
            raise ValueError(f"clip_ratio_high={self.clip_ratio_high} must be >= 0 (the ratio is clipped above at "
                             f"1 + clip_ratio_high; paper: 0.28)")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound), or null")
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
        if self.shared_prompt not in SHARED_PROMPT_MODES:
            raise ValueError(f"shared_prompt={self.shared_prompt!r} must be one of {SHARED_PROMPT_MODES}")
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing_replay={self.routing_replay!r} must be one of {ROUTING_REPLAY_MODES} "
                             "('rollout': replay the engine's expert routes in the actor, MoE models only)")
        if self.old_logprob_source not in OLD_LOGPROB_SOURCES:
            raise ValueError(f"old_logprob_source={self.old_logprob_source!r} must be one of {OLD_LOGPROB_SOURCES}")
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"rollout_is={self.rollout_is!r} must be one of {ROLLOUT_IS_LEVELS} or null")
        if not self.rollout_is_threshold > 0:
            raise ValueError(f"rollout_is_threshold={self.rollout_is_threshold} must be > 0")
        if self.rollout_is_scope not in ("stale", "all"):
            raise ValueError(f"rollout_is_scope={self.rollout_is_scope!r} must be 'stale' or 'all'")
        upper, lower = self.rollout_rs_threshold, self.rollout_rs_threshold_lower
        if upper is not None and not upper > 1:
            raise ValueError(f"rollout_rs_threshold={upper} must be > 1 (the upper ratio bound), or null")
        if lower is not None and not 0 < lower < (upper if upper is not None else math.inf):
            raise ValueError(f"rollout_rs_threshold_lower={lower} must be in (0, rollout_rs_threshold={upper})"
                             if upper is not None else f"rollout_rs_threshold_lower={lower} must be > 0")
        if self.rollout_rs is not None:
            if self.rollout_rs not in ROLLOUT_RS_LEVELS:
                raise ValueError(f"rollout_rs={self.rollout_rs!r} must be one of {ROLLOUT_RS_LEVELS} or null")
            if upper is None:
                raise ValueError(f"rollout_rs={self.rollout_rs!r} needs rollout_rs_threshold (> 1), got null")
            if self.old_logprob_source == "rollout":
                raise ValueError("rollout_rs needs the recomputed pi_old (old_logprob_source='recompute'): in bypass "
                                 "mode pi_old is the rollout policy and no token is off it; set rollout_rs: null")

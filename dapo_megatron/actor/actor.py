"""The Megatron actor: logprob recomputation and DAPO policy updates under TP / PP / DP.

One class, :class:`MegatronActor`, owns the Megatron-wrapped model chunks (DDP),
the distributed optimizer and the LR scheduler. Every forward and backward runs
through ``megatron.core.pipeline_parallel.get_forward_backward_func()``, so the
same code serves PP = 1 and the 1F1B pipeline schedule.

Loss scaling (docs/design.md §3.4). DAPO's token-level loss of a mini-batch is
``sum over all valid tokens / N`` with ``N`` the valid-token count of the whole
mini-batch (all micro-batches, all DP ranks). megatron-core would rescale
that in two places (0.16.1 and 0.19.2 alike), and both are switched off here:

1. ``schedules.forward_step_calc_loss`` (0.19.2 ``pipeline_parallel/schedules.py:290``, the
   branch at :329-335; core_v0.16.1 :218, :257-263): when the loss function returns
   ``(loss, num_tokens, reduced)`` and ``config.calculate_per_token_loss`` is False,
   the loss is divided by ``num_tokens`` and by ``num_microbatches``. We set
   ``calculate_per_token_loss = True``: the loss is back-propagated as returned.
2. ``DistributedDataParallel`` (0.19.2 ``distributed/distributed_data_parallel.py:179-184``;
   core_v0.16.1 :254-259): without ``calculate_per_token_loss`` the grad buffers
   are pre-scaled by ``1 / DP`` (or averaged in the collective), i.e. gradients are
   *averaged* over DP. With it, ``gradient_scaling_factor = 1``: gradients are
   *summed* over DP (``average_in_collective`` must stay False).
3. ``finalize_model_grads(model, num_tokens)`` (0.19.2 ``distributed/finalize_model_grads.py:563``,
   the division at :680; core_v0.16.1 :396, :484) would then divide the gradients by
   the all-reduced token count returned by the loss function; we install a
   ``finalize_model_grads_func`` that passes ``num_tokens=None``, because our loss
   is already divided by the global ``N``.

4. MoE routers attach their balancing / z loss with a process-wide backward scale
   (``MoEAuxLossAutoScaler``): :class:`~dapo_megatron.actor.moe_loss.MoELossScale` installs
   ``moe_grad_scale_func`` = 1 / (router rows of the step, all DP ranks), so that loss is the
   token-weighted mean over micro-batches and DP ranks (docs/design.md §3.4), not their sum.

So each micro-batch back-propagates ``sum(loss_t over its tokens) / N`` and
gradients are summed over micro-batches (accumulation) and DP ranks (reduce-scatter):
the total is exactly ``sum over all tokens / N`` however the mini-batch is cut.

Sources: verl ``MegatronPPOActor`` (config names, token-mean with a global token
count), megatron-core 0.19.2 (and 0.16.1) ``pipeline_parallel/schedules.py`` and
``distributed/`` (scaling rules above), ``training/training.py`` (DDP / optimizer /
scheduler wiring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from dapo_megatron.platform import ParallelDims
from dapo_megatron.platform import distributed as pdist
from dapo_megatron.rollout.types import Sample

from .config import OLD_LOGPROB_SOURCES, SUPPORTED_LOSS_AGG_MODES, ActorConfig, OptimConfig  # noqa: F401
from .loss import SUM_KEYS, dapo_loss_func, logprob_loss_func
from .micro_batch import MicroBatch, Targets, make_micro_batches
from .moe_loss import MoELossScale
from .plan import OldLogprobPlan, gpt_model_of, resolve_actor_plan, resolve_old_logprob_plan
from .routing_replay import RoutingReplay

# token counts of the model calls, summed like the loss metrics (see forward_backward)
COUNT_KEYS = ("tokens_computed", "tokens_padding", "tokens_copied")


@dataclass(frozen=True)
class TrainOutput:
    """What a training call of :class:`MegatronActor` returns (:meth:`~MegatronActor.forward_backward`,
    :meth:`~MegatronActor.train_mini_batch`): one shape whatever was asked.

    Attributes:
        metrics: ``{name: float}`` over the whole mini-batch, identical on all ranks (the keys
            are listed by the method that returned it; ``grad_norm``, ``lr`` and ``skipped``
            after :meth:`~MegatronActor.train_mini_batch` only).
        logprobs: the training forward's detached per-token logprobs, ``list[Tensor[R_i]]``
            float32 CPU (nats) in the caller's flattened micro-batch order, on every rank:
            ``log pi_theta`` at the weights before the update, which is the ``log pi_old`` the
            loss used under an :class:`~dapo_megatron.actor.plan.OldLogprobPlan` ``FROM_TRAINING``.
            Given with that plan or ``return_logprobs=True``; else None.
    """

    metrics: dict[str, float]
    logprobs: Optional[list[torch.Tensor]] = None


def _wrap_ddp(chunks, config):
    """Megatron DDP around each chunk, with the scaling rules of the module docstring: the
    loss is back-propagated as returned and gradients are summed (not averaged) over DP.
    bf16 / fp16 chunks are first wrapped in ``Float16Module`` (see :class:`MegatronActor`)."""
    # megatron-core here, not at the top: the config loads actor/ (its ActorConfig) without it
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if config.bf16 or config.fp16:
        # Mixed precision as megatron/training/training.py get_model (and verl's Megatron worker):
        # Float16Module casts every parameter to bf16 / fp16 (the local spec's torch RMSNorm is
        # built in fp32; TE's norms already use params_dtype), float inputs on the first stage,
        # and the last stage's output (the logits) back to fp32. fp32 copies of the parameters
        # and the fp32 gradients live in the distributed optimizer / DDP buffers.
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        # bf16 params: gradients accumulate and reduce-scatter in fp32 buffers (param.main_grad)
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        average_in_collective=False,
        check_for_nan_in_grad=False,  # a NaN step is skipped by the optimizer instead
    )
    return [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]


def _build_optimizer(o: OptimConfig, config, model_chunks):
    """Megatron's distributed AdamW over the DDP chunks (``OptimizerConfig`` names)."""
    # megatron-core here, not at the top: the config loads actor/ (its ActorConfig) without it
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

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
        # fp32 main params, main grads and Adam moments (megatron-core optimizer_config.py asserts
        # these stay fp32 unless the precision-aware optimizer, TE's FusedAdam, is on: 0.19.2
        # :471-477, core_v0.16.1 :416-422)
        use_precision_aware_optimizer=False,
        main_params_dtype=torch.float32,
        main_grads_dtype=torch.float32,
        # constant scale 1 (exact no-op on values) gives Megatron's found-inf check: a step
        # whose gradients hold NaN/inf is skipped and reported (fp16 keeps the dynamic scaler)
        loss_scale=None if config.fp16 else 1.0,
    )
    return get_megatron_optimizer(opt_config, model_chunks)


def _build_scheduler(optimizer, o: OptimConfig, total_steps: int):
    """Megatron's ``OptimizerParamScheduler``: warm-up then ``lr_decay_style`` over ``total_steps``."""
    # megatron-core here, not at the top: the config loads actor/ (its ActorConfig) without it
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
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


def _keep_label_rows(module, args, kwargs, *, index: torch.Tensor):
    """Output-layer forward pre-hook: its ``[S, B, H]`` input -> the ``[N, 1, H]`` label rows."""
    hidden = args[0]  # [S, B, H] after the final norm
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    return (rows.unsqueeze(1), *args[1:]), kwargs  # [N, 1, H]


def _rotary_at_positions(module, args, output, *, position_ids: torch.Tensor):
    """RotaryEmbedding forward hook: the embedding at ``position_ids`` instead of at ``0 .. S-1``.

    megatron-core's ``GPTModel._preprocess`` (0.19.2 ``models/gpt/gpt_model.py:316``, core_v0.16.1
    :284) asks ``rotary_pos_emb`` for the first ``S``
    positions (``[S, 1, 1, D]``, ``models/common/embeddings/rotary_pos_embedding.py``), which
    is right when RoPE only has to see relative offsets inside each sequence. A shared-prompt
    segment needs each response at the positions that continue its prompt, so the hook
    returns ``get_emb(max + 1)`` gathered at ``position_ids.T``: ``[S, B, 1, D]``, which the
    unfused ``_apply_rotary_pos_emb_bshd`` broadcasts over heads exactly like ``[S, 1, 1, D]``.
    """
    S = position_ids.shape[1]
    if output.shape[0] != S:
        raise RuntimeError(f"rotary embedding for {output.shape[0]} positions, the micro-batch has {S}")
    emb = module.get_emb(int(position_ids.max()) + 1)  # [M, 1, 1, D]
    return emb[:, 0, 0].index_select(0, position_ids.t().reshape(-1)).view(S, -1, 1, emb.shape[-1])


class MegatronActor:
    """DAPO actor over Megatron model chunks (TP / PP / DP, distributed optimizer).

    Args:
        model_chunks: this rank's model: a ``GPTModel`` (or a one-element list); PP
            stages each pass their own stage. Virtual pipeline (several chunks) is not
            supported. Weights must be loaded *before* construction (DDP copies them
            into its contiguous buffers and the optimizer shards them).
        actor_cfg: :class:`ActorConfig`, validated (``load_config`` validates it and its ``optim`` once;
            a config built in code: their ``validate()`` first).
        total_steps: optimizer steps of the whole run (the LR schedule's horizon).
        parallel: this rank's layout (TP group of the vocab-parallel logprobs, PP group of
            the last-stage broadcasts, DP group of the token counts and metrics).
        vocab_size: real tokenizer vocabulary; logits columns beyond it (Megatron's
            vocab padding) are excluded from the softmax. None: no padding.

    Raises:
        ValueError: several model chunks, an invalid ``actor_cfg``, or a layout the model
            cannot run (:func:`~dapo_megatron.actor.plan.resolve_actor_plan`).

    Side effects on the shared ``TransformerConfig`` (``model.config``):
    ``calculate_per_token_loss=True`` (see module docstring), ``variable_seq_lengths=True``
    and ``pipeline_dtype`` (PP), ``finalize_model_grads_func``, ``no_sync_func``,
    ``grad_scale_func``, ``moe_grad_scale_func`` (MoE).

    Precision: ``config.params_dtype`` decides. fp32 trains in fp32. bf16 (or fp16) is
    megatron-core's mixed precision, as megatron/training/training.py sets it up on GPUs:
    the chunk is wrapped in ``Float16Module`` (every parameter, norms included, and every
    activation in bf16; the last stage's logits cast to fp32 for the logprobs), DDP
    accumulates and reduce-scatters fp32 gradients (``grad_reduce_in_fp32``), and the
    distributed optimizer keeps fp32 main parameters and Adam moments, steps them, and
    copies them back to the bf16 parameters (``tests/unit/actor/test_actor_bf16.py``).

    Attributes exposed for checkpointing: ``model_chunks`` (DDP-wrapped; bf16: DDP over
    ``Float16Module``),
    ``optimizer`` (Megatron ``DistributedOptimizer``), ``scheduler``
    (``OptimizerParamScheduler``). ``plan``: the :class:`~dapo_megatron.actor.plan.ActorPlan`
    resolved at construction (layout, mask, logits at labels only, length buckets, padding
    multiples, shared prompt), read at every call.

    Every rank of the model-parallel (TP × PP) group must pass the same
    micro-batches to each call; DP ranks pass their own shard of the mini-batch.
    """

    def __init__(self, model_chunks, actor_cfg: ActorConfig, total_steps: int, *, parallel: ParallelDims,
                 vocab_size: Optional[int] = None):
        # megatron-core here, not at the top: the config loads actor/ (its ActorConfig) without it
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if len(chunks) != 1:
            raise ValueError(
                f"got {len(chunks)} model chunks: virtual pipeline parallelism is not supported; pass this "
                "rank's single pipeline stage"
            )
        actor_cfg.optim.check_total_steps(total_steps)  # a run-time fact; the fields: load_config validated them
        self.cfg = actor_cfg
        self.vocab_size = vocab_size
        config = chunks[0].config
        self.config = config
        self.parallel = parallel
        self.pp_size = parallel.pp_size
        self.tp_size = parallel.tp_size
        self.dp_group = parallel.dp_group
        self.pp_group = parallel.pp_group
        self.device = pdist.device()
        self.plan = resolve_actor_plan(actor_cfg, chunks[0], tp_size=self.tp_size,
                                       experts_span_dp=bool(getattr(parallel, "experts_span_dp", False)))
        # R3: megatron-core's RouterReplay follows Sample.routes in every forward (actor/routing_replay.py)
        self.routing = (RoutingReplay(chunks[0], replay=True, tp_rank=parallel.tp_rank, tp_size=self.tp_size)
                        if actor_cfg.routing_replay == "rollout" else None)
        gpt = gpt_model_of(chunks[0])
        self._output_layer = getattr(gpt, "output_layer", None) if gpt is not None and gpt.post_process else None
        self._rotary = getattr(gpt, "rotary_pos_emb", None) if getattr(gpt, "position_embedding_type", None) == (
            "rope") else None

        # (1)-(3) of the module docstring: no 1/num_microbatches, no 1/DP, no 1/num_tokens
        config.calculate_per_token_loss = True
        if self.pp_size > 1:
            config.variable_seq_lengths = True  # packed micro-batches have different lengths
            if config.pipeline_dtype is None:
                config.pipeline_dtype = config.params_dtype
        self.model_chunks = _wrap_ddp(chunks, config)
        self.optimizer = _build_optimizer(actor_cfg.optim, config, self.model_chunks)
        self.scheduler = _build_scheduler(self.optimizer, actor_cfg.optim, total_steps)

        def _finalize(model, num_tokens, pg_collection=None, force_all_reduce=False):
            # the loss is already divided by the global token count: do not divide again
            finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)

        config.finalize_model_grads_func = _finalize
        config.no_sync_func = self.model_chunks[0].no_sync
        config.grad_scale_func = self.optimizer.scale_loss
        # the routers' balancing / z loss: token-weighted mean over the step (actor/moe_loss.py)
        self.moe_loss = MoELossScale(chunks[0], config, grad_scale_func=self.optimizer.scale_loss)
        self.num_model_calls = 0  # micro-batch forward passes run so far (old-logprob and training)

    # ------------------------------------------------------------------ helpers
    def _make_micro_batches(self, micro_batches, targets: Optional[Targets] = None
                            ) -> tuple[list[MicroBatch], list[int]]:
        return make_micro_batches(micro_batches, self.plan, device=self.device, targets=targets)

    def _forward(self, model, mb: MicroBatch):
        """Model output of one micro-batch: logits ``[B, T, V/TP]``, or ``[1, N, V/TP]`` at the
        ``N`` response label rows only (``plan.logits_at_labels_only``); earlier PP stages
        return hidden states. A shared-prompt micro-batch runs RoPE at its ``position_ids``."""
        b = mb.batch
        psp = b.packed_seq_params if self.plan.use_packed_seq_params else None
        handles = []
        if self.routing is not None:
            self.routing.begin(mb)
        try:
            if b.shares_prompts and self._rotary is not None:
                handles.append(self._rotary.register_forward_hook(
                    partial(_rotary_at_positions, position_ids=b.position_ids)))
            if self.plan.logits_at_labels_only:
                handles.append(self._output_layer.register_forward_pre_hook(
                    partial(_keep_label_rows, index=mb.label_index_sb), with_kwargs=True))
            return model(b.input_ids, b.position_ids, b.attention_mask, packed_seq_params=psp)
        finally:
            for h in handles:
                h.remove()
            if self.routing is not None:
                self.routing.end()

    def pop_routing_metrics(self) -> dict[str, float]:
        """``actor.routing_replay: rollout``: the routing metrics of every forward since the last
        call (:meth:`~dapo_megatron.actor.routing_replay.RoutingReplay.pop_metrics`), pooled over
        DP (and PP, and TP with sequence parallelism); a collective over those groups. ``{}`` when off."""
        if self.routing is None:
            return {}
        groups = ["dp"] + (["pp"] if self.pp_size > 1 else []) + (
            ["tp"] if getattr(self.config, "sequence_parallel", False) and self.tp_size > 1 else [])
        return self.routing.pop_metrics(self.parallel, groups)

    def _run_schedule(self, mbs: list[MicroBatch], forward_step, forward_only: bool):
        # megatron-core here, not at the top: the config loads actor/ (its ActorConfig) without it
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.num_model_calls += len(mbs)  # micro-batch forwards through this rank's model (stage)
        if self.routing is not None:
            self.routing.begin_schedule()
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=self.model_chunks,
            num_microbatches=len(mbs),
            seq_length=max(mb.batch.input_ids.shape[1] for mb in mbs),
            micro_batch_size=max(mb.batch.input_ids.shape[0] for mb in mbs),
            forward_only=forward_only,
        )
        if self.routing is not None:
            self.routing.end_schedule()  # every route queued for a recomputed forward was replayed
        return out

    def _is_last_stage(self) -> bool:
        return self.parallel.is_pp_last

    def _broadcast_from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        self.parallel.broadcast(t, "pp", src=self.parallel.pp_last_rank)
        return t

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_logprobs(
        self, micro_batches: Sequence[Sequence[Sample]], temperature: float = 1.0, *, return_entropy: bool = False,
        own_routing: bool = False,
    ):
        """Logprobs of every sample's response tokens under the current weights (no grad).

        Runs ``forward_only`` through Megatron's forward-backward schedule; the last
        PP stage computes them and broadcasts to the whole PP group, so every rank
        returns them.

        Args:
            micro_batches: list of micro-batches (lists of Sample), e.g. a DP rank's share cut by
                :func:`~dapo_megatron.actor.dp_split.split_for_dp`.
            temperature: the rollout's sampling temperature (logits are divided by it).
            return_entropy: also return per-token entropies.
            own_routing: MoE with routing replay: route these samples with the routers' own choice
                (they carry no engine routes; the weight-sync probe) instead of replaying.

        Returns:
            ``list[Tensor[R_i]]`` float32 CPU logprobs (nats) in the order of the
            flattened micro-batches; with ``return_entropy``, a tuple
            ``(logprobs, entropies)`` of two such lists.
        """
        mbs, order = self._make_micro_batches(micro_batches)
        for m in self.model_chunks:
            m.eval()

        loss_func = partial(logprob_loss_func, temperature=temperature, vocab_size=self.vocab_size,
                            logits_at_labels_only=self.plan.logits_at_labels_only,
                            tp_group=self.parallel.tp_group)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return self._forward(model, mb), partial(loss_func, mb)

        if own_routing and self.routing is not None:
            routing, self.routing = self.routing, None  # no begin/end per micro-batch: nothing to replay
            try:
                with routing.own_routing():
                    outs = self._run_schedule(mbs, forward_step, forward_only=True)
            finally:
                self.routing = routing
        else:
            outs = self._run_schedule(mbs, forward_step, forward_only=True)
        logprobs, entropies = self._per_sample_outputs(mbs, order, outs, ("logprobs", "entropy"))
        return (logprobs, entropies) if return_entropy else logprobs

    def _per_sample_outputs(self, mbs: list[MicroBatch], order: list[int], outs, keys: Sequence[str]):
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
        old: Optional[OldLogprobPlan] = None, return_logprobs: bool = False,
    ) -> TrainOutput:
        """Accumulate the DAPO policy-gradient of one mini-batch into the DDP grad buffers.

        Zeroes the grad buffers, runs every micro-batch through the schedule and
        finishes the DP grad sync (reduce-scatter). Does not step the optimizer
        (see :meth:`train_mini_batch`).

        Args:
            micro_batches: this DP rank's micro-batches of the mini-batch. Samples need
                ``advantage`` and ``old_logprobs`` (unless ``old`` is ``FROM_TRAINING``); the
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
            old: the step's :class:`~dapo_megatron.actor.plan.OldLogprobPlan`
                (:func:`~dapo_megatron.actor.plan.resolve_old_logprob_plan`): ``FROM_TRAINING``
                takes ``log pi_old = sg(log pi_theta)`` of this forward instead of
                ``Sample.old_logprobs`` (exact for the first update since the weights a recompute
                would use: one mini-batch, one epoch); it also says whether the correction
                applies. None: the plan of a caller that fills ``Sample.old_logprobs``
                (``resolve_old_logprob_plan(actor_cfg)``).
            return_logprobs: also return the training forward's detached logprobs.

        Returns:
            :class:`TrainOutput`; its ``metrics`` over the whole mini-batch (identical on all ranks): ``loss`` (incl.
            entropy bonus), ``pg_loss``, ``pg_clipfrac_lower``, ``pg_clipfrac_upper``,
            ``ppo_kl``, ``entropy`` (token means), ``ratio_min``, ``ratio_max``,
            ``num_tokens``, ``num_micro_batches`` (the caller's), ``num_model_calls``
            (micro-batches actually run, after ``length_buckets``; this DP rank), and the
            token counts of the model calls over all DP ranks: ``tokens_computed`` (``B * T``,
            padding included), ``tokens_padding`` and ``tokens_copied`` (prompt + response of
            every sample, the tokens of the copied form), so that the padding share is
            ``tokens_padding / tokens_computed`` and the shared-prompt ratio
            ``(tokens_computed - tokens_padding) / tokens_copied``; the correction's
            ``rollout_corr_frac``, ``rollout_is_mean``, ``rollout_is_clipfrac``,
            ``rollout_rs_masked_frac`` (fractions of the valid tokens; 0, 1, 0, 0 when nothing is
            corrected); ``num_tokens`` is after rejection. Its ``logprobs``: see :class:`TrainOutput`.

        Raises:
            ValueError: missing ``old_logprobs``, a ``global_num_tokens`` that differs
                from the count of the samples, empty micro-batches, ``old`` ``FROM_TRAINING``
                with ``actor.rollout_rs`` set.
        """
        cfg = self.cfg
        old = resolve_old_logprob_plan(cfg) if old is None else old
        if old.from_training and cfg.rollout_rs is not None:
            raise ValueError("an OldLogprobPlan FROM_TRAINING with actor.rollout_rs set: the rejection changes the "
                             "loss denominator, which must be known before the forward; recompute old_logprobs first "
                             "(resolve_old_logprob_plan does)")
        return_logprobs = return_logprobs or old.from_training
        targets = Targets(cfg=cfg, policy_version=policy_version, old=old)
        mbs, order = self._make_micro_batches(micro_batches, targets)
        # counted in python, all-reduced over DP on the group's device (a CPU tensor fails under NCCL)
        counts = torch.tensor([sum(mb.num_valid_tokens for mb in mbs), sum(mb.num_loss_tokens for mb in mbs),
                               sum(mb.num_loss_seqs for mb in mbs), sum(mb.batch.num_tokens for mb in mbs)],
                              dtype=torch.float64, device=pdist.collective_device(self.dp_group))
        self.parallel.all_reduce(counts, "dp")
        n_valid, n_tok, n_seq, n_route = (int(x) for x in counts.tolist())
        self.moe_loss.begin_step(n_route)  # the rows every router sees this step, all DP ranks
        if global_num_tokens is not None and int(global_num_tokens) != n_valid:
            raise ValueError(
                f"global_num_tokens={global_num_tokens} but the mini-batch holds {n_valid} loss tokens over all "
                "micro-batches and DP ranks (overlong-filtered samples count 0); pass None to let the actor count"
            )
        for m in self.model_chunks:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_func = partial(dapo_loss_func, actor_cfg=self.cfg, temperature=temperature, vocab_size=self.vocab_size,
                            logits_at_labels_only=self.plan.logits_at_labels_only, tp_group=self.parallel.tp_group,
                            global_num_tokens=n_tok, global_num_seqs=n_seq, global_num_valid_tokens=n_valid,
                            return_logprobs=return_logprobs)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return self._forward(model, mb), partial(loss_func, mb)

        outs = self._run_schedule(mbs, forward_step, forward_only=False)

        # all-reduced over PP and DP below: on the groups' device (NCCL: this rank's GPU)
        dev = pdist.collective_device(self.dp_group)
        moe_sums = self.moe_loss.pop_sums().reshape(-1).to(dev) if self.moe_loss.active else None
        if moe_sums is not None and getattr(self.config, "sequence_parallel", False) and self.tp_size > 1:
            self.parallel.all_reduce(moe_sums, "tp")  # each TP rank's routers saw its S / TP rows
        n_moe = 0 if moe_sums is None else moe_sums.numel()
        sums = torch.zeros(len(SUM_KEYS) + len(COUNT_KEYS) + n_moe, dtype=torch.float64, device=dev)
        if moe_sums is not None:  # every stage its own layers (the others 0), every DP rank its rows
            sums[len(SUM_KEYS) + len(COUNT_KEYS):] = moe_sums
        mins = torch.full((1,), float("inf"), dtype=torch.float64, device=dev)
        maxs = torch.full((1,), float("-inf"), dtype=torch.float64, device=dev)
        if self._is_last_stage():
            counts = [(mb.batch.num_tokens, mb.batch.num_padding, mb.batch.num_copied_tokens) for mb in mbs]
            sums[len(SUM_KEYS):len(SUM_KEYS) + len(COUNT_KEYS)] += torch.tensor(
                counts, dtype=torch.float64).sum(0).to(sums.device)
            for out in outs:
                sums[:len(SUM_KEYS)] += torch.stack([out[k].double().reshape(()) for k in SUM_KEYS]).to(sums.device)
                mins = torch.minimum(mins, out["ratio_min"].double().reshape(1).to(mins.device))
                maxs = torch.maximum(maxs, out["ratio_max"].double().reshape(1).to(maxs.device))
        # non-last PP stages contribute zeros / +-inf; DP ranks hold disjoint shards
        for group in ("pp", "dp"):
            self.parallel.all_reduce(sums, group)
            self.parallel.all_reduce(mins, group, op=dist.ReduceOp.MIN)
            self.parallel.all_reduce(maxs, group, op=dist.ReduceOp.MAX)
        sums = sums.cpu()
        metrics = {k: float(v) for k, v in zip(SUM_KEYS + COUNT_KEYS, sums.tolist())}
        if moe_sums is not None:
            metrics.update(self.moe_loss.metrics(sums[len(SUM_KEYS) + len(COUNT_KEYS):].view(2, -1), n_route))
        metrics["ratio_min"] = float(mins) if math.isfinite(float(mins)) else 1.0
        metrics["ratio_max"] = float(maxs) if math.isfinite(float(maxs)) else 1.0
        metrics["num_micro_batches"] = float(len(micro_batches))
        metrics["num_model_calls"] = float(len(mbs))
        if n_valid == 0:  # nothing to weight: the correction's neutral values
            metrics["rollout_is_mean"] = 1.0
        logprobs = self._per_sample_outputs(mbs, order, outs, ("logprobs",))[0] if return_logprobs else None
        return TrainOutput(metrics, logprobs)

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
        old: Optional[OldLogprobPlan] = None, return_logprobs: bool = False,
    ) -> TrainOutput:
        """One optimizer step on one mini-batch: :meth:`forward_backward` + :meth:`optimizer_step`
        (the keyword arguments are :meth:`forward_backward`'s).

        Not stepped (``skipped = 1``, weights and scheduler untouched):

        - a mini-batch without any loss token (all samples overlong-filtered): Adam
          would still move the weights with zero gradients;
        - a non-finite loss (e.g. a NaN ``old_logprobs`` entry: the policy loss clamps
          the log-ratio, whose gradient is then 0, so the gradients alone look finite);
        - non-finite gradients (Megatron's found-inf check, see :meth:`optimizer_step`).

        Returns:
            :meth:`forward_backward`'s :class:`TrainOutput`, its ``metrics`` with
            :meth:`optimizer_step`'s added.
        """
        out = self.forward_backward(micro_batches, temperature, global_num_tokens, policy_version=policy_version,
                                    old=old, return_logprobs=return_logprobs)
        metrics = out.metrics
        if metrics["num_tokens"] == 0 or not math.isfinite(metrics["loss"]):
            lr = self.optimizer.param_groups[0]["lr"]
            grad_norm = 0.0 if metrics["num_tokens"] == 0 else float("nan")
            metrics = {**metrics, "grad_norm": grad_norm, "lr": float(lr), "skipped": 1.0}
        else:
            metrics = {**metrics, **self.optimizer_step()}
        return TrainOutput(metrics, out.logprobs)

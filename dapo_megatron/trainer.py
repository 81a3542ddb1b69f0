"""The DAPO training loop (docs/design.md §1), to be read top to bottom.

Every rank runs this same code under ``torchrun`` (SPMD); every method is a collective. The
trainer owns the actor, the tracker and the step counter; everything about how the rollout
is spread over ranks (engines, servers, rollout-TP groups, streamed rounds) is behind one
:class:`~dapo_megatron.rollout.rollout.Rollout` (docs/design.md §2.3). One step:

1-3. rollout, rewards, dynamic sampling: ``Rollout.collect`` returns the step's N kept
   groups (records replicated on every rank, token lists where generated) and its metrics;
4. advantages: group-relative (:func:`~dapo_megatron.algorithms.compute_group_advantages`);
5. the plan: every mini-batch split over DP ranks by token count once (reused by every PPO
   epoch), each response's tokens sent to the DP rank that trains it, and the step's
   :class:`~dapo_megatron.actor.plan.OldLogprobPlan`: the old logprobs recomputed there, taken
   from the first training forward (one update in the step), or the rollout's
   (``actor.old_logprob_source: rollout``);
6. updates: ``ppo_epochs`` × mini-batches, each cut into micro-batches by a token budget,
   with the DAPO token-mean loss normalised by the mini-batch's global token count;
7. weight sync into the engines (``Rollout.sync_weights``) as version ``step``;
8. metrics → MLflow; validation every ``test_freq`` steps; checkpoint every ``save_freq``.

Determinism: every response is sampled with its own seed, derived from ``trainer.seed``
and the prompt's global position in the run (kept in the checkpoint), so the rollout is
the same at any TP/PP/DP layout and a resumed run repeats the uninterrupted one. Versions:
the engines hold weights version ``step`` while step ``step + 1`` rolls out; every sample
records the versions that sampled it (``Sample.versions``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Sequence

import torch

from dapo_megatron.actor import MegatronActor, resolve_old_logprob_plan
from dapo_megatron.actor.plan import ROLLOUT
from dapo_megatron.actor.step_plan import old_logprob_micro_batches, route_step
from dapo_megatron.algorithms import compute_group_advantages
from dapo_megatron.bridge import load_hf_weights, open_hf_source
from dapo_megatron.bridge.dist_ckpt import write_model_meta
from dapo_megatron.checkpointing import Checkpointer
from dapo_megatron.config.frozen import freeze, is_frozen
from dapo_megatron.config.loader import to_flat_dict
from dapo_megatron.config.run import DAPOConfig
from dapo_megatron.data import load_from_config, resolve_data_files
from dapo_megatron.models import build_gpt_model, load_hf_config
from dapo_megatron.platform import ParallelDims
from dapo_megatron.rollout.engines.factory import load_tokenizer
from dapo_megatron.rollout.build import build_rollout, check_rollout_fits, prompt_stream
from dapo_megatron.rollout.sampling.buffer import logprob_mismatch_metrics, split_fresh_stale
from dapo_megatron.rollout.types import HELD_BY_ALL, Group, Sample
from dapo_megatron.run_dir import RunStart, prepare_run_dir
from dapo_megatron.tracking import ProgressBar, Tracker

logger = logging.getLogger("dapo_megatron.trainer")


# --------------------------------------------------------------------------- helpers
def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


# --------------------------------------------------------------------------- trainer
class DAPOTrainer:
    """Owns the actor, the rollout (:class:`~dapo_megatron.rollout.rollout.Rollout`) and the tracker of one run.

    Build it on every rank with the :class:`~dapo_megatron.platform.ParallelDims` that
    :func:`dapo_megatron.platform.init_distributed` returned; then :meth:`fit`. Construction
    resumes from ``<run_dir>/checkpoints/latest`` when ``trainer.resume_mode`` allows it, or
    starts a new run with a previous run's files moved aside, as ``start``
    (:func:`dapo_megatron.run_dir.prepare_run_dir`; computed here when None) says.
    """

    def __init__(self, cfg: DAPOConfig, parallel: ParallelDims, start: RunStart | None = None):
        self.cfg = cfg
        t = cfg.trainer
        if parallel.rank == 0:
            for warning in cfg.warnings():
                logger.warning("%s", warning)
        self.run_dir = os.path.abspath(t.run_dir)
        self.parallel = parallel
        self.rank, self.world = parallel.rank, parallel.world_size
        self.dp_rank, self.dp_size = parallel.dp_rank, parallel.dp_size
        self.mp_rank, self.mp_size = parallel.mp_rank, parallel.mp_size
        # resume, or a new run (a previous run's files moved aside): dapo_megatron/run_dir.py
        self.start = start if start is not None else prepare_run_dir(cfg, parallel)
        os.makedirs(self.run_dir, exist_ok=True)

        # data first: a broken dataset stops the run before minutes of model loading
        self.tokenizer = load_tokenizer(cfg.model.hf_path, cfg.model.gguf_file)
        data_dir = os.path.join(self.run_dir, "data")
        files = None
        if self.rank == 0:  # writes the embedded arithmetic task when no files are given
            data = resolve_data_files(cfg.data, data_dir)
            files = (data.train_files, data.val_files)
        files = parallel.broadcast_object(files, "world")
        # the run's config with the resolved files: a copy (a loaded config is frozen), frozen like it
        data = dataclasses.replace(cfg.data, train_files=list(files[0]), val_files=list(files[1]))
        resolved = dataclasses.replace(cfg, data=data)
        cfg = self.cfg = freeze(resolved) if is_frozen(cfg) else resolved
        self.train_data = load_from_config(cfg.data, self.tokenizer, "train")
        self.val_data = load_from_config(cfg.data, self.tokenizer, "val")
        stream = prompt_stream(cfg, parallel, self.train_data)

        # model: Megatron actor (trains) and its HF twin in the rollout engines (generate)
        self.hf_config = load_hf_config(cfg.model.hf_path, cfg.model.gguf_file)
        check_rollout_fits(cfg, parallel, self.hf_config)
        model = build_gpt_model(self.hf_config, cfg.model, parallel=parallel,
                                routing_replay=cfg.actor.routing_replay == "rollout")
        resuming = self.start.resuming
        if not resuming:  # a resumed run loads its weights from the checkpoint below
            load_hf_weights(model, open_hf_source(cfg.model.hf_path, cfg.model.gguf_file), strict=True,
                            parallel=parallel)
        updates_per_step = cfg.actor.ppo_epochs * (cfg.buffer.train_batch_size // cfg.actor.ppo_mini_batch_size)
        self.actor = MegatronActor(model, cfg.actor, t.total_training_steps * updates_per_step,
                                   parallel=parallel, vocab_size=self.hf_config.vocab_size)
        # engines, rewards, dynamic sampling: the rollout of this rank, whatever the layout
        self.rollout = build_rollout(cfg, parallel, tokenizer=self.tokenizer, hf_config=self.hf_config,
                                     train_data=self.train_data, val_data=self.val_data, stream=stream)

        # every component with state, saved and restored by one checkpointer (with the RNG of every rank)
        self.checkpointer = Checkpointer(
            self.run_dir, self.actor, {"rollout": self.rollout}, parallel=parallel,
            max_ckpt_to_keep=t.max_ckpt_to_keep,
            write_extra=lambda d: write_model_meta(d, self.actor.model_chunks, self.hf_config, self.tokenizer))
        self.step = 0
        mlflow_run_id = None
        if resuming:
            restored = self.checkpointer.load(self.start.checkpoint_dir)
            self.step, mlflow_run_id = restored.step, restored.tracking_run_id
            logger.info("resumed from step %d", self.step)
        self.rollout.sync_weights(self.actor, self.step)

        tracking = dataclasses.replace(cfg.tracking, run_id=cfg.tracking.run_id or mlflow_run_id)
        # verl's names: the MLflow experiment is the project, the run is the experiment
        self.tracker = Tracker(self.run_dir, tracking, rank=self.rank, experiment_name=t.project_name,
                               run_name=t.experiment_name)
        if self.step == 0:
            self.tracker.log_params(to_flat_dict(cfg))
            for split, ds in (("train", self.train_data), ("val", self.val_data)):
                st = ds.stats  # reported, never silent: skipped broken rows and over-long prompts
                self.tracker.log_params({f"data_stats.{split}.rows": st.num_rows,
                                         f"data_stats.{split}.invalid_rows_skipped": st.num_invalid,
                                         f"data_stats.{split}.overlong_prompts_filtered": st.num_overlong,
                                         f"data_stats.{split}.prompts": st.num_kept})
        self.progress = ProgressBar(t.total_training_steps, rank=self.rank)
        self.progress.update(self.step)

    # ------------------------------------------------------------------ pieces
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _route_and_old_logprobs(self, groups: list[Group], samples: list[Sample], metrics: dict[str, float]):
        """The step's plan and each sample's tokens sent to the ranks of the DP rank that trains it
        (:func:`~dapo_megatron.actor.step_plan.route_step`), the step's
        :class:`~dapo_megatron.actor.plan.OldLogprobPlan` (from its update count) and, as it says,
        ``Sample.old_logprobs`` there: recomputed (and the rollout-vs-actor mismatch metrics), the
        rollout's, or left to the training forward; collective. Returns ``(plan, mine, old)``: the
        plan, the indices into ``samples`` of this DP rank's samples, the old-logprob plan."""
        actor, share = self.cfg.actor, self.actor.plan.shares_prompts
        plan, mine = route_step(groups, samples, self.parallel, actor.ppo_mini_batch_size,
                                actor.ppo_max_token_len_per_gpu, share_prompts=share,
                                routes=self.rollout.routes_layout)  # R3: the routes travel too
        old = resolve_old_logprob_plan(actor, num_updates=actor.ppo_epochs * len(plan.mini_batches))
        if old.source == ROLLOUT:  # bypass mode: the engine's logprobs are pi_old
            for i in mine:
                samples[i].old_logprobs = list(samples[i].rollout_logprobs)
        if not old.recompute:
            return plan, mine, old
        micro = old_logprob_micro_batches(plan, mine, self.dp_rank, actor.ppo_max_token_len_per_gpu,
                                          [samples[i] for i in mine], share_prompts=share,
                                          equal_counts=self.parallel.experts_span_dp)
        lps = self.actor.compute_logprobs([[samples[mine[j]] for j in mb] for mb in micro],
                                          temperature=self.cfg.rollout.temperature)
        for j, lp in zip([j for mb in micro for j in mb], lps):
            samples[mine[j]].old_logprobs = lp.tolist()
        self._mismatch_metrics(samples, [samples[i] for i in mine], metrics)
        return plan, mine, old

    def _mismatch_metrics(self, batch: Sequence[Sample], measured: Sequence[Sample], metrics: dict[str, float]) -> None:
        """The rollout-vs-actor logprob gap, pooled over DP: all, fresh (sampled by the actor's
        current weights: the numerics of the sync alone) and stale; collective over DP.
        ``measured``: this DP rank's samples of ``batch`` with the actor's ``old_logprobs``; which
        parts are reported is decided from ``batch`` (versions are replicated), so every DP rank
        makes the same calls."""
        group = self.parallel.dp_group
        metrics.update(logprob_mismatch_metrics(measured, group=group))
        for name, everywhere, here in zip(("fresh", "stale"), split_fresh_stale(batch, self.step),
                                          split_fresh_stale(measured, self.step)):
            if everywhere:
                metrics.update({k.replace("logprob_diff", f"logprob_diff_{name}"): v
                                for k, v in logprob_mismatch_metrics(here, group=group).items()})
        if any(s.staleness(self.step) for s in batch):  # over the stale tokens alone (a partial row's too)
            metrics.update({k.replace("logprob_diff", "logprob_diff_stale_token"): v for k, v in
                            logprob_mismatch_metrics(measured, group=group, older_than=self.step).items()})

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        """One DAPO step (docs/design.md §1); collective. Advances ``self.step`` (the one place
        it is counted) and returns the step's metrics ``{name: float}`` (rank 0's are logged)."""
        metrics, timing = {}, {}

        # 1-3. rollout, rewards, dynamic sampling
        t0 = time.perf_counter()
        self.rollout.check_health()  # a dead server stops the step here, named, not in a hung request
        self.rollout.wake()
        batch = self.rollout.collect(self.step)
        self.rollout.sleep()  # weights too: the actor needs the memory; step 7 syncs them back
        timing["gen"] = time.perf_counter() - t0
        metrics.update(batch.metrics)
        samples = batch.samples
        if samples:  # 4-6
            train_tokens = self._update(batch.groups, samples, metrics, timing)
        else:  # on_cap="train_on_kept" with nothing kept: no update this step
            logger.warning("step %d: no group with mixed accuracy was kept; skipping the update", self.step + 1)
            metrics["actor/skipped_no_groups"] = 1.0

        # 7. weight sync into the engine as version step (after a skipped update the unchanged
        # weights are relabelled: the next step's samples are fresh, not one version stale)
        t0 = time.perf_counter()
        self.step += 1
        nbytes = self.rollout.sync_weights(self.actor, self.step)
        timing["sync"] = time.perf_counter() - t0
        self._last_samples = samples
        if not samples:
            return metrics

        if "rollout/gen_tokens" in metrics:  # absent when the step trained carried groups only
            metrics["perf/gen_tokens_per_s"] = metrics["rollout/gen_tokens"] / max(timing["gen"], 1e-9)
        metrics["perf/update_tokens_per_s"] = train_tokens / max(timing["update"], 1e-9)
        if metrics["actor/recomputed_old_logprobs"]:
            metrics["perf/old_logprob_tokens_per_s"] = (
                sum(s.total_length for s in samples) / max(timing["old_logprob"], 1e-9))
        metrics["perf/sync_GBps"] = nbytes / 1e9 / max(timing["sync"], 1e-9)
        for k, v in timing.items():
            metrics[f"time/{k}_s"] = v
        metrics["time/step_s"] = sum(timing.values())
        return metrics

    def _update(self, groups: list[Group], samples: list[Sample], metrics: dict[str, float],
                timing: dict[str, float]) -> int:
        """Steps 4-6 of :meth:`train_step` on its kept groups: advantages, the plan and the old
        logprobs, the updates; adds their metrics and timings; returns the tokens (prompt +
        response) the updates trained, summed over the epochs; collective."""
        cfg, a = self.cfg, self.cfg.actor

        # 4. group-relative advantages (on the shaped reward)
        adv = compute_group_advantages(
            torch.tensor([s.reward for s in samples], dtype=torch.float64),
            torch.tensor([s.group_id for s in samples]),
            norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo, eps=cfg.algorithm.adv_eps,
        )
        for s, v in zip(samples, adv.tolist()):
            s.advantage = v

        # 5. the plan, the tokens to where they train, old logprobs there as the step's
        # OldLogprobPlan says (and the rollout-vs-actor mismatch they reveal, pooled over DP)
        t0 = time.perf_counter()
        calls_before = self.actor.num_model_calls
        plan, mine, old = self._route_and_old_logprobs(groups, samples, metrics)
        timing["old_logprob"] = time.perf_counter() - t0

        # 6. ppo_epochs × mini-batches of ppo_mini_batch_size groups, each on the DP split planned above
        t0 = time.perf_counter()
        actor_metrics: dict[str, list[float]] = {}
        train_tokens = 0
        for epoch in range(a.ppo_epochs):
            for m, mini in enumerate(plan.mini_batches):
                micro_batches = [[samples[i] for i in mb] for mb in mini.micro_batches[self.dp_rank]]
                # the first update's forward runs at the weights pi_old is defined by: its logprobs
                # are the actor's side of the mismatch metrics when no recompute ran
                first = epoch == 0 and m == 0 and not old.recompute
                out = self.actor.train_mini_batch(micro_batches, cfg.rollout.temperature,
                                                  global_num_tokens=mini.global_num_tokens, policy_version=self.step,
                                                  old=old, return_logprobs=first)
                if first:
                    shard = [s for mb in micro_batches for s in mb]
                    self._mismatch_metrics(samples[mini.start:mini.start + mini.size],
                                           [dataclasses.replace(s, old_logprobs=lp.tolist())
                                            for s, lp in zip(shard, out.logprobs)], metrics)
                train_tokens += mini.total_tokens
                for k, v in out.metrics.items():
                    actor_metrics.setdefault(k, []).append(float(v))
        timing["update"] = time.perf_counter() - t0
        for k, vs in actor_metrics.items():
            key = k if "/" in k else f"actor/{k}"
            metrics[key] = _mean(vs)
        # padding share of the tokens computed, and tokens computed (real) / tokens of the copied form
        metrics["actor/padding_share"] = metrics["actor/tokens_padding"] / max(metrics["actor/tokens_computed"], 1.0)
        metrics["actor/shared_prompt_ratio"] = (metrics["actor/tokens_computed"] - metrics["actor/tokens_padding"]
                                                ) / max(metrics["actor/tokens_copied"], 1.0)
        # every micro-batch forward of the step on this rank: old-logprob recompute and updates
        metrics["actor/num_model_calls"] = float(self.actor.num_model_calls - calls_before)
        metrics["actor/recomputed_old_logprobs"] = float(old.recompute)
        metrics.update(self.actor.pop_routing_metrics())  # R3: moe/route_agreement, expert load, aux loss
        return train_tokens

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """avg@k / pass@k on the validation set at the current weights
        (:meth:`~dapo_megatron.rollout.rollout.Rollout.validate`); collective."""
        return self.rollout.validate(self.step)

    # ------------------------------------------------------------------ checkpoint
    def save(self) -> None:
        """Write the checkpoint of ``self.step`` (atomic, :class:`~dapo_megatron.checkpointing.Checkpointer`);
        collective."""
        self.checkpointer.save(self.step, tracking_run_id=self.tracker.run_id)

    def _log_samples(self, samples: list[Sample], k: int = 4) -> None:
        """The step's first ``k`` samples as text (``samples/step_<k>.txt``, written by rank 0);
        collective. Each is formatted by the rank that generated it (rank 0 for a surplus read
        from a checkpoint), which holds its text and extracted answer."""
        lines = {}
        for i, s in enumerate(samples[:k]):
            if s.holder == self.rank or (s.holder == HELD_BY_ALL and self.rank == 0):
                lines[i] = (f"### group {s.group_id} | reward {s.reward:+.2f} | acc {s.acc} | pred {s.pred!r} | "
                            f"gt {s.ground_truth!r} | {s.finish_reason}, {s.response_length} tokens\n"
                            f"[prompt] {self._decode(s.prompt_ids)}\n[response] {self._decode(s.response_ids)}\n")
        parts = self.parallel.gather_objects(lines, "world", dst=0)
        if self.rank == 0:
            lines = {i: line for part in parts for i, line in part.items()}
        if self.rank == 0:
            self.tracker.log_text("\n".join(lines[i] for i in sorted(lines)), f"samples/step_{self.step:06d}.txt")

    def _validate_and_report(self) -> dict[str, float]:
        """:meth:`validate`, and its overall scores as one log line on rank 0."""
        metrics = self.validate()
        overall = " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k.count("/") == 1)
        logger.info("step %d validation: %s", self.step, overall)
        return metrics

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        """Train until ``trainer.total_training_steps``; returns the last step's metrics."""
        t = self.cfg.trainer
        last: dict[str, float] = {}
        try:
            if self.step == 0 and t.val_before_train and t.test_freq > 0:
                val = self._validate_and_report()
                self.tracker.log_metrics(val, step=0)
                self.progress.update(0, val)
            while self.step < t.total_training_steps:
                metrics = self.train_step()
                if t.test_freq > 0 and (self.step % t.test_freq == 0 or self.step == t.total_training_steps):
                    metrics.update(self._validate_and_report())
                self.tracker.log_metrics(metrics, step=self.step)
                self._log_samples(self._last_samples)
                if t.save_freq > 0 and (self.step % t.save_freq == 0 or self.step == t.total_training_steps):
                    self.save()
                self.progress.update(self.step, metrics)
                last = metrics
        finally:
            self.progress.close()
            self.tracker.finish()
            self.rollout.close()
        return last


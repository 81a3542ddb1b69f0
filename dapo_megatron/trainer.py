"""The DAPO training loop (docs/design.md §1), to be read top to bottom.

Every rank runs this same code under ``torchrun`` (SPMD). One step:

1. rollout: each rank reads its DP shard of a generation batch of prompts; the whole batch
   is dealt over the rollout engines (colocated: one per group of
   ``rollout.tensor_model_parallel_size`` ranks; server mode: one per ``rollout.server_urls``
   entry, after a health check of every server); every rank gets the record of every response (lengths, finish reasons), the token lists stay
   where they were generated (:mod:`~dapo_megatron.rollout.step_data`);
2. rewards: every rank grades the responses it generated in its killable grader pool and
   the grades are all-reduced (:class:`~dapo_megatron.rollout.step_data.DistributedGrader`);
3. buffer: dynamic sampling and overlong shaping run identically on every rank
   (:class:`~dapo_megatron.rollout.buffer.RolloutBuffer`) until N groups are kept; with
   ``rollout.streaming`` the rollout runs in rounds, graded as groups finish and stopped once
   N are kept (:class:`~dapo_megatron.rollout.streaming.StreamingCollector`: steps 1-3 at once);
4. advantages: group-relative (:func:`~dapo_megatron.algorithms.compute_group_advantages`);
5. the plan: every mini-batch split over DP ranks by token count once (reused by every PPO
   epoch), and each response's tokens sent to the DP rank that trains it; the old logprobs
   are recomputed there and stay there; not at all when the step is one mini-batch and one
   epoch (``pi_old = sg(pi_theta)`` in the training forward) or with
   ``actor.old_logprob_source: rollout`` (the engine's logprobs);
6. updates: ``ppo_epochs`` × mini-batches, each cut into micro-batches by a token budget,
   with the DAPO token-mean loss normalised by the mini-batch's global token count;
7. weight sync: Megatron shards → HF tensors in buckets → the engines (colocated: every
   rank of a rollout group hands its GPU's copy to the group's engine; server mode: one
   rank per pipeline stage broadcasts its stage to the servers);
8. metrics → MLflow; validation every ``test_freq`` steps; checkpoint every ``save_freq``.

Determinism: every response is sampled with its own seed, derived from ``trainer.seed``
and the prompt's global position in the run (a generation-batch counter kept in the
checkpoint), so the rollout is the same at any TP/PP/DP layout and a resumed run repeats
the uninterrupted one (streamed too, partial rollouts and skip history included: they are in
the checkpoint). Versions: the engine holds weights version ``step`` while step ``step + 1``
rolls out; every sample records the versions that sampled it (``Sample.versions``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

from dapo_megatron.rollout.types import HELD_BY_ALL, Group, Sample

if TYPE_CHECKING:  # config.run imports TrainerConfig from here
    from dapo_megatron.config.run import DAPOConfig
    from dapo_megatron.platform import ParallelDims
    from dapo_megatron.run_dir import RunStart

logger = logging.getLogger("dapo_megatron.trainer")


# --------------------------------------------------------------------------- config


@dataclass
class TrainerConfig:
    """The training loop, its checkpoints and the run directory (verl ``trainer.*`` names)."""

    project_name: str = "dapo-megatron"
    """project name: the MLflow experiment (as in verl); part of the default run directory."""
    experiment_name: str = "default"
    """this run's name: the MLflow run name (as in verl); part of the default run directory."""
    total_training_steps: int = 100
    """number of DAPO training steps (each: rollout, reward, dynamic sampling, actor updates, weight
    sync); >= 1."""
    save_freq: int = -1
    """save a checkpoint every this many steps (and after the last step); -1 never saves."""
    test_freq: int = -1
    """evaluate (avg@k / pass@k on the validation set) every this many steps; -1 never evaluates."""
    seed: int = 1
    """base random seed; Megatron derives the TP-rank model-parallel RNG stream from it; the data
    order and sampling seeds derive from it too. >= 0."""
    default_local_dir: Optional[str] = None
    """run directory holding ``checkpoints/`` (and logs); None means
    ``runs/<project_name>/<experiment_name>`` (see :attr:`run_dir`). Must be on a file system
    shared by all ranks."""
    resume_mode: str = "auto"
    """``"auto"`` resumes from ``<run dir>/checkpoints/latest`` when it exists (the newest complete
    checkpoint, with a warning, when ``latest`` names a missing one), ``"disable"`` always starts
    from step 0, any other value is the path of a ``step_<k>`` checkpoint directory to resume from.
    A run that starts from step 0 moves a previous run's checkpoints and metrics to
    ``<run dir>/previous_runs/<time>/``; a damaged checkpoint stops the run, naming the file."""
    val_before_train: bool = True
    """validate once before the first step (logged at step 0) when ``test_freq`` > 0, so a run's
    validation curve has its starting point."""
    max_ckpt_to_keep: Optional[int] = None
    """keep only this many newest checkpoints (verl ``max_actor_ckpt_to_keep``), >= 1; None keeps
    all."""

    @property
    def run_dir(self) -> str:
        """``default_local_dir``, or ``runs/<project_name>/<experiment_name>`` when None."""
        if self.default_local_dir:
            return self.default_local_dir
        return os.path.join("runs", self.project_name, self.experiment_name)

    @property
    def resume_path(self) -> str | None:
        """The explicit checkpoint directory of ``resume_mode``, or None for auto/disable."""
        return None if self.resume_mode in ("auto", "disable") else self.resume_mode

    def validate(self) -> None:
        """Check ranges and names.

        Raises:
            ValueError: naming the field, its value and the accepted values.
        """
        for name in ("project_name", "experiment_name"):
            value = getattr(self, name)
            if not value or not value.strip():
                raise ValueError(f"{name}={value!r} must be a non-empty name")
        if self.total_training_steps < 1:
            raise ValueError(f"total_training_steps={self.total_training_steps} must be >= 1")
        for name in ("save_freq", "test_freq"):
            value = getattr(self, name)
            if value != -1 and value < 1:
                raise ValueError(f"{name}={value} must be -1 (never) or >= 1 (every N steps)")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.default_local_dir is not None and not self.default_local_dir.strip():
            raise ValueError(
                "default_local_dir='' must be a directory path, or null for "
                "runs/<project_name>/<experiment_name>"
            )
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep < 1:
            raise ValueError(
                f"max_ckpt_to_keep={self.max_ckpt_to_keep} must be >= 1, or null to keep all"
            )
        if not self.resume_mode:
            raise ValueError("resume_mode='' must be 'auto', 'disable' or a checkpoint directory")
        path = self.resume_path
        if path is not None and not os.path.isdir(path):
            raise ValueError(
                f"resume_mode={path!r} is neither 'auto', 'disable' nor an existing checkpoint "
                "directory (expected <run dir>/checkpoints/step_<k>)"
            )



# --------------------------------------------------------------------------- helpers
def _all_gather_objects(obj: Any, group=None) -> list[Any]:
    """``all_gather_object`` over ``group`` (default: the world), in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank."""
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=src)
    return box[0]


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


# --------------------------------------------------------------------------- trainer
class DAPOTrainer:
    """Owns the actor, the engine, the data stream, the buffer and the tracker of one run.

    Build it on every rank with the :class:`~dapo_megatron.platform.ParallelDims` that
    :func:`dapo_megatron.platform.init_distributed` returned; then :meth:`fit`. Construction
    resumes from ``<run_dir>/checkpoints/latest`` when ``trainer.resume_mode`` allows it, or
    starts a new run with a previous run's files moved aside, as ``start``
    (:func:`dapo_megatron.run_dir.prepare_run_dir`; computed here when None) says.
    """

    def __init__(self, cfg: DAPOConfig, parallel: ParallelDims, start: RunStart | None = None):
        from dapo_megatron.actor import MegatronActor
        from dapo_megatron.bridge import load_hf_weights, open_hf_source
        from dapo_megatron.checkpointing import load_checkpoint
        from dapo_megatron.data import PromptStream, load_from_config, resolve_data_files
        from dapo_megatron.models import build_gpt_model, load_hf_config
        from dapo_megatron.rewards import RewardPool
        from dapo_megatron.rollout.buffer import RolloutBuffer
        from dapo_megatron.rollout.factory import build_training_rollout, load_tokenizer
        from dapo_megatron.rollout.step_data import DistributedGrader
        from dapo_megatron.run_dir import prepare_run_dir
        from dapo_megatron.tracking import ProgressBar, Tracker

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
            resolve_data_files(cfg.data, data_dir)
            files = (cfg.data.train_files, cfg.data.val_files)
        files = _broadcast_object(files)
        cfg.data.train_files, cfg.data.val_files = list(files[0]), list(files[1])
        self.train_data = load_from_config(cfg.data, self.tokenizer, "train")
        self.val_data = load_from_config(cfg.data, self.tokenizer, "val")
        b = cfg.buffer
        if b.gen_batch_size % self.dp_size:
            raise ValueError(f"buffer.gen_batch_size={b.gen_batch_size} must be divisible by the DP size "
                             f"{self.dp_size}")
        if cfg.rollout.streaming:  # every rank draws the same global batches: the decisions are replicated
            self.stream = PromptStream(self.train_data, b.gen_batch_size, 0, 1, seed=cfg.data.seed,
                                       shuffle=cfg.data.shuffle)
        else:
            self.stream = PromptStream(self.train_data, b.gen_batch_size // self.dp_size, self.dp_rank, self.dp_size,
                                       seed=cfg.data.seed, shuffle=cfg.data.shuffle)

        # model: Megatron actor (trains) and its HF twin in the engine (generates)
        self.hf_config = load_hf_config(cfg.model.hf_path, cfg.model.gguf_file)
        if cfg.rollout.mode == "colocated" and cfg.rollout.name == "sglang":  # the HF engine does not shard
            from dapo_megatron.rollout.layout import check_rollout_tp_fits_model

            check_rollout_tp_fits_model(self.hf_config, cfg.rollout.tensor_model_parallel_size)
        if cfg.rollout.name == "sglang" and cfg.rollout.mode == "colocated" and torch.cuda.is_available():
            # colocated actor + engine per GPU: stop now, not at the first OOM minutes later
            from dapo_megatron.platform import device
            from dapo_megatron.platform.memory import check_memory

            gpu_bytes = torch.cuda.get_device_properties(device()).total_memory
            estimate = check_memory(cfg, self.hf_config, self.world, gpu_bytes=gpu_bytes)
            if self.rank == 0:
                logger.info("%s", estimate.report())
        model = build_gpt_model(self.hf_config, cfg.model, parallel=parallel)
        resuming = self.start.resuming
        if not resuming:  # a resumed run loads its weights from the checkpoint below
            load_hf_weights(model, open_hf_source(cfg.model.hf_path, cfg.model.gguf_file), strict=True,
                            parallel=parallel)
        updates_per_step = cfg.actor.ppo_epochs * (cfg.buffer.train_batch_size // cfg.actor.ppo_mini_batch_size)
        self.actor = MegatronActor(model, cfg.actor, t.total_training_steps * updates_per_step,
                                   parallel=parallel, vocab_size=self.hf_config.vocab_size)
        self.engine, self.num_engines, self.engine_index = build_training_rollout(cfg, self.tokenizer,
                                                                                  self.hf_config, parallel)
        self.server_mode = cfg.rollout.mode == "server"
        # a CPU sync into fresh memory pays page faults worth several copies; on GPU the caching
        # allocator reuses blocks, and kept buffers would be out of the engine's reach
        from dapo_megatron.bridge import ExportBuffers

        on_cpu = next(self.actor.model_chunks[0].parameters()).device.type == "cpu"
        self._export_buffers = ExportBuffers() if on_cpu else None

        # rewards and the dynamic-sampling buffer (replicated on every rank)
        self.reward_pool = RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
        self.reward_pool.wait_ready()
        self.buffer = RolloutBuffer(b, DistributedGrader(self.reward_pool), self._decode)
        self.collector = self.prompt_queue = None
        if cfg.rollout.streaming:
            from dapo_megatron.rollout.prompt_skip import PromptSkipper
            from dapo_megatron.rollout.streaming import PromptQueue, StreamingCollector

            if not self.engine.supports_async:
                raise ValueError(f"rollout.streaming=true needs an engine with asynchronous generation; "
                                 f"{type(self.engine).__name__} has none: set rollout.streaming=false")
            self.collector = StreamingCollector(self.buffer, PromptSkipper(b.prompt_skip, seed=t.seed),
                                                partial_rollout=cfg.rollout.partial_rollout,
                                                poll_tokens=cfg.rollout.stream_poll_tokens)
            self.prompt_queue = PromptQueue(self.stream.next_batch, b.gen_batch_size, self.train_data.__getitem__)

        self.step = 0
        self.gen_batches_done = 0  # seeds the sampler: part of the resumable state
        mlflow_run_id = None
        if resuming:
            state = load_checkpoint(self.run_dir, self.actor.model_chunks, self.actor.optimizer,
                                    self.actor.scheduler, checkpoint_dir=self.start.checkpoint_dir)
            self.step = state["step"]
            self.gen_batches_done = state["gen_batches_done"]
            self.stream.load_state_dict(state["streams"][self.dp_rank])
            self.buffer.load_state_dict(state["buffer"])
            for g in self.buffer.surplus:  # every rank read the surplus' token lists from the checkpoint
                for s in g.samples:
                    s.holder = HELD_BY_ALL
            if self.collector is not None:
                if "streaming" not in state:
                    raise ValueError(f"rollout.streaming=true but the checkpoint of step {self.step} was written by a "
                                     "batch (non-streaming) run; resume it with rollout.streaming=false")
                self.collector.load_state_dict(state["streaming"])
                self.prompt_queue.load_state_dict(state["prompt_queue"])
            mlflow_run_id = state.get("mlflow_run_id")
            logger.info("resumed from step %d", self.step)
        self._sync_weights()

        tracking = dataclasses.replace(cfg.tracking, run_id=cfg.tracking.run_id or mlflow_run_id)
        # verl's names: the MLflow experiment is the project, the run is the experiment
        self.tracker = Tracker(self.run_dir, tracking, rank=self.rank, experiment_name=t.project_name,
                               run_name=t.experiment_name)
        if self.step == 0:
            from dapo_megatron.config.loader import to_flat_dict

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

    def _sampling_params(self, *, n: int, temperature: float, top_p: float, seed: int):
        from dapo_megatron.rollout.engine import SamplingParams

        r = self.cfg.rollout
        return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=r.top_k,
                              max_new_tokens=r.response_length, seed=seed)

    def _engine_share(self, num_prompts: int) -> list[int]:
        """The prompts (positions in a list every rank holds) this rank's engine samples."""
        from dapo_megatron.rollout.layout import engine_share

        if self.engine_index is None:
            return []
        return engine_share(num_prompts, self.num_engines, self.engine_index)

    def _global_batch(self, indices: list[int]) -> list[int]:
        """The dataset indices of the whole generation batch, every DP rank's ``indices`` in DP
        order (all DP ranks read equally many); one int64 all-gather over the DP group."""
        if self.dp_size == 1:
            return list(indices)
        from dapo_megatron.platform import collective_device

        mine = torch.tensor(indices, dtype=torch.int64, device=collective_device(self.parallel.dp_group))
        parts = [torch.empty_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(parts, mine, group=self.parallel.dp_group)
        return torch.cat(parts).cpu().tolist()

    def _generate_groups(self, records, params, first_group_id: int) -> list[Group]:
        """Generate ``params.n`` responses for each prompt of the generation batch (every DP
        rank's ``records``), dealt over the rollout engines, and return the groups: every rank
        gets the same list of records, ordered by DP rank then prompt position, with consecutive
        group ids; the token lists only where generated (:func:`~dapo_megatron.rollout.step_data.gather_groups`)."""
        from dapo_megatron.rollout.engine import completions_to_group
        from dapo_megatron.rollout.step_data import gather_groups

        # the batch in global order (DP rank, position); position g seeds its responses, so the
        # rollout depends neither on the actor's TP/PP/DP nor on the engines' layout
        batch = self._global_batch([r.index for r in records])
        mine = self._engine_share(len(batch))
        prompts = [self.train_data[batch[g]].prompt_ids for g in mine]
        outputs = self.engine.generate(prompts, params, [first_group_id + g for g in mine]) if mine else []
        local = []
        for g, completions in zip(mine, outputs):
            rec = self.train_data[batch[g]]
            local.append((0, g, completions_to_group(  # (0, g): ordered by global position
                -1, rec.prompt_ids, completions, prompt_index=rec.index, data_source=rec.data_source,
                ground_truth=rec.ground_truth, extra_info=rec.extra_info)))
        groups = gather_groups(local, n=params.n, max_local=-(-len(batch) // self.num_engines),
                               record_of=self.train_data.__getitem__)
        version = self.engine.weight_version  # the same on every rank: the weights of the last sync
        for k, g in enumerate(groups):
            g.group_id = first_group_id + k
            for s in g.samples:
                s.group_id = g.group_id
                s.versions = [(0, version)]
        return groups

    def _generate_batch(self) -> list[Group]:
        """One generation batch for the buffer: ``buffer.gen_batch_size`` prompts × n."""
        r = self.cfg.rollout
        records = self.stream.next_batch()
        params = self._sampling_params(n=self.cfg.buffer.n, temperature=r.temperature, top_p=r.top_p,
                                       seed=self.cfg.trainer.seed)
        first = self.gen_batches_done * self.cfg.buffer.gen_batch_size
        self.gen_batches_done += 1
        return self._generate_groups(records, params, first)

    def _rollout_params(self):
        r = self.cfg.rollout
        return self._sampling_params(n=self.cfg.buffer.n, temperature=r.temperature, top_p=r.top_p,
                                     seed=self.cfg.trainer.seed)

    def _collect(self) -> tuple[list[Group], dict[str, float]]:
        """Steps 1-3: the step's N groups, by whole generation batches or streamed; collective."""
        if self.collector is None:
            return self.buffer.collect(self._generate_batch, policy_version=self.step)
        groups, metrics = self.collector.collect(_RankRows(self, self._rollout_params()), self.prompt_queue,
                                                 policy_version=self.step)
        self.gen_batches_done = self.prompt_queue.fetched
        return groups, metrics

    def _free_allocator_cache(self) -> None:
        """Hand the actor's cached-but-free GPU blocks back to the driver.

        SGLang maps its weights and KV cache outside PyTorch's caching allocator
        (torch_memory_saver), so blocks the actor freed but the allocator still caches are
        invisible to it: wait for the actor's last kernels (synchronize), then empty the
        cache. Called before every wake-up and weight sync of the engine, on every rank; with
        rollout TP > 1 the group then waits for its slowest rank, because the leader's engine
        maps memory on every GPU of the group (collective over ``parallel.rollout_group``)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if self.parallel.rollout_group is not None:
            torch.distributed.barrier(group=self.parallel.rollout_group)

    def _wake_engine(self) -> None:
        """Give the engine its memory back before generating, with valid weights.

        A wake-up that leaves the weights invalid (released by ``sleep`` without a backup
        and not synced since, see ``RolloutEngine.weights_valid``) is followed by a full
        re-sync, so no rollout ever samples from garbage. Collective: every rank re-syncs
        when any engine needs it (the sync gathers over the model-parallel group)."""
        self._free_allocator_cache()
        self.engine.wake_up()
        lost = any(_all_gather_objects(not self.engine.weights_valid))
        if lost:
            logger.warning("a rollout engine woke up without valid weights; re-syncing weight version %d",
                           self.step)
            self._sync_weights()

    def _sync_weights(self) -> float:
        """Megatron shards → HF tensors (bucketed, collective) → this rank's engine, or, in
        server mode, from one rank per pipeline stage into the servers. Returns the bytes sent."""
        from dapo_megatron.bridge import iter_hf_weights

        self._free_allocator_cache()
        bucket = self.cfg.rollout.update_weights_bucket_megabytes * 2**20
        if self.server_mode:  # the stage's own tensors (no PP broadcast); DP > 0 ranks hold copies
            stream = (iter_hf_weights(self.actor.model_chunks, parallel=self.parallel, bucket_bytes=bucket,
                                      pp_broadcast=False, buffers=self._export_buffers) if self.dp_rank == 0 else None)
            return float(sum(_all_gather_objects(self.engine.sync(stream, version=self.step))))
        nbytes = 0

        def counted(it):
            nonlocal nbytes
            for name, tensor in it:
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor
                del tensor  # held by nothing when the bridge produces the next: it reuses the memory

        self.engine.update_weights(
            counted(iter_hf_weights(self.actor.model_chunks, parallel=self.parallel, bucket_bytes=bucket,
                                    buffers=self._export_buffers)),
            version=self.step)
        return float(nbytes)

    def _route_and_old_logprobs(self, groups: list[Group], samples: list[Sample], recompute: bool = True):
        """The step's plan (:func:`~dapo_megatron.rollout.step_data.plan_step`), each sample's
        tokens sent to the ranks of the DP rank that trains it, and ``Sample.old_logprobs``
        filled there (``recompute``; else left for the training forward); collective. Returns ``(plan, mine)``: the plan and the indices into
        ``samples`` of this DP rank's samples."""
        from dapo_megatron.rollout.dp_split import split_for_dp
        from dapo_megatron.rollout.step_data import plan_step, send_tokens

        actor, share = self.cfg.actor, self.actor.plan.shares_prompts
        plan = plan_step(groups, actor.ppo_mini_batch_size, self.dp_size, actor.ppo_max_token_len_per_gpu,
                         share_prompts=share)
        ranks_of = [self.parallel.ranks_of_dp_rank(d) for d in range(self.dp_size)]
        send_tokens(samples, [ranks_of[d] for d in plan.owner])
        mine = plan.owned(self.dp_rank)
        if not recompute:
            return plan, mine
        # one forward-only pass over this DP rank's samples, packed by the micro-batch budget
        # (forward-only passes need no equal micro-batch count across DP ranks)
        micro = split_for_dp([samples[i] for i in mine], 1, actor.ppo_max_token_len_per_gpu, share_prompts=share)[0]
        lps = self.actor.compute_logprobs([[samples[mine[j]] for j in mb] for mb in micro],
                                          temperature=self.cfg.rollout.temperature)
        for j, lp in zip([j for mb in micro for j in mb], lps):
            samples[mine[j]].old_logprobs = lp.tolist()
        return plan, mine

    def _mismatch_metrics(self, batch: Sequence[Sample], measured: Sequence[Sample], metrics: dict[str, float]) -> None:
        """The rollout-vs-actor logprob gap, pooled over DP: all, fresh (sampled by the actor's
        current weights: the numerics of the sync alone) and stale; collective over DP.
        ``measured``: this DP rank's samples of ``batch`` with the actor's ``old_logprobs``; which
        parts are reported is decided from ``batch`` (versions are replicated), so every DP rank
        makes the same calls."""
        from dapo_megatron.rollout.buffer import logprob_mismatch_metrics, split_fresh_stale

        group = self.parallel.dp_group
        metrics.update(logprob_mismatch_metrics(measured, group=group))
        for name, everywhere, here in zip(("fresh", "stale"), split_fresh_stale(batch, self.step),
                                          split_fresh_stale(measured, self.step)):
            if everywhere:
                metrics.update({k.replace("logprob_diff", f"logprob_diff_{name}"): v
                                for k, v in logprob_mismatch_metrics(here, group=group).items()})

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        """One DAPO step (docs/design.md §1); collective. Advances ``self.step`` and returns
        the step's metrics ``{name: float}`` (rank 0's are the ones logged)."""
        from dapo_megatron.algorithms import compute_group_advantages

        cfg, metrics, timing = self.cfg, {}, {}

        # 1-3. rollout, rewards, dynamic sampling
        t0 = time.perf_counter()
        if self.server_mode:  # a dead server stops the step here, named, not in a hung request
            self.engine.check_health()
        self._wake_engine()
        groups, rollout_metrics = self._collect()
        self.engine.sleep()  # weights too: the actor needs the memory; step 7 syncs them back
        timing["gen"] = time.perf_counter() - t0
        metrics.update(rollout_metrics)
        samples = [s for g in groups for s in g.samples]
        if not samples:  # on_cap="train_on_kept" with nothing kept: no update this step
            logger.warning("step %d: no group with mixed accuracy was kept; skipping the update", self.step + 1)
            self.step += 1
            # weights unchanged, but relabelled as version step: the next step's samples are fresh
            # (engine version == policy version), not one version stale and corrected as such
            self._sync_weights()
            metrics["actor/skipped_no_groups"] = 1.0
            self._last_samples = []
            return metrics

        # 4. group-relative advantages (on the shaped reward)
        adv = compute_group_advantages(
            torch.tensor([s.reward for s in samples], dtype=torch.float64),
            torch.tensor([s.group_id for s in samples]),
            norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo, eps=cfg.algorithm.adv_eps,
        )
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a

        # 5. the plan, the tokens to where they train, old logprobs there (and the rollout-vs-actor
        # mismatch they reveal, pooled over DP). Not recomputed when the first training forward
        # computes the same numbers (one mini-batch, one epoch: pi_old = sg(pi_theta)), nor in bypass
        # mode (the engine's logprobs are pi_old)
        t0 = time.perf_counter()
        a = cfg.actor
        calls_before = self.actor.num_model_calls
        one_update = a.ppo_epochs == 1 and len(groups) <= a.ppo_mini_batch_size
        bypass = a.old_logprob_source == "rollout"
        from_training = bypass or (one_update and a.rollout_rs is None)
        plan, mine = self._route_and_old_logprobs(groups, samples, recompute=not from_training)
        if bypass:
            for i in mine:
                samples[i].old_logprobs = list(samples[i].rollout_logprobs)
        elif not from_training:
            self._mismatch_metrics(samples, [samples[i] for i in mine], metrics)
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
                first = epoch == 0 and m == 0 and from_training
                out = self.actor.train_mini_batch(micro_batches, cfg.rollout.temperature,
                                                  global_num_tokens=mini.global_num_tokens, policy_version=self.step,
                                                  old_from_current=from_training and not bypass,
                                                  return_logprobs=first)
                if first:
                    out, lps = out
                    shard = [s for mb in micro_batches for s in mb]
                    self._mismatch_metrics(samples[mini.start:mini.start + mini.size],
                                           [dataclasses.replace(s, old_logprobs=lp.tolist())
                                            for s, lp in zip(shard, lps)], metrics)
                train_tokens += mini.total_tokens
                for k, v in out.items():
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
        metrics["actor/recomputed_old_logprobs"] = float(not from_training)

        # 7. weight sync into the engine
        t0 = time.perf_counter()
        self.step += 1
        nbytes = self._sync_weights()
        timing["sync"] = time.perf_counter() - t0

        if "rollout/gen_tokens" in metrics:  # absent when the step trained carried groups only
            metrics["perf/gen_tokens_per_s"] = metrics["rollout/gen_tokens"] / max(timing["gen"], 1e-9)
        metrics["perf/update_tokens_per_s"] = train_tokens / max(timing["update"], 1e-9)
        if not from_training:
            metrics["perf/old_logprob_tokens_per_s"] = (
                sum(s.total_length for s in samples) / max(timing["old_logprob"], 1e-9))
        metrics["perf/sync_GBps"] = nbytes / 1e9 / max(timing["sync"], 1e-9)
        for k, v in timing.items():
            metrics[f"time/{k}_s"] = v
        metrics["time/step_s"] = sum(timing.values())
        self._last_samples = samples
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """avg@k and pass@k (k = ``rollout.val_n``) on the distinct problems of the validation set.

        Validation samples ``rollout.val_n`` responses per DISTINCT problem: rows that are
        copies of one problem (equal ``data_source``, chat-templated prompt ids and ground
        truth; :func:`dapo_megatron.data.dataset.unique_prompts`) count once. The AIME 2024
        parquet holds 30 problems × 32 copies, so ``val_n=32`` is the paper's avg@32 over
        30 × 32 samples, not 960 × 32. ``rollout.val_max_prompts`` (> 0) keeps the first M
        distinct problems (in file order of their first copy).

        Problems are dealt round-robin over the rollout engines
        (:func:`~dapo_megatron.rollout.layout.engine_share`; ``rollout.val_temperature`` / ``val_top_p`` / ``top_k``, at most
        ``rollout.response_length`` new tokens); response j of problem i is seeded by
        ``(trainer.seed + 7919 * step, i, j)``, so the samples do not depend on the world
        size. Responses are decoded with ``skip_special_tokens=True`` and graded (0/1
        ``acc``) by this rank's reward pool. Collective: call it on every rank.

        Returns:
            :func:`dapo_megatron.metrics.compute_val_metrics` with ``k = val_n``:
            ``val/avg@k`` (mean over problems of the mean accuracy of their ``val_n``
            samples), ``val/pass@k`` (unbiased estimator), ``val/num_prompts`` (distinct
            problems evaluated) and the same per ``data_source``; identical on all ranks.
        """
        from dapo_megatron.data.dataset import unique_prompts
        from dapo_megatron.metrics import compute_val_metrics

        r = self.cfg.rollout
        problems = [rec for rec, _ in unique_prompts(self.val_data.records)]
        if r.val_max_prompts > 0:
            problems = problems[:r.val_max_prompts]
        mine = self._engine_share(len(problems))
        params = self._sampling_params(n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p,
                                       seed=self.cfg.trainer.seed + 7919 * self.step)
        self._wake_engine()
        outputs = self.engine.generate([problems[i].prompt_ids for i in mine], params, mine) if mine else []
        self.engine.sleep(keep_weights=True)  # no update before the next rollout: the weights stay valid
        requests, owners = [], []
        for i, comps in zip(mine, outputs):
            rec = problems[i]
            for c in comps:
                requests.append((rec.data_source, self._decode(c.response_ids), rec.ground_truth, rec.extra_info))
                owners.append(i)
        results = self.reward_pool.grade(requests) if requests else []
        local: dict[int, list[float]] = {}
        for i, res in zip(owners, results):
            local.setdefault(i, []).append(1.0 if res["acc"] else 0.0)
        accs: dict[int, list[float]] = {}
        for part in _all_gather_objects(local):
            accs.update(part)
        order = sorted(accs)
        return compute_val_metrics([problems[i].data_source for i in order], [accs[i] for i in order], k=r.val_n)

    # ------------------------------------------------------------------ checkpoint
    def save(self) -> None:
        """Write the checkpoint of ``self.step`` (atomic, :func:`~dapo_megatron.checkpointing.save_checkpoint`);
        collective."""
        from dapo_megatron.bridge.dist_ckpt import write_model_meta
        from dapo_megatron.checkpointing import save_checkpoint
        from dapo_megatron.rollout.step_data import gather_preds, send_tokens

        # rank 0 writes the trainer state: it needs the surplus groups whole (their token lists and
        # extracted answers are on the ranks that generated them)
        surplus = [s for g in self.buffer.surplus for s in g.samples]
        send_tokens(surplus, [(0,)] * len(surplus))
        gather_preds(surplus, dst=0)
        # ranks of one DP rank read the same prompts: keep one reader position per DP rank
        by_dp = dict(_all_gather_objects((self.dp_rank, self.stream.state_dict())))
        state = {
            "step": self.step,
            "gen_batches_done": self.gen_batches_done,
            "streams": [by_dp[d] for d in range(self.dp_size)],
            "buffer": self.buffer.state_dict(),
            **({"streaming": self.collector.state_dict(), "prompt_queue": self.prompt_queue.state_dict()}
               if self.collector is not None else {}),
            "mlflow_run_id": self.tracker.run_id,
        }
        save_checkpoint(self.run_dir, self.step, self.actor.model_chunks, self.actor.optimizer,
                        self.actor.scheduler, state, max_ckpt_to_keep=self.cfg.trainer.max_ckpt_to_keep,
                        parallel=self.parallel,
                        write_extra=lambda d: write_model_meta(d, self.actor.model_chunks, self.hf_config,
                                                               self.tokenizer))

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
        if self.world > 1:
            parts = [None] * self.world if self.rank == 0 else None
            dist.gather_object(lines, parts, dst=0)
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
            self.reward_pool.close()
        return last


class _RankRows:
    """The streamed rollout's :class:`~dapo_megatron.rollout.streaming.RowClient` over every rank's
    engine; each call is a collective. Group ``g`` runs on rank ``g.prompt_seed % world`` (its
    ``n`` rows share one prefill there), continued rows included; the rows that finished or
    were aborted on any rank are all-gathered, so every rank sees every result."""

    def __init__(self, trainer: DAPOTrainer, params):
        self.trainer, self.params = trainer, params

    def submit(self, rows) -> None:
        from dapo_megatron.rollout.streaming import row_request

        t = self.trainer
        mine = [row_request(g, j, self.params) for g, j in rows if g.prompt_seed % t.world == t.rank]
        if mine:
            t.engine.submit(mine)

    def poll(self, max_tokens: int):
        t = self.trainer
        local = t.engine.poll(max_tokens) if t.engine.num_in_flight else []
        return [r for part in _all_gather_objects(local) for r in part]

    def abort(self):
        return [r for part in _all_gather_objects(self.trainer.engine.abort()) for r in part]

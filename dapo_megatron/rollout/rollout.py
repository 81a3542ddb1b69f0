"""The rollout of a training run: one object for every engine layout and mode, :class:`Rollout`,
built by :func:`~dapo_megatron.rollout.build.build_rollout`; the trainer talks to it only, and every
method of it is a collective (call it on every rank, in the same order). It composes one step
source: the synchronous one (:class:`~dapo_megatron.rollout.sync_feeder.SyncFeeder`) or, with
``async_training``, the background driver (:class:`~dapo_megatron.rollout.background.BackgroundDriver`,
:meth:`Rollout.run_ahead`); its validation is :class:`~dapo_megatron.rollout.validation.Validation`.
The layouts and the surface: docs/design.md §2.3.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dapo_megatron.bridge import ExportBuffers, iter_hf_weights, unwrap_model
from dapo_megatron.config.run import DAPOConfig
from dapo_megatron.data import PromptStream
from dapo_megatron.platform import ParallelDims, collective_device
from dapo_megatron.platform.sglang_env import release_allocator_cache
from dapo_megatron.rewards.pool import RewardPool
from dapo_megatron.rollout.engines.engine import RolloutEngine, SamplingParams
from dapo_megatron.rollout.engines.layout import engine_share
from dapo_megatron.bridge.verify import (SyncDigest, Timer, WeightSyncVerifyError, probe_error, probe_ids,
                                                  probe_tolerance)
from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
from dapo_megatron.rollout.sampling.feeder import PromptQueue
from dapo_megatron.rollout.sampling.streaming import EngineClient, StreamingCollector
from dapo_megatron.rollout.sync_feeder import SyncFeeder
from dapo_megatron.rollout.trajectory import SINGLE_TURN, Trajectory
from dapo_megatron.rollout.types import Group, Sample
from dapo_megatron.rollout.validation import Validation


logger = logging.getLogger("dapo_megatron.rollout")


@dataclass
class StepBatch:
    """What :meth:`Rollout.collect` returns for one training step.

    Attributes:
        groups: the kept groups, ``buffer.train_batch_size`` of them (fewer only at the cap
            with ``buffer.on_cap="train_on_kept"``), group ids ``0..len-1``; records replicated
            on every rank, token lists where generated.
        metrics: the rollout's ``rollout/*`` (and ``train/*``) metrics, identical on all ranks.
    """

    groups: list[Group]
    metrics: dict[str, float]

    @property
    def samples(self) -> list[Sample]:
        """Every sample of :attr:`groups`, group by group."""
        return [s for g in self.groups for s in g.samples]


class Rollout:
    """One run's rollout on this rank, whatever the engine layout (module docstring).

    Build it with :func:`~dapo_megatron.rollout.build.build_rollout`. Attributes are read-only
    outside this class: ``engine`` (this rank's engine, group member or server client),
    ``num_engines`` and ``engine_index`` (the engine whose prompts this rank deals, None: none),
    ``buffer``, ``collector`` / ``prompt_queue`` / ``row_client`` (streamed only, else None),
    ``reward_pool``, ``validation``, ``steps`` (the step source: a
    :class:`~dapo_megatron.rollout.sync_feeder.SyncFeeder`, or the background driver after
    :meth:`run_ahead`) and ``background`` (that driver, else None).
    """

    def __init__(self, cfg: DAPOConfig, parallel: ParallelDims, *, engine: RolloutEngine, num_engines: int,
                 engine_index: Optional[int], train_data: Any, val_data: Any, stream: PromptStream,
                 reward_pool: RewardPool, decode: Callable[[list[int]], str], buffer: RolloutBuffer,
                 collector: Optional[StreamingCollector], prompt_queue: Optional[PromptQueue],
                 routes_layout: Optional[tuple] = None, trajectory: Trajectory = SINGLE_TURN):
        self.cfg, self.parallel = cfg, parallel
        self.trajectory = trajectory  # settles every finished row (rollout/trajectory.py); default single-turn
        self.routes_layout = routes_layout  # routing replay: (L, K, dtype) of Sample.routes, which travel too
        self.engine, self.num_engines, self.engine_index = engine, num_engines, engine_index
        self.server_mode = cfg.rollout.mode == "server"
        self.train_data, self.val_data, self.stream = train_data, val_data, stream
        self.reward_pool, self.decode = reward_pool, decode
        self.buffer, self.collector, self.prompt_queue = buffer, collector, prompt_queue
        # streamed: group g on engine g.prompt_seed % num_engines (its driving rank); each round
        # replicates records only, the tokens stay there until the step's plan sends them on
        self.row_client = (EngineClient(engine, self.train_params(), num_engines=num_engines,
                                        engine_index=engine_index, parallel=parallel, trajectory=self.trajectory)
                           if collector is not None else None)
        self.validation = Validation(self)
        self.steps: Any = SyncFeeder(self)  # the step source: synchronous, or the background driver (run_ahead)
        self.background: Any = None
        # a CPU sync into fresh memory pays page faults worth several copies; on GPU the caching
        # allocator reuses blocks, and kept buffers would be out of the engine's reach
        self.export_buffers: Optional[ExportBuffers] = None
        self._source: Any = None  # the actor of the last sync_weights, and its version
        self._version = 0

    def run_ahead(self, driver: Any) -> None:
        """Compose ``driver`` (a :class:`~dapo_megatron.rollout.background.BackgroundDriver` built on
        this rollout) as the step source, in place of the synchronous one, before the first
        :meth:`collect` (:func:`~dapo_megatron.rollout.build.compose_rollout` does, under
        ``async_training.enable``). From then on :meth:`collect`, :meth:`validate`, the state and
        :meth:`close` are the driver's, :meth:`sync_weights` goes through it, and :meth:`wake` /
        :meth:`check_health` leave the servers to its controller."""
        self.steps = self.background = driver

    @property
    def controller(self) -> Any:
        """The background driver's controller thread (rank 0 under ``async_training``), else None."""
        return self.background.controller if self.background is not None else None

    # ------------------------------------------------------------------ the engines
    def check_health(self) -> None:
        """Server mode: every server answers ``/health`` (else the error names it, on every rank).
        Nothing under the background driver: its controller keeps its servers' health (a failed
        server leaves dispatch, its rows go to the others) and a step with no healthy server left
        fails in :meth:`collect`, naming every server."""
        if self.server_mode and self.background is None:
            self.engine.check_health()

    def _free_allocator_cache(self) -> None:
        """:func:`~dapo_megatron.platform.sglang_env.release_allocator_cache` (SGLang maps its memory
        outside PyTorch's allocator) before every wake-up and weight sync, then the rollout group waits
        for its slowest rank: the leader's engine maps memory on every GPU of the group (collective
        over ``parallel.rollout_group``)."""
        release_allocator_cache()
        self.parallel.barrier("rollout")

    def wake(self) -> None:
        """Give the engine its memory back before generating, with valid weights.

        A wake-up that leaves the weights invalid (released by ``sleep`` without a backup
        and not synced since, see ``WeightReceiver.weights_valid``) is followed by a full
        re-sync of the last synced actor and version, so no rollout ever samples from garbage.
        Every rank re-syncs when any engine needs it (the sync gathers over the model-parallel
        group). Nothing under the background driver: the servers have their own memory and their
        weights are synced by :meth:`sync_weights` only."""
        if self.background is not None:
            return
        self._free_allocator_cache()
        self.engine.wake_up()
        if any(self.parallel.all_gather_objects(not self.engine.weights_valid, "world")):
            logger.warning("a rollout engine woke up without valid weights; re-syncing weight version %d",
                           self._version)
            self.push_weights(self._source, self._version)

    def sleep(self, keep_weights: bool = False) -> None:
        """Release the engine's GPU memory (its weights too unless ``keep_weights``)."""
        self.engine.sleep(keep_weights=keep_weights)

    def sync_weights(self, actor: Any, version: int) -> float:
        """Megatron shards of ``actor`` → HF tensors (bucketed, collective) → this rank's engine,
        or, in server mode, from one rank per pipeline stage into the servers; the engines then
        hold weights ``version``. Returns the bytes sent (summed over ranks in server mode).
        Under the background driver it is sent when due, with the controller paused
        (:meth:`~dapo_megatron.rollout.background.BackgroundDriver.sync_weights`; 0.0 when not due)."""
        if self.background is not None:
            return self.background.sync_weights(actor, version, self.push_weights)
        return self.push_weights(actor, version)

    def push_weights(self, actor: Any, version: int) -> float:
        """The sync itself (:meth:`sync_weights`), whatever the step source."""
        self._source, self._version = actor, version
        if self.export_buffers is None and next(actor.model_chunks[0].parameters()).device.type == "cpu":
            self.export_buffers = ExportBuffers()
        self._free_allocator_cache()
        bucket = self.cfg.rollout.update_weights_bucket_megabytes * 2**20
        if self.server_mode:  # the stage's own tensors (no PP broadcast); DP > 0 ranks hold copies
            digest = self.new_digest(version)
            # at EP > 1 each EP owner's ranks stream its own experts (iter_hf_weights' expert_owners)
            owners = self.parallel.ep_size > 1
            streams = self.parallel.dp_rank == 0 or (owners and self.parallel.expert_owner is not None)
            stream = (iter_hf_weights(actor.model_chunks, parallel=self.parallel, bucket_bytes=bucket,
                                      pp_broadcast=False, buffers=self.export_buffers, digest=digest,
                                      expert_owners=owners)
                      if streams else None)
            sent = self.engine.sync(stream, version=version, digest=digest)
            return float(sum(self.parallel.all_gather_objects(sent, "world")))
        nbytes = 0
        digest = self.new_digest(version)

        def counted(it):
            nonlocal nbytes
            for name, tensor in it:
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor
                del tensor  # held by nothing when the bridge produces the next: it reuses the memory

        error = None
        try:
            self.engine.update_weights(
                counted(iter_hf_weights(actor.model_chunks, parallel=self.parallel, bucket_bytes=bucket,
                                        buffers=self.export_buffers, digest=digest,
                                        param_views=self.engine.copies_on_load)),
                version=version, digest=digest)
        except WeightSyncVerifyError as err:  # the engine is invalid; every rank stops with this one error
            error = str(err)
        probe = self.probe(actor, version, digest)  # collective over the actor: every rank, even after an error
        if error is None and probe is not None:
            self.engine.abort_weight_update()  # not served
            error = probe
        if digest is not None or self.cfg.rollout.weight_probe:
            errors = [e for e in self.parallel.all_gather_objects(error, "world") if e]
            if errors:
                raise WeightSyncVerifyError(errors[0])
        return float(nbytes)

    def probe(self, actor: Any, version: int, digest: Optional[SyncDigest]) -> Optional[str]:
        """The functional check after a colocated sync (``rollout.weight_probe``): the fixed probe
        sequence's logprobs under this rank's engine against the actor's (``compute_logprobs``, collective
        over the model-parallel group, so every rank runs it); the error, or None. Engines that cannot
        score a sequence (SGLang, a rollout group's other ranks) only take part in the actor's side."""
        r = self.cfg.rollout
        if not r.weight_probe or not hasattr(actor, "compute_logprobs"):
            return None
        ids = probe_ids(actor.vocab_size or unwrap_model(actor.model_chunks[0]).vocab_size)
        sample = Sample(prompt_ids=ids[:8], response_ids=ids[8:], rollout_logprobs=[0.0] * (len(ids) - 8),
                        finish_reason="length", group_id=0)
        with Timer(digest):
            # the probe has no engine routes: an MoE actor under routing replay routes it on its own;
            # its forward is not one of the step's model calls (actor/num_model_calls)
            calls = getattr(actor, "num_model_calls", None)
            actor_lp = actor.compute_logprobs([[sample]], r.temperature, own_routing=True)[0]
            if calls is not None:
                actor.num_model_calls = calls
            if not self.engine.supports_score or not self.engine.weights_valid:
                return None
            engine_lp = self.engine.score(ids, r.temperature)[7:]
        return probe_error(engine_lp, actor_lp, probe_tolerance(r.weight_probe_tolerance,
                                                                digest.dtype if digest else None),
                           version=version, where=getattr(self.engine, "engine_label", "") or type(self.engine).__name__)

    def new_digest(self, version: int) -> Optional[SyncDigest]:
        """The verification record of one sync (None with ``rollout.check_weight_update: false``)."""
        r = self.cfg.rollout
        if not r.check_weight_update:
            return None
        # SGLang receivers (colocated engines, servers) are read back, a tensor's head rows: every rank's
        # digest says so alike, since the rank that checksums a bucket is not always the one that compares
        readback = r.check_weight_update_readback_elements if r.name == "sglang" else None
        return SyncDigest(version, r.check_weight_update_period, readback_elements=readback)

    # ------------------------------------------------------------------ generation
    def sampling_params(self, *, n: int, temperature: float, top_p: float, seed: int) -> SamplingParams:
        """The rollout's sampling parameters (``rollout.top_k``, ``response_length`` new tokens, the
        trajectory's stop strings) with these ``n``, ``temperature``, ``top_p`` and ``seed``."""
        r = self.cfg.rollout
        return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=r.top_k,
                              max_new_tokens=r.response_length, seed=seed, stop=self.trajectory.stop)

    def train_params(self) -> SamplingParams:
        """Training's sampling parameters: ``n = buffer.n``, ``rollout.temperature`` / ``top_p``,
        seed ``trainer.seed`` (response ``j`` of position ``g``: ``sample_seed(seed, g, j)``)."""
        r = self.cfg.rollout
        return self.sampling_params(n=self.cfg.buffer.n, temperature=r.temperature, top_p=r.top_p,
                                    seed=self.cfg.trainer.seed)

    def engine_share(self, num_prompts: int) -> list[int]:
        """The prompts (positions in a list every rank holds) this rank's engine samples."""
        if self.engine_index is None:
            return []
        return engine_share(num_prompts, self.num_engines, self.engine_index)

    def collect(self, step: int) -> StepBatch:
        """The groups that train step ``step + 1`` (sampled by weights version ``step``):
        generation, grading and dynamic sampling (docs/design.md §1, steps 1-3), from the step
        source (:meth:`SyncFeeder.collect <dapo_megatron.rollout.sync_feeder.SyncFeeder.collect>` or
        the background driver's)."""
        return StepBatch(*self.steps.collect(step))

    def trajectory_metrics(self, counts: dict[str, float], prefix: str) -> dict[str, float]:
        """The trajectory's metrics of ``counts`` summed over the world (a collective: every rank
        has the same keys, :meth:`Trajectory.take_counts`); float64 sums of small integers, exact."""
        if not counts:
            return {}
        keys = sorted(counts)
        table = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64)
        if self.parallel.world_size > 1:
            table = self.parallel.all_reduce(table.to(collective_device(self.parallel.world_group)), "world").cpu()
        return self.trajectory.metrics(dict(zip(keys, table.tolist())), prefix)

    def validate(self, step: int) -> dict[str, float]:
        """avg@k and pass@k (k = ``rollout.val_n``) on the distinct problems of the validation set
        (:meth:`Validation.run <dapo_megatron.rollout.validation.Validation.run>`: its contract), from
        the step source (this rank's engine, or the background driver's servers)."""
        return self.steps.validate(step)

    def close(self) -> None:
        """Stop the step source (the background driver's thread), the reward pool's grader
        processes and the trajectory's sandbox pool."""
        self.steps.close()
        self.reward_pool.close()
        self.trajectory.close()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The rollout's part of a checkpoint (collective): the step source's
        (:meth:`SyncFeeder.state_dict <dapo_megatron.rollout.sync_feeder.SyncFeeder.state_dict>`, or the
        background driver's)."""
        return self.steps.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into the step source (its errors: a checkpoint of another mode)."""
        self.steps.load_state_dict(state)

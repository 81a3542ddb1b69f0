"""The rollout of a training run: one object for every engine layout (docs/design.md §2.3).

:func:`build_rollout` builds a :class:`Rollout` for the layout the config names, and the
trainer talks to that object only:

* colocated, rollout TP = 1: every rank drives its own engine;
* colocated rollout-TP groups (``rollout.tensor_model_parallel_size`` k > 1): the first rank
  of each group of k drives the engine, the others only feed its weight sync;
* separate servers (``rollout.mode: server``): rank ``e`` drives ``rollout.server_urls[e]``,
  one rank per pipeline stage sends that stage's weights.

Surface (every method is a collective: call it on every rank, in the same order):

* :meth:`Rollout.collect` -> :class:`StepBatch`: the step's kept groups and rollout metrics,
  by whole generation batches (:meth:`~dapo_megatron.rollout.sampling.buffer.RolloutBuffer.collect`)
  or streamed (``rollout.streaming``,
  :class:`~dapo_megatron.rollout.sampling.streaming.StreamingCollector`);
* :meth:`Rollout.sync_weights`: the actor's weights into the engines, as version ``version``;
* :meth:`Rollout.wake` / :meth:`Rollout.sleep`: the engines' GPU memory around generation
  (no-ops for servers); :meth:`Rollout.check_health`: a dead server stops the step, named;
* :meth:`Rollout.validate`: avg@k / pass@k on the validation set;
* :meth:`Rollout.state_dict` / :meth:`Rollout.load_state_dict`: everything rollout-side a
  checkpoint holds (prompt stream positions per DP rank, generation-batch counter, buffer
  surplus, streamed partial groups and prompt queue).

Prompts: every prompt of a generation batch is dealt over the engines
(:func:`~dapo_megatron.rollout.engines.layout.engine_share`) and each response is seeded by
the prompt's global position, so the rollout does not depend on the actor's TP / PP / DP nor
on the engines' layout. Records (lengths, finish reasons, grades) end up replicated on every
rank; token lists stay where they were generated
(:func:`~dapo_megatron.rollout.plan.step_data.gather_groups`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from dapo_megatron.bridge import ExportBuffers, iter_hf_weights, unwrap_model
from dapo_megatron.config.run import DAPOConfig
from dapo_megatron.data import PromptStream
from dapo_megatron.data.dataset import unique_prompts
from dapo_megatron.metrics import compute_val_metrics
from dapo_megatron.platform import ParallelDims, collective_device
from dapo_megatron.rewards.pool import RewardPool
from dapo_megatron.rollout.engines.engine import RolloutEngine, SamplingParams, completions_to_group
from dapo_megatron.rollout.engines.layout import engine_share
from dapo_megatron.bridge.verify import (SyncDigest, Timer, WeightSyncVerifyError, probe_error, probe_ids,
                                                  probe_tolerance)
from dapo_megatron.rollout.plan.step_data import gather_groups, gather_preds, send_tokens
from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
from dapo_megatron.rollout.sampling.streaming import EngineClient, PromptQueue, StreamingCollector
from dapo_megatron.rollout.trajectory import SINGLE_TURN, Trajectory, run_turns
from dapo_megatron.rollout.types import HELD_BY_ALL, Group, Sample


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

    Build it with :func:`build_rollout`. Attributes are read-only outside this class:
    ``engine`` (this rank's engine, group member or server client), ``num_engines`` and
    ``engine_index`` (the engine whose prompts this rank deals, None: none), ``buffer``,
    ``collector`` / ``prompt_queue`` / ``row_client`` (streamed only, else None), ``gen_batches_done``
    (generation batches drawn so far: it seeds the sampler), ``reward_pool``.
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
        self.row_client = (EngineClient(engine, self._train_params(), num_engines=num_engines,
                                        engine_index=engine_index, parallel=parallel, trajectory=self.trajectory)
                           if collector is not None else None)
        self.gen_batches_done = 0
        # a CPU sync into fresh memory pays page faults worth several copies; on GPU the caching
        # allocator reuses blocks, and kept buffers would be out of the engine's reach
        self.export_buffers: Optional[ExportBuffers] = None
        self._source: Any = None  # the actor of the last sync_weights, and its version
        self._version = 0

    # ------------------------------------------------------------------ the engines
    def check_health(self) -> None:
        """Server mode: every server answers ``/health`` (else the error names it, on every rank)."""
        if self.server_mode:
            self.engine.check_health()

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
        self.parallel.barrier("rollout")

    def wake(self) -> None:
        """Give the engine its memory back before generating, with valid weights.

        A wake-up that leaves the weights invalid (released by ``sleep`` without a backup
        and not synced since, see ``RolloutEngine.weights_valid``) is followed by a full
        re-sync of the last synced actor and version, so no rollout ever samples from garbage.
        Every rank re-syncs when any engine needs it (the sync gathers over the model-parallel
        group)."""
        self._free_allocator_cache()
        self.engine.wake_up()
        if any(self.parallel.all_gather_objects(not self.engine.weights_valid, "world")):
            logger.warning("a rollout engine woke up without valid weights; re-syncing weight version %d",
                           self._version)
            self.sync_weights(self._source, self._version)

    def sleep(self, keep_weights: bool = False) -> None:
        """Release the engine's GPU memory (its weights too unless ``keep_weights``)."""
        self.engine.sleep(keep_weights=keep_weights)

    def sync_weights(self, actor: Any, version: int) -> float:
        """Megatron shards of ``actor`` → HF tensors (bucketed, collective) → this rank's engine,
        or, in server mode, from one rank per pipeline stage into the servers; the engines then
        hold weights ``version``. Returns the bytes sent (summed over ranks in server mode)."""
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
    def _sampling_params(self, *, n: int, temperature: float, top_p: float, seed: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=r.top_k,
                              max_new_tokens=r.response_length, seed=seed, stop=self.trajectory.stop)

    def _train_params(self) -> SamplingParams:
        r = self.cfg.rollout
        return self._sampling_params(n=self.cfg.buffer.n, temperature=r.temperature, top_p=r.top_p,
                                     seed=self.cfg.trainer.seed)

    def _engine_share(self, num_prompts: int) -> list[int]:
        """The prompts (positions in a list every rank holds) this rank's engine samples."""
        if self.engine_index is None:
            return []
        return engine_share(num_prompts, self.num_engines, self.engine_index)

    def _global_batch(self, indices: list[int]) -> list[int]:
        """The dataset indices of the whole generation batch, every DP rank's ``indices`` in DP
        order (all DP ranks read equally many); one int64 all-gather over the DP group."""
        dp_size = self.parallel.dp_size
        if dp_size == 1:
            return list(indices)
        mine = torch.tensor(indices, dtype=torch.int64, device=collective_device(self.parallel.dp_group))
        return torch.cat(self.parallel.all_gather(mine, "dp")).cpu().tolist()

    def _generate_groups(self, records: Sequence[Any], params: SamplingParams, first_group_id: int) -> list[Group]:
        """Generate ``params.n`` responses for each prompt of the generation batch (every DP
        rank's ``records``), dealt over the rollout engines, and return the groups: every rank
        gets the same list of records, ordered by DP rank then prompt position, with consecutive
        group ids; the token lists only where generated."""
        # the batch in global order (DP rank, position); position g seeds its responses, so the
        # rollout depends neither on the actor's TP/PP/DP nor on the engines' layout
        batch = self._global_batch([r.index for r in records])
        mine = self._engine_share(len(batch))
        prompts = [self.train_data[batch[g]].prompt_ids for g in mine]
        outputs = self.engine.generate(prompts, params, [first_group_id + g for g in mine]) if mine else []
        self.parallel.wait_for_generation()  # ranks that generate nothing wait on gloo, not in gather_groups
        local, rows = [], []
        for g, completions in zip(mine, outputs):
            rec = self.train_data[batch[g]]
            local.append((0, g, completions_to_group(  # (0, g): ordered by global position
                -1, rec.prompt_ids, completions, prompt_index=rec.index, data_source=rec.data_source,
                ground_truth=rec.ground_truth, extra_info=rec.extra_info)))
            rows.extend((s, first_group_id + g, j) for j, s in enumerate(local[-1][2].samples))
        # each finished row through the trajectory hook; a multi-turn one runs its next turns here
        run_turns(self.engine, rows, params, self.trajectory)
        groups = gather_groups(local, n=params.n, max_local=-(-len(batch) // self.num_engines),
                               record_of=self.train_data.__getitem__, parallel=self.parallel)
        version = self.engine.weight_version  # the same on every rank: the weights of the last sync
        for k, g in enumerate(groups):
            g.group_id = first_group_id + k
            for s in g.samples:
                s.group_id = g.group_id
                s.versions = [(0, version)]
        return groups

    def _generate_batch(self) -> list[Group]:
        """One generation batch for the buffer: ``buffer.gen_batch_size`` prompts × n."""
        records = self.stream.next_batch()
        first = self.gen_batches_done * self.cfg.buffer.gen_batch_size
        self.gen_batches_done += 1
        return self._generate_groups(records, self._train_params(), first)

    def collect(self, step: int) -> StepBatch:
        """The groups that train step ``step + 1`` (sampled by weights version ``step``):
        generation, grading and dynamic sampling (docs/design.md §1, steps 1-3)."""
        if self.collector is None:
            batch = StepBatch(*self.buffer.collect(self._generate_batch, policy_version=step))
        else:
            groups, metrics = self.collector.collect(self.row_client, self.prompt_queue, policy_version=step)
            self.gen_batches_done = self.prompt_queue.fetched
            batch = StepBatch(groups, metrics)
        if self.trajectory.multi_turn:  # the responses this step finished and graded (tool calls, their accuracy)
            batch.metrics.update(self._trajectory_metrics(self.trajectory.take_counts(), "tool/"))
        return batch

    def _trajectory_metrics(self, counts: dict[str, float], prefix: str) -> dict[str, float]:
        """The trajectory's metrics of ``counts`` summed over the world (a collective: every rank
        has the same keys, :meth:`Trajectory.take_counts`); float64 sums of small integers, exact."""
        if not counts:
            return {}
        keys = sorted(counts)
        table = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64)
        if self.parallel.world_size > 1:
            table = self.parallel.all_reduce(table.to(collective_device(self.parallel.world_group)), "world").cpu()
        return self.trajectory.metrics(dict(zip(keys, table.tolist())), prefix)

    # ------------------------------------------------------------------ validation
    def validate(self, step: int) -> dict[str, float]:
        """avg@k and pass@k (k = ``rollout.val_n``) on the distinct problems of the validation set.

        Validation samples ``rollout.val_n`` responses per DISTINCT problem: rows that are
        copies of one problem (equal ``data_source``, chat-templated prompt ids and ground
        truth; :func:`dapo_megatron.data.dataset.unique_prompts`) count once. The AIME 2024
        parquet holds 30 problems × 32 copies, so ``val_n=32`` is the paper's avg@32 over
        30 × 32 samples, not 960 × 32. ``rollout.val_max_prompts`` (> 0) keeps the first M
        distinct problems (in file order of their first copy).

        Problems are dealt round-robin over the rollout engines
        (:func:`~dapo_megatron.rollout.engines.layout.engine_share`; ``rollout.val_temperature`` /
        ``val_top_p`` / ``top_k``, at most ``rollout.response_length`` new tokens); response j of
        problem i is seeded by ``(trainer.seed + 7919 * step, i, j)``, so the samples do not
        depend on the world size. Responses are decoded with ``skip_special_tokens=True`` and
        graded (0/1 ``acc``) by this rank's reward pool. The engine keeps its weights when it
        sleeps afterwards: no update comes before the next rollout.

        Returns:
            :func:`dapo_megatron.metrics.compute_val_metrics` with ``k = val_n``:
            ``val/avg@k`` (mean over problems of the mean accuracy of their ``val_n``
            samples), ``val/pass@k`` (unbiased estimator), ``val/num_prompts`` (distinct
            problems evaluated) and the same per ``data_source``; identical on all ranks.
        """
        problems, params = self._val_problems(), self._val_params(step)
        mine = self._engine_share(len(problems))
        self.wake()
        outputs = self.engine.generate([problems[i].prompt_ids for i in mine], params, mine) if mine else []
        val_samples = []
        if self.trajectory.multi_turn and outputs:  # the tool turns of validation's responses too
            groups = [completions_to_group(-1, problems[i].prompt_ids, comps) for i, comps in zip(mine, outputs)]
            rows = [(s, i, j) for i, g in zip(mine, groups) for j, s in enumerate(g.samples)]
            run_turns(self.engine, rows, params, self.trajectory)
            outputs = [g.samples for g in groups]  # each with response_ids: what the grader reads
            val_samples = [s for s, _, _ in rows]
        self.sleep(keep_weights=True)  # no update before the next rollout: the weights stay valid
        graded = self._grade_val(problems, zip(mine, outputs))
        for s, acc in zip(val_samples, [a for i in mine for a in graded.get(i, [])]):
            s.acc = bool(acc)
        self.parallel.wait_for_generation()  # ranks that generate nothing wait on gloo, not in the gather
        accs: dict[int, list[float]] = {}
        for part in self.parallel.all_gather_objects(graded, "world"):
            accs.update(part)
        metrics = self._val_metrics(problems, accs)
        if self.trajectory.multi_turn:
            metrics.update(self._trajectory_metrics(self.trajectory.take_counts(val_samples), "val/tool/"))
        return metrics

    # validation's parts, shared with the asynchronous rollout's (AsyncRollout.validate): the same
    # problems, seeds, sampling parameters, grading and metrics whoever generates the responses
    def _val_problems(self) -> list:
        """The validation problems, in order: the distinct ones (:func:`unique_prompts`), the
        first ``rollout.val_max_prompts`` when > 0. Problem ``i`` is prompt seed ``i``."""
        problems = [rec for rec, _ in unique_prompts(self.val_data.records)]
        if self.cfg.rollout.val_max_prompts > 0:
            problems = problems[:self.cfg.rollout.val_max_prompts]
        return problems

    def _val_params(self, step: int) -> SamplingParams:
        """Validation's sampling parameters at ``step``: ``n = rollout.val_n``, ``val_temperature`` /
        ``val_top_p`` / ``top_k``, ``response_length`` new tokens, seed ``trainer.seed + 7919 * step``
        (response ``j`` of problem ``i``: :func:`~dapo_megatron.rollout.engines.engine.sample_seed`
        ``(seed, i, j)``)."""
        r = self.cfg.rollout
        return self._sampling_params(n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p,
                                     seed=self.cfg.trainer.seed + 7919 * step)

    def _grade_val(self, problems: Sequence[Any], outputs: Any) -> dict[int, list[float]]:
        """``(problem index, its completions)`` pairs → per problem index the 0/1 ``acc`` of each
        completion, in order: decoded (``skip_special_tokens=True``) and graded by this rank's
        reward pool in one call. Not a collective."""
        requests, owners = [], []
        for i, comps in outputs:
            rec = problems[i]
            for c in comps:
                requests.append((rec.data_source, self.decode(c.response_ids), rec.ground_truth, rec.extra_info))
                owners.append(i)
        results = self.reward_pool.grade(requests) if requests else []
        local: dict[int, list[float]] = {}
        for i, res in zip(owners, results):
            local.setdefault(i, []).append(1.0 if res["acc"] else 0.0)
        return local

    def _val_metrics(self, problems: Sequence[Any], accs: dict[int, list[float]]) -> dict[str, float]:
        """:func:`~dapo_megatron.metrics.compute_val_metrics` (``k = rollout.val_n``) of every
        problem's accuracies (``accs``: problem index → its ``val_n`` 0/1 grades), by problem index."""
        order = sorted(accs)
        return compute_val_metrics([problems[i].data_source for i in order], [accs[i] for i in order],
                                   k=self.cfg.rollout.val_n)

    def close(self) -> None:
        """Stop the reward pool's grader processes and the trajectory's sandbox pool."""
        self.reward_pool.close()
        self.trajectory.close()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The rollout's part of a checkpoint (the same on every rank; rank 0's is written);
        collective. Keys: ``gen_batches_done``, ``streams`` (one prompt-stream position per DP
        rank), ``buffer`` and, streamed, ``streaming`` and ``prompt_queue``. Rank 0 receives the
        surplus and partial groups' token lists and the surplus' extracted answers from the
        ranks that generated them."""
        surplus = [s for g in self.buffer.surplus for s in g.samples]
        partial = [s for g in self.collector.partial for s in g.samples] if self.collector is not None else []
        send_tokens(surplus + partial, [(0,)] * (len(surplus) + len(partial)),  # streamed partial groups too
                    parallel=self.parallel, routes=self.routes_layout)
        gather_preds(surplus, parallel=self.parallel, dst=0)
        # ranks of one DP rank read the same prompts: keep one reader position per DP rank
        by_dp = dict(self.parallel.all_gather_objects((self.parallel.dp_rank, self.stream.state_dict()), "world"))
        return {
            "gen_batches_done": self.gen_batches_done,
            "streams": [by_dp[d] for d in range(self.parallel.dp_size)],
            "buffer": self.buffer.state_dict(),
            **({"streaming": self.collector.state_dict(), "prompt_queue": self.prompt_queue.state_dict()}
               if self.collector is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (``state`` as read by every rank). Every rank then holds the
        surplus' token lists.

        Raises:
            ValueError: a streamed run resumed from a batch run's checkpoint.
        """
        self.gen_batches_done = state["gen_batches_done"]
        self.stream.load_state_dict(state["streams"][self.parallel.dp_rank])
        self.buffer.load_state_dict(state["buffer"])
        for g in self.buffer.surplus:  # every rank read the surplus' token lists from the checkpoint
            for s in g.samples:
                s.holder = HELD_BY_ALL
        if self.collector is not None:
            if "streaming" not in state:
                raise ValueError("rollout.streaming=true but the checkpoint was written by a batch (non-streaming) "
                                 "run; resume it with rollout.streaming=false")
            self.collector.load_state_dict(state["streaming"])
            self.prompt_queue.load_state_dict(state["prompt_queue"])

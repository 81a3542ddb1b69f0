"""The synchronous step source of a :class:`~dapo_megatron.rollout.rollout.Rollout` (docs/design.md §2.3).

:class:`SyncFeeder` fills each training step in the trainer's own time, on every rank: the step
feeder (:mod:`~dapo_megatron.rollout.sampling.feeder`) over whole generation batches
(:meth:`SyncFeeder.generate_groups`) or, with ``rollout.streaming``, over the engines' rows
(:class:`~dapo_megatron.rollout.sampling.streaming.StreamingCollector`). The other step source is
``async_training``'s :class:`~dapo_megatron.rollout.background.BackgroundDriver`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from dapo_megatron.platform import collective_device
from dapo_megatron.rollout.engines.engine import SamplingParams, completions_to_group
from dapo_megatron.rollout.plan.step_data import gather_groups, gather_preds, send_tokens
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipper
from dapo_megatron.rollout.trajectory import run_turns
from dapo_megatron.rollout.types import HELD_BY_ALL, Group


class SyncFeeder:
    """The synchronous step source (module docstring); every method is a collective.

    It reads the rollout's ``cfg``, ``parallel``, ``engine``, ``train_data``, ``stream``, ``buffer``,
    ``collector`` / ``prompt_queue`` / ``row_client`` (streamed), ``trajectory`` and
    ``routes_layout``, and owns :attr:`gen_batches_done` (generation batches drawn so far: it
    numbers the groups and seeds the sampler) and, batch mode with ``buffer.prompt_skip``, the
    :attr:`skipper` of the batches drawn from the replicated ``prompt_queue`` (:meth:`_generate_batch`).
    """

    def __init__(self, rollout: Any):
        self.rollout = rollout
        self.gen_batches_done = 0
        b = rollout.cfg.buffer
        self.skipper = (PromptSkipper(b.prompt_skip, seed=rollout.cfg.trainer.seed)
                        if b.prompt_skip.enable and not rollout.cfg.rollout.streaming else None)

    # ------------------------------------------------------------------ batch generation
    def _global_batch(self, indices: list[int]) -> list[int]:
        """The dataset indices of the whole generation batch, every DP rank's ``indices`` in DP
        order (all DP ranks read equally many); one int64 all-gather over the DP group."""
        parallel = self.rollout.parallel
        if parallel.dp_size == 1:
            return list(indices)
        mine = torch.tensor(indices, dtype=torch.int64, device=collective_device(parallel.dp_group))
        return torch.cat(parallel.all_gather(mine, "dp")).cpu().tolist()

    def generate_groups(self, batch: Sequence[int], params: SamplingParams, positions: Sequence[int]) -> list[Group]:
        """Generate ``params.n`` responses for each prompt of the generation batch (``batch``: its
        dataset indices, the same on every rank), dealt over the rollout engines
        (:func:`~dapo_megatron.rollout.engines.layout.engine_share`), and return the groups: every
        rank gets the same records, in ``batch`` order, group ``k`` numbered and seeded by its global
        position ``positions[k]`` (so no layout changes them); the token lists only where generated
        (:func:`~dapo_megatron.rollout.plan.step_data.gather_groups`)."""
        r = self.rollout
        mine = r.engine_share(len(batch))
        prompts = [r.train_data[batch[g]].prompt_ids for g in mine]
        outputs = r.engine.generate(prompts, params, [positions[g] for g in mine]) if mine else []
        r.parallel.wait_for_generation()  # ranks that generate nothing wait on gloo, not in gather_groups
        local, rows = [], []
        for g, completions in zip(mine, outputs):
            rec = r.train_data[batch[g]]
            local.append((0, g, completions_to_group(  # (0, g): ordered by global position
                -1, rec.prompt_ids, completions, prompt_index=rec.index, data_source=rec.data_source,
                ground_truth=rec.ground_truth, extra_info=rec.extra_info)))
            rows.extend((s, positions[g], j) for j, s in enumerate(local[-1][2].samples))
        # each finished row through the trajectory hook; a multi-turn one runs its next turns here
        run_turns(r.engine, rows, params, r.trajectory)
        groups = gather_groups(local, n=params.n, max_local=-(-len(batch) // r.num_engines),
                               record_of=r.train_data.__getitem__, parallel=r.parallel)
        version = r.engine.weight_version  # the same on every rank: the weights of the last sync
        for k, g in enumerate(groups):
            g.group_id = positions[k]
            for s in g.samples:
                s.group_id = g.group_id
                s.versions = [(0, version)]
        return groups

    def _generate_batch(self, drawn: Optional[Sequence[tuple[Any, int]]] = None) -> list[Group]:
        """One generation batch for the buffer: every DP rank's share of the stream's next batch in
        DP order, prompt ``g`` of batch ``b`` at position ``b * gen_batch_size + g`` (so the rollout
        depends on no layout); with the skipper, the queue's ``drawn`` ``(record, position)`` pairs
        (every rank reads the whole stream, so every rank's skipper decides alike)."""
        r = self.rollout
        if drawn is None:
            batch = self._global_batch([rec.index for rec in r.stream.next_batch()])
            first = self.gen_batches_done * r.cfg.buffer.gen_batch_size
            self.gen_batches_done += 1
            positions: Sequence[int] = range(first, first + len(batch))
        else:
            batch, positions = [rec.index for rec, _ in drawn], [pos for _, pos in drawn]
            self.gen_batches_done = r.prompt_queue.fetched
        return self.generate_groups(batch, r.train_params(), positions)

    # ------------------------------------------------------------------ the step source
    def collect(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The groups that train step ``step + 1`` (sampled by weights version ``step``) and the
        rollout's metrics: generation, grading and dynamic sampling (docs/design.md §1, steps 1-3),
        by whole generation batches (:meth:`~dapo_megatron.rollout.sampling.buffer.RolloutBuffer.collect`)
        or streamed (:meth:`~dapo_megatron.rollout.sampling.streaming.StreamingCollector.collect`)."""
        r = self.rollout
        if r.collector is None:
            groups, metrics = r.buffer.collect(self._generate_batch, policy_version=step, skipper=self.skipper,
                                               prompts=r.prompt_queue if self.skipper is not None else None)
        else:
            groups, metrics = r.collector.collect(r.row_client, r.prompt_queue, policy_version=step)
            self.gen_batches_done = r.prompt_queue.fetched
        if r.trajectory.multi_turn:  # the responses this step finished and graded (tool calls, their accuracy)
            metrics.update(r.trajectory_metrics(r.trajectory.take_counts(), "tool/"))
        return groups, metrics

    def validate(self, step: int) -> dict[str, float]:
        """:meth:`~dapo_megatron.rollout.validation.Validation.run` on this rank's engine."""
        return self.rollout.validation.run(step)

    def close(self) -> None:
        """Nothing runs between calls."""

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The rollout's part of a checkpoint (the same on every rank; rank 0's is written);
        collective. Keys: ``gen_batches_done``, ``streams`` (one prompt-stream position per DP
        rank), ``buffer`` and, streamed, ``streaming`` and ``prompt_queue``; batch mode with the
        skipper, ``skipper`` (its history) and ``prompt_queue``. Rank 0 receives the
        surplus and partial groups' token lists and the surplus' extracted answers from the
        ranks that generated them."""
        r = self.rollout
        surplus = [s for g in r.buffer.surplus for s in g.samples]
        partial = [s for g in r.collector.partial for s in g.samples] if r.collector is not None else []
        send_tokens(surplus + partial, [(0,)] * (len(surplus) + len(partial)),  # streamed partial groups too
                    parallel=r.parallel, routes=r.routes_layout)
        gather_preds(surplus, parallel=r.parallel, dst=0)
        # ranks of one DP rank read the same prompts: keep one reader position per DP rank
        by_dp = dict(r.parallel.all_gather_objects((r.parallel.dp_rank, r.stream.state_dict()), "world"))
        return {
            "gen_batches_done": self.gen_batches_done,
            "streams": [by_dp[d] for d in range(r.parallel.dp_size)],
            "buffer": r.buffer.state_dict(),
            **({"streaming": r.collector.state_dict()} if r.collector is not None else {}),
            **({"skipper": self.skipper.state_dict()} if self.skipper is not None else {}),
            **({"prompt_queue": r.prompt_queue.state_dict()} if r.collector or self.skipper else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (``state`` as read by every rank). Every rank then holds the
        surplus' token lists.

        Raises:
            ValueError: a streamed run resumed from a batch run's checkpoint, or a batch run from a
                streamed one holding partial groups; a batch run with
                ``buffer.prompt_skip`` from a checkpoint written without it.
        """
        r = self.rollout
        partial = state.get("streaming", {}).get("partial", [])
        # every refusal before any state changes: a refused checkpoint leaves this rollout as it was
        if r.collector is None and partial:  # a batch step has no partial groups to continue: they would be lost
            raise ValueError(f"rollout.streaming=false but the checkpoint was written by a streamed run holding "
                             f"{len(partial)} partial group(s) to continue; resume it with rollout.streaming=true")
        if r.collector is not None and "streaming" not in state:
            raise ValueError("rollout.streaming=true but the checkpoint was written by a batch (non-streaming) "
                             "run; resume it with rollout.streaming=false")
        if self.skipper is not None and "skipper" not in state:
            raise ValueError("buffer.prompt_skip.enable=true but the checkpoint was written without batch mode's "
                             "prompt skipping; resume it with buffer.prompt_skip.enable=false"
                             + (", or with rollout.streaming=true as it was written" if "streaming" in state else ""))
        self.gen_batches_done = state["gen_batches_done"]
        r.stream.load_state_dict(state["streams"][r.parallel.dp_rank])
        r.buffer.load_state_dict(state["buffer"])
        for g in r.buffer.surplus:  # every rank read the surplus' token lists from the checkpoint
            for s in g.samples:
                s.holder = HELD_BY_ALL
        if r.collector is not None:
            r.collector.load_state_dict(state["streaming"])
        if self.skipper is not None:
            self.skipper.load_state_dict(state["skipper"])
        if r.collector is not None or self.skipper is not None:
            r.prompt_queue.load_state_dict(state["prompt_queue"])


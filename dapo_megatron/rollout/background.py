"""The background driver of ``async_training``: the step feeder run ahead of training (docs/design.md §3.8).

A :class:`~dapo_megatron.rollout.rollout.Rollout` composes either the synchronous step source
(:class:`~dapo_megatron.rollout.sync_feeder.SyncFeeder`) or this driver
(:func:`~dapo_megatron.rollout.build.compose_rollout` chooses). On trainer rank 0 the driver owns a
:class:`~dapo_megatron.rollout.async_rollout.RolloutController`, the thread that runs the step
feeder over HTTP while the torchrun world trains; on every rank it is the trainer's seam
(:class:`BackgroundDriver`'s methods, each a collective).

The controller reads every DP rank's share of each generation batch, in DP order, from streams of
its own (the batch synchronous server mode assembles with an all-gather), so the prompts, seeds and
group numbers are those of synchronous server mode at any layout. With ``rollout.streaming`` or
``buffer.prompt_skip`` it reads the synchronous modes' one stream through a
:class:`~dapo_megatron.rollout.sampling.feeder.PromptQueue` instead (keep-rate or whole-batch
admission, GRESO skipping); the skipper's history, the keep rate and the queue are in
:meth:`BackgroundDriver.state_dict`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

from dapo_megatron.data import PromptStream
from dapo_megatron.rollout.async_rollout import RolloutController
from dapo_megatron.rollout.steps_ahead import check_admission
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipper
from dapo_megatron.rollout.types import Group


def strip_tokens(groups: Sequence[Group]) -> list[Group]:
    """Copies of ``groups`` whose samples carry no token lists (``response_ids`` /
    ``rollout_logprobs`` / ``response_mask`` None, the length in ``num_response_tokens``, the
    context tokens' count in ``num_context_tokens``) nor extracted answer:
    the records every rank holds of a response another rank holds."""
    return [Group(g.group_id, [dataclasses.replace(s, response_ids=None, rollout_logprobs=None, response_mask=None,
                                                   routes=None, pred=None, num_response_tokens=s.response_length)
                               for s in g.samples],
                  g.prompt_seed) for g in groups]


class BackgroundDriver:
    """The step source of ``async_training`` (module docstring), on every rank.

    Args:
        rollout: the :class:`~dapo_megatron.rollout.rollout.Rollout` it drives for (its ``cfg``,
            ``parallel``, ``engine`` (the servers' client: ``set_members``, ``eos_token_ids``,
            ``record_routes``), ``train_data``, ``stream``, ``prompt_queue``, ``buffer`` (its type
            and config), ``reward_pool``, ``decode``, ``trajectory``, ``validation`` and
            ``train_params()``).
        sync_every: ``async_training.trigger_parameter_sync_step``, >= 1.
        partial_rollout: ``rollout.partial_rollout`` (default true here): a sync aborts the rows in
            flight, which continue after it; false: it waits for the request in flight to finish.
    """

    def __init__(self, rollout: Any, *, sync_every: int, partial_rollout: bool):
        cfg, parallel = rollout.cfg, rollout.parallel
        self.rollout, self.parallel = rollout, parallel
        self.sync_every, self.partial_rollout = sync_every, partial_rollout
        self.controller: Optional[RolloutController] = None
        self.streams: list = []
        self.started = False
        self._last_collect: Optional[float] = None
        self._idle_before = 0.0
        self._sync_pause_s = 0.0
        if parallel.rank != 0:
            return
        b, d = cfg.buffer, cfg.data
        skipper = None
        if rollout.prompt_queue is not None:  # streamed or skipping: the synchronous modes' one stream and queue
            self.streams = [rollout.stream]
            skipper = PromptSkipper(b.prompt_skip, seed=cfg.trainer.seed)
        else:
            dp = parallel.dp_size
            self.streams = [PromptStream(rollout.train_data, b.gen_batch_size // dp, r, dp, seed=d.seed,
                                         shuffle=d.shuffle) for r in range(dp)]

        def next_batch():
            return [rec for st in self.streams for rec in st.next_batch()]

        # grades from the controller thread with the reward pool itself (no collective): nothing
        # else grades while it runs (validation pauses it)
        selector = type(rollout.buffer)(b, rollout.reward_pool, rollout.decode)
        engine = rollout.engine
        self.controller = RolloutController(selector, next_batch, cfg.rollout.server_urls, rollout.train_params(),
                                            silence_timeout_s=cfg.rollout.server_silence_timeout_s,
                                            eos_token_ids=getattr(engine, "eos_token_ids", ()),
                                            health_timeout_s=cfg.rollout.server_timeout_s, version=0,
                                            policy_version=0, prompts=rollout.prompt_queue, skipper=skipper,
                                            trajectory=rollout.trajectory,
                                            routes_shape=getattr(engine, "record_routes", None),
                                            streamed=cfg.rollout.streaming)

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank, over the gloo generation-wait group: ranks 1..N wait here
        while rank 0's controller generates (a step, validation, the pause before a checkpoint),
        which may take longer than ``parallel.distributed_timeout_minutes``."""
        return self.parallel.broadcast_object(obj, "wait", src=0)

    def _start(self, version: int) -> None:
        if self.started:
            return
        self.started = True
        if self.controller is not None:
            self.controller.version = version
            self.controller.start()

    def collect(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The oldest ready step, for policy version ``step``, on every rank (collective).

        Metrics: those of synchronous mode (:meth:`RolloutBuffer.collect`), plus
        ``time/wait_rollout_s`` (the trainer waited for the rollout), ``trainer/idle_ratio``
        (that wait over the wall time since the previous collect returned, i.e. one step),
        ``rollouter/idle_ratio`` (the controller's time with nothing it was allowed to start,
        over the same wall time) and ``time/sync_pause_s`` (the last sync's wait for the batch
        in flight)."""
        self._start(step)
        payload = None
        if self.controller is not None:
            now = time.perf_counter()
            try:
                groups, metrics = self.controller.take(step)
            except RuntimeError as err:
                payload = err
            else:
                end = time.perf_counter()
                wall = end - (self._last_collect if self._last_collect is not None else now)
                idle = self.controller.idle_s - self._idle_before
                self._last_collect, self._idle_before = end, self.controller.idle_s
                if wall > 0:
                    metrics["trainer/idle_ratio"] = metrics["time/wait_rollout_s"] / wall
                    metrics["rollouter/idle_ratio"] = min(1.0, idle / wall)
                metrics["time/sync_pause_s"] = self._sync_pause_s
                payload = (strip_tokens(groups), metrics)
        payload = self._broadcast(payload)
        if isinstance(payload, BaseException):
            raise RuntimeError(str(payload))
        if self.controller is not None:
            return groups, metrics
        return payload

    def sync_weights(self, actor: Any, version: int, push: Callable[[Any, int], float]) -> float:
        """The weight sync of version ``version`` (``push(actor, version)``: the rollout's own sync
        into the servers) when it is due (start, or ``version`` a multiple of ``sync_every``), with
        the controller paused on rank 0; 0.0 bytes when not due (the servers keep their weights).

        It goes to the servers that answer ``/health`` now (rank 0's controller's
        :meth:`RowClient.members_for_sync <dapo_megatron.rollout.engines.row_client.RowClient.members_for_sync>`,
        broadcast): a failed server is left out, and one that is back is in it and gets work only after it
        (:meth:`~dapo_megatron.rollout.engines.server_sync.ServerRollout.set_members` re-forms the
        weight-update groups when the set changes).

        Raises:
            RuntimeError: on every rank, no server answers ``/health`` (each named), or a
                server failed during the sync (:func:`~dapo_megatron.bridge.servers.sync_servers`
                names it); the run stops and resumes from its last checkpoint.
        """
        if self.started and version % self.sync_every:
            return 0.0
        members = self.controller.client.members_for_sync() if self.controller is not None else None
        if members is not None and not members:
            members = ("no rollout server answers /health for the weight sync of version "
                       f"{version}: " + "; ".join(f"{u}: {e}" for u, e in zip(self.controller.urls,
                                                                            self.controller.client.server_errors)))
        members = self._broadcast(members)
        if isinstance(members, str):
            raise RuntimeError(members)
        self.rollout.engine.set_members(members)
        # partial rollouts: the sync's /pause_generation aborts the rows in flight, which continue
        # after it; else wait for the batch in flight to finish first
        ctrl = self.controller
        self._sync_pause_s = ctrl.pause(wait=not self.partial_rollout) if ctrl is not None else 0.0
        self.parallel.wait_for_generation()  # rank 0 waited for the batch in flight: the others on gloo
        ok = False
        try:
            nbytes = push(actor, version)
            ok = True
        finally:
            if self.controller is not None:
                self.controller.resume(version if ok else None, members if ok else None)
        return nbytes

    def validate(self, step: int) -> dict[str, float]:
        """:meth:`~dapo_megatron.rollout.validation.Validation.run`'s metrics, generated by rank 0's
        controller (collective).

        With the controller paused (after the batch in flight: every request on the weights of
        the last sync, and nothing else grades), rank 0 generates the validation problems
        (:meth:`RolloutController.generate_validation`), grades them with its reward pool and
        broadcasts the metrics: every rank returns the same dict, equal to synchronous server
        mode's at the same weights and step, whichever servers are down.

        Raises:
            RuntimeError: on every rank, no healthy server is left (every server named).
        """
        val = self.rollout.validation

        def metrics():
            problems, params = val.problems(), val.params(step)
            outputs = self.controller.generate_validation([rec.prompt_ids for rec in problems], params)
            graded = val.grade(problems, enumerate(outputs))
            out = val.metrics(problems, graded)
            trajectory = self.controller.trajectory  # the one that ran the turns
            if trajectory.multi_turn:  # the tool turns of validation (rank 0 generated every response)
                samples = [s for comps in outputs for s in comps]
                for s, acc in zip(samples, [a for i in range(len(outputs)) for a in graded.get(i, [])]):
                    s.acc = bool(acc)
                out.update(trajectory.metrics(trajectory.take_counts(samples), "val/tool/"))
            return out

        return self._paused_on_rank_0(metrics, share=True)

    def _paused_on_rank_0(self, compute: Callable[[], Any], *, share: bool) -> Any:
        """``compute()`` on rank 0 with its controller paused (nothing in flight; resumed after,
        whatever happens), on every rank a collective: ``share``: every rank returns rank 0's
        result (a broadcast); else rank 0 returns it and the others None, and only the outcome
        is broadcast. Any exception of ``compute`` (a grader's ValueError too) is raised on every
        rank as ``RuntimeError`` (its type named unless it was one), so no rank waits in a later
        collective for a rank 0 that failed."""
        result, error = None, None
        if self.controller is not None:
            self.controller.pause()
            try:
                result = compute()
            except Exception as err:
                error = str(err) if isinstance(err, RuntimeError) else f"{type(err).__name__}: {err}"
            finally:
                self.controller.resume()
        shared, error = self._broadcast((result if share else None, error))
        if error is not None:
            raise RuntimeError(error)
        return shared if share else result

    def close(self) -> None:
        """Stop rank 0's controller thread (after its current request) and its HTTP client."""
        if self.controller is not None:
            self.controller.stop()

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's controller state (``async_rollout``) and its prompt streams (``streams``),
        taken paused; the batch counter as ``gen_batches_done``. Other ranks return ``{}``
        (rank 0 writes the trainer state). A collective (the checkpointer calls it on every rank
        before it writes anything).

        Raises:
            RuntimeError: on every rank, rank 0 could not take the state (the controller failed:
                :meth:`RolloutController.state_dict`), so no checkpoint is written.
        """
        state = self._paused_on_rank_0(lambda: {"gen_batches_done": self.controller.steps.gen_batches_done,
                                                "streams": [st.state_dict() for st in self.streams],
                                                "async_rollout": self.controller.state_dict()}, share=False)
        return state if state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` on rank 0 (before the first :meth:`collect`).

        Raises:
            ValueError: on every rank, the checkpoint was written by a synchronous run, or by the
                other admission (:func:`~dapo_megatron.rollout.steps_ahead.check_admission`).
        """
        if "async_rollout" not in state:
            raise ValueError("async_training.enable=true but the checkpoint was written by a synchronous run; "
                             "resume it with async_training.enable=false")
        check_admission(state["async_rollout"], streamed=self.rollout.cfg.rollout.streaming,
                        queue=self.rollout.prompt_queue is not None)
        if self.controller is None:
            return
        self.controller.load_state_dict(state["async_rollout"])  # first: it refuses the other admission's state
        for st, s in zip(self.streams, state["streams"]):
            st.load_state_dict(s)

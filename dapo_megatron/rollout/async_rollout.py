"""Asynchronous rollout on separate servers (``async_training.enable``): the rollout thread of
trainer rank 0, :class:`RolloutController`.

It keeps the servers generating while the torchrun world trains, filling the training steps one
after the other with synchronous server mode's rule (the step feeder run ahead,
:class:`~dapo_megatron.rollout.steps_ahead.StepsAhead`, gated by η = ``buffer.max_staleness`` at
admission; its requests: :mod:`~dapo_megatron.rollout.async_requests`), finished steps queued
oldest first. It speaks HTTP to the servers (the row client,
:class:`~dapo_megatron.rollout.engines.row_client.RowClient`, whose module docstring says how a
server goes down and comes back) and calls the reward pool, and NEVER ``torch.distributed``, so it
cannot race the training collectives of the main thread. The trainer's side, on every rank, is
:class:`~dapo_megatron.rollout.background.BackgroundDriver`.

Design: docs/design.md §3.8 (the controller, staleness, the weight syncs, faults).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence


from dapo_megatron.rollout.async_requests import server_groups, validation_rows
from dapo_megatron.rollout.engines.engine import Completion, SamplingParams
from dapo_megatron.rollout.engines.row_client import RowClient
from dapo_megatron.rollout.sampling.buffer import GroupSelector
from dapo_megatron.rollout.sampling.feeder import PromptQueue
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipper
from dapo_megatron.rollout.steps_ahead import StepsAhead
from dapo_megatron.rollout.trajectory import SINGLE_TURN, Trajectory
from dapo_megatron.rollout.types import Group


logger = logging.getLogger("dapo_megatron.rollout.async")


class _Stopped(Exception):
    """The controller was stopped while rows waited for a weight sync to end."""


class RolloutController:
    """The rollout thread of trainer rank 0 (module docstring). HTTP and the reward pool only.

    Args:
        selector, next_batch, policy_version, gen_batches_done, prompts, skipper, streamed: the steps it
            fills ahead and how it admits their prompts, gated by η
            (:class:`~dapo_megatron.rollout.steps_ahead.StepsAhead`'s arguments: the selector,
            whose reward pool this thread uses, so nothing else may grade while it runs (:meth:`pause`);
            the next generation batch in synchronous mode's order; streamed or skipping: the prompt
            queue, GRESO's skipper, ``streamed``).
        urls: the servers (health: the module docstring).
        params: sampling parameters (``n = buffer.n``, seed ``trainer.seed``).
        silence_timeout_s, health_timeout_s, eos_token_ids: the row client's ``silence_timeout_s``,
            ``timeout_s`` and ``eos_token_ids`` (:class:`~dapo_megatron.rollout.engines.row_client.RowClient`).
        version: the weights the servers hold now (the trainer's step).
        generate: ``(rows, version) -> results`` of :meth:`RowClient.generate_rows
            <dapo_megatron.rollout.engines.row_client.RowClient.generate_rows>`; default:
            that function over ``urls``.
        trajectory: the hook that settles each finished row (:mod:`~dapo_megatron.rollout.trajectory`;
            default single-turn); a sample it continues is sent again in the next dispatch round,
            as prompt + its response so far (not counted as a resubmission after a sync).
        routes_shape: routing replay, ``(L, K, E)`` of the model: every row asks for its routes
            (a row continued after a sync from where its sample's end: SGLang's
            ``routed_experts_start_len``, :func:`~dapo_megatron.rollout.engines.routes.routes_start_of`),
            kept on the sample per position (:meth:`~dapo_megatron.rollout.types.Sample.append_tokens`);
            None: off.
    """

    def __init__(self, selector: GroupSelector, next_batch: Callable[[], Sequence[Any]], urls: Sequence[str],
                 params: SamplingParams, *, silence_timeout_s: float, version: int, policy_version: int,
                 gen_batches_done: int = 0, generate: Optional[Callable] = None, health_timeout_s: float = 60.0,
                 prompts: Optional[PromptQueue] = None, skipper: Optional[PromptSkipper] = None,
                 eos_token_ids: Sequence[int] = (), trajectory: Trajectory = SINGLE_TURN,
                 routes_shape: Optional[tuple[int, int, int]] = None, streamed: bool = True):
        self.selector, self.trajectory = selector, trajectory
        # the step feeder run ahead: its admission, the step being filled, the ready steps
        self.steps = StepsAhead(selector, next_batch, policy_version=int(policy_version),
                                gen_batches_done=gen_batches_done, prompts=prompts, skipper=skipper,
                                trajectory=trajectory, streamed=streamed)
        self.urls = list(urls)
        self.params = params
        # the HTTP row client: dispatch over the healthy servers, mark-down and retry, and their health
        self.client = RowClient(self.urls, silence_timeout_s=float(silence_timeout_s),
                                timeout_s=float(health_timeout_s), eos_token_ids=tuple(int(t) for t in eos_token_ids),
                                on_down=self._count_failure, routes_shape=routes_shape)
        self.routes_shape = self.client.routes_shape
        self._generate = generate or self.client.generate_rows
        self.version = int(version)
        self._cv = threading.Condition()
        self._paused = 0
        self._holds: list[bool] = []  # per pause() in force: True for one that does not wait (a sync's)
        self._busy = False
        self._stop = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self.idle_s = 0.0  # time the thread waited for admission (nothing it was allowed to generate)
        self.busy_s = 0.0  # time it spent generating and grading

    # ---- control (main thread) -------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-controller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread after its current batch; idempotent."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.client.close()

    def pause(self, wait: bool = True) -> float:
        """Stop starting new batches and continuing aborted rows until :meth:`resume`; nestable.
        ``wait``: also wait for the batch in flight (its generation and grading); else the
        caller aborts it on the servers (a weight sync's ``/pause_generation``) and its rows
        continue after :meth:`resume`. Returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cv:
            self._paused += 1
            self._holds.append(not wait)
            while wait and self._busy:
                self._cv.wait()
        return time.perf_counter() - t0

    def resume(self, version: Optional[int] = None, synced: Optional[Sequence[int]] = None) -> None:
        """Undo the last :meth:`pause`; ``version``: the weights the servers hold now;
        ``synced``: the servers a sync just put them into (they turn ``"healthy"``)."""
        with self._cv:
            if version is not None:
                self.version = int(version)
            self.client.mark_synced(synced or (), version)
            self._paused = max(0, self._paused - 1)
            if self._holds:
                self._holds.pop()
            self._cv.notify_all()

    # ---- server health (the client's: health, server_errors, members_for_sync) ------------
    def _count_failure(self, e: int) -> None:
        """Server ``e`` went down (the client's ``on_down``): counted for the step being filled."""
        with self._cv:
            self.steps.fill.server_failures += 1

    def take(self, policy_version: int, timeout_s: Optional[float] = None) -> tuple[list[Group], dict]:
        """The oldest ready step (it must be the step of ``policy_version``): its groups and its
        metrics, those of :meth:`RolloutBuffer.collect`, plus ``time/wait_rollout_s``.

        Raises:
            RuntimeError: the controller failed (the cause chained), the step hit the cap
                with ``on_cap="error"`` (synchronous mode's message), or it has no step for
                ``policy_version`` (a state that does not match the trainer's).
        """
        t0 = time.perf_counter()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while not self.steps.ready and self._error is None:
                if self.steps.fill.version > policy_version:  # that step will never come: fail, do not wait
                    raise RuntimeError(f"the rollout controller has no step for policy version {policy_version} (it "
                                       f"fills version {self.steps.fill.version}): its state does not match the "
                                       "trainer's")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError(f"the rollout controller produced no step in {timeout_s} s")
                self._cv.wait(left)
            if not self.steps.ready:
                raise RuntimeError(f"the rollout controller stopped: {self._error}") from self._error
            version, groups, metrics = self.steps.ready.popleft()
            self._cv.notify_all()
        if isinstance(groups, BaseException):
            raise groups
        if version != policy_version:
            raise RuntimeError(f"the rollout controller's next step is for policy version {version}, the trainer is at "
                               f"{policy_version}")
        metrics = dict(metrics)
        metrics["time/wait_rollout_s"] = time.perf_counter() - t0
        return groups, metrics

    # ---- state (paused) --------------------------------------------------------------
    def state_dict(self) -> dict:
        """:meth:`StepsAhead.state_dict <dapo_megatron.rollout.steps_ahead.StepsAhead.state_dict>` (the
        ready steps, the step being filled, the batch counter, streamed: the admission's state); call
        it paused.

        Raises:
            RuntimeError: not paused, or the controller failed (its last request's prompts were drawn
                and never offered: a state saved now would skip them on resume).
        """
        with self._cv:
            if not self._paused or self._busy:  # a waiting pause(): nothing in flight
                raise RuntimeError("RolloutController.state_dict needs the controller paused (pause())")
            failed = self._error or next((gs for _, gs, _ in self.steps.ready if isinstance(gs, BaseException)), None)
            if failed is not None:
                raise RuntimeError(f"the rollout controller failed ({failed}); its state is not saved (the prompts "
                                   "of its last request would be lost): fix the cause and resume from the last "
                                   "checkpoint") from failed
            return self.steps.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` before :meth:`start` (:meth:`StepsAhead.load_state_dict
        <dapo_megatron.rollout.steps_ahead.StepsAhead.load_state_dict>`: what is now too stale is
        evicted; ``ValueError`` for the other admission's state)."""
        self.steps.load_state_dict(state)

    # ---- the thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    t0 = time.perf_counter()
                    while not self._stop and (self._paused or not (self.steps.done() or
                                                                   self.steps.admits(self.version))):
                        self._cv.wait()
                    self.idle_s += time.perf_counter() - t0
                    if self._stop:
                        return
                    if self.steps.done():
                        self._close_step()
                        self._cv.notify_all()
                        continue
                    self._busy = True
                    version = self.version
                    records, positions = self.steps.admit()
                t0 = time.perf_counter()
                graded = None
                try:
                    groups, resubmitted, reprefilled, retried = self._generate_batch(records, positions, version)
                    self.steps.feeder.grade(groups)
                    graded = groups
                finally:
                    with self._cv:
                        self.busy_s += time.perf_counter() - t0
                        if graded is not None:  # in the same critical section as _busy = False: a
                            # pause() returning in between would see the prompts drawn but not their groups
                            self.steps.add(graded, resubmitted=resubmitted, reprefilled=reprefilled, retried=retried)
                        self._busy = False
                        self._cv.notify_all()
        except _Stopped:
            return
        except BaseException as err:  # surfaced by take() on the main thread
            logger.error("rollout controller failed: %s", err)
            with self._cv:
                self._error = err
                self._busy = False
                self._cv.notify_all()

    def _dispatch(self, pending: list, request: Callable[[Any], tuple[int, list[int], dict]],
                  accept: Callable[[Any, tuple], bool], version: int, stoppable: bool = True) -> int:
        """:meth:`RowClient.dispatch <dapo_megatron.rollout.engines.row_client.RowClient.dispatch>`
        through ``self._generate``, for the rollout (:meth:`_generate_batch`) and validation
        (:meth:`generate_validation`): between rounds it waits while a sync holds the servers
        (:meth:`pause` without wait), then generates with the version the sync left.
        ``stoppable``: raise ``_Stopped`` at :meth:`stop` between rounds (the thread's rows;
        validation, from the main thread, finishes its rows on a controller that stopped itself)."""
        def between_rounds() -> int:  # wait out a sync (its abort): continue on the new weights
            with self._cv:
                while any(self._holds) and not self._stop:
                    self._cv.wait()
                if self._stop and stoppable:
                    raise _Stopped()
                return self.version

        return self.client.dispatch(pending, request, accept, version, between_rounds=between_rounds,
                                    generate=self._generate)

    def _generate_batch(self, records, positions: Sequence[int], version: int) -> tuple[list[Group], int, int, int]:
        """:func:`~dapo_megatron.rollout.async_requests.server_groups` of the request (records and
        their positions), through :meth:`_dispatch`: ``(groups, rows resubmitted after a sync, prefix
        tokens re-prefilled, rows retried after their server failed)``."""
        return server_groups(records, positions, version, params=self.params, trajectory=self.trajectory,
                             routes_shape=self.routes_shape, dispatch=self._dispatch)

    def generate_validation(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Validation's responses on the healthy servers (:func:`~dapo_megatron.rollout.async_requests.validation_rows`:
        synchronous server-mode validation's rows and seeds), from the main thread with the controller
        paused (:meth:`pause` with wait: nothing in flight, every request on the weights of the last
        sync); HTTP only, no collective. A server that fails or sends no byte for ``silence_timeout_s``
        is marked down as in the rollout (:meth:`_dispatch`): its rows go to the servers still healthy.

        Raises:
            RuntimeError: the controller is not paused, no healthy server is left (every server
                named), or a row came back aborted (something paused the servers).
        """
        with self._cv:
            if not self._paused or self._busy:
                raise RuntimeError("RolloutController.generate_validation needs the controller paused (pause())")
            version = self.version
        out, retried = validation_rows(prompts, params, version, trajectory=self.trajectory,
                                       dispatch=lambda *args: self._dispatch(*args, stoppable=False))
        if retried:
            logger.warning("validation: %d rows sent again after their server failed", retried)
        return out

    def _close_step(self) -> None:
        """Hand the filled step to the ready queue and open the next (:meth:`StepsAhead.close
        <dapo_megatron.rollout.steps_ahead.StepsAhead.close>`); a step that failed at its cap stops
        the thread (call under the lock)."""
        if not self.steps.close(healthy_servers=sum(h == "healthy" for h in self.client.health)):
            self._stop = True

"""Asynchronous rollout on separate servers (``async_training.enable``; docs/design.md §3.8).

Two pieces:

* :class:`RolloutController`, on trainer rank 0 only: a thread that keeps the servers
  generating while the torchrun world trains. It speaks HTTP to the servers and calls the
  reward pool, and NEVER ``torch.distributed``, so it cannot race the training collectives
  of the main thread. It fills the training steps one after the other with exactly the rule
  of synchronous server mode (:meth:`~dapo_megatron.rollout.sampling.buffer.RolloutBuffer.collect`):
  carried surplus first (dropped when more than η = ``buffer.max_staleness`` versions behind
  the step's policy), then whole generation batches (``buffer.gen_batch_size`` prompts, the
  same stream, seeds and group numbering as synchronous mode, dealt round-robin over the
  servers), graded and kept by the same :class:`RolloutBuffer`, until ``train_batch_size``
  groups are kept or ``max_num_gen_batches`` batches were generated for the step; the
  finished step goes to a ready queue, oldest first. With ``rollout.streaming`` it admits
  keep-rate-sized requests of the prompts that GRESO skipping (``buffer.prompt_skip``) lets
  through instead of whole batches (synchronous streamed mode's sizing and skipper; the
  class docstring).
* :class:`AsyncRollout`, on every rank: the trainer's seam (``collect(step)``,
  ``sync_weights``, ``pause``, ``state_dict``). Rank 0 takes the oldest ready step
  (``time/wait_rollout_s``) and broadcasts its records (lengths, grades, versions; no token
  lists) to the other ranks, which then receive each sample's tokens in the step's plan
  exactly as in synchronous server mode (:func:`~dapo_megatron.rollout.plan.step_data.send_tokens`,
  from holder rank 0).

Staleness (η = ``buffer.max_staleness``, integer weight versions; version ``k`` is the actor
after ``k`` steps, and step ``p + 1`` trains policy version ``p``). The bound is enforced at
*admission*: a generation batch for the step of policy version ``p`` starts only when the
servers hold version ``v >= p - η``, so every token of a kept group is at most η versions
behind the actor that trains on it; only surplus carried past its step can exceed it, and it
is dropped and counted (``rollout/dropped_stale``), as in synchronous mode. With η = 0 the
controller starts the batches of step ``p + 1`` only after the sync of version ``p``: the
same requests as synchronous server mode in the same order, hence the same samples, bit for
bit (batch admission; streamed admission sends one keep-rate-sized request at a time, which
synchronous streamed mode's rounds do not). The weights are pushed every ``async_training.trigger_parameter_sync_step`` steps; a
sync waits for the batch in flight to finish (its tokens then carry one version), pauses
the controller, syncs, and hands it the new version.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence


from dapo_megatron.rollout.engines.engine import Completion, SamplingParams, completions_to_group, sample_seed
from dapo_megatron.rollout.engines.routes import routes_start_of
from dapo_megatron.rollout.engines.row_client import RowClient
from dapo_megatron.rollout.engines.sglang_io import build_sampling_params
from dapo_megatron.rollout.sampling.buffer import GroupSelector, group_from_dict, group_staleness, group_to_dict
from dapo_megatron.rollout.sampling.feeder import (EtaBound, KeepRate, KeepRateStreaming, PromptQueue, StepFeeder,
                                                  WholeBatches)
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig, PromptSkipper
from dapo_megatron.rollout.trajectory import SINGLE_TURN, Trajectory, settle_row
from dapo_megatron.rollout.types import Group, Sample


logger = logging.getLogger("dapo_megatron.rollout.async")


class _Stopped(Exception):
    """The controller was stopped while rows waited for a weight sync to end."""


_EMPTY = Completion([], [], "")


class _Fill:
    """The step being filled: the selector's step (``GroupSelector.begin`` .. ``take``) of policy
    version ``version``, and what the controller counts for it."""

    def __init__(self, version: int):
        self.version = version
        self.resubmitted = self.reprefilled = 0  # partial rows continued after a sync, their prefix tokens
        self.retried = self.server_failures = 0  # rows sent again after their server failed; servers that did
        self.evicted = 0  # carried groups a resume found more than η versions behind (load_state_dict)

    def state_dict(self, feeder: StepFeeder) -> dict:
        """This step's counts with the admission's (``num_batches``, ``submitted``, ``skipped``) and
        the selector's tally of it (``GroupSelector.step_state_dict``)."""
        c, selector = feeder.admission.counts(), feeder.selector
        return {"version": self.version, "num_batches": c["num_batches"], "resubmitted": self.resubmitted,
                "reprefilled": self.reprefilled, "retried": self.retried, "server_failures": self.server_failures,
                "evicted": self.evicted, "submitted": c["submitted"], "skipped": c["skipped"],
                "surplus": selector.state_dict(), **selector.step_state_dict()}

    @classmethod
    def load(cls, d: dict, feeder: StepFeeder) -> "_Fill":
        """The inverse of :meth:`state_dict`: the admission's counts restored and the selector's
        step reopened with its tally (an open step has no surplus: ``begin`` took it in)."""
        f = cls(int(d["version"]))
        f.resubmitted, f.reprefilled = int(d["resubmitted"]), int(d["reprefilled"])
        f.retried, f.server_failures = int(d.get("retried", 0)), int(d.get("server_failures", 0))
        f.evicted = int(d.get("evicted", 0))
        feeder.admission.load_counts({"num_batches": int(d["num_batches"]), "submitted": d.get("submitted", 0),
                                      "skipped": d.get("skipped", 0)})
        feeder.selector.load_state_dict({"surplus": []})
        feeder.selector.load_step_state(f.version, d)
        return f


class RolloutController:
    """The rollout thread of trainer rank 0 (module docstring). HTTP and the reward pool only.

    Args:
        selector: synchronous mode's dynamic-sampling selector (grading, the keep rule, the
            step's tally, the surplus; its reward pool is used from this thread: nothing else may
            grade while the controller runs, see :meth:`pause`) and the batch sizes.
        next_batch: the next generation batch of dataset records, in the order synchronous mode
            deals them (every DP rank's share, DP rank order).
        urls: the servers.
        params: sampling parameters (``n = buffer.n``, seed ``trainer.seed``).
        silence_timeout_s: bound on a server's silence during a streamed ``/generate``
            (``rollout.server_silence_timeout_s``): a server that sends no byte for that long fails,
            as one that is unreachable does; no bound on a request's total time.
        health_timeout_s: bound on one ``/health`` probe and on opening a connection
            (``rollout.server_timeout_s``).
        eos_token_ids: the model's stop tokens (an aborted row that ends on one has finished:
            :func:`~dapo_megatron.rollout.engines.sglang_io.parse_versioned_row`).
        version: the weights the servers hold now (the trainer's step).
        policy_version: the policy version of the first step to fill (the trainer's step).
        gen_batches_done: generation batches drawn so far (numbers groups, seeds responses).
        generate: ``(rows, version) -> results`` of :meth:`RowClient.generate_rows
            <dapo_megatron.rollout.engines.row_client.RowClient.generate_rows>`; default:
            that function over ``urls``.
        prompts: streamed admission (``rollout.streaming``): the prompt queue of synchronous
            streamed mode (whole stream, positions ``fetched * gen_batch_size + i``); None: batch
            admission from ``next_batch``.
        skipper: with ``prompts``, GRESO prompt skipping (``buffer.prompt_skip``; a disabled one
            never skips); default a disabled one.
        trajectory: the hook that settles each finished row (:mod:`~dapo_megatron.rollout.trajectory`;
            default single-turn); a sample it continues is sent again in the next dispatch round,
            as prompt + its response so far (not counted as a resubmission after a sync).
        routes_shape: routing replay, ``(L, K, E)`` of the model: every row asks for its routes
            (a row continued after a sync from where its sample's end: SGLang's
            ``routed_experts_start_len``, :func:`~dapo_megatron.rollout.engines.routes.routes_start_of`),
            kept on the sample per position (:meth:`~dapo_megatron.rollout.types.Sample.append_tokens`);
            None: off.

    Admission of new prompts, for the step being filled (``_admit``):

    * batch (``prompts`` None): whole generation batches from ``next_batch``, group ``g`` of
      batch ``b`` at position ``b * gen_batch_size + g`` (its seed and group number), until
      ``train_batch_size`` groups are kept or ``max_num_gen_batches`` batches were generated;
    * streamed: each request is the next ``KeepRate.admission(missing, gen_batch_size, cap -
      submitted)`` prompts that the skipper does not skip (cap = ``max_num_gen_batches *
      gen_batch_size`` prompts per step; synchronous streamed mode's sizing, with nothing in
      flight since a request is generated and graded before the next), until ``train_batch_size``
      groups are kept or the cap; every graded group updates the skipper's history (zero
      variance on ``buffer.filter_metric``) and the keep rate, which halves at every step. The
      same selector keeps the groups in both.

    Server health (every state change under the lock; :attr:`health` per server):
    ``"healthy"`` servers get the rows, dealt round-robin over them; a server whose
    ``/generate`` fails (unreachable, reset, an HTTP error, or no byte for
    ``silence_timeout_s``) or whose ``/health`` probe fails before a sync becomes ``"down"``:
    it leaves dispatch at once and its rows (the prefix they had before that request, their
    own seed) go to the healthy servers in the next round; the trainer's weight syncs leave it
    out (:meth:`members_for_sync`). A down server that answers ``/health`` again is
    ``"back"``: it is in the next sync, and only once that sync has put the current weights
    into it does it turn ``"healthy"`` and get work (:meth:`resume`). With no healthy server
    left the controller fails, naming every server and its error.
    """

    def __init__(self, selector: GroupSelector, next_batch: Callable[[], Sequence[Any]], urls: Sequence[str],
                 params: SamplingParams, *, silence_timeout_s: float, version: int, policy_version: int,
                 gen_batches_done: int = 0, generate: Optional[Callable] = None, health_timeout_s: float = 60.0,
                 prompts: Optional[PromptQueue] = None, skipper: Optional[PromptSkipper] = None,
                 eos_token_ids: Sequence[int] = (), trajectory: Trajectory = SINGLE_TURN,
                 routes_shape: Optional[tuple[int, int, int]] = None):
        self.selector, self.cfg = selector, selector.config
        self.trajectory = trajectory
        self.next_batch = next_batch
        self.prompts = prompts
        if prompts is not None and prompts.batch_size != self.cfg.gen_batch_size:
            raise ValueError(f"the prompt queue's batch_size={prompts.batch_size} must be buffer.gen_batch_size="
                             f"{self.cfg.gen_batch_size} (it numbers the prompts)")
        if skipper is None:
            skipper = PromptSkipper(PromptSkipConfig(enable=False))
        self.skipper, self.keep_rate = skipper, KeepRate()
        # the step feeder: the selector with this controller's admission (streamed: synchronous streamed
        # mode's keep-rate sizing and skipper; batch: whole generation batches), gated by η (_admits)
        admission = (KeepRateStreaming(self.cfg, prompts, skipper, self.keep_rate) if prompts is not None
                     else WholeBatches(self.cfg, self._draw_batch))
        self.feeder = StepFeeder(selector, admission)
        self.eta = EtaBound(self.cfg.max_staleness)
        self.urls = list(urls)
        self.params = params
        self.silence_timeout_s = float(silence_timeout_s)
        self.health_timeout_s = float(health_timeout_s)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        # the HTTP row client: dispatch over the healthy servers, mark-down and retry, and their health
        self.client = RowClient(self.urls, silence_timeout_s=self.silence_timeout_s, timeout_s=self.health_timeout_s,
                                eos_token_ids=self.eos_token_ids, on_down=self._count_failure,
                                routes_shape=routes_shape)
        self.routes_shape = self.client.routes_shape
        self._generate = generate or self.client.generate_rows
        self.gen_batches_done = int(gen_batches_done)
        self.version = int(version)
        self._fill = _Fill(int(policy_version))
        self.feeder.begin(self._fill.version)
        self._ready: deque = deque()  # (policy version, groups, metrics) or (version, RuntimeError, None)
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

    # ---- server health ------------------------------------------------------------------
    @property
    def health(self) -> list[str]:
        """Per server ``"healthy"``, ``"down"`` or ``"back"`` (:attr:`RowClient.health
        <dapo_megatron.rollout.engines.row_client.RowClient.health>`)."""
        return self.client.health

    @property
    def server_errors(self) -> list[Optional[str]]:
        """Per server its last failure (None: none)."""
        return self.client.server_errors

    def _count_failure(self, e: int) -> None:
        """Server ``e`` went down (the client's ``on_down``): counted for the step being filled."""
        with self._cv:
            self._fill.server_failures += 1

    def members_for_sync(self) -> list[int]:
        """The servers the next weight sync goes to (:meth:`RowClient.members_for_sync
        <dapo_megatron.rollout.engines.row_client.RowClient.members_for_sync>`: ``GET /health`` of
        every server, ``health_timeout_s`` each; HTTP only, from the main thread): a healthy server
        that fails it goes down; a down one that answers is back (synced, then dispatched:
        :meth:`resume`). Returns their indices (ascending), possibly none."""
        return self.client.members_for_sync()

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
            while not self._ready and self._error is None:
                if self._fill.version > policy_version:  # that step will never come: fail, do not wait
                    raise RuntimeError(f"the rollout controller has no step for policy version {policy_version} (it "
                                       f"fills version {self._fill.version}): its state does not match the trainer's")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError(f"the rollout controller produced no step in {timeout_s} s")
                self._cv.wait(left)
            if not self._ready:
                raise RuntimeError(f"the rollout controller stopped: {self._error}") from self._error
            version, groups, metrics = self._ready.popleft()
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
        """The ready steps, the step being filled and the batch counter, and with streamed
        admission ``admission``: the prompt queue, the keep rate and the skipper's history; call
        it paused."""
        with self._cv:
            if not self._paused or self._busy:  # a waiting pause(): nothing in flight
                raise RuntimeError("RolloutController.state_dict needs the controller paused (pause())")
            failed = self._error or next((gs for _, gs, _ in self._ready if isinstance(gs, BaseException)), None)
            if failed is not None:  # its last request's prompts were drawn and never offered: a state
                # saved now would skip them on resume
                raise RuntimeError(f"the rollout controller failed ({failed}); its state is not saved (the prompts "
                                   "of its last request would be lost): fix the cause and resume from the last "
                                   "checkpoint") from failed
            out = {"gen_batches_done": self.gen_batches_done, "fill": self._fill.state_dict(self.feeder),
                   "ready": [{"version": v, "groups": [group_to_dict(g) for g in gs], "metrics": m}
                             for v, gs, m in self._ready if not isinstance(gs, BaseException)]}
            if self.prompts is not None:
                out["admission"] = {"prompts": self.prompts.state_dict(), "keep_rate": self.keep_rate.state_dict(),
                                    "skipper": self.skipper.state_dict()}
            return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (before :meth:`start`), evicting what is now too stale.

        Each kept group is checked against the policy version of the step it was kept for
        (a ready step's, or the open step's for its kept groups and surplus), with η =
        ``buffer.max_staleness`` of this run (a resume may lower it). The steps before the
        first one holding a group more than η behind are restored as they were; so is all of
        it when there is none (the resumed run repeats the uninterrupted one). From that step
        on, the groups more than η behind their step are evicted, counted in that step's
        ``rollout/evicted_on_resume``, and the others, in generation order, are carried into
        it as synchronous mode carries surplus (each is within η of it: it is not newer than
        the step they were kept for); the step is filled again from there. No group is lost
        or used twice: every one is trained once or counted as evicted. (Streamed admission
        keeps the keep rate it had at the save, already halved for the ready steps that are
        filled again: it sizes the next requests only.)

        Raises:
            ValueError: the checkpoint's admission (batch or streamed, ``rollout.streaming``) is
                not this controller's.
        """
        check_admission(state, streamed=self.prompts is not None)
        if self.prompts is not None:
            a = state["admission"]
            self.prompts.load_state_dict(a["prompts"])
            self.keep_rate.load_state_dict(a["keep_rate"])
            self.skipper.load_state_dict(a["skipper"])
        self.gen_batches_done = int(state["gen_batches_done"])
        self._fill = _Fill.load(state["fill"], self.feeder)
        self._ready = deque((int(r["version"]), [group_from_dict(g) for g in r["groups"]], dict(r["metrics"]))
                            for r in state["ready"])
        eta, fill = self.cfg.max_staleness, self._fill
        steps = [(v, gs) for v, gs, _ in self._ready] + [(fill.version, self.selector.kept + self.selector.surplus)]
        stale = [any(group_staleness(g, v) > eta for g in gs) for v, gs in steps]
        if not any(stale):
            return
        first = stale.index(True)
        keep = [g for v, gs in steps[first:] for g in gs if group_staleness(g, v) <= eta]
        evicted = sum(len(gs) for _, gs in steps[first:]) - len(keep)
        version = steps[first][0]
        self._ready = deque(list(self._ready)[:first])
        if first < len(steps) - 1:  # a ready step is filled again: the open step's tally starts anew
            self._fill = _Fill(version)
            self.feeder.admission.load_counts({})
        self.selector.load_state_dict({"surplus": [group_to_dict(g) for g in keep]})
        self.selector.begin(version)
        self._fill.evicted = evicted
        logger.warning("resume: %d carried groups are more than buffer.max_staleness=%d versions behind the step they "
                       "were kept for: evicted from the step of policy version %d on", evicted, eta, version)

    # ---- the thread -----------------------------------------------------------------
    def _admits(self) -> bool:
        """A request for the step being filled may start (:class:`~dapo_megatron.rollout.sampling.feeder.EtaBound`):
        its tokens would be at most η versions behind the policy that trains on them."""
        return self.eta.admits(self.version, self._fill.version)

    def _step_done(self) -> bool:
        """N groups are kept, or the step's cap is reached (batches, or streamed prompts)."""
        return self.feeder.filled()

    def _draw_batch(self) -> list[tuple[Any, int]]:
        """Batch admission's draw: the next whole generation batch from ``next_batch``, group ``g`` at
        position ``gen_batches_done * gen_batch_size + g`` (its seed and group number)."""
        first = self.gen_batches_done * self.cfg.gen_batch_size
        self.gen_batches_done += 1
        return [(rec, first + g) for g, rec in enumerate(self.next_batch())]

    def _admit(self) -> tuple[list[Any], list[int]]:
        """The records of the next request and their positions (seed and group number), by the
        feeder's admission (class docstring; call under the lock, the step not done)."""
        drawn = self.feeder.admit()
        if self.prompts is not None:
            self.gen_batches_done = self.prompts.fetched
        return [rec for rec, _ in drawn], [pos for _, pos in drawn]

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    t0 = time.perf_counter()
                    while not self._stop and (self._paused or not (self._step_done() or self._admits())):
                        self._cv.wait()
                    self.idle_s += time.perf_counter() - t0
                    if self._stop:
                        return
                    if self._step_done():
                        self._close_step()
                        self._cv.notify_all()
                        continue
                    self._busy = True
                    version = self.version
                    records, positions = self._admit()
                t0 = time.perf_counter()
                graded = None
                try:
                    groups, resubmitted, reprefilled, retried = self._generate_batch(records, positions, version)
                    self.feeder.grade(groups)
                    graded = groups
                finally:
                    with self._cv:
                        self.busy_s += time.perf_counter() - t0
                        if graded is not None:  # in the same critical section as _busy = False: a
                            # pause() returning in between would see the prompts drawn but not their groups
                            self._add_batch(graded)
                            self._fill.resubmitted += resubmitted
                            self._fill.reprefilled += reprefilled
                            self._fill.retried += retried
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
        """Generate rows on the healthy servers until every one is done
        (:meth:`RowClient.dispatch <dapo_megatron.rollout.engines.row_client.RowClient.dispatch>`,
        through ``self._generate``); the one dispatch and retry loop of the rollout
        (:meth:`_generate_batch`) and of validation (:meth:`generate_validation`). Between rounds
        it waits while a sync holds the servers (:meth:`pause` without wait) and then generates
        with the version the sync left. ``stoppable``: end at :meth:`stop` between rounds (the
        thread's rows; validation, from the main thread, finishes its rows on a controller that
        stopped itself).

        Returns:
            the rows sent again after their server failed.

        Raises:
            RuntimeError: no healthy server is left (every server named).
            _Stopped: :meth:`stop` while rows waited for a sync to end.
        """
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
        """Synchronous server mode's ``_generate_groups`` over HTTP, interruptible.

        Group ``g`` of the request is seeded and numbered ``positions[g]`` (batch admission:
        ``first + g``) and dealt to server ``g % len(urls)`` (:func:`~dapo_megatron.rollout.engines.layout.engine_share`); the first
        round is exactly synchronous server mode's request per server. A row that a weight sync
        aborts (the sync pauses the servers with ``mode=abort``) comes back with the tokens it
        sampled; once the sync is over it is resubmitted as prompt + those tokens with the
        remaining budget and the same seed (the server's draws are keyed on the absolute
        position, so the row continues as it would have), and its new tokens get a new version
        span. Every token's version is the one its output reports (``meta_info.weight_version``).
        ``holder = 0``: trainer rank 0 holds the token lists. Rows go out through
        :meth:`_dispatch` (group ``g``'s rows dealt by ``g`` over the healthy servers).

        Returns:
            ``(groups, rows resubmitted, prefix tokens re-prefilled, rows retried)``: rows
            retried are those sent again after their server failed (the server's error marks
            it down: :meth:`RowClient.mark_down <dapo_megatron.rollout.engines.row_client.RowClient.mark_down>`; they restart from the prefix they had, on a healthy
            server, with their own seed, so they draw what they would have drawn).

        Raises:
            RuntimeError: no healthy server is left (every server named).
        """
        n, p = self.params.n, self.params
        groups = []
        for g, rec in enumerate(records):
            comps = [_EMPTY] * n
            grp = completions_to_group(positions[g], rec.prompt_ids, comps, prompt_index=rec.index,
                                       data_source=rec.data_source, ground_truth=rec.ground_truth,
                                       extra_info=rec.extra_info)
            grp.prompt_seed = positions[g]
            for s in grp.samples:
                s.holder, s.finish_reason = 0, ""
            groups.append(grp)
        resubmitted = reprefilled = 0
        next_turn = set()  # rows a multi-turn trajectory continues (not resubmissions after a sync)

        def request(key):
            nonlocal resubmitted, reprefilled
            g, j = key
            s = groups[g].samples[j]
            budget = p.max_new_tokens - len(s.response_ids)
            sp = build_sampling_params(dataclasses.replace(p, n=1, max_new_tokens=budget),
                                       sample_seed(p.seed, positions[g], j))
            if key in next_turn:
                next_turn.discard(key)
            elif s.response_ids:
                resubmitted += 1
                reprefilled += len(s.response_ids)
            # all servers healthy: server g % len(urls), synchronous server mode's deal
            ids = list(s.prompt_ids) + list(s.response_ids)
            if self.routes_shape is None:
                return g, ids, sp
            return g, ids, sp, routes_start_of(len(ids), s.routes)  # continued: its routes from where s's end

        def accept(key, res) -> bool:
            g, j = key
            ids, lps, kind, row_version = res[:4]
            routes = res[4] if len(res) > 4 else None  # routing replay (RowClient.generate_rows)
            s = groups[g].samples[j]
            if kind == "abort" and self.trajectory.ends_turn(s, ids):
                kind = "stop"  # the abort's extra decode step completed a tool call's stop string: the turn ended
            if ids:
                s.append_tokens(row_version, ids, lps, routes=routes)
            if kind == "abort":  # aborted by a weight sync: continued once it is over, on the new weights (a
                return False  # row it aborted right after its stop token or at its budget is "stop" / "length": sglang_io.row_outcome)
            if not s.versions:
                s.versions = [(0, row_version)]
            if settle_row(s, kind, self.trajectory, version=row_version, max_new_tokens=p.max_new_tokens):
                next_turn.add(key)  # the trajectory appended context: the next turn goes out next round
                return False
            return True

        retried = self._dispatch([(g, j) for g in range(len(records)) for j in range(n)], request, accept, version)
        return groups, resubmitted, reprefilled, retried

    def generate_validation(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Validation's responses on the healthy servers, from the main thread with the controller
        paused (:meth:`pause` with wait: nothing in flight, every request on the weights of the
        last sync); HTTP only, no collective.

        The requests of synchronous server-mode validation (``ServerRollout.generate(prompts,
        params, range(len(prompts)))``): response ``j`` of prompt ``i`` is one row seeded
        :func:`~dapo_megatron.rollout.engines.engine.sample_seed` ``(params.seed, i, j)``, with
        ``params``' sampling parameters, so it draws the same tokens on whichever server it
        runs. Prompt ``i``'s rows go to healthy server ``live[i % len(live)]`` and a server that
        fails or sends no byte for ``silence_timeout_s`` is marked down as in the rollout
        (:meth:`_dispatch`): its rows go to the servers still healthy.

        A multi-turn trajectory runs its turns as the rollout does (:meth:`_generate_batch`): a
        row it continues goes out again as prompt + the response so far (context included),
        with the remaining budget and its own seed.

        Returns:
            per prompt its ``params.n`` completions, in seed order (multi-turn: its
            :class:`~dapo_megatron.rollout.types.Sample` s, each with its whole response).

        Raises:
            RuntimeError: the controller is not paused, no healthy server is left (every server
                named), or a row came back aborted (something paused the servers).
        """
        with self._cv:
            if not self._paused or self._busy:
                raise RuntimeError("RolloutController.generate_validation needs the controller paused (pause())")
            version = self.version
        n = params.n
        out: list[list[Any]] = [[_EMPTY] * n for _ in prompts]
        turns: dict[tuple[int, int], Sample] = {}  # multi-turn: the samples a trajectory continues

        def request(key):
            i, j = key
            done = list(turns[key].response_ids) if key in turns else []
            return i, list(prompts[i]) + done, build_sampling_params(
                dataclasses.replace(params, n=1, max_new_tokens=params.max_new_tokens - len(done)),
                sample_seed(params.seed, i, j))

        def accept(key, res) -> bool:
            i, j = key
            ids, lps, kind, row_version = res[:4]  # (a fifth item, the routes, under routing replay: not kept)
            if kind == "abort":
                raise RuntimeError(f"validation row {j} of problem {i} was aborted on its server: nothing may pause "
                                   "the rollout servers during validation")
            if not self.trajectory.multi_turn:
                out[i][j] = Completion(ids, lps, kind)
                return True
            s = turns.pop(key, None) or Sample(prompt_ids=list(prompts[i]), response_ids=[], rollout_logprobs=[],
                                               finish_reason="", holder=0)
            s.append_tokens(row_version, ids, lps)
            if not s.versions:
                s.versions = [(0, row_version)]
            if settle_row(s, kind, self.trajectory, version=row_version, max_new_tokens=params.max_new_tokens):
                turns[key] = s  # the trajectory appended context: the next turn goes out next round
                return False
            out[i][j] = s
            return True

        retried = self._dispatch([(i, j) for i in range(len(prompts)) for j in range(n)], request, accept, version,
                                 stoppable=False)
        if retried:
            logger.warning("validation: %d rows sent again after their server failed", retried)
        return out

    def _add_batch(self, groups: list[Group]) -> None:
        """Offer a graded request's groups through the feeder, in submission order (streamed, each
        one also updates the skipper's history and the keep rate); call under the lock."""
        self.feeder.offer(groups)

    def _close_step(self) -> None:
        """Hand the filled step to the ready queue (exactly N groups, or fewer at the cap), as
        :meth:`RolloutBuffer.collect` ends a step, and open the next: the feeder's ``begin`` keeps
        the surplus that is within η of it (the rest is dropped and counted) and halves the keep rate."""
        cfg, f, sel = self.cfg, self._fill, self.selector
        if sel.missing and cfg.on_cap == "error":
            try:
                self.feeder.take()  # GroupSelector.fail_at_cap, naming what the admission spent
            except RuntimeError as err:
                self._ready.append((f.version, err, None))
            self._stop = True
            return
        generated = sel.graded
        out, metrics = self.feeder.take()
        metrics.update(partial_metrics([s for g in out for s in g.samples], resubmitted=f.resubmitted,
                                       reprefilled=f.reprefilled, generated=generated))
        if self.trajectory.multi_turn:  # the responses this step generated and graded, as Rollout.collect's
            metrics.update(self.trajectory.metrics(self.trajectory.take_counts(generated), "tool/"))
        metrics.update({"rollout/retried_rows": float(f.retried), "rollout/server_failures": float(f.server_failures),
                        "rollout/healthy_servers": float(sum(h == "healthy" for h in self.health)),
                        "rollout/evicted_on_resume": float(f.evicted)})
        if self.prompts is not None:  # synchronous streamed mode's names
            a = self.feeder.admission
            metrics.update({"rollout/keep_rate": self.keep_rate.value, "rollout/prompts_submitted": float(a.submitted),
                            "rollout/skipped_prompts": float(a.skipped)})
        self._ready.append((f.version, out, metrics))
        self._fill = _Fill(f.version + 1)
        self.feeder.begin(self._fill.version)


def check_admission(state: dict, *, streamed: bool) -> None:
    """Raise ``ValueError`` (naming ``rollout.streaming`` and its value to resume with) when the
    controller state ``state`` (:meth:`RolloutController.state_dict`) was written by the other
    admission: batch and streamed steps are filled from different prompt positions."""
    if streamed != ("admission" in state):
        was = "true" if "admission" in state else "false"
        raise ValueError(f"the checkpoint was written with rollout.streaming={was} (the async controller's "
                         f"{'streamed' if was == 'true' else 'batch'} admission of prompts); resume it with "
                         f"rollout.streaming={was}")


def partial_metrics(trained: Sequence[Sample], *, resubmitted: int, reprefilled: int,
                    generated: Sequence[Sample]) -> dict[str, float]:
    """verl's partial-rollout metrics of a step: ``async/partial_ratio`` (trained samples whose
    tokens span more than one weight version), ``async/max_partial_span`` (the most versions
    between the oldest and the newest token of a trained sample), ``rollout/resubmitted_rows``
    (rows continued after a sync, in the step's generation) and ``rollout/reprefill_ratio``
    (their prefix tokens, prefilled again, over the tokens the step generated)."""
    spans = [max(v for _, v in s.versions) - min(v for _, v in s.versions) for s in trained if s.versions]
    gen_tokens = sum(s.response_length for s in generated)
    return {"async/partial_ratio": sum(1 for s in trained if len(s.versions) > 1) / max(len(trained), 1),
            "async/max_partial_span": float(max(spans, default=0)),
            "rollout/resubmitted_rows": float(resubmitted),
            "rollout/reprefill_ratio": reprefilled / max(gen_tokens, 1)}

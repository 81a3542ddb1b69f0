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
  finished step goes to a ready queue, oldest first.
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
bit. The weights are pushed every ``async_training.trigger_parameter_sync_step`` steps; a
sync waits for the batch in flight to finish (its tokens then carry one version), pauses
the controller, syncs, and hands it the new version.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch.distributed as dist

from dapo_megatron.rollout.engines.engine import SamplingParams, completions_to_group
from dapo_megatron.rollout.engines.layout import engine_share
from dapo_megatron.rollout.sampling.buffer import RolloutBuffer, _group_from_dict, _group_to_dict, staleness_metrics
from dapo_megatron.rollout.rollout import Rollout, StepBatch
from dapo_megatron.rollout.types import Group, Sample

if TYPE_CHECKING:
    from dapo_megatron.config.run import DAPOConfig
    from dapo_megatron.platform import ParallelDims

logger = logging.getLogger("dapo_megatron.rollout.async")


def generate_on_servers(urls: Sequence[str], prompts: Sequence[Sequence[int]], params: SamplingParams,
                        prompt_seeds: Sequence[int], timeout_s: float, pool: Optional[ThreadPoolExecutor] = None):
    """One generation batch dealt round-robin over ``urls`` (prompt ``i`` to server
    ``i % len(urls)``, :func:`~dapo_megatron.rollout.engines.layout.engine_share`), one batched
    ``/generate`` per server, all at once; returns ``outputs[i][j]`` (a
    :class:`~dapo_megatron.rollout.engines.engine.Completion`) in prompt order.

    The same request per server as synchronous server mode sends from trainer rank ``e`` to
    server ``e`` (:meth:`~dapo_megatron.rollout.engines.server_sync.ServerRollout.generate`), so the
    same continuous batch runs there. HTTP only.

    Raises:
        RuntimeError: a server failed or timed out (its URL in the message).
    """
    from dapo_megatron.rollout.engines.sglang_engine import build_generate_request, http_post, parse_generate_output

    shares = [engine_share(len(prompts), len(urls), e) for e in range(len(urls))]

    def one(e):
        mine = shares[e]
        if not mine:
            return []
        req = build_generate_request([prompts[i] for i in mine], params, [prompt_seeds[i] for i in mine])
        try:
            out = http_post(urls[e], "/generate", req, timeout_s)
            return parse_generate_output(out, len(mine), params.n)
        except Exception as err:
            raise RuntimeError(f"rollout server {urls[e]}: /generate of {len(mine)} prompts failed: {err}") from err

    if pool is None or len(urls) == 1:
        parts = [one(e) for e in range(len(urls))]
    else:
        parts = list(pool.map(one, range(len(urls))))
    outputs: list = [None] * len(prompts)
    for e, mine in enumerate(shares):
        for i, comps in zip(mine, parts[e]):
            outputs[i] = comps
    return outputs


class _Step:
    """The step being filled: policy version ``version`` and what synchronous ``collect`` tracks."""

    def __init__(self, version: int, kept: list[Group], surplus_in: int, dropped_stale: int):
        self.version = version
        self.kept = kept
        self.surplus_in, self.dropped_stale = surplus_in, dropped_stale
        self.num_batches = 0
        self.generated: list[Sample] = []
        self.drops = [0, 0, 0]  # all correct, all wrong, other constant

    def state_dict(self) -> dict:
        return {"version": self.version, "kept": [_group_to_dict(g) for g in self.kept],
                "surplus_in": self.surplus_in, "dropped_stale": self.dropped_stale, "num_batches": self.num_batches,
                "generated": [_group_to_dict(Group(-1, [s])) for s in self.generated], "drops": list(self.drops)}

    @classmethod
    def from_state(cls, d: dict) -> "_Step":
        st = cls(int(d["version"]), [_group_from_dict(g) for g in d["kept"]], int(d["surplus_in"]),
                 int(d["dropped_stale"]))
        st.num_batches = int(d["num_batches"])
        st.generated = [_group_from_dict(g).samples[0] for g in d["generated"]]
        st.drops = [int(x) for x in d["drops"]]
        return st


class RolloutController:
    """The rollout thread of trainer rank 0 (module docstring). HTTP and the reward pool only.

    Args:
        buffer: the keep rule, grading (its reward pool is used from this thread: nothing else
            may grade while the controller runs, see :meth:`pause`) and the batch sizes.
        next_batch: the next generation batch of dataset records, in the order synchronous mode
            deals them (every DP rank's share, DP rank order).
        urls: the servers.
        params: sampling parameters (``n = buffer.n``, seed ``trainer.seed``).
        generate_timeout_s: bound on one ``/generate`` call.
        version: the weights the servers hold now (the trainer's step).
        policy_version: the policy version of the first step to fill (the trainer's step).
        gen_batches_done: generation batches drawn so far (numbers groups, seeds responses).
        generate: ``(prompts, params, prompt_seeds) -> outputs``; default
            :func:`generate_on_servers` over ``urls``.
    """

    def __init__(self, buffer: RolloutBuffer, next_batch: Callable[[], Sequence[Any]], urls: Sequence[str],
                 params: SamplingParams, *, generate_timeout_s: float, version: int, policy_version: int,
                 gen_batches_done: int = 0, generate: Optional[Callable] = None):
        self.buffer, self.cfg = buffer, buffer.config
        self.next_batch = next_batch
        self.urls = list(urls)
        self.params = params
        self.timeout_s = float(generate_timeout_s)
        self._pool = ThreadPoolExecutor(max(1, len(self.urls)), thread_name_prefix="rollout-http")
        self._generate = generate or (lambda prompts, p, seeds: generate_on_servers(
            self.urls, prompts, p, seeds, self.timeout_s, self._pool))
        self.gen_batches_done = int(gen_batches_done)
        self.version = int(version)
        self._fill = _Step(int(policy_version), [], 0, 0)
        self._ready: deque = deque()  # (policy version, groups, metrics) or (version, RuntimeError, None)
        self._cv = threading.Condition()
        self._paused = 0
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
        self._pool.shutdown(wait=False)

    def pause(self) -> float:
        """Wait for the batch in flight (its generation and grading) and stop starting new
        ones until :meth:`resume`; nestable. Returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cv:
            self._paused += 1
            while self._busy:
                self._cv.wait()
        return time.perf_counter() - t0

    def resume(self, version: Optional[int] = None) -> None:
        """Undo one :meth:`pause`; ``version``: the weights the servers hold now."""
        with self._cv:
            if version is not None:
                self.version = int(version)
            self._paused = max(0, self._paused - 1)
            self._cv.notify_all()

    def take(self, policy_version: int, timeout_s: Optional[float] = None) -> tuple[list[Group], dict]:
        """The oldest ready step (it must be the step of ``policy_version``): its groups and its
        metrics, those of :meth:`RolloutBuffer.collect`, plus ``time/wait_rollout_s``.

        Raises:
            RuntimeError: the controller failed (the cause chained), or the step hit the cap
                with ``on_cap="error"`` (synchronous mode's message).
        """
        t0 = time.perf_counter()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while not self._ready and self._error is None:
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
        """The ready steps, the step being filled and the batch counter; call it paused."""
        with self._cv:
            if not self._paused or self._busy:
                raise RuntimeError("RolloutController.state_dict needs the controller paused (pause())")
            return {"gen_batches_done": self.gen_batches_done, "fill": self._fill.state_dict(),
                    "ready": [{"version": v, "groups": [_group_to_dict(g) for g in gs], "metrics": m}
                              for v, gs, m in self._ready if not isinstance(gs, BaseException)]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (before :meth:`start`)."""
        self.gen_batches_done = int(state["gen_batches_done"])
        self._fill = _Step.from_state(state["fill"])
        self._ready = deque((int(r["version"]), [_group_from_dict(g) for g in r["groups"]], dict(r["metrics"]))
                            for r in state["ready"])

    # ---- the thread -----------------------------------------------------------------
    def _admits(self) -> bool:
        """A generation batch for the step being filled may start: its tokens would be at most
        η versions behind the policy that trains on them."""
        return self.version >= self._fill.version - self.cfg.max_staleness

    def _step_done(self) -> bool:
        f = self._fill
        return len(f.kept) >= self.cfg.train_batch_size or f.num_batches >= self.cfg.max_num_gen_batches

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
                    version, first = self.version, self.gen_batches_done * self.cfg.gen_batch_size
                    self.gen_batches_done += 1
                    records = list(self.next_batch())
                t0 = time.perf_counter()
                try:
                    groups = self._generate_batch(records, first, version)
                    self.buffer.grade(groups)
                finally:
                    self.busy_s += time.perf_counter() - t0
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()
                with self._cv:
                    self._add_batch(groups)
                    self._cv.notify_all()
        except BaseException as err:  # surfaced by take() on the main thread
            logger.error("rollout controller failed: %s", err)
            with self._cv:
                self._error = err
                self._busy = False
                self._cv.notify_all()

    def _generate_batch(self, records, first: int, version: int) -> list[Group]:
        """Synchronous server mode's ``_generate_groups`` over HTTP: group ``g`` of the batch
        is seeded and numbered ``first + g``; every sample ``versions = [(0, version)]`` and
        ``holder = 0`` (trainer rank 0 holds the token lists)."""
        outputs = self._generate([r.prompt_ids for r in records], self.params, [first + g for g in range(len(records))])
        groups = []
        for g, (rec, comps) in enumerate(zip(records, outputs)):
            grp = completions_to_group(first + g, rec.prompt_ids, comps, prompt_index=rec.index,
                                       data_source=rec.data_source, ground_truth=rec.ground_truth,
                                       extra_info=rec.extra_info, version=version)
            grp.prompt_seed = first + g
            for s in grp.samples:
                s.holder = 0
            groups.append(grp)
        return groups

    def _add_batch(self, groups: list[Group]) -> None:
        f = self._fill
        f.num_batches += 1
        for g in groups:
            f.generated.extend(g.samples)
            if self.buffer.keep_group(g):
                f.kept.append(g)
            elif all(g.accs):
                f.drops[0] += 1
            elif not any(g.accs):
                f.drops[1] += 1
            else:
                f.drops[2] += 1

    def _close_step(self) -> None:
        """Hand the filled step to the ready queue (exactly N groups, or fewer at the cap) and
        open the next one with the surplus that is still within η of it."""
        cfg, f, buf = self.cfg, self._fill, self.buffer
        hit_cap = len(f.kept) < cfg.train_batch_size
        if hit_cap and cfg.on_cap == "error":
            d = f.drops
            self._ready.append((f.version, RuntimeError(
                f"dynamic sampling kept {len(f.kept)} of train_batch_size={cfg.train_batch_size} prompt groups "
                f"after max_num_gen_batches={cfg.max_num_gen_batches} generation batches "
                f"(dropped {d[0]} all-correct, {d[1]} all-wrong, {d[2]} other constant groups). Raise "
                "max_num_gen_batches or gen_batch_size, use data of suitable difficulty, or set "
                "on_cap='train_on_kept'."), None))
            self._stop = True
            return
        out, surplus = f.kept[:cfg.train_batch_size], f.kept[cfg.train_batch_size:]
        for i, g in enumerate(out):
            g.group_id = i
            for s in g.samples:
                s.group_id = i
        buf._surplus = surplus  # what _metrics reports as surplus_out
        metrics = buf._metrics(out, f.generated, num_batches=f.num_batches, surplus_in=f.surplus_in,
                               dropped=tuple(f.drops), hit_cap=hit_cap)
        buf._surplus = []
        metrics["rollout/dropped_stale"] = float(f.dropped_stale)
        metrics.update(staleness_metrics([s for g in out for s in g.samples], f.version))
        self._ready.append((f.version, out, metrics))
        kept, dropped = buf.drop_stale(surplus, f.version + 1)
        self._fill = _Step(f.version + 1, kept, len(kept), dropped)


def strip_tokens(groups: Sequence[Group]) -> list[Group]:
    """Copies of ``groups`` whose samples carry no token lists (``response_ids`` /
    ``rollout_logprobs`` None, the length in ``num_response_tokens``) nor extracted answer:
    the records every rank holds of a response another rank holds."""
    import dataclasses

    return [Group(g.group_id, [dataclasses.replace(s, response_ids=None, rollout_logprobs=None, pred=None,
                                                   num_response_tokens=s.response_length) for s in g.samples],
                  g.prompt_seed) for g in groups]


class AsyncRollout(Rollout):
    """The :class:`~dapo_megatron.rollout.rollout.Rollout` of ``async_training.enable`` (server
    mode), on every rank; :func:`~dapo_megatron.rollout.rollout.build_rollout` builds it.

    Same surface, every method a collective:

    * :meth:`collect`: rank 0's :class:`RolloutController` hands over the oldest ready step
      (``time/wait_rollout_s``); its records (no token lists) are broadcast, the token lists
      stay on rank 0 (``Sample.holder = 0``) until the step's plan sends them where they train;
    * :meth:`sync_weights`: every ``async_training.trigger_parameter_sync_step`` versions (and
      at start), with the controller paused on rank 0 (after the batch in flight: its tokens
      carry one version), which then generates with the new version; between those steps
      nothing is sent and the servers keep their weights;
    * :meth:`validate`: with the controller paused, so every validation request runs on the
      weights of the last sync;
    * :meth:`state_dict`: the controller's ready steps, the step being filled, the batch
      counter and the prompt streams, taken paused (nothing in flight), written by rank 0.

    The controller reads every DP rank's share of each generation batch, in DP order, from
    streams of its own (the batch synchronous server mode assembles with an all-gather), so
    the prompts, seeds and group numbers are those of synchronous server mode at any layout.
    """

    def __init__(self, cfg: "DAPOConfig", parallel: "ParallelDims", **kwargs):
        super().__init__(cfg, parallel, **kwargs)
        b, d = cfg.buffer, cfg.data
        self.sync_every = cfg.async_training.trigger_parameter_sync_step
        self.controller: Optional[RolloutController] = None
        self.streams: list = []
        self._started = False
        self._last_collect: Optional[float] = None
        self._idle_before = 0.0
        self._sync_pause_s = 0.0
        if parallel.rank != 0:
            return
        from dapo_megatron.data import PromptStream

        dp = parallel.dp_size
        self.streams = [PromptStream(self.train_data, b.gen_batch_size // dp, r, dp, seed=d.seed, shuffle=d.shuffle)
                        for r in range(dp)]

        def next_batch():
            return [rec for st in self.streams for rec in st.next_batch()]

        # grades from the controller thread with the reward pool itself (no collective): nothing
        # else grades while it runs (validation pauses it)
        buffer = RolloutBuffer(b, self.reward_pool, self.decode)
        self.controller = RolloutController(buffer, next_batch, cfg.rollout.server_urls, self._train_params(),
                                            generate_timeout_s=cfg.rollout.server_generate_timeout_s,
                                            version=0, policy_version=0)

    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _start(self, version: int) -> None:
        if self._started:
            return
        self._started = True
        if self.controller is not None:
            self.controller.version = version
            self.controller.start()

    def collect(self, step: int) -> StepBatch:
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
            return StepBatch(groups, metrics)
        return StepBatch(*payload)

    def sync_weights(self, actor: Any, version: int) -> float:
        """The weight sync of version ``version`` when it is due (start, or ``version`` a multiple
        of ``trigger_parameter_sync_step``), with the controller paused on rank 0; 0.0 bytes
        when not due (the servers keep their weights)."""
        if self._started and version % self.sync_every:
            return 0.0
        self._sync_pause_s = self.controller.pause() if self.controller is not None else 0.0
        ok = False
        try:
            nbytes = super().sync_weights(actor, version)
            ok = True
        finally:
            if self.controller is not None:
                self.controller.resume(version if ok else None)
        return nbytes

    def wake(self) -> None:
        """Nothing: the servers have their own memory and their weights are synced by
        :meth:`sync_weights` only."""

    def validate(self, step: int) -> dict[str, float]:
        """:meth:`Rollout.validate` with the controller paused: every request on one weight version."""
        if self.controller is not None:
            self.controller.pause()
        try:
            self._broadcast(None)  # no rank sends a validation request before rank 0 has paused
            return super().validate(step)
        finally:
            if self.controller is not None:
                self.controller.resume()

    def close(self) -> None:
        if self.controller is not None:
            self.controller.stop()
        super().close()

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's controller state (``async_rollout``) and its prompt streams (``streams``),
        taken paused; the batch counter as ``gen_batches_done``. Other ranks return ``{}``
        (rank 0 writes the trainer state)."""
        if self.controller is None:
            return {}
        self.controller.pause()
        try:
            return {"gen_batches_done": self.controller.gen_batches_done,
                    "streams": [st.state_dict() for st in self.streams],
                    "async_rollout": self.controller.state_dict()}
        finally:
            self.controller.resume()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` on rank 0 (before the first :meth:`collect`).

        Raises:
            ValueError: the checkpoint was written by a synchronous run.
        """
        if "async_rollout" not in state:
            raise ValueError(f"async_training.enable=true but the checkpoint of step {state.get('step')} was written "
                             "by a synchronous run; resume it with async_training.enable=false")
        if self.controller is None:
            return
        for st, s in zip(self.streams, state["streams"]):
            st.load_state_dict(s)
        self.controller.load_state_dict(state["async_rollout"])

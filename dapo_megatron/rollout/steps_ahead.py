"""The steps the async controller fills ahead of training: the step feeder, its open step, the ready queue.

:class:`StepsAhead` is the bookkeeping half of :class:`~dapo_megatron.rollout.async_rollout.RolloutController`
(the other half is the thread, its lock and the servers): the step feeder with the controller's
admission gated by η, the counts of the step being filled (:class:`Fill`), the finished steps
waiting for the trainer, and their checkpoint state. Not thread-safe: the controller calls it
under its lock.

Design: docs/design.md §3.8 (asynchronous training on separate servers).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Optional, Sequence

from dapo_megatron.rollout.sampling.buffer import GroupSelector, group_from_dict, group_staleness, group_to_dict
from dapo_megatron.rollout.sampling.feeder import (EtaBound, KeepRate, KeepRateStreaming, PromptQueue, StepFeeder,
                                                  WholeBatches)
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig, PromptSkipper
from dapo_megatron.rollout.trajectory import SINGLE_TURN, Trajectory
from dapo_megatron.rollout.types import Group, Sample

logger = logging.getLogger("dapo_megatron.rollout.async")


class Fill:
    """The counts of the step being filled (policy version ``version``) beside the feeder's: rows
    continued after a sync and their prefix tokens, rows retried after their server failed, servers
    that failed, carried groups a resume evicted."""

    def __init__(self, version: int):
        self.version = version
        self.resubmitted = self.reprefilled = 0  # partial rows continued after a sync, their prefix tokens
        self.retried = self.server_failures = 0  # rows sent again after their server failed; servers that did
        self.evicted = 0  # carried groups a resume found more than η versions behind (load_state_dict)

    def state_dict(self, feeder: StepFeeder) -> dict:
        """This step's counts with the admission's (``num_batches``, ``submitted``, ``skipped``) and
        the selector's tally of it (``GroupSelector.step_state_dict``)."""
        selector = feeder.selector
        return {"version": self.version, **feeder.admission.counts(), "resubmitted": self.resubmitted,
                "reprefilled": self.reprefilled, "retried": self.retried, "server_failures": self.server_failures,
                "evicted": self.evicted, "surplus": selector.state_dict(), **selector.step_state_dict()}

    @classmethod
    def load(cls, d: dict, feeder: StepFeeder) -> "Fill":
        """The inverse of :meth:`state_dict`: the admission's counts restored and the selector's
        step reopened with its tally (an open step has no surplus: ``begin`` took it in)."""
        f = cls(int(d["version"]))
        f.resubmitted, f.reprefilled = int(d["resubmitted"]), int(d["reprefilled"])
        f.retried, f.server_failures = int(d.get("retried", 0)), int(d.get("server_failures", 0))
        f.evicted = int(d.get("evicted", 0))
        feeder.admission.load_counts(d)
        feeder.selector.load_state_dict({"surplus": []})
        feeder.selector.load_step_state(f.version, d)
        return f


class StepsAhead:
    """The feeder run ahead of training (module docstring).

    Args:
        selector: the dynamic-sampling selector (its ``config``: the batch sizes and η).
        next_batch: batch admission's next generation batch of records (every DP rank's share).
        policy_version: the policy version of the first step to fill.
        gen_batches_done: generation batches drawn so far (numbers groups, seeds responses).
        prompts: the prompt queue of streamed admission, or of batch admission with prompt
            skipping (``streamed`` false: whole batches of the prompts the skipper lets through);
            None: batch admission from ``next_batch``.
        skipper: with ``prompts``, GRESO prompt skipping; default a disabled one.
        streamed: with ``prompts``, keep-rate streaming admission (``rollout.streaming``).
        trajectory: its metrics of the responses a step graded (``tool/*``), multi-turn only.

    Raises:
        ValueError: ``prompts.batch_size`` is not ``buffer.gen_batch_size``.
    """

    def __init__(self, selector: GroupSelector, next_batch: Callable[[], Sequence[Any]], *, policy_version: int,
                 gen_batches_done: int = 0, prompts: Optional[PromptQueue] = None,
                 skipper: Optional[PromptSkipper] = None, trajectory: Trajectory = SINGLE_TURN,
                 streamed: bool = True):
        self.selector, self.cfg, self.trajectory = selector, selector.config, trajectory
        self.next_batch, self.prompts = next_batch, prompts
        if prompts is not None and prompts.batch_size != self.cfg.gen_batch_size:
            raise ValueError(f"the prompt queue's batch_size={prompts.batch_size} must be buffer.gen_batch_size="
                             f"{self.cfg.gen_batch_size} (it numbers the prompts)")
        self.skipper = skipper if skipper is not None else PromptSkipper(PromptSkipConfig(enable=False))
        self.keep_rate = KeepRate()
        self.streamed = prompts is not None and streamed
        admission = (KeepRateStreaming(self.cfg, prompts, self.skipper, self.keep_rate) if self.streamed
                     else WholeBatches(self.cfg, self._draw_batch if prompts is None else list, prompts, self.skipper))
        self.feeder = StepFeeder(selector, admission)
        self.eta = EtaBound(self.cfg.max_staleness)
        self.gen_batches_done = int(gen_batches_done)
        self.fill = Fill(int(policy_version))
        self.feeder.begin(self.fill.version)
        self.ready: deque = deque()  # (policy version, groups, metrics) or (version, RuntimeError, None)

    # ---- filling ------------------------------------------------------------------------
    def admits(self, version: int) -> bool:
        """A request sampled by the servers' weights ``version`` may feed the step being filled: its
        tokens would be at most η versions behind the policy that trains on them."""
        return self.eta.admits(version, self.fill.version)

    def done(self) -> bool:
        """N groups are kept, or the step's cap is reached (batches, or streamed prompts)."""
        return self.feeder.filled()

    def _draw_batch(self) -> list[tuple[Any, int]]:
        """Batch admission's draw: the next whole generation batch from ``next_batch``, group ``g`` at
        position ``gen_batches_done * gen_batch_size + g`` (its seed and group number)."""
        first = self.gen_batches_done * self.cfg.gen_batch_size
        self.gen_batches_done += 1
        return [(rec, first + g) for g, rec in enumerate(self.next_batch())]

    def admit(self) -> tuple[list[Any], list[int]]:
        """The records of the next request and their positions (seed and group number), by the
        feeder's admission (the step not done; nothing in flight: a request is generated and graded
        before the next)."""
        drawn = self.feeder.admit()
        if self.prompts is not None:
            self.gen_batches_done = self.prompts.fetched
        return [rec for rec, _ in drawn], [pos for _, pos in drawn]

    def add(self, groups: list[Group], *, resubmitted: int = 0, reprefilled: int = 0, retried: int = 0) -> None:
        """Offer a graded request's groups through the feeder, in submission order (streamed, each
        one also updates the skipper's history and the keep rate), and count its rows resubmitted
        after a sync, their prefix tokens and its rows retried after their server failed (:class:`Fill`)."""
        self.feeder.offer(groups)
        self.fill.resubmitted += resubmitted
        self.fill.reprefilled += reprefilled
        self.fill.retried += retried

    def close(self, healthy_servers: int) -> bool:
        """Hand the filled step to :attr:`ready` (as :meth:`RolloutBuffer.collect` ends a step) and
        open the next (``StepFeeder.begin``). Returns False when the step failed at its cap
        (``on_cap="error"``: the error is queued in its place and nothing more is filled)."""
        cfg, f, sel = self.cfg, self.fill, self.selector
        if sel.missing and cfg.on_cap == "error":
            try:
                self.feeder.take()  # GroupSelector.fail_at_cap, naming what the admission spent
            except RuntimeError as err:
                self.ready.append((f.version, err, None))
            return False
        generated = sel.graded
        out, metrics = self.feeder.take()
        metrics.update(partial_metrics([s for g in out for s in g.samples], resubmitted=f.resubmitted,
                                       reprefilled=f.reprefilled, generated=generated))
        if self.trajectory.multi_turn:  # the responses this step generated and graded, as Rollout.collect's
            metrics.update(self.trajectory.metrics(self.trajectory.take_counts(generated), "tool/"))
        metrics.update({"rollout/retried_rows": float(f.retried), "rollout/server_failures": float(f.server_failures),
                        "rollout/healthy_servers": float(healthy_servers),
                        "rollout/evicted_on_resume": float(f.evicted)})
        if self.prompts is not None:  # the synchronous modes' names
            metrics.update({**({"rollout/keep_rate": self.keep_rate.value} if self.streamed else {}),
                            **self.feeder.admission.skip_metrics()})
        self.ready.append((f.version, out, metrics))
        self.fill = Fill(f.version + 1)
        self.feeder.begin(self.fill.version)
        return True

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The ready steps (failed ones left out), the step being filled and the batch counter, and
        with a prompt queue ``admission``: the queue, the keep rate, the skipper's history and whether
        the admission is ``streamed``."""
        out = {"gen_batches_done": self.gen_batches_done, "fill": self.fill.state_dict(self.feeder),
               "ready": [{"version": v, "groups": [group_to_dict(g) for g in gs], "metrics": m}
                         for v, gs, m in self.ready if not isinstance(gs, BaseException)]}
        if self.prompts is not None:
            out["admission"] = {"prompts": self.prompts.state_dict(), "keep_rate": self.keep_rate.state_dict(),
                                "skipper": self.skipper.state_dict(), "streamed": self.streamed}
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`, evicting what is now too stale with this run's η
        (docs/design.md §3.8, State): no group is lost or used twice, every one is trained once or
        counted in ``rollout/evicted_on_resume``; the others are carried, in generation order, into
        the first step holding a too-stale group, filled again from there. (Streamed admission keeps
        the keep rate it had at the save: it sizes the next requests only.)

        Raises:
            ValueError: the checkpoint's admission is not this one's (:func:`check_admission`).
        """
        check_admission(state, streamed=self.streamed, queue=self.prompts is not None)
        if self.prompts is not None:
            a = state["admission"]
            self.prompts.load_state_dict(a["prompts"])
            self.keep_rate.load_state_dict(a["keep_rate"])
            self.skipper.load_state_dict(a["skipper"])
        self.gen_batches_done = int(state["gen_batches_done"])
        self.fill = Fill.load(state["fill"], self.feeder)
        self.ready = deque((int(r["version"]), [group_from_dict(g) for g in r["groups"]], dict(r["metrics"]))
                           for r in state["ready"])
        eta, fill = self.cfg.max_staleness, self.fill
        steps = [(v, gs) for v, gs, _ in self.ready] + [(fill.version, self.selector.kept + self.selector.surplus)]
        stale = [any(group_staleness(g, v) > eta for g in gs) for v, gs in steps]
        if not any(stale):
            return
        first = stale.index(True)
        keep = [g for v, gs in steps[first:] for g in gs if group_staleness(g, v) <= eta]
        evicted = sum(len(gs) for _, gs in steps[first:]) - len(keep)
        version = steps[first][0]
        self.ready = deque(list(self.ready)[:first])
        if first < len(steps) - 1:  # a ready step is filled again: the open step's tally starts anew
            self.fill = Fill(version)
            self.feeder.admission.load_counts({})
        self.selector.load_state_dict({"surplus": [group_to_dict(g) for g in keep]})
        self.selector.begin(version)
        self.fill.evicted = evicted
        logger.warning("resume: %d carried groups are more than buffer.max_staleness=%d versions behind the step they "
                       "were kept for: evicted from the step of policy version %d on", evicted, eta, version)


def check_admission(state: dict, *, streamed: bool, queue: bool) -> None:
    """Raise ``ValueError`` naming the key and value to resume with (``rollout.streaming``, or
    ``buffer.prompt_skip.enable``: batch admission from the prompt ``queue``) when ``state``
    (:meth:`StepsAhead.state_dict`) was written by another admission, which draws other prompts."""
    a = state.get("admission")
    was_streamed = a is not None and a.get("streamed", True)
    if streamed != was_streamed:
        key, was = "rollout.streaming", was_streamed
    elif queue != (a is not None):
        key, was = "buffer.prompt_skip.enable", a is not None
    else:
        return
    raise ValueError(f"the checkpoint was written with {key}={str(was).lower()} (another admission of prompts by "
                     f"the async controller, from other prompt positions); resume it with {key}={str(was).lower()}")


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

"""The step feeder: one loop's worth of rules between a prompt stream and the dynamic-sampling selector.

Every way of filling a training step (batch, streamed, asynchronous) is the same sequence: begin,
admit, submit and poll, grade and offer, carry or abort, take (docs/design.md §2.3, with its table
of the modes' policies and transports). :class:`StepFeeder` holds it once and is the only caller of
``GroupSelector.offer``. This module holds the admission policies (:class:`WholeBatches`,
:class:`KeepRateStreaming`, the async controller's :class:`EtaBound` gate; a new one subclasses
:class:`Admission`), the batch transport :class:`Generated`, and the prompt-side helpers every
admission shares: :class:`PromptQueue`, :class:`KeepRate` and :func:`draw_unskipped`.

Design: docs/design.md §2.3 (the rollout rooms) and §3.7 (streaming).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from dapo_megatron.rollout.sampling.config import KEPT
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipper
from dapo_megatron.rollout.types import Group


@dataclass
class PromptQueue:
    """The prompts not yet submitted, in stream order, each with its global position (seed):
    ``next_batch()``'s records numbered ``fetched * batch_size + i`` (the batch form's seeding),
    handed out one at a time, the rest of a batch kept for later steps (in the checkpoint)."""

    next_batch: Callable[[], Sequence[Any]]
    batch_size: int
    record_of: Callable[[int], Any]
    fetched: int = 0
    leftover: list[tuple[int, int]] = field(default_factory=list)  # (dataset index, position)

    def pop(self) -> tuple[Any, int]:
        """``(record, position)`` of the next prompt."""
        if not self.leftover:
            batch = list(self.next_batch())
            if len(batch) != self.batch_size:
                raise ValueError(f"next_batch() returned {len(batch)} prompts, expected batch_size={self.batch_size}")
            self.leftover = [(rec.index, self.fetched * self.batch_size + i) for i, rec in enumerate(batch)]
            self.fetched += 1
        index, position = self.leftover.pop(0)
        return self.record_of(index), position

    def state_dict(self) -> dict:
        return {"fetched": self.fetched, "leftover": [list(x) for x in self.leftover]}

    def load_state_dict(self, state: dict) -> None:
        self.fetched = int(state["fetched"])
        self.leftover = [(int(i), int(p)) for i, p in state["leftover"]]


@dataclass
class KeepRate:
    """The observed keep rate of dynamic sampling that sizes a feeder's next admission. Plain
    floats, the counts the whole state: the same arithmetic on every rank and after a resume."""

    kept: float = 0.0
    graded: float = 0.0

    @property
    def value(self) -> float:
        """``(kept + 1) / (graded + 1)``, in (0, 1]: one kept of one graded as the prior, so the
        first admission asks for ``missing`` prompts."""
        return (self.kept + 1.0) / (self.graded + 1.0)

    def new_step(self) -> None:
        """Halve both counts: the rate follows the policy as it changes."""
        self.kept, self.graded = self.kept / 2, self.graded / 2

    def count(self, kept: bool) -> None:
        """One graded group, kept or dropped."""
        self.graded += 1
        if kept:
            self.kept += 1

    def admission(self, missing: float, batch_size: int, left: int) -> int:
        """New prompts to submit for ``missing`` (> 0) expected kept groups: ``ceil(missing /
        rate)``, at most ``batch_size`` (``buffer.gen_batch_size``: one round's share) and ``left``
        (the step's cap minus what it submitted; GRESO's adaptive batch size, arXiv 2506.02177
        Sec. 4.2, without its 1.25 margin: the next round tops up)."""
        return min(math.ceil(missing / self.value), batch_size, left)

    def state_dict(self) -> dict:
        return {"kept": self.kept, "graded": self.graded}

    def load_state_dict(self, state: dict) -> None:
        self.kept, self.graded = float(state["kept"]), float(state["graded"])


def draw_unskipped(prompts: PromptQueue, skipper: PromptSkipper, want: int, counts: Admission) -> list[tuple[Any, int]]:
    """The next ``want`` prompts of the queue that ``skipper`` does not skip, in stream order:
    ``[(record, position), ...]``, counted in the admission's ``counts.submitted`` (and the skipped
    ones in ``counts.skipped``); each skipped prompt is consumed (it counts as an encounter of the
    skipper and is not offered again until the stream comes back to it)."""
    drawn = []
    while len(drawn) < want:
        record, position = prompts.pop()
        if skipper.skip(record.index):
            counts.skipped += 1
            continue
        drawn.append((record, position))
    counts.submitted += len(drawn)
    return drawn


# ---------------------------------------------------------------- admission policies
class Admission(abc.ABC):
    """What :class:`StepFeeder` asks of an admission policy; a policy subclasses it for its per-step
    counters (``num_batches``: generation batches drawn from the stream this step; ``submitted`` /
    ``skipped``: prompts admitted / skipped this step), plain ints, the whole per-step state
    (:meth:`counts`, their checkpoint form)."""

    num_batches = submitted = skipped = 0

    def new_step(self) -> None:
        """A step begins: zero the per-step counters (a policy that learns across steps also decays what it learned)."""
        self.load_counts({})

    @abc.abstractmethod
    def admit(self, missing: int, in_flight: int) -> Optional[Any]:
        """The next request for ``missing`` (> 0) kept groups with ``in_flight`` groups running, or
        None when none may start now (at the cap, or what runs is expected to fill the step)."""

    @abc.abstractmethod
    def at_cap(self) -> bool:
        """The step's admissions are spent (``buffer.max_num_gen_batches``)."""

    @abc.abstractmethod
    def record(self, g: Group, kept: bool, zero_variance: bool) -> None:
        """A graded group of this step was offered (kept or not; ``zero_variance`` on ``buffer.filter_metric``)."""

    @abc.abstractmethod
    def cap_spent(self) -> str:
        """What the step spent at its cap, for ``GroupSelector.fail_at_cap``."""

    def counts(self) -> dict[str, int]:
        """``num_batches``, ``submitted``, ``skipped`` (the async controller checkpoints them mid-step)."""
        return {"num_batches": self.num_batches, "submitted": self.submitted, "skipped": self.skipped}

    def load_counts(self, state: dict) -> None:
        """Restore :meth:`counts` (a missing key: 0)."""
        self.num_batches = int(state.get("num_batches", 0))
        self.submitted, self.skipped = int(state.get("submitted", 0)), int(state.get("skipped", 0))

    def skip_metrics(self) -> dict[str, float]:
        """``rollout/{prompts_submitted, skipped_prompts}``: prompts admitted and skipped this step."""
        return {"rollout/prompts_submitted": float(self.submitted), "rollout/skipped_prompts": float(self.skipped)}


class WholeBatches(Admission):
    """Admission by whole generation batches (verl's dynamic sampling; docs/design.md §2.3).

    Args:
        config: the :class:`~dapo_megatron.rollout.sampling.config.BufferConfig`.
        draw: ``draw()`` -> the next batch as the transport takes it (batch mode: the generated
            groups of ``buffer.gen_batch_size`` prompts, one collective engine call, so the engine
            keeps sampling whole batches; the async controller: ``(record, position)`` pairs).
            It may read :attr:`num_batches`: the batch's index in the step. With ``prompts``:
            ``draw(drawn)``, the batch of those ``(record, position)`` pairs.
        prompts, skipper: GRESO prompt skipping (``buffer.prompt_skip``): each batch is
            :func:`draw_unskipped` of ``gen_batch_size`` from the replicated queue, and every offered
            group updates the skipper's history. None: ``draw()`` reads the batch itself.
    """

    def __init__(self, config: Any, draw: Callable[..., Any], prompts: Optional[PromptQueue] = None,
                 skipper: Optional[PromptSkipper] = None):
        self.config, self.draw, self.prompts, self.skipper = config, draw, prompts, skipper

    def at_cap(self) -> bool:
        return self.num_batches >= self.config.max_num_gen_batches

    def admit(self, missing: int, in_flight: int) -> Optional[Any]:
        if in_flight or self.at_cap():
            return None
        if self.prompts is None:
            request = self.draw()
        else:
            request = self.draw(draw_unskipped(self.prompts, self.skipper, self.config.gen_batch_size, self))
        self.num_batches += 1
        return request

    def record(self, g: Group, kept: bool, zero_variance: bool) -> None:
        if self.skipper is not None:
            self.skipper.record(g.samples[0].prompt_index, zero_variance)

    def cap_spent(self) -> str:
        return (f"dynamic sampling after max_num_gen_batches={self.config.max_num_gen_batches} "
                "generation batches")


class KeepRateStreaming(Admission):
    """Streamed admission (GRESO's adaptive batch size): new prompts while ``missing - keep_rate *
    in_flight > 0``, :meth:`KeepRate.admission` of them within :attr:`cap`, skipped ones not
    counted; every offered group updates the skipper's history and the keep rate.

    Args:
        config: the :class:`~dapo_megatron.rollout.sampling.config.BufferConfig`.
        prompts: the prompt queue (positions ``fetched * gen_batch_size + i``).
        skipper: GRESO prompt skipping (a disabled one never skips).
        keep: the keep rate (its owner checkpoints it).
    """

    def __init__(self, config: Any, prompts: PromptQueue, skipper: PromptSkipper, keep: KeepRate):
        self.config, self.prompts, self.skipper, self.keep = config, prompts, skipper, keep

    @property
    def cap(self) -> int:
        """Prompts a step may submit: ``max_num_gen_batches * gen_batch_size``."""
        return self.config.max_num_gen_batches * self.config.gen_batch_size

    def new_step(self) -> None:
        self.keep.new_step()
        super().new_step()

    def at_cap(self) -> bool:
        return self.submitted >= self.cap

    def admit(self, missing: int, in_flight: int) -> Optional[list[tuple[Any, int]]]:
        expected = missing - self.keep.value * in_flight
        if expected <= 0 or self.at_cap():
            return None
        fetched = self.prompts.fetched
        drawn = draw_unskipped(self.prompts, self.skipper,
                               self.keep.admission(expected, self.config.gen_batch_size, self.cap - self.submitted),
                               self)
        self.num_batches += self.prompts.fetched - fetched  # generation batches drawn from the stream
        return drawn

    def record(self, g: Group, kept: bool, zero_variance: bool) -> None:
        self.skipper.record(g.samples[0].prompt_index, zero_variance)
        self.keep.count(kept)

    def cap_spent(self) -> str:
        cfg = self.config
        return (f"streaming dynamic sampling after {self.submitted} prompts (max_num_gen_batches="
                f"{cfg.max_num_gen_batches} x gen_batch_size={cfg.gen_batch_size}; {self.skipped} skipped)")


@dataclass(frozen=True)
class EtaBound:
    """The async controller's admission gate, η = ``buffer.max_staleness``: a request for the step of
    policy version ``p`` may start only while the servers hold weights ``version >= p - η``, so
    every token of a kept group is at most η versions behind the actor that trains on it."""

    max_staleness: int

    def admits(self, version: int, policy_version: int) -> bool:
        """Whether a request sampled by weights ``version`` may feed the step of ``policy_version``."""
        return version >= policy_version - self.max_staleness


# ---------------------------------------------------------------- the feeder
class Transport(Protocol):
    """Where a synchronous :meth:`StepFeeder.fill` sends what it admits."""

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet handed back by :meth:`poll`."""

    def submit(self, request: Any) -> None:
        """Start the admitted request."""

    def poll(self) -> list[Group]:
        """Advance; the groups that finished (every response settled), in submission order."""


class Generated:
    """The transport of whole generation batches: the batch engine call (the admission's ``draw``)
    already generated the request's groups, :meth:`poll` hands them back."""

    def __init__(self):
        self._groups: list[Group] = []

    @property
    def in_flight(self) -> int:
        return len(self._groups)

    def submit(self, request: list[Group]) -> None:
        self._groups = list(request)

    def poll(self) -> list[Group]:
        out, self._groups = self._groups, []
        return out


class StepFeeder:
    """The step feeder (module docstring) over one
    :class:`~dapo_megatron.rollout.sampling.buffer.GroupSelector` and one :class:`Admission`: a step
    is :meth:`begin`, then :meth:`admit` / :meth:`grade` / :meth:`offer` (or :meth:`fill` over a
    synchronous :class:`Transport`) until :meth:`filled`, then :meth:`take`."""

    def __init__(self, selector: Any, admission: Admission):
        self.selector, self.admission = selector, admission

    def begin(self, policy_version: Optional[int]) -> None:
        """Open the step of ``policy_version``: the admission's counters restart, the selector takes
        in its carried surplus (``GroupSelector.begin``)."""
        self.admission.new_step()
        self.selector.begin(policy_version)

    def filled(self) -> bool:
        """N groups are kept, or the admission's cap is spent."""
        return not self.selector.missing or self.admission.at_cap()

    def admit(self, in_flight: int = 0) -> Optional[Any]:
        """The next request of the admission policy for the missing groups, or None."""
        return self.admission.admit(self.selector.missing, in_flight)

    def grade(self, groups: list[Group]) -> None:
        """Grade and shape ``groups`` in place (``GroupSelector.grade``, one reward-pool call)."""
        self.selector.grade(groups)

    def offer(self, groups: Sequence[Group]) -> None:
        """Offer graded ``groups`` to the selector in order (the one caller of ``GroupSelector.offer``);
        each one's outcome goes to the admission policy."""
        sel = self.selector
        for g in groups:
            self.admission.record(g, sel.offer(g) == KEPT, sel.zero_variance(g))

    def fill(self, transport: Transport) -> None:
        """Admit, submit, poll, grade and offer until N groups are kept, or nothing runs and
        nothing more may be admitted (the cap). What is still in flight is the caller's to abort."""
        while self.selector.missing:
            request = self.admit(transport.in_flight)
            if request:
                transport.submit(request)
            if not transport.in_flight:
                break
            done = transport.poll()
            if done:
                self.grade(done)
                self.offer(done)

    def take(self, *, gen_tokens: Optional[int] = None) -> tuple[list[Group], dict[str, float]]:
        """End the step: ``(groups, GroupSelector.step_metrics)``, ``num_batches`` from the admission.
        Raises ``GroupSelector.fail_at_cap`` 's error, naming what the admission spent."""
        sel = self.selector
        if sel.missing and sel.config.on_cap == "error":
            sel.fail_at_cap(self.admission.cap_spent())
        out = sel.take()
        return out, sel.step_metrics(num_batches=self.admission.num_batches, gen_tokens=gen_tokens)

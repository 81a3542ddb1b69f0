"""The trajectory hook: what happens between a finished row and a finished sample.

A *row* is one uninterrupted generation of one response (a :class:`~dapo_megatron.rollout.engines.engine.RowRequest`,
or one completion of a batch ``generate``); a *sample* (:class:`~dapo_megatron.rollout.types.Sample`) is
what the actor trains on. Single-turn, the two are the same: the row's end is the sample's end.
A multi-turn rollout (a model that calls a tool mid-response, issue 38) is a sample made of
several rows with context tokens between them::

    prompt | model tokens (row 1) | tool output (context) | model tokens (row 2) | ...
              response_mask 1        response_mask 0         response_mask 1

Every generation loop hands each row that finished to :func:`settle_row`, the one place a row
becomes a finished sample or a continued one, where the loop's :class:`Trajectory` decides; which
loops, how a continued row is sent and how ``rollout.response_length`` bounds the whole response
are docs/design.md §2.3's (trajectories).

Why the hook returns tokens, not a :class:`RowRequest`: the three loops send rows differently
(engine rows keyed ``(prompt_seed, j)``, HTTP rows keyed by batch position), and each already
continues a row from its sample; the hook's part is the only thing they do not know (the
context), so it stays one small interface every loop consults in the same way.

Design: docs/design.md §2.3 (trajectories: where a multi-turn rollout plugs in).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional, Sequence

from dapo_megatron.rollout.engines.engine import RowRequest
from dapo_megatron.rollout.engines.routes import routes_start_of
from dapo_megatron.rollout.types import Sample

PENDING = ""
"""``Sample.finish_reason`` of a response in flight (not started, partial, or between turns)."""


class Trajectory:
    """The hook between a finished row and a finished sample (module docstring).

    The base class is single-turn: every finished row finishes its sample, nothing is appended.
    A multi-turn trajectory overrides :meth:`on_row_finished` (and sets :attr:`multi_turn`).
    It is called where the row's tokens are held (the rank that drives the engine; the async
    controller's thread on rank 0), once per finished row, in the loop's order.
    """

    #: False: :func:`settle_row` never calls :meth:`on_row_finished` (single-turn, the default),
    #: so a rank that does not hold a sample's tokens can settle its row from the record alone
    multi_turn: bool = False

    #: stop strings the engines must end a row at (``SamplingParams.stop``; a tool call's end), in
    #: the training rollout's and validation's sampling parameters; none for single-turn
    stop: tuple[str, ...] = ()

    def on_row_finished(self, sample: Sample, finish_reason: str, budget: int) -> Optional[Sequence[int]]:
        """The row of ``sample`` finished; its tokens are appended already.

        Args:
            sample: the sample so far (``response_ids``, ``response_mask``, ``rollout_logprobs``,
                ``versions``, grading inputs); do not modify it (:func:`settle_row` appends).
            finish_reason: the row's: ``"stop"`` (a stop token: the end of a turn) or ``"length"``
                (the whole response reached ``max_new_tokens``).
            budget: response tokens still allowed (``max_new_tokens - R``), >= 0.

        Returns:
            None: the sample is finished. Or the context token ids to append (mask 0, non-empty,
            tokenised once by the trajectory), after which a new row continues the sample; ids
            beyond ``budget`` are cut. Context that ends on a stop token ends the next row at once.
        """
        return None

    def ends_turn(self, sample: Sample, new_ids: Sequence[int]) -> bool:
        """Whether an ABORTED row's tokens end a turn: ``new_ids`` (the row's, not yet appended to
        ``sample``) complete one of :attr:`stop`. SGLang lets an aborted row (a weight sync's
        pause) decode one more token and applies the abort before its stop checks (as for EOS,
        :func:`~dapo_megatron.rollout.engines.sglang_io.row_outcome`), so a tool call's last token
        can come back ``"abort"``; the loops then settle the row as ``"stop"`` rather than
        continue it past the call. The base class has no stop strings: False."""
        return False

    def bind_sandbox(self, config: Any) -> None:
        """Take the run's ``sandbox`` block (a trajectory that runs programs starts its pool here;
        ``build_rollout`` calls it for a multi-turn trajectory). The base class runs nothing."""

    def take_counts(self, samples: Optional[Sequence[Sample]] = None) -> dict[str, float]:
        """Summable counts for the step's metrics over ``samples`` (default: the finished samples
        settled on this rank since the last call), which are then forgotten; the same keys on every
        rank (the rollout sums them over ranks). The base class counts nothing: ``{}``."""
        return {}

    def metrics(self, counts: dict[str, float], prefix: str) -> dict[str, float]:
        """The metrics of :meth:`take_counts`' counts summed over ranks (names under ``prefix``)."""
        return {}

    def close(self) -> None:
        """Release what the trajectory holds (a sandbox pool's threads)."""


SINGLE_TURN = Trajectory()
"""The default trajectory: single-turn."""


def settle_row(sample: Sample, finish_reason: str, trajectory: Trajectory, *, version: int,
               max_new_tokens: int) -> bool:
    """The one place a finished row becomes a finished sample or a continued one (module docstring).

    ``sample`` holds the row's tokens already (:meth:`Sample.append_tokens`). Single-turn
    (``trajectory.multi_turn`` False): sets ``sample.finish_reason = finish_reason`` and returns
    False, nothing else. Multi-turn: asks ``trajectory.on_row_finished``; None finishes the sample
    as above; context ids are appended with mask 0 (version span ``version``: the weights of the
    turn they answer), cut to the budget, and the sample is left ``PENDING`` for the loop to
    continue (True), or finished as ``"length"`` when no budget is left (False).

    Args:
        sample: the sample whose row finished.
        finish_reason: ``"stop"`` or ``"length"`` (never ``"abort"``: a partial row is not a turn).
        trajectory: the loop's :class:`Trajectory`.
        version: the weights version that sampled the finished row.
        max_new_tokens: the response budget (``rollout.response_length``), context included.

    Returns:
        True when the loop must submit a continuation row for ``sample``.

    Raises:
        ValueError: ``finish_reason`` not ``"stop"`` / ``"length"``; a trajectory that returned
            an empty or non-int context.
        RuntimeError: a multi-turn trajectory on a rank that does not hold the sample's tokens.
    """
    if finish_reason not in ("stop", "length"):
        raise ValueError(f"settle_row: finish_reason={finish_reason!r} must be 'stop' or 'length' (an aborted row "
                         "is continued as a partial rollout, not settled)")
    sample.finish_reason = finish_reason
    if not trajectory.multi_turn:
        return False
    if sample.response_ids is None:
        raise RuntimeError(f"{type(trajectory).__name__}: a multi-turn trajectory needs the sample's tokens where its "
                           f"row finished (held by rank {sample.holder})")
    budget = max(0, max_new_tokens - sample.response_length)
    context = trajectory.on_row_finished(sample, finish_reason, budget)
    if context is None:
        return False
    context = list(context)
    if not context or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in context):
        raise ValueError(f"{type(trajectory).__name__}.on_row_finished returned {context[:8]!r}: it must return None "
                         "or a non-empty list of token ids (ints >= 0)")
    context = context[:budget]
    if context:
        sample.append_tokens(version, context, None, context=True)
    if sample.response_length >= max_new_tokens:
        sample.finish_reason = "length"
        return False
    sample.finish_reason = PENDING
    return True


def build_trajectory(multi_turn: Any, tokenizer: Any = None) -> Trajectory:
    """The run's trajectory from ``rollout.multi_turn``: :data:`SINGLE_TURN` unless ``enable``;
    with ``enable``, ``trajectory`` names a factory ``"package.module:attribute"`` (a
    :class:`Trajectory` subclass or a function) called as ``factory(multi_turn, tokenizer)``.

    Raises:
        ValueError: ``enable`` without ``trajectory``, a name that does not import, or a factory
            that does not return a :class:`Trajectory` (each naming ``rollout.multi_turn.trajectory``).
    """
    if not multi_turn.enable:
        return SINGLE_TURN
    name = multi_turn.trajectory
    module, _, attr = str(name).partition(":")
    if not module or not attr:
        raise ValueError(f"rollout.multi_turn.trajectory={name!r} must name a Trajectory factory as "
                         "'package.module:attribute' (rollout.multi_turn.enable=true)")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"rollout.multi_turn.trajectory={name!r} does not import: {err}") from err
    trajectory = factory(multi_turn, tokenizer)
    if not isinstance(trajectory, Trajectory):
        raise ValueError(f"rollout.multi_turn.trajectory={name!r} returned {type(trajectory).__name__}, not a "
                         "dapo_megatron.rollout.trajectory.Trajectory")
    return trajectory


def run_turns(engine: Any, rows: Sequence[tuple[Sample, int, int]], params: Any, trajectory: Trajectory) -> None:
    """The batch loop's turns: settle the rows of a batch ``generate`` (each sample holds its first
    row already) and, for the samples a multi-turn trajectory continues, run their continuation
    rows on ``engine`` (``submit`` / ``poll``, :class:`~dapo_megatron.rollout.engines.engine.RowRequest`
    with the response so far as the prefix: the same seed stream, the remaining budget) until
    every sample is finished. Single-turn: each sample's finish reason is settled as it is, no row
    is run.

    Args:
        engine: the rollout engine that generated the rows (its ``weight_version`` sampled them).
        rows: ``(sample, prompt_seed, index)`` per response: the seed of response ``index`` of the
            prompt at ``prompt_seed`` (``generate``'s ``prompt_seeds``).
        params: the batch's :class:`~dapo_megatron.rollout.engines.engine.SamplingParams`.
        trajectory: the loop's :class:`Trajectory`.

    Raises:
        ValueError: a multi-turn trajectory on an engine without rows (``supports_async``).
    """
    if not rows:  # a rank that drives no engine
        return
    version = engine.weight_version
    pending: dict[tuple[int, int], tuple[Sample, int, int]] = {}
    for s, seed, j in rows:
        if trajectory.multi_turn and not s.versions:
            s.versions = [(0, version)]
        if settle_row(s, s.finish_reason, trajectory, version=version, max_new_tokens=params.max_new_tokens):
            pending[(seed, j)] = (s, seed, j)
    if pending and not engine.supports_async:
        raise ValueError(f"rollout.multi_turn: {type(engine).__name__} cannot continue a response (no submit / poll); "
                         "use the HF or SGLang engine")
    while pending:
        # routes (routing replay) from where the sample's end: the context's from this row's prefill
        engine.submit([RowRequest(key, s.prompt_ids, params, seed, j, prefix_ids=s.response_ids,
                                  routes_start=routes_start_of(len(s.prompt_ids) + len(s.response_ids), s.routes))
                       for key, (s, seed, j) in pending.items()])
        following = {}
        for r in engine.poll():
            s, seed, j = pending[r.key]
            s.append_tokens(r.version, r.response_ids, r.logprobs, routes=r.routes)
            if settle_row(s, r.finish_reason, trajectory, version=r.version, max_new_tokens=params.max_new_tokens):
                following[r.key] = pending[r.key]
        pending = following

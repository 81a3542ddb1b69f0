"""The tool-calling trajectory: a response that calls a sandboxed Python interpreter mid-generation
(issue 38), on the rollout's trajectory hook (:mod:`dapo_megatron.rollout.trajectory`).

Select it with ``rollout.multi_turn.enable: true`` and ``rollout.multi_turn.trajectory:
dapo_megatron.tools.trajectory:ToolTrajectory``; its keys are ``rollout.multi_turn``'s
(:class:`~dapo_megatron.tools.calls.ToolCallConfig`, verl's names) and the programs run under the
top-level ``sandbox`` block (:class:`~dapo_megatron.tools.sandbox.SandboxConfig`).

One turn, as the hook sees it (:meth:`ToolTrajectory.on_row_finished`): the engine stopped the row
at a tool call's end (the stop strings :attr:`ToolTrajectory.stop`, passed to every engine in the
sampling parameters) or on its own; the turn's model tokens (those after the last context token)
are decoded for PARSING only (:func:`~dapo_megatron.tools.calls.find_tool_call`); a call found runs
in the :class:`~dapo_megatron.tools.sandbox.SandboxPool` (never in this process); its output,
truncated per ``max_tool_response_length`` / ``tool_response_truncate_side`` and placed in the
format's response template, is tokenised ONCE (``tokenizer.encode(text, add_special_tokens=False)``)
and those ids are returned as context. The sampled ids are never decoded into what is trained:
the sample keeps them as sampled, and :func:`~dapo_megatron.rollout.trajectory.settle_row` appends
the tool ids after them with ``response_mask`` 0 (no loss, no token count, no overlong length,
no entropy or mismatch), so the trained sequence is ``sampled ids + tool ids + sampled ids ...``
exactly. No call, a turn that ended on ``"length"``, no budget left, or ``max_assistant_turns``
model turns reached: the sample is finished.

Counts for the metrics (:data:`COUNTS`, :func:`tool_metrics`): per response its calls, the calls
that failed (a malformed call, a traceback, ``sys.exit(n)``, a memory error, output over the cap,
a sandbox failure) and those that timed out; with the grader's ``acc``, the accuracy of the
responses that called the tool and of those that did not.

Design: docs/design.md §4.1 (tool calls in a sandbox) and §2.3 (trajectories).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

from dapo_megatron.rollout.engines.engine import match_stop_string
from dapo_megatron.rollout.trajectory import PENDING, Trajectory
from dapo_megatron.rollout.types import Sample
from dapo_megatron.tools.calls import (ToolCallConfig, find_tool_call, format_tool_response, stop_strings,
                                       tool_result_text)
from dapo_megatron.tools.sandbox import SandboxConfig, SandboxPool

logger = logging.getLogger(__name__)

__all__ = ["ToolTrajectory", "COUNTS", "tool_metrics"]

COUNTS = ("responses", "calls", "errors", "timeouts", "with_call", "acc_with_call", "without_call",
          "acc_without_call")
"""The summable counts :meth:`ToolTrajectory.take_counts` returns (summed over ranks before
:func:`tool_metrics` divides them)."""

_MAX_COUNTED = 1 << 16  # samples whose counts wait for take_counts, at most


def tool_metrics(counts: dict[str, float], prefix: str = "tool/") -> dict[str, float]:
    """Metrics from :data:`COUNTS` (summed over ranks): ``{prefix}calls_per_response``,
    ``call_rate`` (responses with at least one call), ``errors_per_call``, ``timeouts_per_call``
    (0 without calls), and ``acc_with_call`` / ``acc_without_call`` (present when such responses
    were graded). ``{}`` when no response was counted."""
    n = counts.get("responses", 0.0)
    if not n:
        return {}
    calls = counts["calls"]
    out = {f"{prefix}calls_per_response": calls / n,
           f"{prefix}call_rate": counts["with_call"] / n,
           f"{prefix}errors_per_call": counts["errors"] / calls if calls else 0.0,
           f"{prefix}timeouts_per_call": counts["timeouts"] / calls if calls else 0.0}
    for side in ("with_call", "without_call"):
        if counts[side]:
            out[f"{prefix}acc_{side}"] = counts[f"acc_{side}"] / counts[side]
    return out


class ToolTrajectory(Trajectory):
    """The Python-tool trajectory (module docstring); build it with ``(rollout.multi_turn,
    tokenizer)`` as the hook's factories are, then :meth:`bind_sandbox` (``build_rollout`` does,
    with the run's ``sandbox`` block; without it the first call uses :class:`SandboxConfig`'s
    defaults).

    Args:
        multi_turn: ``rollout.multi_turn`` (anything with :class:`ToolCallConfig`'s fields).
        tokenizer: the model's tokenizer (``decode(ids, skip_special_tokens=False)`` to parse a
            turn, ``encode(text, add_special_tokens=False)`` for the tool's text).

    Raises:
        ValueError: no tokenizer; a bad ``rollout.multi_turn`` key (named).
    """

    multi_turn = True

    def __init__(self, multi_turn: Any, tokenizer: Any):
        if tokenizer is None:
            raise ValueError("rollout.multi_turn.trajectory=dapo_megatron.tools.trajectory:ToolTrajectory needs the "
                             "model's tokenizer (to parse a turn and tokenise the tool's output once)")
        self.config = ToolCallConfig(**{f.name: getattr(multi_turn, f.name) for f in dataclasses.fields(ToolCallConfig)})
        self.config.enable = True
        self.config.validate()
        self.tokenizer = tokenizer
        self.stop = stop_strings(self.config)
        self.pool: Optional[SandboxPool] = None
        # per sample of this rank since the last take_counts: [sample, calls, errors, timeouts]
        self._counts: dict[int, list] = {}

    def bind_sandbox(self, config: Optional[SandboxConfig]) -> None:
        """Start the sandbox pool with ``config`` (probing bwrap now, so a machine that cannot run
        it stops the run at start: :class:`~dapo_megatron.tools.sandbox.SandboxUnavailable`)."""
        if self.pool is not None:
            self.pool.close()
        self.pool = SandboxPool(config)

    def close(self) -> None:
        """Wait for the calls in flight and stop the pool's threads."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def ends_turn(self, sample: Sample, new_ids: Sequence[int]) -> bool:
        """:meth:`Trajectory.ends_turn`: this turn's model tokens (after the last context, then
        ``new_ids``) end on a stop string, by the engines' rule
        (:func:`~dapo_megatron.rollout.engines.engine.match_stop_string`)."""
        if not new_ids or sample.response_ids is None:
            return False
        mask = sample.loss_token_mask()
        start = max((i + 1 for i, m in enumerate(mask) if m == 0), default=0)  # this turn's first token
        turn = list(sample.response_ids[start:]) + list(new_ids)
        return match_stop_string(self.stop, turn, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)) \
            is not None

    def on_row_finished(self, sample: Sample, finish_reason: str, budget: int) -> Optional[Sequence[int]]:
        """The hook (class docstring): the tool's output ids to append, or None."""
        if len(self._counts) >= _MAX_COUNTED and id(sample) not in self._counts:
            # a loop that never takes the counts (the async rollout logs no tool/* yet): forget the oldest
            for key in list(self._counts)[:len(self._counts) // 2]:
                del self._counts[key]
        record = self._counts.setdefault(id(sample), [sample, 0, 0, 0])
        record[0] = sample
        if finish_reason != "stop" or budget <= 0:
            return None
        mask = sample.loss_token_mask()
        turns = 1 + sum(1 for i, m in enumerate(mask) if m == 0 and (i + 1 == len(mask) or mask[i + 1] == 1))
        if turns >= self.config.max_assistant_turns:
            return None
        start = max((i + 1 for i, m in enumerate(mask) if m == 0), default=0)  # this turn's model tokens
        # decoded to find the call only; the sampled ids stay as sampled
        call = find_tool_call(self.tokenizer.decode(sample.response_ids[start:], skip_special_tokens=False),
                              self.config)
        if call is None:
            return None
        record[1] += 1
        if call.code is None:  # malformed (a Hermes call's JSON): not run, its error is the answer
            record[2] += 1
            text = format_tool_response(f"Error: {call.error}", self.config)
        else:
            if self.pool is None:
                self.bind_sandbox(None)
            result = self.pool.submit(call.code).result()
            if result.kind == "timeout":
                record[3] += 1
            elif result.kind != "ok":
                record[2] += 1
            text = format_tool_response(tool_result_text(result), self.config)
        return self.tokenizer.encode(text, add_special_tokens=False)  # the one tokenisation of the tool's text

    def metrics(self, counts: dict[str, float], prefix: str) -> dict[str, float]:
        """:func:`tool_metrics`."""
        return tool_metrics(counts, prefix)

    def take_counts(self, samples: Optional[Sequence[Sample]] = None) -> dict[str, float]:
        """:data:`COUNTS` over ``samples`` (default: every finished sample this rank settled since
        the last call; grade them first, ``acc`` is read), which are then forgotten."""
        if samples is None:
            keys = [k for k, r in self._counts.items() if r[0].finish_reason != PENDING]
        else:
            keys = [id(s) for s in samples if id(s) in self._counts]
        out = dict.fromkeys(COUNTS, 0.0)
        for k in keys:
            s, calls, errors, timeouts = self._counts.pop(k)
            side = "with_call" if calls else "without_call"
            out["responses"] += 1
            out["calls"] += calls
            out["errors"] += errors
            out["timeouts"] += timeouts
            out[side] += 1
            out[f"acc_{side}"] += float(s.acc)
        return out

"""Plain data records that travel between the rollout engine, the buffer and the actor.

They hold python lists, not tensors: a rollout is variable-length by nature, and is packed
into tensors only where it crosses ranks (:mod:`dapo_megatron.rollout.plan.step_data`) and when
the actor builds its micro-batches. In a distributed step every rank holds a
:class:`Sample` of every response, but its token lists (``response_ids``,
``rollout_logprobs``) only where they are needed: on the rank that generated it
(``holder``) and, once the step's DP plan is fixed, on the ranks that train it.

Design: docs/design.md §2.3 (the rollout rooms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

HELD_BY_ALL = -1
"""``Sample.holder`` of a sample whose token lists every rank holds (one process; a resumed
buffer surplus, which every rank reads from the checkpoint)."""


@dataclass
class Sample:
    """One response to one prompt.

    Attributes:
        prompt_ids: chat-templated prompt token ids, length P.
        response_ids: generated token ids, length R (R may be 0), EOS included when
            the engine stopped on it; None on a rank that does not hold them (see ``holder``).
        rollout_logprobs: per-token logprob of ``response_ids`` under the engine's
            sampling distribution (after temperature / top-p / top-k), length R, nats;
            float32 values (the engines' precision, which is what crosses ranks); None
            where ``response_ids`` is.
        finish_reason: ``"stop"`` (EOS or a stop token) or ``"length"`` (hit
            ``max_new_tokens``: truncated).
        group_id: index of the prompt group this sample belongs to (unique per step).
        prompt_index: row index of the prompt in its dataset (for reports and resume).
        data_source, ground_truth, extra_info: grading inputs (DAPO schema).
        reward: final scalar reward (score + overlong shaping), filled by the buffer.
        score: grader score before shaping, filled by the buffer.
        acc: grader accuracy (raw, unshaped), filled by the buffer.
        overlong_penalty: the soft overlong term added to ``score`` (<= 0).
        pred: the answer the grader extracted (for logs), or None.
        advantage: group-relative advantage, filled by the trainer.
        old_logprobs: actor logprobs of ``response_ids`` before the update, length R.
        loss_mask_zero: True when overlong filtering removes this sample from the loss.
        versions: the weight versions that generated ``response_ids``, as
            ``(first token index, version)`` spans in ascending token order: ``[(0, 3)]``
            means every token was sampled by weights version 3; ``[(0, 3), (12, 4)]`` a
            partial rollout: tokens 0-11 by version 3, aborted at the end of a step and
            continued by version 4. Empty: unknown (counted as current). The trainer's
            version is its step count: version ``k`` is the actor after ``k`` steps.
        holder: global rank that generated the response and holds its token lists
            (:data:`HELD_BY_ALL` when every rank does).
        num_response_tokens: R, kept where ``response_ids`` is None (the replicated
            decisions need the length, not the tokens).
        routes: routing replay (``actor.routing_replay: rollout``): the experts the engine routed
            every token but the last of ``prompt_ids + response_ids`` to, a CPU tensor
            ``[P + R - 1, L, K]`` (layers × top-k global expert indices) of uint8 (<= 256
            experts) or int16 (:mod:`dapo_megatron.rollout.engines.routes`); held where
            ``response_ids`` is and sent with it. None: not recorded.
        response_mask: which response tokens the policy sampled (multi-turn rollouts,
            docs/design.md §2.3 "trajectories"): a list of R ints, 1 = a model-sampled token (trained
            on: in the loss, DAPO's token count, the entropy and mismatch metrics and the soft
            overlong length), 0 = a context-only token appended between turns (a tool's output,
            a user turn), which the actor reads as context in the forward and never trains on.
            None: every token is the model's (single-turn; nothing else changes). Held where
            ``response_ids`` is and sent with it; only :meth:`append_tokens` writes it.
        num_context_tokens: the mask-0 tokens of the response (``R - sum(response_mask)``), kept
            on every rank (the replicated decisions need the loss-token count where the mask is
            not held: :attr:`num_model_tokens`).
    """

    prompt_ids: list[int]
    response_ids: Optional[list[int]]
    rollout_logprobs: Optional[list[float]]
    finish_reason: str
    group_id: int = -1
    prompt_index: int = -1
    data_source: str = ""
    ground_truth: str = ""
    extra_info: Optional[dict[str, Any]] = None
    reward: float = 0.0
    score: float = 0.0
    acc: bool = False
    overlong_penalty: float = 0.0
    pred: Optional[str] = None
    advantage: float = 0.0
    old_logprobs: Optional[list[float]] = None
    loss_mask_zero: bool = False
    versions: list[tuple[int, int]] = field(default_factory=list)
    holder: int = HELD_BY_ALL
    num_response_tokens: Optional[int] = None
    routes: Optional[Any] = None
    response_mask: Optional[list[int]] = None
    num_context_tokens: int = 0

    @property
    def response_length(self) -> int:
        """Number of generated tokens |y| (the length Eq. 13 of the DAPO paper uses), whether or
        not this rank holds them."""
        if self.response_ids is None:
            if self.num_response_tokens is None:
                raise ValueError("Sample without response_ids must carry num_response_tokens")
            return self.num_response_tokens
        return len(self.response_ids)

    @property
    def num_model_tokens(self) -> int:
        """Response tokens the policy sampled (``response_mask`` 1), whether or not this rank holds
        them: the tokens the loss, DAPO's token-mean denominator and the soft overlong penalty
        count (R for a single-turn sample)."""
        return self.response_length - self.num_context_tokens

    def loss_token_mask(self) -> list[int]:
        """``response_mask``, or R ones when it is None (every token the model's).

        Raises:
            ValueError: the tokens are not held here, or the mask's length is not R.
        """
        if self.response_ids is None:
            raise ValueError("Sample.loss_token_mask: this rank does not hold the response's tokens")
        if self.response_mask is None:
            return [1] * len(self.response_ids)
        if len(self.response_mask) != len(self.response_ids):
            raise ValueError(f"Sample.response_mask has {len(self.response_mask)} entries for "
                             f"{len(self.response_ids)} response tokens")
        return list(self.response_mask)

    @property
    def total_length(self) -> int:
        """Prompt plus response tokens: the sequence length the actor trains on."""
        return len(self.prompt_ids) + self.response_length

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def oldest_version(self) -> Optional[int]:
        """The oldest weights version among the response's tokens (None: unknown)."""
        return min(v for _, v in self.versions) if self.versions else None

    def token_versions(self) -> list[int]:
        """Weights version of every response token, length R (empty when unknown).

        Raises:
            ValueError: spans that do not start at token 0 or are not ascending.
        """
        if not self.versions:
            return []
        starts = [start for start, _ in self.versions]
        if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"Sample.versions={self.versions!r}: spans must start at token 0 and ascend")
        out: list[int] = []
        ends = starts[1:] + [self.response_length]
        for (start, version), end in zip(self.versions, ends):
            out.extend([version] * max(0, end - start))
        return out

    def append_tokens(self, version: int, response_ids: Optional[list[int]], logprobs: Optional[list[float]],
                      num_tokens: Optional[int] = None, *, context: bool = False,
                      routes: Optional[Any] = None) -> None:
        """Append one row's new tokens (sampled by weights ``version``), or context tokens between
        two turns: the one place a sample grows (the batch, streamed and async loops' rows, and a
        trajectory's context through :func:`~dapo_megatron.rollout.trajectory.settle_row`).

        A new version span ``(start, version)`` opens where the tokens start unless the last span
        has that version already (no span for no token). ``response_ids`` / ``logprobs``: the new
        tokens and their logprobs (appended, the sample's lists replaced by new ones), or None on
        a rank that does not hold them: the sample then keeps only its length
        (``num_response_tokens`` grows by ``num_tokens``; the token lists become None).
        ``num_tokens``: the count of new tokens (default ``len(response_ids)``).

        ``context=True``: the tokens are context, not sampled (a tool's output, tokenised once by
        the trajectory and appended as they are): they get ``response_mask`` 0 and count in
        ``num_context_tokens``; ``logprobs`` must be None and ``rollout_logprobs`` gets a 0.0
        placeholder per token, so it keeps one entry per response token (length R, aligned with
        ``response_ids``) and the placeholder is never read (every reader of rollout logprobs
        masks by ``response_mask``: the loss, the behaviour-policy correction, the mismatch
        metrics). Their version span is ``version`` (pass the version of the turn before them:
        the weights whose output they answer). The mask is materialised at the first context
        append (ones before it); model tokens appended after it get ones. A sample that never
        sees context keeps ``response_mask`` None, bit for bit as before.

        ``routes`` (routing replay): the row's routes, the LAST rows of ``prompt + response so far +
        new tokens`` (minus the last token, :func:`~dapo_megatron.rollout.engines.routes.num_route_tokens`
        rows in all): all of them (a row from position 0), which replace the sample's, or a tail
        from position ``start = num_route_tokens - len(routes)`` (a continued row that asked for
        its routes from there: ``RowRequest.routes_start``, SGLang's ``routed_experts_start_len``),
        which replaces the sample's rows from ``start`` on and keeps those before it: each
        position keeps the route of the weights that forwarded it to sample the next token
        (versions per token, as ``versions`` has them). A context append keeps the routes the
        sample holds: the next row asks for its routes from where they end
        (:func:`~dapo_megatron.rollout.engines.routes.routes_start_of`), so the context's positions
        (and the last token before it) take the routes of the prefill that forwarded them, and
        the earlier positions keep theirs, also across a weight sync between the turns.

        Raises:
            RuntimeError: new tokens given for a sample whose earlier tokens are not held here.
            ValueError: logprobs given for context tokens, or not one logprob per model token;
                routes that start past the rows the sample holds, or more rows than the sequence has.
        """
        start = self.response_length
        count = len(response_ids) if num_tokens is None else int(num_tokens)
        if context and logprobs is not None:
            raise ValueError("Sample.append_tokens(context=True): context tokens have no rollout logprobs "
                             "(pass logprobs=None)")
        if count and (not self.versions or self.versions[-1][1] != version):
            self.versions = list(self.versions) + [(start, version)]
        if context:
            self.num_context_tokens += count
        if response_ids is not None:
            if self.response_ids is None:
                raise RuntimeError("new tokens for a response whose earlier tokens this rank does not hold")
            if not context and len(logprobs) != len(response_ids):
                raise ValueError(f"Sample.append_tokens: {len(logprobs)} logprobs for {len(response_ids)} tokens")
            self.response_ids = list(self.response_ids) + list(response_ids)
            self.rollout_logprobs = list(self.rollout_logprobs) + ([0.0] * count if context else list(logprobs))
            if context or self.response_mask is not None:
                mask = self.response_mask if self.response_mask is not None else [1] * start
                self.response_mask = list(mask) + [0 if context else 1] * count
            if routes is not None and count:  # a row that sampled nothing adds no route the sample needs
                self.routes = self._joined_routes(routes)
        else:
            self.response_ids = self.rollout_logprobs = self.response_mask = None
            self.num_response_tokens = start + count

    def _joined_routes(self, routes):
        """The sample's routes after a row's ``routes`` (the tail rule of :meth:`append_tokens`;
        ``response_ids`` already extended)."""
        total = max(len(self.prompt_ids) + len(self.response_ids) - 1, 0)  # engines.routes.num_route_tokens
        start = total - int(routes.shape[0])
        if start < 0:
            raise ValueError(f"Sample.append_tokens: {int(routes.shape[0])} route rows for a sequence of "
                             f"{total + 1} tokens (at most {total}: every token but the last)")
        if start == 0:
            return routes
        held = 0 if self.routes is None else int(self.routes.shape[0])
        if held < start:
            raise ValueError(f"Sample.append_tokens: the row's routes start at position {start}, the sample holds "
                             f"routes of {held} positions (a continued row must ask for its routes from the first "
                             "position the sample lacks: RowRequest.routes_start)")
        return torch.cat([self.routes[:start], routes.to(self.routes.dtype)], dim=0)

    def staleness(self, current_version: int) -> int:
        """Versions behind ``current_version`` of the response's oldest token (0 when unknown)."""
        oldest = self.oldest_version
        return 0 if oldest is None else max(0, current_version - oldest)


@dataclass
class Group:
    """The G responses sampled for one prompt (a GRPO/DAPO group).

    ``prompt_seed``: the prompt's global position in the run, which seeds its responses
    (``rollout.engines.engine.sample_seed``); -1 when unknown. A streamed group in flight keeps it to
    continue its partial responses."""

    group_id: int
    samples: list[Sample] = field(default_factory=list)
    prompt_seed: int = -1

    @property
    def accs(self) -> list[bool]:
        return [s.acc for s in self.samples]

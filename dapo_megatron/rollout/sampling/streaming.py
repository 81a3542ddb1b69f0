"""Streaming dynamic sampling: grade groups as they finish, stop at N kept, carry the rest.

Where batch mode (:meth:`RolloutBuffer.collect`, verl's) generates whole generation batches and
discards what it does not need, :class:`StreamingCollector` runs a step in *rounds*: carried
partial groups (``rollout.partial_rollout``) are continued first, new prompts are admitted by the
keep rate (:class:`~dapo_megatron.rollout.sampling.feeder.KeepRateStreaming`, GRESO-skipped ones
not counted), every engine samples ``rollout.stream_poll_tokens`` tokens per round, finished groups
are graded and offered in submission order, and once N are kept the rows still running are
aborted: discarded, or kept with their tokens, logprobs and versions to continue next step.
Carried work more than ``buffer.max_staleness`` versions behind is dropped (counted).

Every rank takes every decision from the same records, with no communication besides the
client's. With the HF engine a round is a token count, so the kept groups, aborted rows and
carried state are the same at any layout and on resume; SGLang's rounds are time slices
(``SGLangEngine.poll_timeout_s``) and are not reproducible, each response staying seed-exact
under ``rollout.deterministic``.

Design: docs/design.md §3.7 (streaming, partial rollouts).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Sequence

import torch

from dapo_megatron.platform.parallel_dims import ParallelDims, dims_or_single
from dapo_megatron.rollout.sampling.buffer import GroupSelector, group_from_dict, group_to_dict
from dapo_megatron.rollout.sampling.feeder import KeepRate, KeepRateStreaming, PromptQueue, StepFeeder
from dapo_megatron.rollout.engines.engine import RolloutEngine, RowRequest, RowResult, SamplingParams
from dapo_megatron.rollout.engines.routes import routes_start_of
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipper
from dapo_megatron.rollout.plan.step_data import all_gather_rows
from dapo_megatron.rollout.trajectory import PENDING, SINGLE_TURN, Trajectory, settle_row
from dapo_megatron.rollout.types import HELD_BY_ALL, Group, Sample

ROW_FINISH = ("stop", "length", "abort")
"""The finish reasons of a row result (:class:`~dapo_megatron.rollout.engines.engine.RowResult`), coded by
position in the replicated record table."""


class RowUpdate(NamedTuple):
    """What one round did to one row, as every rank sees it: ``key`` ``(group.prompt_seed, j)``,
    the ``num_tokens`` new tokens, the ``finish_reason`` (one of :data:`ROW_FINISH`), the weights
    ``version`` that sampled them and the ``holder`` of the row's tokens (its engine's driving rank,
    :data:`~dapo_megatron.rollout.types.HELD_BY_ALL` in one process). On the holder only (None
    elsewhere): the new ``response_ids``, ``logprobs`` and ``routes`` (``RowResult.routes``)."""

    key: tuple[int, int]
    num_tokens: int
    finish_reason: str
    version: int
    holder: int
    response_ids: Optional[list[int]] = None
    logprobs: Optional[list[float]] = None
    routes: Optional[Any] = None


class RowClient(Protocol):
    """What :class:`StreamingCollector` needs of the engines (one engine, or every rank's)."""

    def submit(self, rows: Sequence[tuple[Group, int]]) -> None:
        """Start (or continue, after the tokens ``group.samples[j]`` already holds) response
        ``j`` of each group; the row's key is ``(group.prompt_seed, j)``."""

    def poll(self, max_tokens: int) -> list[RowUpdate]:
        """Advance every engine ``max_tokens`` sampled tokens; the rows that finished."""

    def abort(self) -> list[RowUpdate]:
        """Stop every row; each one's new tokens since its submission (``"abort"``)."""

    def share_turns(self, turns: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
        """A multi-turn trajectory's decisions, taken where the tokens are, for every rank:
        ``(prompt_seed, j, context tokens appended, TURN_END code)`` per row this rank settled;
        every rank's, in rank order."""


TURN_END = ("stop", "length", PENDING)
"""How :func:`~dapo_megatron.rollout.trajectory.settle_row` left a sample (finished, or continued after
its context), coded by position in :meth:`EngineClient.share_turns`' records."""


class EngineClient:
    """:class:`RowClient` over the run's rollout engines; in a distributed run every call is a
    collective over the world. Group ``g`` runs on :meth:`engine_of` (continued rows included, so
    a partial response continues where its tokens are); a round replicates records only, 5 int64
    per finished or aborted row, the tokens staying with :attr:`RowUpdate.holder`
    (docs/design.md §3.7).

    Args:
        engine: this rank's engine (asynchronous interface: ``submit`` / ``poll`` / ``abort``).
        params: the rollout's sampling parameters (``n`` ignored: one row per response).
        num_engines: engines of the run.
        engine_index: the engine this rank drives (colocated: a rollout-TP group's leader; server
            mode: rank ``e`` drives ``rollout.server_urls[e]``), or None.
        parallel: the run's layout (its world group); None: a world of one.

    Raises:
        ValueError: on every rank, when a driving rank's engine has no asynchronous
            generation (a collective check); ``parallel`` None in a world of more than one rank.
    """

    def __init__(self, engine: Optional[RolloutEngine], params: SamplingParams, *, num_engines: int = 1,
                 engine_index: Optional[int] = 0, parallel: Optional[ParallelDims] = None,
                 trajectory: Trajectory = SINGLE_TURN):
        if num_engines < 1 or (engine_index is not None and not 0 <= engine_index < num_engines):
            raise ValueError(f"engine_index={engine_index} must be None or in [0, num_engines={num_engines})")
        self.engine, self.params, self.trajectory = engine, params, trajectory
        self._samples: dict[tuple[int, int], Sample] = {}  # the rows this rank's engine runs (ends_turn reads them)
        self.num_engines, self.engine_index = num_engines, engine_index
        self.parallel = dims_or_single(parallel, "EngineClient")
        self.rank, self.world = self.parallel.rank, self.parallel.world_size
        lacking = engine_index is not None and not engine.supports_async
        names = [type(engine).__name__] if lacking else []
        # every rank raises, not only the one whose engine lacks it
        names = [n for part in self.parallel.all_gather_objects(names, "world") for n in part]
        if names:
            raise ValueError(f"rollout.streaming=true needs engines with asynchronous generation; {names[0]} has "
                             "none: set rollout.streaming=false")

    def engine_of(self, g: Group) -> int:
        """The engine that samples group ``g`` (and continues its partial responses)."""
        return g.prompt_seed % self.num_engines

    def submit(self, rows: Sequence[tuple[Group, int]]) -> None:
        mine = [(g, j) for g, j in rows if self.engine_of(g) == self.engine_index]
        if self.trajectory.stop:
            self._samples.update(((g.prompt_seed, j), g.samples[j]) for g, j in mine)
        if mine:
            self.engine.submit([row_request(g, j, self.params) for g, j in mine])

    def poll(self, max_tokens: int) -> list[RowUpdate]:
        driving = self.engine_index is not None and self.engine.num_in_flight
        return self._replicate(self.engine.poll(max_tokens) if driving else [])

    def abort(self) -> list[RowUpdate]:
        return self._replicate(self.engine.abort() if self.engine_index is not None else [])

    def share_turns(self, turns: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
        """:meth:`RowClient.share_turns`: one all-gather of 4 int64 per settled row (a collective)."""
        if self.world == 1:
            return [tuple(t) for t in turns]
        table = torch.tensor([list(t) for t in turns], dtype=torch.int64).view(len(turns), 4)
        return [tuple(row) for _, row in all_gather_rows(table, group=self.parallel.world_group)]

    def _replicate(self, local: list[RowResult]) -> list[RowUpdate]:
        """Every rank's results as :class:`RowUpdate` s, in rank order then each engine's order;
        the tokens only in this rank's own. An aborted row whose tokens end a turn
        (:meth:`~dapo_megatron.rollout.trajectory.Trajectory.ends_turn`: SGLang's extra decode step
        completed a stop string) is a finished one, decided here, where its tokens are."""
        if self.trajectory.stop:
            local = [r._replace(finish_reason="stop")
                     if r.finish_reason == "abort" and self.trajectory.ends_turn(self._samples[r.key], r.response_ids)
                     else r for r in local]
            for r in local:
                self._samples.pop(r.key, None)
        if self.world == 1:
            return [RowUpdate(r.key, len(r.response_ids), r.finish_reason, r.version, HELD_BY_ALL, list(r.response_ids),
                              list(r.logprobs), r.routes) for r in local]
        self.parallel.wait_for_generation()  # a rank with nothing in flight waits on gloo for the round
        table = torch.tensor([[r.key[0], r.key[1], len(r.response_ids), ROW_FINISH.index(r.finish_reason), r.version]
                              for r in local], dtype=torch.int64).view(len(local), 5)
        own = iter(local)
        out = []
        for src, (seed, j, num, finish, version) in all_gather_rows(table, group=self.parallel.world_group):
            r = next(own) if src == self.rank else None
            out.append(RowUpdate((seed, j), num, ROW_FINISH[finish], version, src,
                                 None if r is None else list(r.response_ids), None if r is None else list(r.logprobs),
                                 None if r is None else r.routes))
        return out


def row_request(g: Group, j: int, params: SamplingParams) -> RowRequest:
    """The :class:`RowRequest` of response ``j`` of a group in flight: keyed
    ``(prompt_seed, j)``, continuing after the tokens it holds (routing replay: its routes from
    where the sample's end, :func:`~dapo_megatron.rollout.engines.routes.routes_start_of`)."""
    s = g.samples[j]
    if s.response_ids is None:
        raise RuntimeError(f"response {j} of the group of prompt position {g.prompt_seed} is continued on a rank "
                           f"that does not hold its tokens (held by rank {s.holder})")
    return RowRequest((g.prompt_seed, j), s.prompt_ids, params, g.prompt_seed, j, prefix_ids=s.response_ids,
                      routes_start=routes_start_of(len(s.prompt_ids) + len(s.response_ids), s.routes))


def new_group(record: Any, position: int, n: int) -> Group:
    """An empty group in flight for a dataset record (``prompt_ids``, ``index``, grading fields)."""
    samples = [Sample(prompt_ids=list(record.prompt_ids), response_ids=[], rollout_logprobs=[], finish_reason=PENDING,
                      prompt_index=record.index, data_source=record.data_source, ground_truth=record.ground_truth,
                      extra_info=dict(record.extra_info) if record.extra_info is not None else None)
               for _ in range(n)]
    return Group(group_id=-1, samples=samples, prompt_seed=position)


def extend_sample(s: Sample, u: RowUpdate, trajectory: Trajectory = SINGLE_TURN,
                  max_new_tokens: Optional[int] = None) -> bool:
    """Apply one row's update to its sample on every rank (:meth:`Sample.append_tokens
    <dapo_megatron.rollout.types.Sample.append_tokens>`: the tokens on the holder, the length and
    version span everywhere). An aborted row leaves the sample ``PENDING`` (a partial rollout); a
    finished one is settled by ``trajectory``
    (:func:`~dapo_megatron.rollout.trajectory.settle_row`, budget ``max_new_tokens``, needed by a
    multi-turn trajectory only). Returns True when the trajectory continues the sample (a
    continuation row must be submitted)."""
    if u.response_ids is not None and s.response_ids is None:
        raise RuntimeError(f"rank {u.holder} got new tokens of a response whose earlier tokens it does not hold")
    s.append_tokens(u.version, u.response_ids, u.logprobs, num_tokens=u.num_tokens, routes=u.routes)
    s.holder = u.holder
    if u.finish_reason == "abort":
        s.finish_reason = PENDING
        return False
    if trajectory.multi_turn and max_new_tokens is None:
        raise ValueError("extend_sample: a multi-turn trajectory needs max_new_tokens (rollout.response_length)")
    if trajectory.multi_turn and s.response_ids is None:
        # the trajectory runs where the tokens are; this rank applies the holder's decision
        # (StreamingCollector._share_turns), and until then the sample is still in flight
        s.finish_reason = PENDING
        return False
    return settle_row(s, u.finish_reason, trajectory, version=u.version, max_new_tokens=max_new_tokens or 0)


class StreamingCollector:
    """The streamed form of the step feeder (module docstring): the
    :class:`~dapo_megatron.rollout.sampling.feeder.KeepRateStreaming` admission over rounds of the
    engines' rows (:class:`_Rounds`), with the partial groups it carries between steps.

    Args:
        selector: the :class:`~dapo_megatron.rollout.sampling.buffer.GroupSelector`.
        skipper: prompt skipping (a disabled one never skips).
        partial_rollout: keep aborted responses and continue them next step.
        poll_tokens: sampled tokens per engine per round, >= 1.
        trajectory: the hook that settles each finished row (default single-turn); a multi-turn one
            runs where each row's tokens are, the other ranks take its decisions
            (:meth:`RowClient.share_turns`).
        max_new_tokens: the response budget (``rollout.response_length``) of a multi-turn trajectory.
    """

    def __init__(self, selector: GroupSelector, skipper: PromptSkipper, *, partial_rollout: bool, poll_tokens: int,
                 trajectory: Trajectory = SINGLE_TURN, max_new_tokens: Optional[int] = None):
        if poll_tokens < 1:
            raise ValueError(f"rollout.stream_poll_tokens={poll_tokens} must be >= 1")
        if trajectory.multi_turn and max_new_tokens is None:
            raise ValueError("StreamingCollector: a multi-turn trajectory needs max_new_tokens (rollout.response_length)")
        self.selector, self.skipper = selector, skipper
        self.partial_rollout, self.poll_tokens = partial_rollout, poll_tokens
        self.trajectory, self.max_new_tokens = trajectory, max_new_tokens
        self._partial: list[Group] = []
        self.keep = KeepRate()  # sizes the admissions (KeepRateStreaming); in state_dict

    # ---- state --------------------------------------------------------------------
    @property
    def partial(self) -> list[Group]:
        """Groups aborted at the end of the last step, to be continued (partial_rollout)."""
        return list(self._partial)

    def state_dict(self) -> dict:
        """The partial groups (whole: the caller gives this rank their tokens first), the keep
        rate's counts and the skipper's history."""
        return {"partial": [group_to_dict(g) for g in self._partial], **self.keep.state_dict(),
                "skipper": self.skipper.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; every rank then holds the partial groups' tokens
        (``holder`` :data:`~dapo_megatron.rollout.types.HELD_BY_ALL`)."""
        self._partial = [group_from_dict(d) for d in state["partial"]]
        for g in self._partial:
            for s in g.samples:
                s.holder = HELD_BY_ALL
        self.keep.load_state_dict(state)
        self.skipper.load_state_dict(state["skipper"])

    # ---- the step -------------------------------------------------------------------
    def _share_turns(self, client: RowClient, inflight: dict[int, Group],
                     finished: list[tuple[RowUpdate, int]]) -> list[tuple[Group, int]]:
        """A multi-turn trajectory's decisions on every rank (a collective when the client is): the
        rank holding a finished row's tokens settled it (:func:`extend_sample`); each rank
        elsewhere appends the same number of context tokens (their count: it holds no tokens) and
        takes the same finish reason. Returns the rows to continue, in the holders' order."""
        mine = []
        for u, before in finished:
            s = inflight[u.key[0]].samples[u.key[1]]
            if s.response_ids is not None:  # settled here: this rank holds the row's tokens
                mine.append((u.key[0], u.key[1], s.num_context_tokens - before, TURN_END.index(s.finish_reason)))
        versions = {u.key: u.version for u, _ in finished}
        continued = []
        for seed, j, added, end in client.share_turns(mine):
            g = inflight[seed]
            s = g.samples[j]
            if s.response_ids is None:  # the holder's decision, as settle_row took it there
                if added:
                    s.append_tokens(versions[(seed, j)], None, None, num_tokens=added, context=True)
                s.finish_reason = TURN_END[end]
            if TURN_END[end] == PENDING:
                continued.append((g, j))
        return continued

    def collect(self, client: RowClient, prompts: PromptQueue, policy_version: int) -> tuple[list[Group], dict]:
        """The groups of one training step (module docstring); a collective when the client is.

        Returns:
            ``(groups, metrics)`` as :meth:`~dapo_megatron.rollout.sampling.buffer.RolloutBuffer.collect`
            (and raising as it does), plus ``rollout/{keep_rate, partial_in, partial_out}``,
            ``rollout/dropped_stale`` counting stale partial groups too, and, with the generation's
            other metrics (:data:`~dapo_megatron.rollout.sampling.buffer.GENERATION_METRICS`),
            ``rollout/{rounds, prompts_submitted, skipped_prompts, aborted_rows, aborted_tokens}``;
            ``rollout/gen_tokens`` counts the tokens sampled in this step, aborted ones included.
        """
        sel, cfg = self.selector, self.selector.config
        feeder = StepFeeder(sel, KeepRateStreaming(cfg, prompts, self.skipper, self.keep))
        feeder.begin(policy_version)
        carried, stale_partial = sel.drop_stale(self._partial, policy_version)  # the surplus' rule, for partial groups
        self._partial = []
        rounds = _Rounds(self, client, carried)
        feeder.fill(rounds)
        inflight = rounds.inflight
        aborted = client.abort() if inflight else []
        # an abort that ended a turn (EngineClient reads "stop") is settled by the trajectory: its
        # tool runs now, and a continued sample is carried with its context (partial_rollout)
        rounds.apply(aborted)
        aborted_tokens = sum(u.num_tokens for u in aborted)
        if self.partial_rollout:
            self._partial = list(inflight.values())
        out, metrics = feeder.take(gen_tokens=rounds.gen_tokens)
        metrics.update({
            "rollout/keep_rate": self.keep.value,
            "rollout/partial_in": float(rounds.partial_in),
            "rollout/partial_out": float(sum(s.finish_reason == PENDING for g in self._partial for s in g.samples)),
            "rollout/dropped_stale": metrics["rollout/dropped_stale"] + stale_partial,
        })
        if "rollout/gen_tokens" in metrics:  # absent with the generation's other metrics when nothing was sampled
            metrics.update({
                "rollout/rounds": float(rounds.rounds), **feeder.admission.skip_metrics(),
                "rollout/aborted_rows": float(len(aborted)), "rollout/aborted_tokens": float(aborted_tokens),
            })
        return out, metrics


class _Rounds:
    """The streamed transport of one step (:class:`~dapo_megatron.rollout.sampling.feeder.Transport`):
    the groups in flight by ``prompt_seed`` (carried partial groups first, resubmitted as it is
    built) as rows of ``client``; each :meth:`poll` is one round of ``collector.poll_tokens`` tokens
    per engine. Counts ``rounds``, ``gen_tokens`` and ``partial_in``."""

    def __init__(self, collector: "StreamingCollector", client: RowClient, carried: Sequence[Group]):
        self.collector, self.client, self.n = collector, client, collector.selector.config.n
        self.inflight: dict[int, Group] = {}  # prompt_seed -> group, in submission order
        resubmit = []
        for g in carried:
            self.inflight[g.prompt_seed] = g
            resubmit.extend((g, j) for j, s in enumerate(g.samples) if s.finish_reason == PENDING)
        if resubmit:
            client.submit(resubmit)
        self.partial_in = len(resubmit)
        self.rounds = self.gen_tokens = 0

    @property
    def in_flight(self) -> int:
        return len(self.inflight)

    def submit(self, drawn: Sequence[tuple[Any, int]]) -> None:
        new = [new_group(record, position, self.n) for record, position in drawn]
        for g in new:
            self.inflight[g.prompt_seed] = g
        self.client.submit([(g, j) for g in new for j in range(self.n)])

    def apply(self, updates: Sequence[RowUpdate]) -> list[tuple[Group, int]]:
        """Apply a round's (or the abort's) rows to their samples (:func:`extend_sample`), counting
        their tokens; a multi-turn trajectory's decisions are shared (a collective when the client
        is). Returns the rows the trajectory continues."""
        c, continued, finished = self.collector, [], []
        for u in updates:
            g = self.inflight[u.key[0]]
            before = g.samples[u.key[1]].num_context_tokens
            if extend_sample(g.samples[u.key[1]], u, c.trajectory, c.max_new_tokens):
                continued.append((g, u.key[1]))
            if u.finish_reason != "abort":
                finished.append((u, before))
            self.gen_tokens += u.num_tokens
        if c.trajectory.multi_turn:
            continued = c._share_turns(self.client, self.inflight, finished)
        return continued

    def poll(self) -> list[Group]:
        self.rounds += 1
        continued = self.apply(self.client.poll(self.collector.poll_tokens))
        if continued:  # a multi-turn trajectory's next turns, after their context
            self.client.submit(continued)
        done = [g for g in self.inflight.values() if all(s.finish_reason != PENDING for s in g.samples)]
        for g in done:
            del self.inflight[g.prompt_seed]
        return done

"""Streaming dynamic sampling: grade groups as they finish, stop at N kept, carry the rest.

The batch form of dynamic sampling (:meth:`RolloutBuffer.collect`, verl's) generates whole
generation batches and discards what it does not need. :class:`StreamingCollector` runs the
rollout of one step in *rounds* instead:

1. carried work first: partial groups aborted at the end of the previous step
   (``rollout.partial_rollout``) are resubmitted, each unfinished response continued after
   its prefix; carried surplus groups count as kept. Both are dropped when more than
   ``buffer.max_staleness`` weight versions behind the actor (counted);
2. it submits new prompts while ``kept + keep_rate * in_flight < N``: as many as the keep
   rate observed so far says will yield the missing groups (``ceil(missing / keep_rate)``,
   at most ``buffer.gen_batch_size`` per round and ``max_num_gen_batches * gen_batch_size``
   per step; GRESO's adaptive batch size, arXiv 2506.02177 Sec. 4.2, without its 1.25
   margin: the next round tops up). A prompt that the :class:`~dapo_megatron.rollout.sampling.prompt_skip.PromptSkipper`
   skips does not count;
3. every engine advances ``rollout.stream_poll_tokens`` sampled tokens; the groups whose
   ``n`` responses have all finished are graded and kept or dropped, in submission order;
4. once N groups are kept it stops: the rows still running are aborted and either
   discarded (``partial_rollout: false``) or kept, with their tokens, logprobs and the
   weight versions that sampled them, to be continued next step (``true``). Exactly N groups
   are returned (fewer only at the cap with ``on_cap="train_on_kept"``); groups kept beyond
   N are carried as surplus.

Determinism and layout: all decisions are taken on every rank from the same records, so
they need no communication besides the client's. With the HF engine a round is a fixed
number of sampled tokens and rows are admitted at every poll (continuous batching), so the
round in which a group finishes depends only on its responses' lengths and on the round it
was submitted in: the kept groups, the aborted rows and the carried state are the same at
any TP / PP / DP layout, and a resumed run repeats an uninterrupted one (responses
themselves are batch-independent up to the last bits of batched matmuls, see
:class:`~dapo_megatron.rollout.engines.hf_engine.HFEngine`). SGLang cannot stop after a token
count: its rounds are time slices (``SGLangEngine.poll_timeout_s``), so which groups finish
first, and hence which are kept, aborted or carried, depends on timing and is not
reproducible; each response stays seed-exact under ``rollout.deterministic``, continued
ones included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from dapo_megatron.rollout.sampling.buffer import (RolloutBuffer, _group_from_dict, _group_to_dict, group_staleness,
                                          staleness_metrics)
from dapo_megatron.rollout.engines.engine import RolloutEngine, RowRequest, RowResult, SamplingParams
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipper
from dapo_megatron.rollout.types import Group, Sample

PENDING = ""
"""``Sample.finish_reason`` of a response in flight (not started, or partial)."""


class RowClient(Protocol):
    """What :class:`StreamingCollector` needs of the engines (one engine, or every rank's)."""

    def submit(self, rows: Sequence[tuple[Group, int]]) -> None:
        """Start (or continue, after the tokens ``group.samples[j]`` already holds) response
        ``j`` of each group; the row's key is ``(group.prompt_seed, j)``."""

    def poll(self, max_tokens: int) -> list[RowResult]:
        """Advance every engine ``max_tokens`` sampled tokens; the rows that finished."""

    def abort(self) -> list[RowResult]:
        """Stop every row; each one's new tokens since its submission (``"abort"``)."""


class EngineClient:
    """:class:`RowClient` over one engine with the asynchronous interface (one process)."""

    def __init__(self, engine: RolloutEngine, params: SamplingParams):
        if not engine.supports_async:
            raise ValueError(f"{type(engine).__name__} has no asynchronous generation; set rollout.streaming: false")
        self.engine, self.params = engine, params

    def submit(self, rows: Sequence[tuple[Group, int]]) -> None:
        self.engine.submit([row_request(g, j, self.params) for g, j in rows])

    def poll(self, max_tokens: int) -> list[RowResult]:
        return self.engine.poll(max_tokens)

    def abort(self) -> list[RowResult]:
        return self.engine.abort()


def row_request(g: Group, j: int, params: SamplingParams) -> RowRequest:
    """The :class:`RowRequest` of response ``j`` of a group in flight: keyed
    ``(prompt_seed, j)``, continuing after the tokens it holds."""
    s = g.samples[j]
    return RowRequest((g.prompt_seed, j), s.prompt_ids, params, g.prompt_seed, j, prefix_ids=s.response_ids)


@dataclass
class PromptQueue:
    """The prompts not yet submitted, in stream order, each with its global position (seed).

    ``next_batch()`` returns the next generation batch of records from the stream; the
    queue numbers them ``fetched * batch_size + i`` (the batch form's seeding), hands them out
    one at a time and keeps the rest of a batch for later steps (in the checkpoint).
    """

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


def new_group(record: Any, position: int, n: int) -> Group:
    """An empty group in flight for a dataset record (``prompt_ids``, ``index``, grading fields)."""
    samples = [Sample(prompt_ids=list(record.prompt_ids), response_ids=[], rollout_logprobs=[], finish_reason=PENDING,
                      prompt_index=record.index, data_source=record.data_source, ground_truth=record.ground_truth,
                      extra_info=dict(record.extra_info) if record.extra_info is not None else None)
               for _ in range(n)]
    return Group(group_id=-1, samples=samples, prompt_seed=position)


def extend_sample(s: Sample, r: RowResult) -> None:
    """Append a row's new tokens to its sample, with the version that sampled them."""
    if r.response_ids:
        start = len(s.response_ids)
        if not s.versions or s.versions[-1][1] != r.version:
            s.versions = list(s.versions) + [(start, r.version)]
        s.response_ids = list(s.response_ids) + list(r.response_ids)
        s.rollout_logprobs = list(s.rollout_logprobs) + list(r.logprobs)
    s.finish_reason = PENDING if r.finish_reason == "abort" else r.finish_reason


class StreamingCollector:
    """Streaming dynamic sampling over a :class:`RolloutBuffer` (module docstring).

    Args:
        buffer: grading, the keep rule, the surplus and the batch-size settings.
        skipper: prompt skipping (a disabled one never skips).
        partial_rollout: keep aborted responses and continue them next step.
        poll_tokens: sampled tokens per engine per round, >= 1.
    """

    def __init__(self, buffer: RolloutBuffer, skipper: PromptSkipper, *, partial_rollout: bool, poll_tokens: int):
        if poll_tokens < 1:
            raise ValueError(f"rollout.stream_poll_tokens={poll_tokens} must be >= 1")
        self.buffer, self.skipper = buffer, skipper
        self.partial_rollout, self.poll_tokens = partial_rollout, poll_tokens
        self._partial: list[Group] = []
        self._kept, self._graded = 0.0, 0.0  # decayed counts of kept / graded groups: the keep rate

    # ---- state --------------------------------------------------------------------
    @property
    def partial(self) -> list[Group]:
        """Groups aborted at the end of the last step, to be continued (partial_rollout)."""
        return list(self._partial)

    @property
    def keep_rate(self) -> float:
        """Kept / graded groups, decayed by half every step, with one kept of one graded as the prior."""
        return (self._kept + 1.0) / (self._graded + 1.0)

    def state_dict(self) -> dict:
        return {"partial": [_group_to_dict(g) for g in self._partial], "kept": self._kept, "graded": self._graded,
                "skipper": self.skipper.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._partial = [_group_from_dict(d) for d in state["partial"]]
        self._kept, self._graded = float(state["kept"]), float(state["graded"])
        self.skipper.load_state_dict(state["skipper"])

    # ---- the step -------------------------------------------------------------------
    def collect(self, client: RowClient, prompts: PromptQueue, policy_version: int) -> tuple[list[Group], dict]:
        """The groups of one training step (module docstring); a collective when the client is.

        Returns:
            ``(groups, metrics)`` as :meth:`RolloutBuffer.collect`, plus
            ``rollout/{keep_rate, partial_in, partial_out, dropped_stale}`` and, with the
            generation's other metrics (absent when no token was sampled and no group graded,
            :data:`~dapo_megatron.rollout.sampling.buffer.GENERATION_METRICS`), ``rollout/{rounds,
            prompts_submitted, skipped_prompts, aborted_rows, aborted_tokens}``.
            ``rollout/gen_tokens`` counts the tokens sampled in this step (the continued part
            of a partial rollout, not its prefix; aborted tokens included, whether carried or
            discarded).

        Raises:
            RuntimeError: the cap was reached with fewer than N kept and ``on_cap="error"``
                (the kept groups stay in the surplus).
        """
        buf, cfg = self.buffer, self.buffer.config
        self._kept, self._graded = self._kept / 2, self._graded / 2
        kept, dropped_stale = buf.drop_stale(buf._surplus, policy_version)
        surplus_in = len(kept)
        buf._surplus = []
        carried, stale_partial = [], 0
        for g in self._partial:
            if group_staleness(g, policy_version) > cfg.max_staleness:
                stale_partial += 1
            else:
                carried.append(g)
        self._partial = []
        inflight: dict[int, Group] = {}  # prompt_seed -> group, in submission order
        resubmit = []
        for g in carried:
            inflight[g.prompt_seed] = g
            resubmit.extend((g, j) for j, s in enumerate(g.samples) if s.finish_reason == PENDING)
        if resubmit:
            client.submit(resubmit)
        partial_in = len(resubmit)
        cap = cfg.max_num_gen_batches * cfg.gen_batch_size
        fetched_before = prompts.fetched
        submitted = skipped = rounds = gen_tokens = 0
        graded: list[Sample] = []
        drops = [0, 0, 0]  # all correct, all wrong, other constant
        while len(kept) < cfg.train_batch_size:
            missing = cfg.train_batch_size - len(kept) - self.keep_rate * len(inflight)
            if missing > 0 and submitted < cap:
                want = min(math.ceil(missing / self.keep_rate), cfg.gen_batch_size, cap - submitted)
                new = []
                while len(new) < want:
                    record, position = prompts.pop()
                    if self.skipper.skip(record.index):
                        skipped += 1
                        continue
                    g = new_group(record, position, cfg.n)
                    inflight[position] = g
                    new.append(g)
                submitted += len(new)
                client.submit([(g, j) for g in new for j in range(cfg.n)])
            if not inflight:
                break  # at the cap, nothing running
            rounds += 1
            for r in client.poll(self.poll_tokens):
                extend_sample(inflight[r.key[0]].samples[r.key[1]], r)
                gen_tokens += len(r.response_ids)
            done = [g for g in inflight.values() if all(s.finish_reason != PENDING for s in g.samples)]
            if not done:
                continue
            for g in done:
                del inflight[g.prompt_seed]
            buf.grade(done)
            for g in done:
                graded.extend(g.samples)
                zero = buf.zero_variance(g)
                self.skipper.record(g.samples[0].prompt_index, zero)
                self._graded += 1
                if buf.keep_group(g):
                    kept.append(g)
                    self._kept += 1
                elif all(g.accs):
                    drops[0] += 1
                elif not any(g.accs):
                    drops[1] += 1
                else:
                    drops[2] += 1
        aborted = client.abort() if inflight else []
        aborted_tokens = 0
        for r in aborted:
            extend_sample(inflight[r.key[0]].samples[r.key[1]], r)
            gen_tokens += len(r.response_ids)
            aborted_tokens += len(r.response_ids)
        if self.partial_rollout:
            self._partial = list(inflight.values())
        hit_cap = len(kept) < cfg.train_batch_size
        if hit_cap and cfg.on_cap == "error":
            buf._surplus = kept
            raise RuntimeError(
                f"streaming dynamic sampling kept {len(kept)} of train_batch_size={cfg.train_batch_size} prompt groups "
                f"after {submitted} prompts (max_num_gen_batches={cfg.max_num_gen_batches} x gen_batch_size="
                f"{cfg.gen_batch_size}); dropped {drops[0]} all-correct, {drops[1]} all-wrong, {drops[2]} other constant "
                f"groups, skipped {skipped} prompts. Raise max_num_gen_batches or gen_batch_size, use data of suitable "
                "difficulty, or set on_cap='train_on_kept'.")
        out, buf._surplus = kept[:cfg.train_batch_size], kept[cfg.train_batch_size:]
        for i, g in enumerate(out):
            g.group_id = i
            for s in g.samples:
                s.group_id = i
        trained = [s for g in out for s in g.samples]
        metrics = buf._metrics(out, graded, num_batches=prompts.fetched - fetched_before, surplus_in=surplus_in,
                               dropped=tuple(drops), hit_cap=hit_cap, gen_tokens=gen_tokens)
        metrics.update({
            "rollout/keep_rate": self.keep_rate,
            "rollout/partial_in": float(partial_in),
            "rollout/partial_out": float(sum(s.finish_reason == PENDING for g in self._partial for s in g.samples)),
            "rollout/dropped_stale": float(dropped_stale + stale_partial),
        })
        if "rollout/gen_tokens" in metrics:  # absent with the generation's other metrics when nothing was sampled
            metrics.update({
                "rollout/rounds": float(rounds),
                "rollout/prompts_submitted": float(submitted),
                "rollout/skipped_prompts": float(skipped),
                "rollout/aborted_rows": float(len(aborted)),
                "rollout/aborted_tokens": float(aborted_tokens),
            })
        metrics.update(staleness_metrics(trained, policy_version))
        return out, metrics

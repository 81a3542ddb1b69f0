"""Rollout buffer with DAPO dynamic sampling (arXiv 2503.14476, Sec. 3.2, Algorithm 1).

:class:`GroupSelector` holds the rule once (keep a group of ``n`` responses iff ``max(metric) -
min(metric) > 0``, on the raw accuracy by default), with the step's keep/drop tally, the group
renumbering, the surplus and the metrics; the one step feeder
(:class:`~dapo_megatron.rollout.sampling.feeder.StepFeeder`) offers it groups.
:meth:`RolloutBuffer.collect` is the batch form: the surplus within ``max_staleness`` first, then
whole generation batches, graded (``reward = score + soft overlong penalty``, paper Eq. 13) and
offered until ``train_batch_size`` are kept or ``max_num_gen_batches`` are spent (``on_cap``).

Deterministic: the same generation batches and grades give the same output. In a distributed run
every rank runs this logic on the same replicated records
(:mod:`~dapo_megatron.rollout.plan.step_data`), while token lists stay on the rank that generated
them (``Sample.response_ids`` is None elsewhere) until the step's DP plan sends them.

Design: docs/design.md §3.3 (dynamic sampling).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from dapo_megatron.algorithms.overlong import overlong_penalty
from dapo_megatron.platform import collectives
from dapo_megatron.platform.distributed import collective_device
from dapo_megatron.rollout.sampling.config import DROP_REASONS, KEPT, BufferConfig
from dapo_megatron.rollout.sampling.feeder import Generated, StepFeeder, WholeBatches
from dapo_megatron.rollout.types import HELD_BY_ALL, Group, Sample

class RewardPoolLike(Protocol):
    """What the buffer needs of ``dapo_megatron.rewards.RewardPool``."""

    def grade(self, requests: Sequence[tuple[str, Optional[str], str, Optional[dict]]]) -> list[dict]:
        """``(data_source, solution_str, ground_truth, extra_info)`` per response →
        ``{"score": float, "acc": bool, "pred": str | None}`` per response, same order.
        ``solution_str`` is None for a response this rank does not hold: only a distributed
        pool (:class:`~dapo_megatron.rewards.distributed.DistributedGrader`) receives those."""


def group_to_dict(g: Group) -> dict:
    """A group as plain python (its samples' every field), for checkpoints."""
    return {"group_id": g.group_id, "samples": [dataclasses.asdict(s) for s in g.samples], "prompt_seed": g.prompt_seed}


def group_from_dict(d: dict) -> Group:
    """The inverse of :func:`group_to_dict`."""
    samples = [Sample(**{**s, "versions": [tuple(v) for v in s.get("versions", [])]}) for s in d["samples"]]
    return Group(group_id=int(d["group_id"]), samples=samples, prompt_seed=int(d.get("prompt_seed", -1)))


@dataclass
class _Step:
    """The tally of one step between :meth:`GroupSelector.begin` and :meth:`GroupSelector.take`."""

    policy_version: Optional[int]
    kept: list[Group]
    surplus_in: int
    dropped_stale: int
    graded: list[Sample] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    out: Optional[list[Group]] = None


class GroupSelector:
    """DAPO's dynamic-sampling selector (slime's ``filter_hub`` shape), for every way of feeding a
    step through the step feeder (the one caller of :meth:`offer`). A step is :meth:`begin`, then
    :meth:`grade` + :meth:`offer` per finished group in generation order until :attr:`missing` is 0
    or the feeder's cap, then :meth:`take` and :meth:`step_metrics`.

    Args:
        config: :class:`BufferConfig`, validated (``load_config``, or its own ``validate()``).
        reward_pool: a :class:`RewardPoolLike`.
        decode: token ids → response text for grading (tokenizer ``decode`` with
            ``skip_special_tokens=True``); not called for a response another rank holds.
    """

    def __init__(self, config: BufferConfig, reward_pool: RewardPoolLike, decode: Callable[[list[int]], str]):
        self.config = config
        self.reward_pool = reward_pool
        self.decode = decode
        self._surplus: list[Group] = []
        self._step: Optional[_Step] = None

    # ---- state ----------------------------------------------------------------------
    @property
    def surplus(self) -> list[Group]:
        """Kept groups waiting for the next step (graded and shaped), oldest first."""
        return list(self._surplus)

    def state_dict(self) -> dict:
        """Plain python (lists, dicts, numbers, strings): the surplus groups, for checkpoints."""
        return {"surplus": [group_to_dict(g) for g in self._surplus]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the surplus written by :meth:`state_dict`."""
        if not isinstance(state, dict) or "surplus" not in state:
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected a dict with key 'surplus' "
                             "(from state_dict())")
        self._surplus = [group_from_dict(d) for d in state["surplus"]]

    # ---- grading and the keep rule --------------------------------------------------------
    def grade(self, groups: list[Group]) -> None:
        """Grade and shape every sample of ``groups`` in place (one ``reward_pool.grade`` call):
        sets ``score``, ``acc``, ``pred``, ``overlong_penalty``, ``reward``, ``loss_mask_zero``.
        The overlong penalty's length is ``Sample.num_model_tokens``: the context tokens of a
        multi-turn rollout (a tool's output) do not count, as the penalty punishes the policy's
        own verbosity, which a long tool output is not (R for a single-turn sample)."""
        samples = [s for g in groups for s in g.samples]
        requests = [(s.data_source, self.decode(s.response_ids) if _grades_here(s) else None, s.ground_truth,
                     s.extra_info) for s in samples]
        results = self.reward_pool.grade(requests)
        if len(results) != len(samples):
            raise RuntimeError(f"reward_pool.grade returned {len(results)} results for {len(samples)} requests")
        lengths = torch.tensor([s.num_model_tokens for s in samples], dtype=torch.long)
        penalty = overlong_penalty(self.config.overlong, lengths).tolist()
        for s, r, p in zip(samples, results, penalty):
            s.score = float(r["score"])
            s.acc = bool(r["acc"])
            s.pred = r.get("pred")
            s.overlong_penalty = float(p)
            s.reward = s.score + s.overlong_penalty
            s.loss_mask_zero = bool(self.config.overlong_filter and s.truncated)

    def _metric_values(self, g: Group) -> list[float]:
        m = self.config.filter_metric
        if m == "acc":
            return [float(s.acc) for s in g.samples]
        if m == "score":
            return [s.score for s in g.samples]
        return [s.reward for s in g.samples]

    def zero_variance(self, g: Group) -> bool:
        """Every response of the (graded) group has the same ``filter_metric`` value: zero advantage."""
        vals = self._metric_values(g)
        return not max(vals) - min(vals) > 0

    def keep_group(self, g: Group) -> bool:
        """Dynamic-sampling rule: ``max(metric) - min(metric) > 0`` over the group's responses."""
        return not self.config.filter_groups or not self.zero_variance(g)

    def drop_stale(self, groups: list[Group], policy_version: Optional[int]) -> tuple[list[Group], int]:
        """``(kept, dropped)``: the groups within ``max_staleness`` versions of ``policy_version``
        (all of them when it is None), and how many were not."""
        if policy_version is None:
            return list(groups), 0
        kept = [g for g in groups if group_staleness(g, policy_version) <= self.config.max_staleness]
        return kept, len(groups) - len(kept)

    # ---- the step -------------------------------------------------------------------------
    def begin(self, policy_version: Optional[int]) -> None:
        """Start a step for the actor of weights version ``policy_version`` (None: no staleness
        bookkeeping): the surplus within ``max_staleness`` is kept first, the rest dropped."""
        kept, dropped_stale = self.drop_stale(self._surplus, policy_version)
        self._surplus = []
        self._step = _Step(policy_version, kept, surplus_in=len(kept), dropped_stale=dropped_stale)

    def _current(self) -> _Step:
        if self._step is None:
            raise RuntimeError(f"{type(self).__name__}: call begin(policy_version) before offering groups")
        return self._step

    @property
    def missing(self) -> int:
        """Kept groups still needed for ``train_batch_size`` (0 once reached)."""
        return max(0, self.config.train_batch_size - len(self._current().kept))

    @property
    def kept(self) -> list[Group]:
        """The open step's kept groups so far, in the order kept (carried surplus first); a copy."""
        return list(self._current().kept)

    @property
    def graded(self) -> list[Sample]:
        """The samples of every group offered in the open step (kept or dropped), in offer order; a copy."""
        return list(self._current().graded)

    def step_state_dict(self) -> dict:
        """The open step's tally as plain python, for a checkpoint taken mid-step (the async
        controller's): ``kept`` (groups, :func:`group_to_dict`), ``surplus_in``, ``dropped_stale``,
        ``graded`` (one single-sample group per graded sample) and ``dropped`` (reason -> count).
        :meth:`load_step_state` is its inverse. The surplus is not in it (:meth:`state_dict`)."""
        st = self._current()
        return {"kept": [group_to_dict(g) for g in st.kept], "surplus_in": st.surplus_in,
                "dropped_stale": st.dropped_stale, "graded": [group_to_dict(Group(-1, [x])) for x in st.graded],
                "dropped": dict(st.dropped)}

    def load_step_state(self, policy_version: Optional[int], state: dict) -> None:
        """Open the step of ``policy_version`` with the tally :meth:`step_state_dict` wrote (the
        surplus is left as it is: restore it first with :meth:`load_state_dict`, which this does not
        consume). Raises ``KeyError`` naming a missing key."""
        step = _Step(policy_version, [group_from_dict(g) for g in state["kept"]], surplus_in=int(state["surplus_in"]),
                     dropped_stale=int(state["dropped_stale"]))
        step.graded = [group_from_dict(g).samples[0] for g in state["graded"]]
        step.dropped = {r: int(state["dropped"][r]) for r in DROP_REASONS}
        self._step = step

    def offer(self, g: Group) -> str:
        """Offer one graded group of this step's generation: :data:`KEPT`, or the reason it was
        dropped (one of :data:`DROP_REASONS`). Its samples count for the generation metrics
        either way."""
        step = self._current()
        step.graded.extend(g.samples)
        if self.keep_group(g):
            step.kept.append(g)
            return KEPT
        reason = "all_correct" if all(g.accs) else "all_wrong" if not any(g.accs) else "other"
        step.dropped[reason] += 1
        return reason

    def fail_at_cap(self, what: str) -> None:
        """End the step at the feeder's cap with fewer than N kept under ``on_cap="error"``: the
        kept groups stay in the surplus, and ``RuntimeError`` names ``what`` was spent, the
        dropped counts and the knobs."""
        step = self._current()
        self._surplus, self._step = step.kept, None
        d = step.dropped
        raise RuntimeError(
            f"{what}: kept {len(step.kept)} of train_batch_size={self.config.train_batch_size} prompt groups "
            f"(dropped {d['all_correct']} all-correct, {d['all_wrong']} all-wrong, {d['other']} other constant "
            "groups). Raise max_num_gen_batches or gen_batch_size, use data of suitable difficulty, or set "
            "on_cap='train_on_kept'.")

    def take(self) -> list[Group]:
        """The step's trained groups: the first ``train_batch_size`` kept (surplus first),
        renumbered ``group_id = 0..len-1`` (samples too) so ids are unique per step; the kept
        rest becomes the surplus."""
        step = self._current()
        n = self.config.train_batch_size
        step.out, self._surplus = step.kept[:n], step.kept[n:]
        for i, g in enumerate(step.out):
            g.group_id = i
            for s in g.samples:
                s.group_id = i
        return list(step.out)

    def step_metrics(self, *, num_batches: int, gen_tokens: Optional[int] = None) -> dict[str, float]:
        """The metrics of the step that :meth:`take` ended (and ends the step).

        ``rollout/{num_gen_batches, kept_groups, surplus_in, surplus_out, hit_cap,
        dropped_stale}`` (``hit_cap``: fewer than N trained); the trained batch
        (:func:`trained_batch_metrics`, :func:`staleness_metrics`); the step's generation
        (:func:`generation_metrics` over the offered groups' samples; ``gen_tokens``: the
        tokens sampled, default their response tokens), absent when nothing was generated.
        """
        step = self._current()
        if step.out is None:
            raise RuntimeError(f"{type(self).__name__}.step_metrics: call take() first")
        self._step = None
        out = step.out
        metrics = {
            "rollout/num_gen_batches": float(num_batches),
            "rollout/kept_groups": float(len(out)),
            "rollout/surplus_in": float(step.surplus_in),
            "rollout/surplus_out": float(len(self._surplus)),
            "rollout/hit_cap": float(len(out) < self.config.train_batch_size),
        }
        train = [s for g in out for s in g.samples]
        metrics.update(trained_batch_metrics(train))
        if gen_tokens is None:
            gen_tokens = sum(s.response_length for s in step.graded)
        metrics.update(generation_metrics(step.graded, gen_tokens, train,
                                          tuple(step.dropped[r] for r in DROP_REASONS)))
        metrics["rollout/dropped_stale"] = float(step.dropped_stale)
        metrics.update(staleness_metrics(train, step.policy_version))
        return metrics


class RolloutBuffer(GroupSelector):
    """The selector with the batch form of the step feeder (verl's dynamic sampling: the
    :class:`~dapo_megatron.rollout.sampling.feeder.WholeBatches` admission; module docstring)."""

    def _check_batch(self, groups: Any, batch_index: int) -> list[Group]:
        cfg = self.config
        if not isinstance(groups, list) or not groups or not all(isinstance(g, Group) for g in groups):
            raise ValueError(f"generate_batch() call {batch_index} must return a non-empty list of Group")
        if len(groups) > cfg.gen_batch_size:
            raise ValueError(f"generate_batch() call {batch_index} returned {len(groups)} groups, more than "
                             f"buffer.gen_batch_size={cfg.gen_batch_size}")
        for g in groups:
            if len(g.samples) != cfg.n:
                raise ValueError(f"group {g.group_id} of generation batch {batch_index} has {len(g.samples)} "
                                 f"responses; buffer.n={cfg.n} requires exactly n per prompt")
        return groups

    def collect(self, generate_batch: Callable[..., list[Group]], policy_version: Optional[int] = None, *,
                prompts: Any = None, skipper: Any = None) -> tuple[list[Group], dict[str, float]]:
        """Gather the groups of one training step.

        Args:
            generate_batch: returns the ungraded groups (``n`` samples each, at most
                ``gen_batch_size`` groups) of the next generation batch; with ``prompts``, of
                the ``(record, position)`` pairs it is given.
            policy_version: the actor's weights version (:meth:`GroupSelector.begin`).
            prompts, skipper: GRESO prompt skipping
                (:class:`~dapo_megatron.rollout.sampling.feeder.WholeBatches`); the metrics add
                ``rollout/{prompts_submitted, skipped_prompts}``.

        Returns:
            ``(groups, metrics)``: :meth:`GroupSelector.take` (fewer than ``train_batch_size``,
            possibly 0, only with ``on_cap="train_on_kept"`` at the cap: the trainer skips an
            empty step) and :meth:`GroupSelector.step_metrics`.

        Raises:
            RuntimeError: the cap under ``on_cap == "error"`` (:meth:`GroupSelector.fail_at_cap`).
            ValueError: a generation batch of the wrong shape.
        """
        feeder = StepFeeder(self, WholeBatches(self.config, lambda *drawn: self._check_batch(
            generate_batch(*drawn), feeder.admission.num_batches), prompts, skipper))
        feeder.begin(policy_version)
        feeder.fill(Generated())
        out, metrics = feeder.take()
        if prompts is not None and "rollout/gen_tokens" in metrics:  # absent with the others when nothing ran
            metrics.update(feeder.admission.skip_metrics())
        return out, metrics


GENERATION_METRICS = (
    "rollout/gen_tokens", "rollout/gen_tokens_per_kept_token", "rollout/gen_response_length_mean",
    "rollout/gen_score_mean", "rollout/gen_acc_mean", "rollout/gen_reward_mean", "rollout/gen_overlong_penalty_mean",
    "rollout/dropped_all_correct", "rollout/dropped_all_wrong", "rollout/dropped_other",
    # the streamed rollout's (StreamingCollector.collect) and the trainer's throughput
    "rollout/rounds", "rollout/prompts_submitted", "rollout/skipped_prompts", "rollout/aborted_rows",
    "rollout/aborted_tokens", "perf/gen_tokens_per_s",
)
"""Metrics of what a step generated: logged only by a step that sampled a token or graded a
response (none of them by a step that trains carried groups only: absent, not NaN or 0)."""


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs))


def generation_metrics(graded: Sequence[Sample], gen_tokens: int, trained: Sequence[Sample],
                       dropped: tuple[int, int, int]) -> dict[str, float]:
    """Metrics of the step's generation (names in :data:`GENERATION_METRICS`); ``{}`` when
    nothing was generated (``gen_tokens == 0`` and nothing ``graded``).

    ``graded``: the responses graded in this step, before dynamic sampling; ``gen_tokens``: the
    tokens sampled in this step; ``trained``: the trained batch's samples; ``dropped``: the groups
    dropped per :data:`DROP_REASONS`. ``rollout/gen_tokens_per_kept_token`` = gen_tokens / response
    tokens of ``trained`` (dynamic sampling's over-generation cost; carried surplus makes it < 1 at
    times); the ``rollout/gen_*_mean`` (the policy's unfiltered performance) only when a response
    was graded (a streamed step may abort all it sampled).
    """
    if not gen_tokens and not graded:
        return {}
    kept_tokens = sum(s.response_length for s in trained)
    out = {"rollout/gen_tokens": float(gen_tokens),
           "rollout/dropped_all_correct": float(dropped[0]),
           "rollout/dropped_all_wrong": float(dropped[1]),
           "rollout/dropped_other": float(dropped[2])}
    if kept_tokens:
        out["rollout/gen_tokens_per_kept_token"] = gen_tokens / kept_tokens
    if graded:
        out.update({
            "rollout/gen_score_mean": _mean(s.score for s in graded),
            "rollout/gen_acc_mean": _mean(s.acc for s in graded),
            "rollout/gen_reward_mean": _mean(s.reward for s in graded),
            "rollout/gen_overlong_penalty_mean": _mean(s.overlong_penalty for s in graded),
            "rollout/gen_response_length_mean": _mean(s.response_length for s in graded),
        })
    return out


def trained_batch_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Metrics of the trained batch (carried groups included; ``{}`` when empty), as verl's
    ``critic/score/mean``: with dynamic sampling ``train/acc_mean`` is that of mixed groups only
    (``rollout/gen_acc_mean`` is the policy's)."""
    if not samples:
        return {}
    return {
        "train/score_mean": _mean(s.score for s in samples),
        "train/acc_mean": _mean(s.acc for s in samples),
        "train/reward_mean": _mean(s.reward for s in samples),
        "train/overlong_penalty_mean": _mean(s.overlong_penalty for s in samples),
        "train/response_length_mean": _mean(s.response_length for s in samples),
        "train/response_length_max": float(max(s.response_length for s in samples)),
        "train/truncation_ratio": _mean(s.truncated for s in samples),
    }


def _grades_here(s: Sample) -> bool:
    """Whether this rank grades ``s``: it holds the response, and a response every rank holds
    (:data:`~dapo_megatron.rollout.types.HELD_BY_ALL`: streamed, or read from a checkpoint) is
    graded by rank 0 alone (the distributed grader needs exactly one grader per response)."""
    if s.response_ids is None:
        return False
    if s.holder != HELD_BY_ALL:
        return True
    return not dist.is_initialized() or dist.get_rank() == 0


def group_staleness(g: Group, policy_version: int) -> int:
    """Versions behind ``policy_version`` of the oldest token of the group (0 when unknown)."""
    return max((s.staleness(policy_version) for s in g.samples), default=0)


def staleness_metrics(samples: Sequence[Sample], policy_version: Optional[int]) -> dict[str, float]:
    """The trained batch's staleness: ``train/staleness_{mean,max}``, weight versions behind
    ``policy_version`` over every response token of ``samples`` (tokens of unknown version
    count 0), and ``train/stale_samples``, samples with at least one stale token. Empty when
    ``policy_version`` is None or there are no samples."""
    if policy_version is None or not samples:
        return {}
    behind = [policy_version - v for s in samples for v in s.token_versions()]
    return {
        "train/staleness_mean": float(sum(behind) / len(behind)) if behind else 0.0,
        "train/staleness_max": float(max(behind, default=0)),
        "train/stale_samples": float(sum(1 for s in samples if s.staleness(policy_version) > 0)),
    }


def split_fresh_stale(samples: Sequence[Sample], policy_version: int) -> tuple[list[Sample], list[Sample]]:
    """``(fresh, stale)``: samples whose every token the actor's current weights
    ``policy_version`` sampled (their rollout-vs-actor gap is the numerics alone), and the
    rest (the gap also holds the policy change)."""
    fresh = [s for s in samples if s.staleness(policy_version) == 0]
    stale = [s for s in samples if s.staleness(policy_version) > 0]
    return fresh, stale


def logprob_mismatch_metrics(samples: Sequence[Sample], group=None, older_than: Optional[int] = None) -> dict[str, float]:
    """Rollout-vs-actor logprob mismatch: ``|Sample.rollout_logprobs - Sample.old_logprobs|`` per
    model token (nats; context tokens, ``response_mask`` 0, left out), over the samples with
    ``old_logprobs`` (``loss_mask_zero`` ones included). Top-p/top-k rollout logprobs are those of
    the truncated distribution, so a non-zero mismatch is expected there.

    Args:
        samples: the samples; each DP rank passes its own (with their ``old_logprobs``).
        group: the DP group to pool over (a collective then: every rank of it calls);
            None pools ``samples`` alone. The mean is the pooled float64 sum over the pooled
            token count (bitwise ``torch.mean`` of the concatenated tokens on one rank).
        older_than: count only the tokens sampled by weights older than this version
            (``Sample.token_versions``: the stale tokens of a policy version, also those of a
            partial rollout whose later tokens are fresh; tokens of unknown version count as
            fresh); None: every token.

    Returns:
        ``{"rollout/logprob_diff_mean": mean over tokens, "rollout/logprob_diff_max": max}``.

    Raises:
        ValueError: a sample's two logprob lists differ in length (naming its index), or
            no sample (of any rank of ``group``) has ``old_logprobs``.
    """
    diffs = []
    for i, s in enumerate(samples):
        if s.old_logprobs is None:
            continue
        if s.rollout_logprobs is None or len(s.old_logprobs) != len(s.rollout_logprobs):
            raise ValueError(f"samples[{i}]: old_logprobs has {len(s.old_logprobs)} entries but rollout_logprobs "
                             f"has {None if s.rollout_logprobs is None else len(s.rollout_logprobs)} (both must "
                             "cover response_ids)")
        d = torch.tensor(s.rollout_logprobs, dtype=torch.float64) - torch.tensor(s.old_logprobs, dtype=torch.float64)
        keep = None if s.response_mask is None else torch.tensor(s.loss_token_mask(), dtype=torch.bool)
        if older_than is not None:
            versions = s.token_versions() or [older_than] * len(d)  # unknown versions count as fresh
            stale = torch.tensor([v < older_than for v in versions], dtype=torch.bool)
            keep = stale if keep is None else keep & stale
        if keep is not None:
            d = d[keep]
        diffs.append(d)
    d = torch.cat(diffs).abs() if diffs else torch.zeros(0, dtype=torch.float64)
    # [sum, token count, samples with old_logprobs] and the max: exact to pool over ranks
    totals = torch.tensor([float(d.sum()), float(d.numel()), float(len(diffs))], dtype=torch.float64)
    peak = torch.tensor([float(d.max()) if d.numel() else float("-inf")], dtype=torch.float64)
    if group is not None and collectives.group_size(group) > 1:
        dev = collective_device(group)
        totals = collectives.all_reduce(totals.to(dev), group=group).cpu()
        peak = collectives.all_reduce(peak.to(dev), group=group, op=collectives.ReduceOp.MAX).cpu()
    total, count, with_old = totals.tolist()
    if with_old == 0:
        raise ValueError("logprob_mismatch_metrics: no sample has old_logprobs; compute actor logprobs first")
    if count == 0:
        return {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0}
    return {"rollout/logprob_diff_mean": total / count, "rollout/logprob_diff_max": float(peak[0])}

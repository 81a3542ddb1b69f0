"""Validation of a training run: avg@k / pass@k on the distinct validation problems (docs/design.md §2.3).

:class:`Validation` holds what every way of generating the validation responses shares (the
problems, their seeds and sampling parameters, the grading and the metrics) and the synchronous
engine path (:meth:`Validation.run`); the background driver of ``async_training``
(:class:`~dapo_megatron.rollout.background.BackgroundDriver`) generates the same requests on its
controller's servers and grades them with the same parts, so both report the same metrics at the
same weights and step.
"""

from __future__ import annotations

from typing import Any, Sequence

from dapo_megatron.data.dataset import unique_prompts
from dapo_megatron.metrics import compute_val_metrics
from dapo_megatron.rollout.engines.engine import SamplingParams, completions_to_group
from dapo_megatron.rollout.trajectory import run_turns


class Validation:
    """The validation of one rollout (composed by :class:`~dapo_megatron.rollout.rollout.Rollout`,
    whose ``cfg``, ``parallel``, ``engine``, ``val_data``, ``reward_pool``, ``decode``, ``trajectory``
    and sampling parameters it reads)."""

    def __init__(self, rollout: Any):
        self.rollout = rollout

    def run(self, step: int) -> dict[str, float]:
        """avg@k and pass@k (k = ``rollout.val_n``) on :meth:`problems`, a collective: the problems
        are dealt over the rollout engines
        (:func:`~dapo_megatron.rollout.engines.layout.engine_share`) and sampled with :meth:`params`,
        so the samples do not depend on the world size, then graded (:meth:`grade`). The engine keeps
        its weights when it sleeps afterwards: no update comes before the next rollout.

        Returns:
            :meth:`metrics`, identical on all ranks.
        """
        r = self.rollout
        problems, params = self.problems(), self.params(step)
        mine = r.engine_share(len(problems))
        r.wake()
        outputs = r.engine.generate([problems[i].prompt_ids for i in mine], params, mine) if mine else []
        val_samples = []
        if r.trajectory.multi_turn and outputs:  # the tool turns of validation's responses too
            groups = [completions_to_group(-1, problems[i].prompt_ids, comps) for i, comps in zip(mine, outputs)]
            rows = [(s, i, j) for i, g in zip(mine, groups) for j, s in enumerate(g.samples)]
            run_turns(r.engine, rows, params, r.trajectory)
            outputs = [g.samples for g in groups]  # each with response_ids: what the grader reads
            val_samples = [s for s, _, _ in rows]
        r.sleep(keep_weights=True)  # no update before the next rollout: the weights stay valid
        graded = self.grade(problems, zip(mine, outputs))
        for s, acc in zip(val_samples, [a for i in mine for a in graded.get(i, [])]):
            s.acc = bool(acc)
        r.parallel.wait_for_generation()  # ranks that generate nothing wait on gloo, not in the gather
        accs: dict[int, list[float]] = {}
        for part in r.parallel.all_gather_objects(graded, "world"):
            accs.update(part)
        metrics = self.metrics(problems, accs)
        if r.trajectory.multi_turn:
            metrics.update(r.trajectory_metrics(r.trajectory.take_counts(val_samples), "val/tool/"))
        return metrics

    def problems(self) -> list:
        """The validation problems, in file order of their first copy: the distinct ones (copies of
        one problem, equal ``data_source``, prompt ids and ground truth, count once:
        :func:`unique_prompts`), the first ``rollout.val_max_prompts`` when > 0. Problem ``i`` is
        prompt seed ``i``."""
        r = self.rollout
        problems = [rec for rec, _ in unique_prompts(r.val_data.records)]
        if r.cfg.rollout.val_max_prompts > 0:
            problems = problems[:r.cfg.rollout.val_max_prompts]
        return problems

    def params(self, step: int) -> SamplingParams:
        """Validation's sampling parameters at ``step``: ``n = rollout.val_n``, ``val_temperature`` /
        ``val_top_p`` / ``top_k``, ``response_length`` new tokens, seed ``trainer.seed + 7919 * step``
        (response ``j`` of problem ``i``: :func:`~dapo_megatron.rollout.engines.engine.sample_seed`
        ``(seed, i, j)``)."""
        r = self.rollout
        c = r.cfg.rollout
        return r.sampling_params(n=c.val_n, temperature=c.val_temperature, top_p=c.val_top_p,
                                 seed=r.cfg.trainer.seed + 7919 * step)

    def grade(self, problems: Sequence[Any], outputs: Any) -> dict[int, list[float]]:
        """``(problem index, its completions)`` pairs → per problem index the 0/1 ``acc`` of each
        completion, in order: decoded (``skip_special_tokens=True``) and graded by this rank's
        reward pool in one call. Not a collective."""
        requests, owners = [], []
        for i, comps in outputs:
            rec = problems[i]
            for c in comps:
                requests.append((rec.data_source, self.rollout.decode(c.response_ids), rec.ground_truth,
                                 rec.extra_info))
                owners.append(i)
        results = self.rollout.reward_pool.grade(requests) if requests else []
        local: dict[int, list[float]] = {}
        for i, res in zip(owners, results):
            local.setdefault(i, []).append(1.0 if res["acc"] else 0.0)
        return local

    def metrics(self, problems: Sequence[Any], accs: dict[int, list[float]]) -> dict[str, float]:
        """:func:`~dapo_megatron.metrics.compute_val_metrics` (``k = rollout.val_n``) of every
        problem's accuracies (``accs``: problem index → its ``val_n`` 0/1 grades), by problem index."""
        order = sorted(accs)
        return compute_val_metrics([problems[i].data_source for i in order], [accs[i] for i in order],
                                   k=self.rollout.cfg.rollout.val_n)

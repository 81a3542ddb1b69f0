"""The step's data path (rollout.plan.step_data, actor.step_plan): records replicated, grades graded once where held and
replicated, the per-mini-batch DP plan, tokens delivered exactly to the ranks that train them,
and the pooled mismatch metrics; on one process and on a 4-process gloo world (TP=2 × DP=2)."""

from __future__ import annotations

import random

import pytest
import torch

from dapo_megatron.actor.dp_split import split_for_dp
from dapo_megatron.actor.step_plan import old_logprob_micro_batches, plan_step
from dapo_megatron.data.dataset import PromptRecord
from dapo_megatron.platform import ParallelConfig, spawn
from dapo_megatron.rewards.distributed import DistributedGrader
from dapo_megatron.rollout.engines.engine import Completion, completions_to_group
from dapo_megatron.rollout.plan.step_data import gather_groups, send_tokens
from dapo_megatron.rollout.sampling.buffer import RolloutBuffer, logprob_mismatch_metrics
from dapo_megatron.rollout.sampling.config import BufferConfig
from dapo_megatron.rollout.types import Group, Sample

N = 3  # responses per prompt
PER_DP = 5  # prompts per DP rank: the two MP ranks generate 3 and 2 of them
RECORDS = [PromptRecord(index=i, data_source="toy", prompt_ids=[7, 8, 9][: 1 + i % 3] + [i], messages=[],
                        ground_truth=str(i % 4), extra_info={"row": i}) for i in range(40)]


def _prompt_of(dp_rank: int, position: int) -> int:
    return (11 * dp_rank + 3 * position) % len(RECORDS)


def _completions(dp_rank: int, position: int) -> list[Completion]:
    """Deterministic responses of one prompt: lengths 0..9, float32 logprobs, both finish reasons."""
    rng = random.Random(1000 * dp_rank + position)
    out = []
    for _ in range(N):
        length = rng.randrange(0, 10)
        ids = [rng.randrange(0, 50_000) for _ in range(length)]
        lps = torch.randn(length, generator=torch.Generator().manual_seed(rng.randrange(10**6))).tolist()
        out.append(Completion(ids, lps, rng.choice(("stop", "length"))))
    return out


def _group(dp_rank: int, position: int) -> Group:
    """The group of a prompt; at position 1 its first response is a two-turn one (context tokens
    with ``response_mask`` 0, then one more model token), whose mask and count travel too."""
    rec = RECORDS[_prompt_of(dp_rank, position)]
    g = completions_to_group(-1, rec.prompt_ids, _completions(dp_rank, position), prompt_index=rec.index,
                             data_source=rec.data_source, ground_truth=rec.ground_truth, extra_info=rec.extra_info)
    if position == 1:
        s = g.samples[0]
        s.append_tokens(0, [11, 12, 13], None, context=True)
        s.append_tokens(0, [14], [-0.75])
    return g


class ParityGrader:
    """A RewardPoolLike that grades by the text's length (the exchange, not the grading, is under
    test) and records every request it was given."""

    def __init__(self):
        self.seen: list[str] = []

    def grade(self, requests):
        self.seen.extend(r[1] for r in requests)
        return [{"score": 1.0 if len(r[1]) % 2 else -1.0, "acc": len(r[1]) % 2 == 1, "pred": f"p{len(r[1])}"}
                for r in requests]


def _decode(ids):
    return " ".join(map(str, ids))


def _groups_with_lengths(lengths_per_group, prompt_len=3):
    return [Group(g, [Sample([1] * prompt_len, [5] * L, [-0.5] * L, "stop", group_id=g) for L in lens])
            for g, lens in enumerate(lengths_per_group)]


@pytest.mark.parametrize("dp,mb,budget", [(1, 2, 64), (2, 1, 40), (2, 3, 25), (3, 2, 1000)])
def test_plan_splits_each_mini_batch_once_like_split_for_dp(dp, mb, budget):
    rng = random.Random(dp * 100 + mb)
    groups = _groups_with_lengths([[rng.randrange(0, 20) for _ in range(4)] for _ in range(6)])
    groups[2].samples[1].loss_mask_zero = True
    plan = plan_step(groups, mb, dp, budget)
    samples = [s for g in groups for s in g.samples]
    owner = {}
    for m, mini in enumerate(plan.mini_batches):
        first = m * mb * 4
        want = split_for_dp(samples[first:first + mini.size], dp, budget)  # the old per-mini-batch call
        assert mini.start == first and mini.size == len([s for g in groups[m * mb:(m + 1) * mb] for s in g.samples])
        assert [[[i - first for i in b] for b in rank] for rank in mini.micro_batches] == want
        assert mini.global_num_tokens == sum(len(s.response_ids) for s in samples[first:first + mini.size]
                                             if not s.loss_mask_zero)
        assert mini.total_tokens == sum(s.total_length for s in samples[first:first + mini.size])
        for d, rank in enumerate(mini.micro_batches):
            for b in rank:
                for i in b:
                    assert i not in owner
                    owner[i] = d
    assert sorted(owner) == list(range(len(samples))) and plan.owner == tuple(owner[i] for i in range(len(samples)))
    assert sorted(i for d in range(dp) for i in plan.owned(d)) == list(range(len(samples)))



def test_old_logprob_pass_runs_equal_micro_batch_counts_on_every_dp_rank_when_experts_span_dp():
    # DP=2, 2 mini-batches of 2 groups: packing each rank's whole share anew gives the two ranks
    # 4 and 5 micro-batches (fine for a dense model; an EP=2 MoE hung in the all-to-all of the
    # fifth forward, in the SmolLM2 MoE job's first step)
    groups = _groups_with_lengths([[2, 30, 1, 3], [1, 20, 20, 20], [20, 2, 1, 20], [1, 20, 20, 30]])
    samples = [s for g in groups for s in g.samples]
    budget = 40
    plan = plan_step(groups, 2, 2, budget)
    counts = {}
    for equal in (False, True):
        for d in range(2):
            mine = plan.owned(d)
            mbs = old_logprob_micro_batches(plan, mine, d, budget, [samples[i] for i in mine], equal_counts=equal)
            assert sorted(j for mb in mbs for j in mb) == list(range(len(mine)))  # each own sample once
            assert all(sum(samples[mine[j]].total_length for j in mb) <= budget for mb in mbs)
            counts[(equal, d)] = len(mbs)
    assert counts[(False, 0)] != counts[(False, 1)], counts  # the case the equal counts are for
    assert counts[(True, 0)] == counts[(True, 1)] == sum(len(m.micro_batches[0]) for m in plan.mini_batches)

def test_one_process_gathers_its_own_groups_and_grades_them():
    local = [(0, p, _group(0, p)) for p in (2, 0, 1)]
    groups = gather_groups(local, n=N, max_local=3, record_of=RECORDS.__getitem__)
    assert groups == [local[1][2], local[2][2], local[0][2]]  # ordered by position, the same objects
    grader = ParityGrader()
    buffer = RolloutBuffer(BufferConfig(train_batch_size=1, n=N, gen_batch_size=3), DistributedGrader(grader), _decode)
    buffer.grade(groups)
    samples = [s for g in groups for s in g.samples]
    assert grader.seen == [_decode(s.response_ids) for s in samples]
    assert [s.acc for s in samples] == [len(_decode(s.response_ids)) % 2 == 1 for s in samples]
    assert send_tokens(samples, [(0,)] * len(samples)) == 0  # nothing to move in a world of one
    with pytest.raises(RuntimeError, match="response 0 of the batch was graded by 0 ranks"):
        DistributedGrader(grader).grade([("toy", None, "1", None)])


def _world_worker(out_path: str) -> None:
    import torch.distributed as dist

    from dapo_megatron.platform import init_distributed
    from dapo_megatron.rollout.plan.step_data import gather_preds

    par = init_distributed(ParallelConfig(2, 1), seed=0)  # 4 ranks: TP=2 × DP=2
    res = {}
    positions = list(range(par.mp_rank, PER_DP, par.mp_size))
    local = [(par.dp_rank, p, _group(par.dp_rank, p)) for p in positions]
    groups = gather_groups(local, n=N, max_local=-(-PER_DP // par.mp_size), record_of=RECORDS.__getitem__,
                           parallel=par)
    samples = [s for g in groups for s in g.samples]
    res["records"] = [(s.prompt_index, s.prompt_ids, s.response_length, s.finish_reason, s.holder, s.data_source,
                       s.ground_truth, s.extra_info, s.num_context_tokens) for s in samples]
    res["held"] = [s.response_ids is not None for s in samples]

    grader = ParityGrader()
    RolloutBuffer(BufferConfig(train_batch_size=1, n=N, gen_batch_size=2 * PER_DP), DistributedGrader(grader, par),
                  _decode).grade(groups)
    res["graded_here"] = list(grader.seen)
    res["grades"] = [(s.score, s.acc, s.reward, s.pred) for s in samples]

    plan = plan_step(groups, 3, par.dp_size, 24)
    res["owner"] = plan.owner
    received = send_tokens(samples, [par.ranks_of_dp_rank(d) for d in plan.owner], parallel=par)
    mine = plan.owned(par.dp_rank)
    res["received_bytes"] = received
    res["mine"] = {i: (samples[i].response_ids, samples[i].rollout_logprobs, samples[i].response_mask) for i in mine}
    res["not_mine_held"] = [i for i, s in enumerate(samples) if i not in mine and s.response_ids is not None]
    for i in mine:  # an old policy 0.25 nats per token below the rollout's
        samples[i].old_logprobs = [x - 0.25 * (k % 3) for k, x in enumerate(samples[i].rollout_logprobs)]
    res["mismatch"] = logprob_mismatch_metrics([samples[i] for i in mine], group=par.dp_group)

    send_tokens(samples, [(0,)] * len(samples), parallel=par)  # as DAPOTrainer.save does for its surplus
    gather_preds(samples, parallel=par, dst=0)
    if par.rank == 0:
        res["rank0_all"] = [(s.response_ids, s.rollout_logprobs, s.response_mask, s.pred) for s in samples]
    torch.save(res, out_path.format(rank=dist.get_rank()))


@pytest.mark.dist
def test_four_ranks_route_each_response_once_to_the_ranks_that_train_it(tmp_path):
    path = str(tmp_path / "rank{rank}.pt")
    spawn(_world_worker, 4, path)
    ranks = [torch.load(path.format(rank=r), weights_only=False) for r in range(4)]
    # the reference, on one process: DP rank d's prompts, position order; (dp, mp) generates
    # positions mp::2 on global rank 2 * dp + mp (megatron-core puts a TP group on consecutive ranks)
    ref = [(d, p, _group(d, p)) for d in range(2) for p in range(PER_DP)]
    ref_samples = [s for _, _, g in ref for s in g.samples]
    holders = [2 * d + p % 2 for d, p, g in ref for _ in g.samples]
    want_records = [(s.prompt_index, s.prompt_ids, len(s.response_ids), s.finish_reason, h, s.data_source,
                     s.ground_truth, s.extra_info, s.num_context_tokens) for s, h in zip(ref_samples, holders)]
    assert sum(s.num_context_tokens > 0 for s in ref_samples) == 2  # one two-turn response per DP rank
    texts = [_decode(s.response_ids) for s in ref_samples]
    want_grades = [(1.0 if len(t) % 2 else -1.0, len(t) % 2 == 1) for t in texts]
    for r, res in enumerate(ranks):
        assert res["records"] == want_records  # every rank: every record, in (DP rank, position) order
        assert res["held"] == [h == r for h in holders]  # the token lists only where generated
        # each response graded once, by its holder; the grades everywhere, the extracted answer on the holder
        assert res["graded_here"] == [t for t, h in zip(texts, holders) if h == r]
        for (score, acc, reward, pred), (ws, wa), t, h in zip(res["grades"], want_grades, texts, holders):
            assert (score, acc) == (ws, wa) and reward == score  # overlong shaping is off
            assert pred == (f"p{len(t)}" if h == r else None)
        assert res["owner"] == ranks[0]["owner"]  # one plan on every rank
        # exactly this DP rank's samples, bit for bit, and nothing else beyond what it generated
        dp = r // 2
        assert sorted(res["mine"]) == [i for i, d in enumerate(res["owner"]) if d == dp]
        for i, (ids, lps, mask) in res["mine"].items():
            assert ids == ref_samples[i].response_ids and lps == ref_samples[i].rollout_logprobs
            assert mask == ref_samples[i].response_mask  # None single-turn; the two-turn one's travelled
        assert all(holders[i] == r for i in res["not_mine_held"])
        want_bytes = sum((12 if ref_samples[i].num_context_tokens else 8) * len(ref_samples[i].response_ids)
                         for i, d in enumerate(res["owner"]) if d == dp and holders[i] != r)
        assert res["received_bytes"] == want_bytes
        # the mismatch pooled over DP equals the one-process metric over all samples
        diffs = torch.cat([torch.tensor([0.25 * (k % 3) for k, m in enumerate(s.loss_token_mask()) if m],
                                        dtype=torch.float64) for s in ref_samples])  # the context left out
        assert res["mismatch"]["rollout/logprob_diff_max"] == pytest.approx(float(diffs.max()), abs=1e-12)
        assert res["mismatch"]["rollout/logprob_diff_mean"] == pytest.approx(float(diffs.mean()), rel=1e-12)
    assert ranks[0]["rank0_all"] == [(s.response_ids, s.rollout_logprobs, s.response_mask, f"p{len(t)}")
                                     for s, t in zip(ref_samples, texts)]

"""split_for_dp: token-balanced DP ranks, token-budget micro-batches, equal micro-batch counts."""

import itertools
import warnings

import pytest
from hypothesis import given, settings, strategies as st

from dapo_megatron.actor.dp_split import split_for_dp
from dapo_megatron.algorithms.overlong import OverlongConfig
from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
from dapo_megatron.rollout.sampling.config import BufferConfig
from dapo_megatron.rollout.types import Group, Sample


def samples_of(lengths, prompt_len=2):
    return [Sample(prompt_ids=[1] * prompt_len, response_ids=[5] * (L - prompt_len), rollout_logprobs=[0.0] * (L - prompt_len),
                   finish_reason="stop") for L in lengths]


def check_plan(plan, lengths, dp_size, budget):
    assert len(plan) == dp_size
    counts = {len(mbs) for mbs in plan}
    assert len(counts) == 1, f"unequal micro-batch counts per rank: {[len(m) for m in plan]}"
    flat = [i for mbs in plan for mb in mbs for i in mb]
    assert sorted(flat) == list(range(len(lengths))), "every sample exactly once"
    for mbs in plan:
        for mb in mbs:
            assert mb, "empty micro-batch"
            assert sum(lengths[i] for i in mb) <= budget or len(mb) == 1


def rank_tokens(plan, lengths):
    return [sum(lengths[i] for mb in mbs for i in mb) for mbs in plan]


def fewest_micro_batches(lengths, budget):
    """The exact minimum number of valid micro-batches (<= budget tokens, or one over-long sample)
    the batch packs into, solved independently of split_for_dp's first-fit-decreasing.

    Two samples longer than budget / 2 never share a micro-batch, so each "big" one opens its own
    and can absorb a subset of the "small" ones (<= budget / 2) that fits beside it; the small ones
    left over are packed exactly by a DP over their subsets. Exponential in the number of small
    samples only: returns None when there are more than 12 of them.
    """
    over = [L for L in lengths if L > budget]
    big = [L for L in lengths if budget / 2 < L <= budget]
    small = [L for L in lengths if L <= budget / 2]
    if len(small) > 12:
        return None
    full = (1 << len(small)) - 1
    load = [sum(L for k, L in enumerate(small) if m >> k & 1) for m in range(full + 1)]
    fewest = [0] * (full + 1)  # exact bin packing of each subset of the small samples
    for m in range(1, full + 1):
        low = m & -m  # the micro-batch holding the lowest sample of m: enumerate the rest of it
        rest, sub, best = m ^ low, m ^ low, len(small)
        while True:
            if load[sub | low] <= budget:
                best = min(best, 1 + fewest[m ^ (sub | low)])
            if sub == 0:
                break
            sub = (sub - 1) & rest
        fewest[m] = best
    absorbed = {0}  # subsets of small samples that the big samples' micro-batches can hold
    for L in big:
        grown = set(absorbed)
        for u in absorbed:
            free = full ^ u
            sub = free
            while sub:
                if load[sub] <= budget - L:
                    grown.add(u | sub)
                sub = (sub - 1) & free
        absorbed = grown
    return len(over) + len(big) + min(fewest[full ^ u] for u in absorbed)


def test_odd_number_of_kept_prompts_over_two_ranks():
    # the buffer keeps 3 prompts × 3 responses = 9 samples: an odd count over 2 DP ranks
    class Grader:
        def grade(self, reqs):
            return [{"score": float(t == g), "acc": t == g, "pred": t} for _, t, g, _ in reqs]

    def batch():
        groups = []
        for p, (pattern, lens) in enumerate([("ywy", (3, 9, 4)), ("yyw", (12, 2, 7)), ("wyy", (5, 5, 30))]):
            groups.append(Group(p, [Sample([1, 2], [0] * (L - 1) + [ord(c)], [0.0] * L, "stop", prompt_index=p,
                                           ground_truth="y") for c, L in zip(pattern, lens)]))
        return groups

    buf = RolloutBuffer(BufferConfig(train_batch_size=3, n=3, gen_batch_size=3, max_num_gen_batches=1,
                                     overlong=OverlongConfig(enable=False)), Grader(), lambda ids: chr(ids[-1]))
    groups, _ = buf.collect(batch)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 9
    lengths = [s.total_length for s in samples]
    plan = split_for_dp(samples, 2, max_tokens_per_micro_batch=16)
    check_plan(plan, lengths, 2, 16)
    sizes = sorted(sum(len(mb) for mb in mbs) for mbs in plan)
    assert sum(sizes) == 9 and sizes[0] >= 1
    tokens = rank_tokens(plan, lengths)
    best = min(abs(2 * sum(lengths[i] for i in c) - sum(lengths))
               for k in range(10) for c in itertools.combinations(range(9), k))
    assert abs(tokens[0] - tokens[1]) <= max(best, max(lengths))  # LPT: within one sample of the optimum gap


@pytest.mark.parametrize("seed", range(5))
def test_balance_close_to_optimal(seed):
    import random

    rng = random.Random(seed)
    lengths = [rng.choice([3, 5, 40, 200, 700]) + rng.randint(0, 9) for _ in range(10)]
    for dp in (2, 3):
        plan = split_for_dp(samples_of(lengths), dp, max_tokens_per_micro_batch=800)
        check_plan(plan, lengths, dp, 800)
        # brute-force optimal makespan over all assignments of 10 samples to dp ranks
        opt = min(max(sum(L for L, r in zip(lengths, assign) if r == k) for k in range(dp))
                  for assign in itertools.product(range(dp), repeat=len(lengths)))
        assert max(rank_tokens(plan, lengths)) <= (4 / 3) * opt  # Graham's LPT bound


def test_wildly_uneven_lengths():
    lengths = [1000] + [10] * 20 + [900]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        plan = split_for_dp(samples_of(lengths), 2, max_tokens_per_micro_batch=950)
    assert any("more than max_tokens_per_micro_batch=950" in str(x.message) for x in w)
    check_plan(plan, lengths, 2, 950)
    assert rank_tokens(plan, lengths) == [1050, 1050]  # total 2100: a perfect split exists and is found
    # the token-balanced split leaves the long sample alone on a rank, which cannot be cut into the
    # 5 micro-batches the other needs; a plan exists (6 micro-batches, 3 per rank) and is found
    lengths = [1000] + [10] * 20
    with pytest.warns(UserWarning, match="DP rank 0 of the token-balanced split holds 1 samples but another rank "
                                         "needs 5 micro-batches"):
        plan = split_for_dp(samples_of(lengths), 2, max_tokens_per_micro_batch=40)
    check_plan(plan, lengths, 2, 40)
    assert [len(mbs) for mbs in plan] == [3, 3] and sorted(rank_tokens(plan, lengths)) == [120, 1080]
    # three over-long samples are three micro-batches: 2 ranks cannot run equal counts of them
    with pytest.raises(ValueError, match="needs 3 micro-batches.*no multiple of dp_size=2"):
        split_for_dp(samples_of([1000, 900, 800]), 2, max_tokens_per_micro_batch=500)


def test_budget_edges():
    lengths = [4, 4, 4, 4]
    plan = split_for_dp(samples_of(lengths), 1, max_tokens_per_micro_batch=8)
    assert plan == [[[0, 1], [2, 3]]]  # exactly at the budget: two per micro-batch
    assert split_for_dp(samples_of(lengths), 1, max_tokens_per_micro_batch=7) == [[[0], [1], [2], [3]]]
    assert split_for_dp(samples_of(lengths), 1, max_tokens_per_micro_batch=10**6) == [[[0, 1, 2, 3]]]
    # equalising counts: rank 1 must split its single micro-batch to match rank 0's two
    lengths = [9, 9, 3, 3, 3, 3, 3, 3]
    plan = split_for_dp(samples_of(lengths), 2, max_tokens_per_micro_batch=10)
    check_plan(plan, lengths, 2, 10)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        split_for_dp(samples_of(lengths), 2, max_tokens_per_micro_batch=0)
    with pytest.raises(ValueError, match="cannot split 2 samples over dp_size=3"):
        split_for_dp(samples_of([4, 4]), 3, 8)


def test_deterministic():
    lengths = [7, 3, 7, 3, 12, 1, 1, 5, 5, 9, 2]
    a = split_for_dp(samples_of(lengths), 2, 12)
    b = split_for_dp(samples_of(lengths), 2, 12)
    assert a == b
    check_plan(a, lengths, 2, 12)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), dp=st.integers(1, 4),
       budget=st.integers(1, 600))
def test_plan_invariants_property(lengths, dp, budget):
    """For any batch: a valid plan (all invariants), or a ValueError for a batch that has none.

    Any plan is K = dp * M non-empty valid micro-batches; conversely any K valid micro-batches dealt
    M per rank are a plan, and the achievable K are every count from the fewest micro-batches to
    one per sample (splitting one of >= 2 samples keeps it valid). So a batch has a plan iff a
    multiple of dp lies in [fewest_micro_batches, len(lengths)], which each rejection must refute.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = split_for_dp(samples_of(lengths, prompt_len=1), dp, budget)
        except ValueError as err:
            fewest = fewest_micro_batches(lengths, budget)
            assert fewest is not None, f"rejected a batch with many short samples, which has a plan: {err}"
            assert fewest > dp * (len(lengths) // dp), f"rejected a feasible batch ({fewest} micro-batches): {err}"
            return
    check_plan(plan, lengths, dp, budget)
    tokens = rank_tokens(plan, lengths)
    if any("dealing whole micro-batches" in str(w.message) for w in caught):
        # fallback: micro-batches dealt heaviest first to the lightest rank with room
        assert max(tokens) - min(tokens) <= max(sum(lengths[i] for i in mb) for mbs in plan for mb in mbs)
    else:
        # LPT: the heaviest rank got its last sample while it was the lightest, so the gap is at most one sample
        assert max(tokens) - min(tokens) <= max(lengths)


def grouped_samples(groups):
    """groups: list of (prompt_len, [response lengths]); prompt token ids differ per group."""
    out = []
    for g, (P, rlens) in enumerate(groups):
        out += [Sample(prompt_ids=[100 + g] * P, response_ids=[5] * R, rollout_logprobs=[0.0] * R, finish_reason="stop",
                       group_id=g) for R in rlens]
    return out


def shared_tokens(samples, mb):
    """Tokens the shared-prompt forward computes for a micro-batch: each distinct prompt once."""
    prompts = {tuple(samples[i].prompt_ids): len(samples[i].prompt_ids) for i in mb}
    return sum(prompts.values()) + sum(len(samples[i].response_ids) for i in mb)


def test_share_prompts_keeps_groups_whole_and_counts_the_prompt_once():
    samples = grouped_samples([(40, [10, 12, 8, 15]), (30, [20, 5, 5, 5]), (50, [2, 2, 2, 2]), (10, [30, 1, 1, 1])])
    # copied form: 4 * 40 + 45 = 205 tokens for group 0 alone; shared: 40 + 45 = 85
    plan = split_for_dp(samples, 2, max_tokens_per_micro_batch=100, share_prompts=True)
    assert len(plan) == 2 and len({len(mbs) for mbs in plan}) == 1
    flat = sorted(i for mbs in plan for mb in mbs for i in mb)
    assert flat == list(range(16))
    where = {i: (r, k) for r, mbs in enumerate(plan) for k, mb in enumerate(mbs) for i in mb}
    for g in range(4):  # every group in one micro-batch
        assert len({where[i] for i in range(4 * g, 4 * g + 4)}) == 1
    assert all(shared_tokens(samples, mb) <= 100 for mbs in plan for mb in mbs)
    # without sharing, the same budget cannot even hold one group
    assert max(len(mb) for mbs in split_for_dp(samples, 2, 100) for mb in mbs) < 4


def test_share_prompts_cuts_a_group_only_when_it_must():
    samples = grouped_samples([(40, [30, 30, 30, 30])])  # 160 shared tokens
    plan = split_for_dp(samples, 1, max_tokens_per_micro_batch=100, share_prompts=True)
    assert [[len(mb) for mb in mbs] for mbs in plan] == [[2, 2]]  # 40 + 60 each: two items of the group
    plan = split_for_dp(samples, 2, max_tokens_per_micro_batch=1000, share_prompts=True)
    assert sorted(len(mbs[0]) for mbs in plan) == [2, 2]  # two ranks need two items
    # a rank that needs more micro-batches than whole groups give splits its group
    samples = grouped_samples([(5, [50, 50]), (5, [1]), (5, [1])])
    plan = split_for_dp(samples, 2, max_tokens_per_micro_batch=60, share_prompts=True)
    assert len({len(mbs) for mbs in plan}) == 1 and sorted(i for mbs in plan for mb in mbs for i in mb) == [0, 1, 2, 3]


@settings(max_examples=150, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(1, 60), st.lists(st.integers(0, 80), min_size=1, max_size=6)),
                       min_size=1, max_size=8),
       dp=st.integers(1, 3), budget=st.integers(1, 400))
def test_share_prompts_plan_invariants_property(groups, dp, budget):
    samples = grouped_samples(groups)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = split_for_dp(samples, dp, budget, share_prompts=True)
        except ValueError as err:
            assert len(samples) < dp or "micro-batches" in str(err)
            return
    assert len(plan) == dp and len({len(mbs) for mbs in plan}) == 1
    assert sorted(i for mbs in plan for mb in mbs for i in mb) == list(range(len(samples)))
    for mbs in plan:
        for mb in mbs:
            assert mb and (shared_tokens(samples, mb) <= budget or len(mb) == 1)

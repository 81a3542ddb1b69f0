"""The first DAPO step gives the same loss and grad norm at TP=1, TP=2, PP=2 and DP=2 (fp32, CPU).

Same SmolLM2 weights, same data, same seeds: the rollout is layout-independent because
every response is sampled from its own seed (``rollout.engines.engine.sample_seed``), so the
runs train on the same responses; the loss normalisation (token-mean over the mini-batch)
and Megatron's TP/PP reductions must then agree to fp32 round-off. At DP=2 the step's data
path routes each response's tokens to the DP rank that trains it (``rollout.plan.step_data``):
a response that reached the wrong rank, or its logprobs another response's, would show in the
rollout-vs-actor logprob gap, which must stay at round-off.

Each run is a torchrun of ``dapo_megatron.train`` (~1 minute): the ``first_step`` fixture
(tests/conftest.py) runs each distinct layout once a session, so the TP=1 reference is shared by
both tests here and by tests/unit/actor/test_shared_prompt.py (which also reuses the TP=2 run); the
1-process runs (the reference, THD and, when the rollout-TP test is selected, its streamed reference) run
side by side, where the 2-process ones each fill both cores.
Each layout is checked as soon as it has run, so a planted layout bug fails within a few runs.
"""

from __future__ import annotations

import pytest

ROLLOUT_KEYS = ("rollout/gen_tokens", "rollout/gen_reward_mean", "rollout/kept_groups", "rollout/num_gen_batches")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# Every layout's loss, grad norm and entropy within this relative distance of TP=1 BSHD: a fixed
# bound, not one scaled by a floor measured on the code under test (a layout bug that inflated
# the floor would loosen the check with it). Measured (grad norm, entropy): THD at TP=1 9.4e-7,
# 8.9e-7; TP=2 5.6e-7, 7.2e-7; PP=2 9.4e-8, 0. The first-step pg_loss does not depend on the
# model's rounding (ratio = 1 exactly): it checks the token-mean normalisation, and is equal.
REL_BOUND = 1e-5
# The engine holds the actor's weights at the first step (fp32 HF engine): its logprobs and the
# actor's differ by round-off only (tests/integration/test_trainer_e2e.py measured 2.6e-5).
LOGPROB_GAP_MAX = 1e-4
# the streamed rollout's overrides (the rollout-TP test)
STREAMED = ("rollout.streaming=true", "rollout.stream_poll_tokens=4", "buffer.on_cap=train_on_kept")


@pytest.mark.slow
@pytest.mark.dist
def test_first_step_loss_and_grad_norm_match_across_layouts(first_step, request):
    first_step.start(1, 1, "actor.micro_batch_layout=thd")  # both 1-process runs side by side: one per core
    if any(item.name == test_rollout_tensor_parallel_groups_sample_the_same_rollout.__name__
           for item in request.session.items):  # its 1-process reference too: 3 runs on 2 cores take 1.5 runs' time
        first_step.start(1, 1, *STREAMED)
    ref = first_step(1, 1)
    assert ref["rollout/kept_groups"] >= 1 and ref["actor/grad_norm"] > 0
    assert ref["rollout/logprob_diff_max"] <= LOGPROB_GAP_MAX
    # THD is a layout too: every micro-batch packed into one row (block-diagonal mask) instead of
    # padded rows, mathematically identical, only the matmul shapes and so the fp32 rounding
    # differ. The grad norms agree to fp32 round-off because the CPU compat layer accumulates it
    # in fp64 (Megatron's fp32 torch.norm fallback alone moved it by 1.3e-5 between TP=1 and TP=2).
    # THD runs at TP=1 (DP=1): both kept groups in one micro-batch, so the packing of several
    # sequences into one row is exercised (at DP=2 each rank's micro-batch is one group: a planted
    # cross-sequence attention in the THD mask went unseen there).
    layouts = {"thd": ((1, 1, "actor.micro_batch_layout=thd"), 1), "dp2": ((1, 1), 2), "tp2": ((2, 1), 1),
               "pp2": ((1, 2), 1)}
    for name, (args, dp) in layouts.items():
        got = first_step(*args, dp=dp)
        # identical rollouts (discrete): the same responses, rewards and kept groups
        for key in ROLLOUT_KEYS:
            assert got[key] == ref[key], (name, key, got[key], ref[key])
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert _rel(got[key], ref[key]) <= REL_BOUND, (name, key, got[key], ref[key])
        assert got["rollout/logprob_diff_max"] <= LOGPROB_GAP_MAX, (name, got["rollout/logprob_diff_max"])
        # the run really had its micro-batch layout: THD packs both groups into one row without
        # padding, BSHD pads the shorter group's row (at DP=2 each rank holds one group: no padding)
        if name == "thd":
            assert got["actor/tokens_padding"] == 0 < ref["actor/tokens_padding"], (name, got["actor/tokens_padding"])
        elif dp == 1:
            assert got["actor/tokens_padding"] == ref["actor/tokens_padding"], (name, got["actor/tokens_padding"])


@pytest.mark.slow
@pytest.mark.dist
def test_rollout_tensor_parallel_groups_sample_the_same_rollout(first_step):
    """rollout.tensor_model_parallel_size=2: one engine per 2 ranks (the leader's; its peer only
    feeds the sync), the batch dealt over engines, not over model-parallel ranks. Against one
    engine per rank: the same responses and rewards, both with a TP=2 actor (the group is the
    actor's TP group) and with DP=2 (the group spans both DP ranks, so the engine samples both
    ranks' prompts). Streamed too: the same streamed rollout as one engine alone."""
    ref = first_step(1, 1)
    for tp, pp in ((2, 1), (1, 1)):
        got = first_step(tp, pp, "rollout.tensor_model_parallel_size=2", dp=2 // (tp * pp))
        for key in ROLLOUT_KEYS:
            assert got[key] == ref[key], (tp, pp, key, got[key], ref[key])
        assert _rel(got["actor/pg_loss"], ref["actor/pg_loss"]) <= REL_BOUND
    # streamed (issue 20): the leader's engine runs every group; records are replicated each round,
    # the tokens stay with the leader until the plan sends DP rank 1 its half. The HF engine's
    # rounds are token counts, so the streamed rollout equals one engine in a world of one
    ref = first_step(1, 1, *STREAMED)
    assert ref["rollout/rounds"] > 1 and ref["rollout/kept_groups"] >= 1
    got = first_step(1, 1, "rollout.tensor_model_parallel_size=2", *STREAMED, dp=2)
    for key in (*ROLLOUT_KEYS, "rollout/rounds", "rollout/prompts_submitted", "rollout/aborted_rows",
                "rollout/aborted_tokens", "rollout/keep_rate", "rollout/partial_out", "train/response_length_mean"):
        assert got[key] == ref[key], (key, got[key], ref[key])
    assert _rel(got["actor/pg_loss"], ref["actor/pg_loss"]) <= REL_BOUND
    assert got["rollout/logprob_diff_max"] <= LOGPROB_GAP_MAX, got["rollout/logprob_diff_max"]

"""The trajectory hook (rollout/trajectory.py) in the three generation loops.

A two-turn trajectory (after a row that stops, append three context ids once and continue) runs on a
real HFEngine (tiny random Llama, CPU) through the batch loop's ``run_turns`` and the streamed
``StreamingCollector``, and on the async controller's dispatch with a fake ``/generate``. The oracle of
the token ids is the first row ``generate`` sampled plus the appended ids, kept exactly (nothing is
decoded or re-tokenised), and of the logprobs a teacher-forced forward of the HF model on
prompt + everything before each model token. Single-turn leaves every sample as it was.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from dapo_megatron.config.run import DAPOConfig
from dapo_megatron.rollout.async_rollout import RolloutController
from dapo_megatron.rollout.config import MultiTurnConfig
from dapo_megatron.rollout.engines.engine import SamplingParams, completions_to_group, sample_seed
from dapo_megatron.rollout.engines.hf_engine import HFEngine
from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
from dapo_megatron.rollout.sampling.config import BufferConfig
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig, PromptSkipper
from dapo_megatron.rollout.sampling.streaming import EngineClient, StreamingCollector
from dapo_megatron.rollout.sampling.feeder import PromptQueue
from dapo_megatron.rollout.trajectory import SINGLE_TURN, Trajectory, build_trajectory, run_turns, settle_row
from dapo_megatron.rollout.types import Sample
from dapo_megatron.algorithms.overlong import OverlongConfig
from unit.rollout.test_hf_engine import teacher_forced_logprobs, tiny_llama
from unit.rollout.test_streaming import BATCH, RECORDS, Mod3Grader, Stream, decode

CONTEXT = [20, 21, 22]  # neither a stop token (4, 5) nor EOS (3): the next row samples after them
PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, stop_token_ids=(4, 5), seed=13)


class TwoTurns(Trajectory):
    """After the first row that stops, append :data:`CONTEXT` once and continue; records its calls."""

    multi_turn = True

    def __init__(self, multi_turn_cfg=None, tokenizer=None):
        self.calls = []

    def on_row_finished(self, sample, finish_reason, budget):
        self.calls.append((list(sample.response_ids), finish_reason, budget))
        return list(CONTEXT) if finish_reason == "stop" and sample.num_context_tokens == 0 else None


def make_two_turns(cfg, tokenizer):
    """The ``rollout.multi_turn.trajectory`` factory the config test names."""
    return TwoTurns(cfg, tokenizer)


def make_not_a_trajectory(cfg, tokenizer):
    return object()


@pytest.fixture(scope="module")
def engine():
    return HFEngine(tiny_llama(seed=2), eos_token_ids=[3])


def _check_two_turn(engine, s: Sample, turn1: list[int], first_finish: str, params=PARAMS):
    """``s`` is ``turn1`` + CONTEXT + a second turn when the first stopped with room left, else the
    first row alone; its mask, placeholders, versions and logprobs line up with its tokens."""
    R = s.response_length
    if first_finish != "stop" or len(turn1) + len(CONTEXT) >= params.max_new_tokens:
        assert s.response_ids[:len(turn1)] == turn1 and s.finish_reason in ("stop", "length")
        if first_finish != "stop":
            assert s.response_ids == turn1 and s.response_mask is None
        return False
    k = len(turn1) + len(CONTEXT)
    assert s.response_ids[:k] == turn1 + CONTEXT  # the sampled ids and the appended ids, exactly
    assert s.response_mask == [1] * len(turn1) + [0] * len(CONTEXT) + [1] * (R - k)
    assert s.num_context_tokens == 3 and s.num_model_tokens == R - 3
    assert s.rollout_logprobs[len(turn1):k] == [0.0] * 3  # placeholders, never read
    assert s.versions == [(0, engine.weight_version)] and len(s.token_versions()) == R
    assert s.finish_reason in ("stop", "length") and R <= params.max_new_tokens
    # every model token's logprob is the model's given the prompt and everything before it, context included
    want = teacher_forced_logprobs(engine.model, s.prompt_ids, s.response_ids, params.temperature)
    for lp, w, m in zip(s.rollout_logprobs, want.tolist(), s.response_mask):
        if m:
            assert abs(lp - w) < 1e-4
    return True


def _batch(engine, prompts, seeds, trajectory, params=PARAMS):
    outs = engine.generate(prompts, params, prompt_seeds=seeds)
    groups = [completions_to_group(-1, p, comps) for p, comps in zip(prompts, outs)]
    rows = [(s, seed, j) for seed, g in zip(seeds, groups) for j, s in enumerate(g.samples)]
    run_turns(engine, rows, params, trajectory)
    return outs, groups


def test_batch_turns_append_the_context_and_sample_the_next_turn_after_it(engine):
    prompts = [list(r.prompt_ids) for r in RECORDS[:4]]
    seeds = [0, 1, 2, 3]
    trajectory = TwoTurns()
    outs, groups = _batch(engine, prompts, seeds, trajectory)
    two_turn = [_check_two_turn(engine, s, list(c.response_ids), c.finish_reason)
                for comps, g in zip(outs, groups) for c, s in zip(comps, g.samples)]
    assert sum(two_turn) >= 4  # the test exercises the second turn
    assert len(trajectory.calls) == len(two_turn) + sum(two_turn)  # every finished row, once
    assert engine.num_in_flight == 0
    # single-turn: the same generation, every sample as generate() returned it
    outs1 = engine.generate(prompts, PARAMS, prompt_seeds=seeds)
    groups1 = [completions_to_group(-1, p, comps) for p, comps in zip(prompts, outs1)]
    before = copy.deepcopy(groups1)
    run_turns(engine, [(s, seed, j) for seed, g in zip(seeds, groups1) for j, s in enumerate(g.samples)], PARAMS,
              SINGLE_TURN)
    assert groups1 == before


def _collector(trajectory):
    cfg = BufferConfig(train_batch_size=3, n=4, gen_batch_size=BATCH, max_num_gen_batches=4,
                       overlong=OverlongConfig(enable=False), on_cap="train_on_kept")
    buf = RolloutBuffer(cfg, Mod3Grader(), decode)
    collector = StreamingCollector(buf, PromptSkipper(PromptSkipConfig(), seed=0), partial_rollout=False,
                                   poll_tokens=3, trajectory=trajectory, max_new_tokens=PARAMS.max_new_tokens)
    return collector, PromptQueue(Stream(), BATCH, RECORDS.__getitem__)


def test_streamed_turns_equal_the_batch_loops_token_for_token(engine):
    """The streamed loop submits each next turn in the round its first turn finished; every kept
    response equals the batch loop's for the same prompt seed (ids and mask)."""
    collector, queue = _collector(TwoTurns())
    out, m = collector.collect(EngineClient(engine, PARAMS), queue, policy_version=0)
    assert len(out) == 3 and engine.num_in_flight == 0
    assert m["rollout/gen_tokens"] == pytest.approx(  # sampled tokens: the context is not generated
        sum(s.response_length for g in out for s in g.samples) * m["rollout/gen_tokens_per_kept_token"])
    multi = 0
    for g in out:
        outs, (ref,) = _batch(engine, [g.samples[0].prompt_ids], [g.prompt_seed], TwoTurns())
        for s, r, c in zip(g.samples, ref.samples, outs[0], strict=True):
            assert (s.response_ids, s.response_mask, s.finish_reason) == (r.response_ids, r.response_mask,
                                                                           r.finish_reason)
            multi += _check_two_turn(engine, s, list(c.response_ids), c.finish_reason)
    assert multi >= 2


def test_the_streamed_client_settles_an_aborted_row_that_ends_a_turn_where_its_tokens_are(engine):
    """The abort's extra decode step (SGLang's) can complete a call: the client asks the trajectory
    (``ends_turn``) before it replicates the row's record, so every rank reads ``"stop"`` and the
    row is settled as a turn (here: a turn ends at an even id)."""
    from dapo_megatron.rollout.sampling.streaming import extend_sample, new_group

    class EndsAtEven(TwoTurns):
        stop = ("<the call's end>",)

        def ends_turn(self, sample, new_ids):
            return bool(new_ids) and new_ids[-1] % 2 == 0

    trajectory = EndsAtEven()
    client = EngineClient(engine, PARAMS, trajectory=trajectory)
    groups = [new_group(r, i, PARAMS.n) for i, r in enumerate(RECORDS[:4])]
    client.submit([(g, j) for g in groups for j in range(PARAMS.n)])
    finished = client.poll(2)
    aborted = client.abort()
    assert engine.num_in_flight == 0
    kinds = set()
    for u in aborted:
        want = "stop" if u.response_ids and u.response_ids[-1] % 2 == 0 else "abort"
        assert u.finish_reason == want
        kinds.add(want)
        s = groups[u.key[0]].samples[u.key[1]]
        continued = extend_sample(s, u, trajectory, PARAMS.max_new_tokens)
        assert continued == (want == "stop" and len(s.response_ids) < PARAMS.max_new_tokens)  # settled, after CONTEXT
        assert (s.num_context_tokens > 0) == (want == "stop")  # the trajectory ran on the row's turn
    assert kinds == {"stop", "abort"} and len(finished) + len(aborted) == 4 * PARAMS.n
    assert not client._samples  # every row's sample released


def test_settle_row_cuts_the_context_to_the_budget_and_refuses_bad_context():
    def sample(n_tokens):
        s = Sample([1, 2], [], [], "")
        s.append_tokens(0, list(range(6, 6 + n_tokens)), [-1.0] * n_tokens)
        return s

    s = sample(10)  # 2 left of 12: the context is cut to 2 and the sample is truncated
    assert not settle_row(s, "stop", TwoTurns(), version=0, max_new_tokens=12)
    assert s.response_ids[10:] == CONTEXT[:2] and s.response_mask[10:] == [0, 0] and s.finish_reason == "length"
    s = sample(4)
    assert settle_row(s, "stop", TwoTurns(), version=0, max_new_tokens=12) and s.finish_reason == ""
    s = sample(4)  # single-turn: the finish reason, nothing else
    before = copy.deepcopy(s)
    assert not settle_row(s, "stop", SINGLE_TURN, version=0, max_new_tokens=12)
    before.finish_reason = "stop"
    assert s == before

    class Bad(Trajectory):
        multi_turn = True

        def on_row_finished(self, sample, finish_reason, budget):
            return []

    with pytest.raises(ValueError, match="non-empty list of token ids"):
        settle_row(sample(4), "stop", Bad(), version=0, max_new_tokens=12)
    with pytest.raises(ValueError, match="an aborted row"):
        settle_row(sample(4), "abort", SINGLE_TURN, version=0, max_new_tokens=12)
    elsewhere = Sample([1], None, None, "", holder=3, num_response_tokens=4)
    with pytest.raises(RuntimeError, match="held by rank 3"):
        settle_row(elsewhere, "stop", TwoTurns(), version=0, max_new_tokens=12)


def _two_turn_servers(calls: list, first_kind: str = "stop"):
    """A fake ``/generate``: a first turn (one-token input) samples 7, 8 and ends ``first_kind``; a
    continued row (longer input) samples 9 and stops. Each request's (ids, max_new_tokens, seed)
    are appended to ``calls``."""
    def servers(rows, version):
        calls.append([(list(ids), sp["max_new_tokens"], sp["sampling_seed"]) for _, ids, sp in rows])
        return [(([7, 8] if len(ids) == 1 else [9]), ([-0.5, -0.25] if len(ids) == 1 else [-0.75]),
                 first_kind if len(ids) == 1 else "stop", version) for _, ids, sp in rows]
    return servers


def _controller(servers, trajectory, params=SamplingParams(n=2, max_new_tokens=10, seed=5)):
    """An async controller at version 4 over ``servers``, groups of 2."""
    cfg = BufferConfig(train_batch_size=1, n=2, gen_batch_size=2, max_num_gen_batches=1)
    return RolloutController(SimpleNamespace(config=cfg, begin=lambda version: None), lambda: [], ["http://a"],
                             params, silence_timeout_s=1.0, version=4, policy_version=4, generate=servers,
                             trajectory=trajectory)


def test_the_async_controller_sends_the_next_turn_as_prompt_plus_the_response_so_far():
    calls = []
    ctrl = _controller(_two_turn_servers(calls), TwoTurns())
    records = [SimpleNamespace(prompt_ids=[10 + g], index=g, data_source="d", ground_truth="1", extra_info={})
               for g in range(2)]
    groups, resubmitted, reprefilled, retried = ctrl._generate_batch(records, [6, 7], 4)
    assert (resubmitted, reprefilled, retried) == (0, 0, 0)  # a next turn is not a resubmission after a sync
    first, second = calls
    assert [ids for ids, _, _ in second] == [[10 + g, 7, 8, *CONTEXT] for g in range(2) for _ in range(2)]
    assert [n for _, n, _ in second] == [10 - 5] * 4  # the budget left after turn 1 and the context
    assert [seed for _, _, seed in second] == [seed for _, _, seed in first]  # the row's own seed
    for g in groups:
        for s in g.samples:
            assert s.response_ids == [7, 8, *CONTEXT, 9] and s.response_mask == [1, 1, 0, 0, 0, 1]
            assert s.rollout_logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -0.75] and s.finish_reason == "stop"
            assert s.versions == [(0, 4)] and s.holder == 0
    assert sample_seed(5, 6, 0) == first[0][2]


@pytest.mark.timeout(60)
def test_an_aborted_row_whose_tokens_end_the_turn_is_settled_as_a_finished_turn():
    """SGLang's abort (a weight sync's pause) decodes one more token before it applies, so a tool
    call's last token can come back ``"abort"``: the controller asks the trajectory
    (``ends_turn``) and settles that row as ``"stop"``, its next turn after the context, rather
    than continuing it past the call."""

    class CallEndsAt8(TwoTurns):
        stop = ("<the call's end>",)

        def ends_turn(self, sample, new_ids):
            return bool(new_ids) and new_ids[-1] == 8

    calls = []
    ctrl = _controller(_two_turn_servers(calls, first_kind="abort"), CallEndsAt8())
    records = [SimpleNamespace(prompt_ids=[10 + g], index=g, data_source="d", ground_truth="1", extra_info={})
               for g in range(2)]
    groups, resubmitted, reprefilled, retried = ctrl._generate_batch(records, [6, 7], 4)
    assert resubmitted == 0  # nothing continued as a partial row
    # the next turn, after the tool's output
    assert [ids for ids, _, _ in calls[1]] == [[10 + g, 7, 8, *CONTEXT] for g in range(2) for _ in range(2)]
    for g in groups:
        for s in g.samples:
            assert s.response_ids == [7, 8, *CONTEXT, 9] and s.response_mask == [1, 1, 0, 0, 0, 1]
            assert s.finish_reason == "stop"


def test_the_trajectory_is_selected_from_rollout_multi_turn():
    assert build_trajectory(MultiTurnConfig()) is SINGLE_TURN
    assert DAPOConfig().rollout.multi_turn == MultiTurnConfig(enable=False, trajectory="")
    t = build_trajectory(MultiTurnConfig(enable=True, trajectory="unit.rollout.test_trajectory:make_two_turns"))
    assert isinstance(t, TwoTurns) and t.multi_turn
    with pytest.raises(ValueError, match=r"rollout.multi_turn.trajectory='no.such.module:x' does not import"):
        build_trajectory(MultiTurnConfig(enable=True, trajectory="no.such.module:x"))
    with pytest.raises(ValueError, match="not a dapo_megatron.rollout.trajectory.Trajectory"):
        build_trajectory(MultiTurnConfig(enable=True, trajectory="unit.rollout.test_trajectory:make_not_a_trajectory"))


def test_async_validation_runs_the_turns_as_the_rollout_does():
    calls = []
    params = SamplingParams(n=2, max_new_tokens=10, seed=5)
    for trajectory in (TwoTurns(), SINGLE_TURN):
        calls.clear()
        ctrl = _controller(_two_turn_servers(calls), trajectory, params)
        ctrl.pause()
        out = ctrl.generate_validation([[10], [11]], params)
        first = calls[0]
        assert [seed for _, _, seed in first] == [sample_seed(5, i, j) for i in range(2) for j in range(2)]
        if trajectory is SINGLE_TURN:  # one round, completions as before
            assert len(calls) == 1 and [[c.response_ids for c in comps] for comps in out] == [[[7, 8]] * 2] * 2
            continue
        second = calls[1]
        assert [ids for ids, _, _ in second] == [[10 + i, 7, 8, *CONTEXT] for i in range(2) for _ in range(2)]
        assert [n for _, n, _ in second] == [10 - 5] * 4  # the budget left after turn 1 and the context
        assert [seed for _, _, seed in second] == [seed for _, _, seed in first]  # the row's own seed
        for comps in out:
            for s in comps:
                assert s.response_ids == [7, 8, *CONTEXT, 9] and s.response_mask == [1, 1, 0, 0, 0, 1]
                assert s.rollout_logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -0.75] and s.finish_reason == "stop"
                assert s.versions == [(0, 4)]


class CountingTwoTurns(TwoTurns):
    """:class:`TwoTurns` with metrics: the responses it finished, and their calls to it."""

    def take_counts(self, samples=None):
        mine = [s for s in samples if s.response_mask is not None]
        return {"responses": float(len(mine)), "acc": float(sum(s.acc for s in mine))}

    def metrics(self, counts, prefix):
        return {f"{prefix}responses": counts["responses"], f"{prefix}acc": counts["acc"]}


def test_the_async_controller_logs_the_trajectory_metrics_of_every_response_a_step_graded():
    def servers(rows, version):
        return [(([7, 8] if len(ids) == 1 else [9 + len(ids) % 2]), ([-0.5, -0.25] if len(ids) == 1 else [-0.75]),
                 "stop", version) for _, ids, sp in rows]

    from dapo_megatron.rollout.sampling.buffer import GroupSelector

    cfg = BufferConfig(train_batch_size=2, n=2, gen_batch_size=2, max_num_gen_batches=1, on_cap="train_on_kept")
    selector = GroupSelector(cfg, Mod3Grader(), decode)
    ctrl = RolloutController(selector, lambda: [], ["http://a"], SamplingParams(n=2, max_new_tokens=10, seed=5),
                             silence_timeout_s=1.0, version=4, policy_version=4, generate=servers,
                             trajectory=CountingTwoTurns())
    records = [SimpleNamespace(prompt_ids=[10 + g], index=g, data_source="d", ground_truth="1", extra_info={})
               for g in range(2)]
    groups = ctrl._generate_batch(records, [0, 1], 4)[0]
    selector.grade(groups)
    ctrl.steps.add(groups)
    ctrl._close_step()
    _, trained, metrics = ctrl.steps.ready[-1]
    # every response of the batch ends in 9 (acc, 9 % 3 == 0): both groups are all-correct, none is
    # kept, and the metrics still count the 4 responses generated and graded
    assert trained == [] and metrics["tool/responses"] == 4.0 and metrics["tool/acc"] == 4.0


def test_async_validate_logs_the_trajectory_metrics_of_the_validation_responses():
    from unit.rollout.test_async_dispatch import _async_rollout

    def servers(rows, version):
        return [(([7, 8] if len(ids) <= 3 else [9]), ([-0.5, -0.25] if len(ids) <= 3 else [-0.75]), "stop", version)
                for _, ids, sp in rows]

    cfg = BufferConfig(train_batch_size=1, n=3, gen_batch_size=2, max_num_gen_batches=1)
    ctrl = RolloutController(SimpleNamespace(config=cfg, begin=lambda version: None), lambda: [], ["http://a"],
                             SamplingParams(n=3, max_new_tokens=10, seed=5), silence_timeout_s=1.0, version=4,
                             policy_version=4, generate=servers, trajectory=CountingTwoTurns())
    ar = _async_rollout(ctrl, lambda obj, group, src: obj)
    ar.rollout.validation.params = lambda step: SamplingParams(n=3, max_new_tokens=10, seed=5)
    graded = []
    ar.rollout.reward_pool = SimpleNamespace(grade=lambda reqs: graded.extend(r[1] for r in reqs) or
                                     [{"acc": r[1].split()[-1] == "9"} for r in reqs])
    metrics = ar.validate(2)
    # every response is turn 1, the context and turn 2 (graded whole), right: 15 responses of 5 problems
    assert graded == ["7 8 20 21 22 9"] * 15 and metrics["val/avg@3"] == 1.0
    assert metrics["val/tool/responses"] == 15.0 and metrics["val/tool/acc"] == 15.0

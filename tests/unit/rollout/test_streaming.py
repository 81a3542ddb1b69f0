"""StreamingCollector on a real HFEngine (tiny random Llama, CPU) with a small real grader.

The grader marks a response correct iff its last token id is a multiple of 3, so the random
model gives a mix of correct, wrong, all-correct and all-wrong groups. Prompts are 24 dataset
records served by a PromptQueue in fixed order (batches of 6).
"""

import math

import pytest
import torch

from dapo_megatron.algorithms.overlong import OverlongConfig
from dapo_megatron.data.dataset import PromptRecord
from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
from dapo_megatron.rollout.sampling.config import BufferConfig
from dapo_megatron.rollout.engines.engine import SamplingParams
from dapo_megatron.rollout.engines.hf_engine import HFEngine
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig, PromptSkipper
from dapo_megatron.rollout.sampling.streaming import PENDING, EngineClient, StreamingCollector
from dapo_megatron.rollout.sampling.feeder import PromptQueue
from unit.rollout.test_hf_engine import tiny_llama

N_PROMPTS, BATCH = 24, 6
RECORDS = [PromptRecord(index=i, data_source="mod3", prompt_ids=[1, 5 + i % 7, 9 + i, 2 + i % 5][: 2 + i % 3],
                        messages=[], ground_truth="0", extra_info={}) for i in range(N_PROMPTS)]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=(4, 5), seed=13)


def decode(ids):
    return " ".join(str(t) for t in ids)


class Mod3Grader:
    def __init__(self):
        self.calls = 0

    def grade(self, requests):
        self.calls += 1
        out = []
        for _, text, _, _ in requests:
            last = int(text.split()[-1]) if text.split() else 1
            out.append({"score": 1.0 if last % 3 == 0 else -1.0, "acc": last % 3 == 0, "pred": str(last)})
        return out


class Stream:
    """next_batch() over RECORDS in order, wrapping around (an epoch per 4 batches)."""

    def __init__(self):
        self.batches = 0

    def __call__(self):
        start = (self.batches * BATCH) % N_PROMPTS
        self.batches += 1
        return RECORDS[start:start + BATCH]


def make(partial=False, skip=None, **buffer_kw):
    cfg = dict(train_batch_size=3, n=4, gen_batch_size=BATCH, max_num_gen_batches=4,
               overlong=OverlongConfig(enable=False), on_cap="train_on_kept")
    cfg.update(buffer_kw)
    buf = RolloutBuffer(BufferConfig(**cfg), Mod3Grader(), decode)
    skipper = PromptSkipper(skip or PromptSkipConfig(), seed=0)
    collector = StreamingCollector(buf, skipper, partial_rollout=partial, poll_tokens=3)
    stream = Stream()
    queue = PromptQueue(stream, BATCH, RECORDS.__getitem__)
    return buf, collector, queue, stream


@pytest.fixture(scope="module")
def engine():
    return HFEngine(tiny_llama(seed=2), eos_token_ids=[3])


def _signature(groups):
    return [(g.prompt_seed, [(s.response_ids, s.finish_reason, s.versions) for s in g.samples]) for g in groups]


def _check_one_logprob_per_token(*group_lists):
    """Every sample (returned, carried as surplus, carried as a partial rollout) holds one rollout
    logprob per response token, and versions that cover its tokens."""
    for groups in group_lists:
        for g in groups:
            for s in g.samples:
                assert len(s.rollout_logprobs) == len(s.response_ids), (g.prompt_seed, len(s.rollout_logprobs),
                                                                         len(s.response_ids))
                assert len(s.token_versions()) == (len(s.response_ids) if s.versions else 0)


def test_exactly_n_mixed_groups_in_finishing_order(engine):
    buf, collector, queue, _ = make()
    out, m = collector.collect(EngineClient(engine, PARAMS), queue, policy_version=0)
    assert len(out) == 3 and m["rollout/kept_groups"] == 3 and m["rollout/hit_cap"] == 0
    assert [g.group_id for g in out] == [0, 1, 2]
    for g in out:
        accs = [s.acc for s in g.samples]
        assert any(accs) and not all(accs)  # dynamic sampling kept mixed groups only
        assert all(s.finish_reason in ("stop", "length") and s.versions == [(0, engine.weight_version)]
                   for s in g.samples)
    assert m["rollout/prompts_submitted"] >= 3 and m["rollout/rounds"] >= 1
    assert m["rollout/gen_tokens"] == pytest.approx(
        sum(len(s.response_ids) for g in out for s in g.samples) * m["rollout/gen_tokens_per_kept_token"])
    # every response equals the one generate() gives its prompt alone with the same seed
    for g in out:
        alone = engine.generate([g.samples[0].prompt_ids], SamplingParams(n=4, **{
            k: getattr(PARAMS, k) for k in ("temperature", "max_new_tokens", "stop_token_ids", "seed")}),
            prompt_seeds=[g.prompt_seed])[0]
        assert [s.response_ids for s in g.samples] == [c.response_ids for c in alone]
        for s, c in zip(g.samples, alone, strict=True):  # and one logprob per token, each the engine's
            assert len(s.rollout_logprobs) == len(c.logprobs) == len(s.response_ids)
            assert max((abs(a - b) for a, b in zip(s.rollout_logprobs, c.logprobs, strict=True)), default=0) < 1e-5
    _check_one_logprob_per_token(out, buf.surplus, collector.partial)
    assert engine.num_in_flight == 0


def test_partial_rollouts_continue_next_step_with_their_versions(engine):
    """Rows aborted at the end of step 1 are continued in step 2 by weights version 1; with
    unchanged weights the continued response is the uninterrupted one, and its versions say
    which tokens each version sampled."""
    buf, collector, queue, _ = make(partial=True, max_staleness=1)
    client = EngineClient(engine, PARAMS)
    version0 = engine.weight_version
    for _ in range(6):  # until a step ends with rows in flight (the third one here)
        out1, m1 = collector.collect(client, queue, policy_version=version0)
        if collector.partial:
            break
    carried = collector.partial
    _check_one_logprob_per_token(out1, buf.surplus, carried)
    assert carried and m1["rollout/partial_out"] > 0 and m1["rollout/aborted_rows"] >= m1["rollout/partial_out"]
    started = {(g.prompt_seed, j): len(s.response_ids) for g in carried for j, s in enumerate(g.samples)
               if s.finish_reason == PENDING}
    assert any(n > 0 for n in started.values()), "some aborted row had sampled tokens"
    engine.update_weights(iter(engine.model.state_dict().items()), version=version0 + 1)  # same weights, new version
    out2, m2 = collector.collect(client, queue, policy_version=version0 + 1)
    _check_one_logprob_per_token(out2, buf.surplus, collector.partial)
    assert m2["rollout/partial_in"] == len(started)
    continued = [(g, j, s) for g in out2 + buf.surplus + collector.partial for j, s in enumerate(g.samples)
                 if (g.prompt_seed, j) in started and s.finish_reason != PENDING]
    assert continued, "a carried group finished in step 2"
    for g, j, s in continued:
        k = started[(g.prompt_seed, j)]
        want = [(0, version0)] if k else []
        if len(s.response_ids) > k:
            want = want + [(k, version0 + 1)]
        assert s.versions == want, (s.versions, k)
        alone = engine.generate([s.prompt_ids], SamplingParams(n=j + 1, **{
            key: getattr(PARAMS, key) for key in ("temperature", "max_new_tokens", "stop_token_ids", "seed")}),
            prompt_seeds=[g.prompt_seed])[0][j]
        assert s.response_ids == alone.response_ids and s.finish_reason == alone.finish_reason
        # strict: a continued response holds the logprob of every token, its prefix's included
        assert max((abs(a - b) for a, b in zip(s.rollout_logprobs, alone.logprobs, strict=True)), default=0) < 1e-5
    stale = [s for g in out2 for s in g.samples if s.staleness(version0 + 1) > 0]
    assert m2["train/stale_samples"] == len(stale)


def test_without_partial_rollout_in_flight_rows_are_discarded(engine):
    buf, collector, queue, _ = make(partial=False)
    out, m = collector.collect(EngineClient(engine, PARAMS), queue, policy_version=engine.weight_version)
    assert collector.partial == [] and m["rollout/partial_out"] == 0
    assert m["rollout/aborted_tokens"] <= m["rollout/gen_tokens"]


def test_a_step_of_carried_groups_only_logs_no_generation_metric(engine):
    """Issue 25, streamed: a step whose N groups are all carried surplus (here: the groups the
    last step returned, loaded back as the buffer's surplus) submits nothing; its generation
    metrics are absent and every value it logs is finite."""
    from dapo_megatron.rollout.sampling.buffer import GENERATION_METRICS, group_to_dict

    buf, collector, queue, _ = make()
    client = EngineClient(engine, PARAMS)
    out, m1 = collector.collect(client, queue, policy_version=engine.weight_version)
    assert set(GENERATION_METRICS) - {"perf/gen_tokens_per_s"} <= set(m1)  # a step that generated logs them all
    buf.load_state_dict({"surplus": [group_to_dict(g) for g in out]})
    fetched = queue.fetched
    again, m = collector.collect(client, queue, policy_version=engine.weight_version)
    assert [g.prompt_seed for g in again] == [g.prompt_seed for g in out] and queue.fetched == fetched
    assert all(math.isfinite(v) for v in m.values()), m
    assert not set(GENERATION_METRICS) & set(m), sorted(set(GENERATION_METRICS) & set(m))
    trained = [s for g in again for s in g.samples]
    assert m["train/acc_mean"] == pytest.approx(sum(s.acc for s in trained) / len(trained))
    assert m["train/response_length_mean"] == pytest.approx(sum(len(s.response_ids) for s in trained) / len(trained))
    assert m["rollout/surplus_in"] == 3 and m["rollout/kept_groups"] == 3 and m["train/staleness_max"] == 0


def test_state_roundtrip_repeats_the_next_step_exactly(engine):
    """What a resume needs: buffer surplus, partial groups, keep rate, skip history and queue
    position restored from state dicts give the same next step as the uninterrupted run."""
    skip = PromptSkipConfig(enable=True, zero_variance_visits=1, skip_probability=0.7)
    a = make(partial=True, skip=skip)
    client = EngineClient(engine, PARAMS)
    for step in range(3):
        a[1].collect(client, a[2], policy_version=engine.weight_version)
    state = {"buffer": a[0].state_dict(), "collector": a[1].state_dict(), "queue": a[2].state_dict(),
             "stream": a[3].batches}
    state = torch.load(_roundtrip(state), weights_only=True)
    b = make(partial=True, skip=skip)
    b[0].load_state_dict(state["buffer"])
    b[1].load_state_dict(state["collector"])
    b[2].load_state_dict(state["queue"])
    b[3].batches = state["stream"]
    out_a, m_a = a[1].collect(client, a[2], policy_version=engine.weight_version)
    out_b, m_b = b[1].collect(client, b[2], policy_version=engine.weight_version)
    assert _signature(out_a) == _signature(out_b)
    assert {k: v for k, v in m_a.items() if not math.isnan(v)} == {k: v for k, v in m_b.items() if not math.isnan(v)}
    assert _signature(a[1].partial) == _signature(b[1].partial) and _signature(a[0].surplus) == _signature(b[0].surplus)
    assert a[1].skipper.state_dict() == b[1].skipper.state_dict()


def _roundtrip(obj):
    import io

    blob = io.BytesIO()
    torch.save(obj, blob)
    blob.seek(0)
    return blob


def test_prompt_skipping_skips_zero_variance_prompts_and_explores_the_rest(engine):
    skip = PromptSkipConfig(enable=True, zero_variance_visits=1, skip_probability=0.5)
    buf, collector, queue, _ = make(skip=skip, train_batch_size=4)
    client = EngineClient(engine, PARAMS)
    # the oracle, from the graded groups themselves: was the last group of each prompt all right
    # or all wrong (zero variance of buffer.filter_metric=acc)?
    last_zero, real_grade = {}, buf.grade

    def grade_spy(groups):
        real_grade(groups)
        for g in groups:
            last_zero[g.samples[0].prompt_index] = len({s.acc for s in g.samples}) == 1

    buf.grade = grade_spy
    decisions = []  # (prompt index, a candidate when it came up, skipped, its last group zero-variance)
    real = collector.skipper.skip

    def spy(index):
        candidate, zero = collector.skipper.is_candidate(index), last_zero.get(index)
        decisions.append((index, candidate, real(index), zero))
        return decisions[-1][2]

    collector.skipper.skip = spy
    skipped = 0
    for _ in range(8):  # 24 prompts, several epochs: each prompt is visited again
        _, m = collector.collect(client, queue, policy_version=engine.weight_version)
        skipped += m["rollout/skipped_prompts"]
    assert skipped == sum(s for _, _, s, _ in decisions) > 0
    # k = 1: a candidate exactly when the last graded group of the prompt had zero variance
    assert all(c == bool(z) for _, c, _, z in decisions), [(i, c, z) for i, c, _, z in decisions if c != bool(z)]
    assert not any(s for _, _, s, z in decisions if not z), "a prompt whose last group had mixed accuracy was skipped"
    assert any(z is False for *_, z in decisions) and any(z for *_, z in decisions), "both kinds came up again"
    assert all(c for _, c, s, _ in decisions if s), "only zero-variance prompts are skipped"
    explored = [s for _, c, s, _ in decisions if c]
    assert not all(explored), "some candidates were explored again"
    state = collector.skipper.state_dict()
    assert state["streak"] and all(n == 1 for _, n in state["streak"])
    # a disabled skipper never skips, whatever the history
    off = PromptSkipper(PromptSkipConfig(enable=False))
    off.load_state_dict(state)
    assert not any(off.skip(i) for i in range(N_PROMPTS))


def test_skip_draws_are_a_function_of_seed_prompt_and_encounter():
    cfg = PromptSkipConfig(enable=True, zero_variance_visits=2, skip_probability=0.5)
    a, b = PromptSkipper(cfg, seed=1), PromptSkipper(cfg, seed=1)
    for s in (a, b):
        s.record(7, True)
        assert not s.skip(7)  # one zero-variance visit < k = 2
        s.record(7, True)
    draws_a = [a.skip(7) for _ in range(200)]
    assert draws_a == [b.skip(7) for _ in range(200)]
    assert 60 < sum(draws_a) < 140  # about p = 0.5 of the encounters
    a.record(7, False)
    assert not a.is_candidate(7) and not any(a.skip(7) for _ in range(20))
    with pytest.raises(ValueError, match="skip_probability"):
        PromptSkipConfig(skip_probability=1.0).validate()


def test_stale_partial_groups_are_dropped(engine):
    buf, collector, queue, _ = make(partial=True, max_staleness=1)
    client = EngineClient(engine, PARAMS)
    for _ in range(6):
        collector.collect(client, queue, policy_version=0)
        if collector.partial:
            break
    assert collector.partial
    n = len(collector.partial)
    _, m = collector.collect(client, queue, policy_version=5)  # five versions later: all too old
    assert m["rollout/partial_in"] == 0 and m["rollout/dropped_stale"] >= n


def test_cap_with_on_cap_error_keeps_the_kept_groups(engine):
    buf, collector, queue, _ = make(on_cap="error", train_batch_size=20, max_num_gen_batches=1)
    with pytest.raises(RuntimeError, match="max_num_gen_batches=1"):
        collector.collect(EngineClient(engine, PARAMS), queue, policy_version=0)
    assert len(buf.surplus) < 20 and engine.num_in_flight == 0

"""RolloutBuffer dynamic sampling with scripted responses and a small real grader.

Responses are token-id lists; ``decode`` writes them as text ("5 7") and the grader marks
a response correct iff its last number equals the ground truth. A group pattern such as
"CWWW" means: first response correct, the other three wrong.
"""

import io
import math

import pytest
import torch

from dapo_megatron.algorithms.overlong import OverlongConfig
from dapo_megatron.rollout.sampling.buffer import GENERATION_METRICS, RolloutBuffer, logprob_mismatch_metrics
from dapo_megatron.rollout.sampling.config import BufferConfig
from dapo_megatron.rollout.types import Group, Sample

GT = "7"


def decode(ids):
    return " ".join(str(t) for t in ids)


class LastNumberGrader:
    """Grades 'text' against the ground truth on its last whitespace-separated token."""

    def __init__(self):
        self.num_requests = 0

    def grade(self, requests):
        out = []
        for data_source, text, gt, extra in requests:
            pred = text.split()[-1] if text.split() else None
            acc = pred == gt
            out.append({"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred})
        self.num_requests += len(requests)
        return out


def make_group(prompt_index, pattern, lengths=None, reasons=None):
    samples = []
    for j, c in enumerate(pattern):
        L = lengths[j] if lengths else 2
        resp = [5] * (L - 1) + [7 if c == "C" else 8]
        samples.append(Sample(prompt_ids=[1, 2, 3], response_ids=resp, rollout_logprobs=[-0.5] * L,
                              finish_reason=reasons[j] if reasons else "stop", group_id=prompt_index,
                              prompt_index=prompt_index, data_source="scripted", ground_truth=GT))
    return Group(group_id=prompt_index, samples=samples)


class Script:
    """generate_batch() that returns pre-written generation batches in order."""

    def __init__(self, batches):
        self.batches = batches
        self.calls = 0
        self.next_index = 0

    def __call__(self):
        assert self.calls < len(self.batches), "buffer asked for more generation batches than scripted"
        batch = []
        for pattern in self.batches[self.calls]:
            if isinstance(pattern, Group):
                batch.append(pattern)
            else:
                batch.append(make_group(self.next_index, pattern))
            self.next_index += 1
        self.calls += 1
        return batch


def make_buffer(**kw):
    cfg = dict(train_batch_size=2, n=4, gen_batch_size=4, max_num_gen_batches=4,
               overlong=OverlongConfig(enable=False))
    cfg.update(kw)
    return RolloutBuffer(BufferConfig(**cfg), LastNumberGrader(), decode)


def check_shape(groups, n):
    assert all(len(g.samples) == n for g in groups)
    assert [g.group_id for g in groups] == list(range(len(groups)))
    assert all(s.group_id == g.group_id for g in groups for s in g.samples)


def test_all_correct_and_all_wrong_groups_dropped():
    buf = make_buffer()
    script = Script([["CCCC", "WWWW", "CWCW", "WWWC"]])
    out, m = buf.collect(script)
    assert [g.samples[0].prompt_index for g in out] == [2, 3]
    check_shape(out, 4)
    assert m["rollout/dropped_all_correct"] == 1 and m["rollout/dropped_all_wrong"] == 1
    assert m["rollout/kept_groups"] == 2 and m["rollout/num_gen_batches"] == 1 and script.calls == 1
    assert [s.acc for s in out[0].samples] == [True, False, True, False]
    assert [s.score for s in out[1].samples] == [-1.0, -1.0, -1.0, 1.0]
    assert m["rollout/gen_acc_mean"] == pytest.approx((4 + 0 + 2 + 1) / 16)
    assert m["rollout/gen_tokens"] == 16 * 2 and m["rollout/gen_tokens_per_kept_token"] == pytest.approx(32 / 16)


def test_over_generates_then_carries_surplus_first():
    buf = make_buffer()
    script = Script([["CCCC", "CWWW"], ["WWWW", "WWWW"], ["CCWW", "WCWC"], ["WCCC", "CCCC"]])
    out, m = buf.collect(script)
    assert [g.samples[0].prompt_index for g in out] == [1, 4]
    assert m["rollout/num_gen_batches"] == 3 and m["rollout/surplus_out"] == 1
    assert [g.samples[0].prompt_index for g in buf.surplus] == [5]
    out2, m2 = buf.collect(script)
    assert [g.samples[0].prompt_index for g in out2] == [5, 6], "surplus must be used first"
    assert m2["rollout/surplus_in"] == 1 and m2["rollout/num_gen_batches"] == 1 and m2["rollout/surplus_out"] == 0
    check_shape(out2, 4)
    assert script.calls == 4


def test_a_step_of_carried_groups_only_logs_no_generation_metric_and_finite_trained_ones():
    """Issue 25: step 2 trains the two groups carried from step 1 and generates nothing. Its
    generation metrics are absent (not NaN, not 0); the trained batch's are there, finite,
    and equal to values computed here from the carried groups' responses."""
    ol = OverlongConfig(enable=True, max_response_length=8, overlong_buffer_len=4)
    batch = [make_group(i, p, lengths=ls) for i, (p, ls) in enumerate(
        [("CWWW", [2, 2, 2, 2]), ("CCWW", [2, 6, 2, 2]), ("CCCW", [7, 2, 2, 2]), ("WCWC", [2, 2, 8, 5])])]
    buf = make_buffer(overlong=ol)
    script = VersionedScript([batch])
    _, m1 = buf.collect(script, policy_version=0)
    assert m1["rollout/surplus_out"] == 2 and "rollout/gen_acc_mean" in m1 and "rollout/gen_tokens_per_kept_token" in m1
    carried = [s for g in buf.surplus for s in g.samples]
    out, m = buf.collect(script, policy_version=1)
    assert script.calls == 1 and m["rollout/num_gen_batches"] == 0 and m["rollout/surplus_in"] == 2
    assert all(math.isfinite(v) for v in m.values()), m
    assert not set(GENERATION_METRICS) & set(m), sorted(set(GENERATION_METRICS) & set(m))
    lengths = [7, 2, 2, 2, 2, 2, 8, 5]  # the carried CCCW and WCWC; Eq. 13 with L_max 8, L_cache 4:
    penalty = [-0.75, 0, 0, 0, 0, 0, -1.0, -0.25]
    score = [1, 1, 1, -1, -1, 1, -1, 1]
    assert [s.response_length for s in carried] == lengths
    assert m["train/score_mean"] == pytest.approx(sum(score) / 8)
    assert m["train/acc_mean"] == pytest.approx(5 / 8)
    assert m["train/overlong_penalty_mean"] == pytest.approx(sum(penalty) / 8)
    assert m["train/reward_mean"] == pytest.approx((sum(score) + sum(penalty)) / 8)
    assert m["train/response_length_mean"] == pytest.approx(sum(lengths) / 8) and m["train/response_length_max"] == 8
    assert m["train/staleness_max"] == 1 and m["train/stale_samples"] == 8


class VersionedScript(Script):
    """Script whose groups carry the weights version they were generated with (``version``)."""

    version = 0

    def __call__(self):
        batch = super().__call__()
        for g in batch:
            for s in g.samples:
                s.versions = [(0, self.version)]
        return batch


def test_surplus_older_than_max_staleness_is_dropped_and_counted():
    # step 1 (actor version 0) keeps 4 groups: 2 train, 2 carried; step 2 (version 1) needs only 1
    # of them, the other is carried again; at step 3 (version 2) it is 2 versions old and dropped
    buf = make_buffer(max_staleness=1)
    script = VersionedScript([["CWWW", "CCWW", "CCCW", "WCWC"], ["CWCW", "CCWW"]])
    out, m = buf.collect(script, policy_version=0)
    assert m["rollout/surplus_out"] == 2 and m["rollout/dropped_stale"] == 0 and m["train/staleness_max"] == 0
    buf.config.train_batch_size = 1
    script.version = 1
    out, m = buf.collect(script, policy_version=1)
    assert [g.samples[0].prompt_index for g in out] == [2] and m["rollout/num_gen_batches"] == 0
    assert m["train/staleness_mean"] == 1.0 and m["train/stale_samples"] == 4
    buf.config.train_batch_size = 2
    script.version = 2
    out, m = buf.collect(script, policy_version=2)
    assert m["rollout/dropped_stale"] == 1 and m["rollout/surplus_in"] == 0
    assert [g.samples[0].prompt_index for g in out] == [4, 5] and m["train/staleness_max"] == 0


def test_max_staleness_zero_carries_nothing():
    buf = make_buffer(max_staleness=0)
    script = VersionedScript([["CWWW", "CCWW", "CCCW"], ["CWCW", "CCWW"]])
    buf.collect(script, policy_version=0)
    script.version = 1
    out, m = buf.collect(script, policy_version=1)
    assert m["rollout/dropped_stale"] == 1 and [g.samples[0].prompt_index for g in out] == [3, 4]


def test_token_versions_of_a_partial_rollout():
    s = make_group(0, "C", lengths=[5]).samples[0]
    s.versions = [(0, 3), (2, 4)]
    assert s.token_versions() == [3, 3, 4, 4, 4] and s.oldest_version == 3 and s.staleness(5) == 2
    s.versions = [(1, 3)]
    with pytest.raises(ValueError, match="start at token 0"):
        s.token_versions()


def test_cap_reached_raises_naming_the_knob():
    buf = make_buffer(max_num_gen_batches=3)
    script = Script([["WWWW", "CWWW"], ["CCCC", "WWWW"], ["WWWW", "WWWW"], ["CWCW", "CWCW"]])
    with pytest.raises(RuntimeError, match=r"max_num_gen_batches=3.*kept 1 of train_batch_size=2|"
                                           r"kept 1 of train_batch_size=2.*max_num_gen_batches=3"):
        buf.collect(script)
    assert script.calls == 3, "must stop at the cap, not loop on"
    assert [g.samples[0].prompt_index for g in buf.surplus] == [1], "kept groups are not thrown away"


def test_cap_train_on_kept_returns_fewer_and_says_so():
    buf = make_buffer(max_num_gen_batches=2, on_cap="train_on_kept", train_batch_size=3)
    out, m = buf.collect(Script([["WWWW", "CWWW"], ["CCCC", "CCWW"]]))
    assert len(out) == 2 and m["rollout/hit_cap"] == 1.0 and m["rollout/kept_groups"] == 2
    check_shape(out, 4)
    out, m = make_buffer(max_num_gen_batches=1, on_cap="train_on_kept").collect(Script([["WWWW", "CCCC"]]))
    assert out == [] and m["rollout/hit_cap"] == 1.0 and "train/response_length_mean" not in m


def test_filter_on_raw_accuracy_not_on_shaped_reward():
    ol = OverlongConfig(enable=True, max_response_length=8, overlong_buffer_len=4)
    lengths = [2, 5, 8, 3]  # Eq. 13 with L_max 8, L_cache 4: penalties 0, -0.25, -1, 0
    group = make_group(0, "CCCC", lengths=lengths)
    mixed = make_group(1, "CWCW")
    buf = make_buffer(train_batch_size=1, overlong=ol, max_num_gen_batches=2)
    out, m = buf.collect(Script([[group, mixed]]))
    assert [g.samples[0].prompt_index for g in out] == [1] and m["rollout/dropped_all_correct"] == 1
    assert [s.overlong_penalty for s in group.samples] == [0.0, -0.25, -1.0, 0.0]
    assert [s.reward for s in group.samples] == [1.0, 0.75, 0.0, 1.0]
    # filtering on the shaped reward would have kept the all-correct group
    group2 = make_group(0, "CCCC", lengths=lengths)
    out, _ = make_buffer(train_batch_size=1, overlong=ol, filter_metric="reward").collect(Script([[group2]]))
    assert out[0].samples[0].prompt_index == 0


def test_truncated_responses_and_overlong_filter():
    reasons = ["length", "stop", "length", "stop"]
    g = make_group(0, "CWWW", lengths=[6, 3, 6, 2], reasons=reasons)
    g2 = make_group(1, "CCWC", lengths=[2, 2, 2, 2])
    buf = make_buffer(overlong_filter=True)
    out, m = buf.collect(Script([[g, g2]]))
    assert [s.loss_mask_zero for s in out[0].samples] == [True, False, True, False]
    assert not any(s.loss_mask_zero for s in out[1].samples)
    assert m["train/truncation_ratio"] == pytest.approx(2 / 8)
    assert m["train/response_length_mean"] == pytest.approx((6 + 3 + 6 + 2 + 8) / 8)
    assert m["train/response_length_max"] == 6
    out, _ = make_buffer().collect(Script([[make_group(0, "CWWW", lengths=[6, 3, 6, 2], reasons=reasons), g2]]))
    assert not any(s.loss_mask_zero for s in out[0].samples), "overlong_filter off masks nothing"


def test_state_dict_roundtrip_and_determinism():
    batches = [["CWWW", "CCWW", "CCCW", "WWWW"], ["CWCW", "WWWC", "CCCC", "CWWW"]]
    a = make_buffer()
    script_a = Script(batches)
    a.collect(script_a)
    blob = io.BytesIO()
    torch.save(a.state_dict(), blob)
    blob.seek(0)
    b = make_buffer()
    b.load_state_dict(torch.load(blob, weights_only=True))  # plain python types only
    script_b = Script(batches[1:])
    script_b.next_index = script_a.next_index
    out_a, m_a = a.collect(script_a)
    out_b, m_b = b.collect(script_b)
    assert out_a == out_b and m_a == m_b
    assert [g.samples[0].prompt_index for g in out_a] == [2, 4]


def test_filter_groups_off_keeps_everything():
    out, m = make_buffer(filter_groups=False).collect(Script([["CCCC", "WWWW"]]))
    assert [g.samples[0].prompt_index for g in out] == [0, 1] and m["rollout/dropped_all_wrong"] == 0


@pytest.mark.parametrize("kw,field", [(dict(max_num_gen_batches=0), "^max_num_gen_batches=0 must be"),
                                      (dict(n=1), "^n=1: dynamic sampling"), (dict(filter_metric="std"), "filter_metric"),
                                      (dict(on_cap="skip"), "on_cap"), (dict(train_batch_size=0), "train_batch_size"),
                                      (dict(max_staleness=-1), "max_staleness")])
def test_config_validation(kw, field):
    """BufferConfig.validate is the one owner of these checks (load_config runs it; the buffer's
    constructor takes a validated section and does not check it again)."""
    cfg = dict(train_batch_size=2, n=4, gen_batch_size=4, max_num_gen_batches=4, overlong=OverlongConfig(enable=False))
    with pytest.raises(ValueError, match=field):
        BufferConfig(**{**cfg, **kw}).validate()


def test_bad_generation_batch_rejected():
    with pytest.raises(ValueError, match="buffer.n=4 requires exactly n"):
        make_buffer().collect(Script([[make_group(0, "CWC")]]))
    with pytest.raises(ValueError, match="gen_batch_size=1"):
        make_buffer(gen_batch_size=1).collect(Script([["CWCW", "CWCW"]]))


def test_logprob_mismatch_metrics():
    a = Sample([1], [4, 5], [-1.0, -2.0], "stop", old_logprobs=[-1.5, -2.0])
    b = Sample([1], [6], [-0.1], "stop", old_logprobs=[-0.4])
    c = Sample([1], [6], [-9.0], "stop")  # no actor logprobs: skipped
    m = logprob_mismatch_metrics([a, b, c])
    assert m["rollout/logprob_diff_mean"] == pytest.approx((0.5 + 0.0 + 0.3) / 3)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"samples\[0\]"):
        logprob_mismatch_metrics([Sample([1], [4], [-1.0], "stop", old_logprobs=[-1.0, -2.0])])
    with pytest.raises(ValueError, match="old_logprobs"):
        logprob_mismatch_metrics([c])


def test_the_stale_token_gap_counts_the_tokens_of_older_weights_only():
    # a partial rollout: tokens 0-1 by version 3, tokens 2-3 by version 5; a fresh sample; one of unknown version
    partial = Sample([1], [4, 5, 6, 7], [-1.0, -2.0, -3.0, -4.0], "stop", old_logprobs=[-1.25, -2.5, -9.0, -9.0],
                     versions=[(0, 3), (2, 5)])
    fresh = Sample([1], [6], [-0.1], "stop", old_logprobs=[-5.0], versions=[(0, 5)])
    unknown = Sample([1], [6], [-0.1], "stop", old_logprobs=[-7.0])
    m = logprob_mismatch_metrics([partial, fresh, unknown], older_than=5)
    assert m == {"rollout/logprob_diff_mean": pytest.approx((0.25 + 0.5) / 2), "rollout/logprob_diff_max": 0.5}
    assert logprob_mismatch_metrics([fresh], older_than=5) == {"rollout/logprob_diff_mean": 0.0,
                                                              "rollout/logprob_diff_max": 0.0}
    assert logprob_mismatch_metrics([partial], older_than=4)["rollout/logprob_diff_max"] == 0.5

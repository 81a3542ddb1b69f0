"""The step feeder's parts that no mode's test reaches alone: the selector's public step state (the
async controller checkpoints an open step with it), the admission policies' sizing, whole batches
with GRESO skipping (batch mode's and the async controller's) and the η gate."""

import hashlib
from types import SimpleNamespace

import pytest

from dapo_megatron.rollout.sampling.buffer import GroupSelector
from dapo_megatron.rollout.sampling.config import BufferConfig
from dapo_megatron.rollout.sampling.feeder import Admission, EtaBound, KeepRate, KeepRateStreaming, PromptQueue, WholeBatches
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig, PromptSkipper
from dapo_megatron.rollout.steps_ahead import StepsAhead
from unit.rollout.test_buffer import LastNumberGrader, decode, make_group


def _selector() -> GroupSelector:
    cfg = BufferConfig(train_batch_size=2, n=3, gen_batch_size=2, max_num_gen_batches=3)
    cfg.validate()
    return GroupSelector(cfg, LastNumberGrader(), decode)


def test_an_open_step_restored_from_its_state_ends_as_the_uninterrupted_one():
    groups = [make_group(0, "CWW"), make_group(1, "CCC"), make_group(2, "WWW")]
    full, restored = _selector(), _selector()
    full.begin(5)
    full.grade(groups)
    for g in groups[:2]:
        full.offer(g)
    state = full.step_state_dict()
    assert (len(state["kept"]), len(state["graded"]), state["dropped"]) == (1, 6, {"all_correct": 1, "all_wrong": 0,
                                                                                  "other": 0})
    restored.load_step_state(5, state)
    assert [g.group_id for g in restored.kept] == [0] and len(restored.graded) == 6 and restored.missing == 1
    for sel in (full, restored):
        sel.offer(groups[2])
        sel.take()
    metrics = [sel.step_metrics(num_batches=1) for sel in (full, restored)]
    assert metrics[0] == metrics[1] and metrics[0]["rollout/dropped_all_wrong"] == 1.0
    assert metrics[0]["rollout/gen_acc_mean"] == 4 / 9  # 1 + 3 + 0 right of the 9 graded


def test_whole_batches_admit_one_batch_with_nothing_in_flight_up_to_the_cap():
    drawn = []
    admission = WholeBatches(SimpleNamespace(max_num_gen_batches=2), lambda: drawn.append(len(drawn)) or drawn[-1])
    admission.new_step()
    assert admission.admit(missing=3, in_flight=4) is None and drawn == []
    assert [admission.admit(3, 0), admission.admit(3, 0), admission.admit(3, 0)] == [0, 1, None]
    assert admission.at_cap() and admission.counts() == {"num_batches": 2, "submitted": 0, "skipped": 0}


def test_keep_rate_admission_counts_in_flight_groups_as_expected_keeps():
    cfg = BufferConfig(train_batch_size=4, n=2, gen_batch_size=3, max_num_gen_batches=2)
    records = [SimpleNamespace(index=i) for i in range(12)]
    stream = iter([records[:3], records[3:6], records[6:9]])
    queue = PromptQueue(lambda: next(stream), 3, records.__getitem__)
    keep = KeepRate(kept=1.0, graded=3.0)  # rate (1 + 1) / (3 + 1) = 0.5
    admission = KeepRateStreaming(cfg, queue, PromptSkipper(PromptSkipConfig(enable=False)), keep)
    # 4 missing, 6 in flight at 0.5: 3 expected, 1 more expected keep needs ceil(1 / 0.5) = 2 prompts
    assert [pos for _, pos in admission.admit(4, 6)] == [0, 1]
    assert admission.admit(3, 6) is None  # 3 expected from what runs: nothing more
    # the rest of the cap (2 batches x 3 = 6 prompts), one round's share (3) at most
    assert [pos for _, pos in admission.admit(4, 0)] == [2, 3, 4]
    assert [pos for _, pos in admission.admit(4, 0)] == [5] and admission.at_cap() and admission.admit(4, 0) is None
    assert admission.counts() == {"num_batches": 2, "submitted": 6, "skipped": 0}


def test_eta_bounds_the_weights_a_request_may_sample_with():
    assert EtaBound(1).admits(version=3, policy_version=4) and not EtaBound(0).admits(version=3, policy_version=4)
    assert EtaBound(0).admits(version=4, policy_version=4)


def greso_skips(seed, p, k, index, encounter, streak):
    """GRESO's rule from its definition (``prompt_skip``'s docstring): a prompt whose last ``k`` visits
    had zero variance is skipped when blake2b's 53-bit uniform of ``skip:{seed}:{index}:{encounter}``
    is below ``p``."""
    digest = hashlib.blake2b(f"skip:{seed}:{index}:{encounter}".encode(), digest_size=8).digest()
    return streak >= k and (int.from_bytes(digest, "little") >> 11) / float(1 << 53) < p


def _skipping_queue(num=6, batch=3):
    records = [SimpleNamespace(index=i) for i in range(num)]
    fetched = iter(range(10**6))
    queue = PromptQueue(lambda: records[next(fetched) * batch % num:][:batch], batch, records.__getitem__)
    skipper = PromptSkipper(PromptSkipConfig(enable=True, zero_variance_visits=1, skip_probability=0.5), seed=7)
    return queue, skipper


def _group_of(index):
    return SimpleNamespace(samples=[SimpleNamespace(prompt_index=index)])


def test_whole_batches_with_a_skipper_admit_whole_batches_of_the_prompts_it_lets_through():
    queue, skipper = _skipping_queue()
    admission = WholeBatches(SimpleNamespace(max_num_gen_batches=2, gen_batch_size=3), lambda drawn: drawn, queue,
                             skipper)
    admission.new_step()
    first = admission.admit(2, 0)
    assert [pos for _, pos in first] == [0, 1, 2]  # no history yet: nothing is skipped
    zero = {0: True, 1: True, 2: False}  # the outcomes of the first batch: prompts 0 and 1 become candidates
    for rec, _ in first:
        admission.record(_group_of(rec.index), kept=not zero[rec.index], zero_variance=zero[rec.index])
    # the independent replay: positions 3, 4, ... are prompts 3, 4, 5, 0, 1, 2, ... (6 prompts, batches of 3)
    want, skipped, seen, pos = [], 0, {}, 3
    while len(want) < 3:
        i = pos % 6
        if greso_skips(7, 0.5, 1, i, seen.get(i, 0), int(zero.get(i, False))):
            skipped += 1
        else:
            want.append(pos)
        seen[i] = seen.get(i, 0) + 1
        pos += 1
    second = admission.admit(2, 0)
    assert [p for _, p in second] == want and [r.index for r, _ in second] == [p % 6 for p in want]
    assert admission.at_cap() and admission.admit(2, 0) is None
    assert admission.counts() == {"num_batches": 2, "submitted": 6, "skipped": skipped}
    assert admission.skip_metrics() == {"rollout/prompts_submitted": 6.0, "rollout/skipped_prompts": float(skipped)}


def test_the_async_controllers_batch_admission_skips_and_checkpoints_its_kind():
    def steps(streamed=False, queue=True):
        q, sk = _skipping_queue()
        sk.record(1, zero_variance=True)  # prompt 1 a candidate
        cfg = BufferConfig(train_batch_size=2, n=2, gen_batch_size=3, max_num_gen_batches=2, max_staleness=1)
        return StepsAhead(GroupSelector(cfg, LastNumberGrader(), decode), lambda: [], policy_version=0,
                          prompts=q if queue else None, skipper=sk, streamed=streamed)

    ahead = steps()
    records, positions = ahead.admit()
    want = [p for p in range(4) if not greso_skips(7, 0.5, 1, p, 0, int(p == 1))][:3]
    assert positions == want and [r.index for r in records] == want
    state = ahead.state_dict()
    assert state["admission"]["streamed"] is False and state["admission"]["skipper"] == ahead.skipper.state_dict()
    again = steps()
    again.load_state_dict(state)
    assert again.skipper.state_dict() == ahead.skipper.state_dict() and again.prompts.state_dict() == \
        ahead.prompts.state_dict()
    with pytest.raises(ValueError, match=r"^the checkpoint was written with rollout.streaming=false .* with "
                                         r"rollout.streaming=false$"):
        steps(streamed=True).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^the checkpoint was written with buffer.prompt_skip.enable=true .* with "
                                         r"buffer.prompt_skip.enable=true$"):
        steps(queue=False).load_state_dict(state)


def test_a_new_admission_policy_must_define_every_decision():
    """``Admission`` holds the counters; a policy that leaves out a decision (here ``at_cap``) is
    refused when built, not read as None by the feeder (a step that never reaches its cap)."""

    class NoCap(Admission):
        def admit(self, missing, in_flight):
            return None

        def record(self, g, kept, zero_variance):
            pass

        def cap_spent(self):
            return "nothing"

    with pytest.raises(TypeError, match="at_cap"):
        NoCap()
    policy = type("WithCap", (NoCap,), {"at_cap": lambda self: True})()
    policy.submitted, policy.skipped, policy.num_batches = 3, 1, 2
    policy.new_step()  # the counters restart with the step
    assert policy.counts() == {"num_batches": 0, "submitted": 0, "skipped": 0}

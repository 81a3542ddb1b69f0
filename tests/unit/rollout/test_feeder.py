"""The step feeder's parts that no mode's test reaches alone: the selector's public step state (the
async controller checkpoints an open step with it), the admission policies' sizing and the η gate."""

from types import SimpleNamespace

from dapo_megatron.rollout.sampling.buffer import BufferConfig, GroupSelector
from dapo_megatron.rollout.sampling.feeder import EtaBound, KeepRate, KeepRateStreaming, PromptQueue, WholeBatches
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig, PromptSkipper
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

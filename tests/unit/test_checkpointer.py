"""The run's one checkpointer (``checkpointing.Checkpointer``): every component's state round-trips,
a checkpoint in the layout main wrote up to e9128fc loads, and a damaged or mismatched one fails
with one message naming the file and the fix.

One world-of-one process: the tiny GPT + DDP + distributed optimizer + scheduler of
``test_checkpointing`` stand in for the actor; the rollout is a real ``Rollout`` (no engine: its
state is the prompt stream, the selector's surplus, the streamed collector's partial groups and
keep rate, the GRESO skip history (streamed, or batch mode's) and the prompt queue), put in a
known state through the components' own operations. Each value is compared with the one the
saved objects hold (or would produce next), not with what the checkpointer wrote.
"""

import os
import shutil

import pytest
import torch

from dapo_megatron.platform import spawn
from unit.test_checkpointing import _build, _params, _rng_probe, _seed_this_rank, _train_step

NUM_PROMPTS, GEN_BATCH = 12, 4


def _records():
    from dapo_megatron.data.dataset import PromptRecord

    return [PromptRecord(index=k, data_source="arithmetic", prompt_ids=[5, k + 10], messages=[], ground_truth=str(k),
                         extra_info={"index": k}) for k in range(NUM_PROMPTS)]


def _rollout(par, streaming: bool = True, prompt_skip: bool = True):
    """A real Rollout without an engine (engine_index None): everything it checkpoints."""
    from dapo_megatron.config import DAPOConfig
    from dapo_megatron.data.stream import PromptStream
    from dapo_megatron.rollout.rollout import Rollout
    from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
    from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipper
    from dapo_megatron.rollout.sampling.streaming import StreamingCollector
    from dapo_megatron.rollout.sampling.feeder import PromptQueue

    cfg = DAPOConfig()  # the model is never loaded: only the buffer and rollout sections are read
    cfg.buffer.gen_batch_size, cfg.buffer.train_batch_size, cfg.buffer.n = GEN_BATCH, 2, 2
    cfg.buffer.prompt_skip.enable, cfg.rollout.streaming = prompt_skip, streaming
    records = _records()
    stream = PromptStream(records, GEN_BATCH, 0, 1, seed=3)
    buffer = RolloutBuffer(cfg.buffer, reward_pool=None, decode=None)
    queue = PromptQueue(stream.next_batch, GEN_BATCH, records.__getitem__)  # streamed, or batch mode with skipping
    collector = None
    if streaming:
        collector = StreamingCollector(buffer, PromptSkipper(cfg.buffer.prompt_skip, seed=1), partial_rollout=True,
                                       poll_tokens=2)
    return Rollout(cfg, par, engine=None, num_engines=1, engine_index=None, train_data=records, val_data=None,
                   stream=stream, reward_pool=None, decode=None, buffer=buffer, collector=collector,
                   prompt_queue=queue if streaming or prompt_skip else None)  # as build_rollout


def _group(gid, seed, versions, reward):
    from dapo_megatron.rollout.types import Group, Sample

    samples = [Sample(prompt_ids=[5, seed], response_ids=[7, 8, 9][:j + 2], rollout_logprobs=[-0.5, -0.25, -1.0][:j + 2],
                      finish_reason="stop" if j else "", group_id=gid, prompt_index=seed, data_source="arithmetic",
                      ground_truth=str(seed), reward=reward + j, score=reward, acc=bool(j), versions=versions,
                      holder=0) for j in range(2)]
    return Group(group_id=gid, samples=samples, prompt_seed=seed)


def _put_in_state(r):
    """Move every part of the rollout away from its initial state by its own operations."""
    from dapo_megatron.rollout.sampling.buffer import group_to_dict

    r.stream.next_batch()  # the stream one batch on
    r.prompt_queue.pop()  # the queue: a batch fetched (one more from the stream), three left over
    r.steps.gen_batches_done = r.prompt_queue.fetched
    sk = _skipper(r)
    for k in (1, 1, 1, 4):
        sk.skip(k)
        sk.record(k, zero_variance=k == 1)
    r.buffer.load_state_dict({"surplus": [group_to_dict(_group(0, 6, [(0, 2)], 1.0))]})
    if r.collector is not None:  # the collector's partial groups and keep-rate counts, as a step's end leaves them
        r.collector.load_state_dict({"partial": [group_to_dict(_group(1, 9, [(0, 1), (1, 2)], -1.0))], "kept": 1.5,
                                     "graded": 3.25, "skipper": sk.state_dict()})


def _skipper(r):
    """The rollout's GRESO skipper: the streamed collector's, or batch mode's (the step source's)."""
    return r.collector.skipper if r.collector is not None else r.steps.skipper


def _view(r):
    """What the next step would start from (values, not the state dicts the checkpointer wrote)."""
    sk = _skipper(r)

    def samples(groups):
        return [(g.group_id, g.prompt_seed, [(s.response_ids, s.rollout_logprobs, s.versions, s.finish_reason,
                                               s.reward, s.acc) for s in g.samples]) for g in groups]

    return {"gen_batches_done": r.steps.gen_batches_done, "next_stream": [x.index for x in r.stream.next_batch()],
            "surplus": samples(r.buffer.surplus),
            "candidates": [k for k in range(NUM_PROMPTS) if sk.is_candidate(k)],
            "encounters": [sk._encounters.get(k, 0) for k in range(NUM_PROMPTS)],
            "next_queue": [r.prompt_queue.pop()[1] for _ in range(4)],
            **({"partial": samples(r.collector.partial), "keep_rate": r.collector.keep.value}
               if r.collector is not None else {})}


def _worker(out_path, run_dir):
    from dapo_megatron import checkpointing as ckpt

    ddp, opt, sched, par = _build(1)
    _seed_this_rank(par)
    actor = type("Actor", (), {"model_chunks": [ddp], "optimizer": opt, "scheduler": sched})()
    res = {}

    # (1) layout 2: save, change everything, load into fresh objects
    _train_step(ddp, opt, sched)
    rollout = _rollout(par)
    _put_in_state(rollout)
    saver = ckpt.Checkpointer(run_dir, actor, {"rollout": rollout}, parallel=par)
    path = saver.save(3, tracking_run_id="run-abc")
    res["params_saved"], res["probe_saved"] = _params(ddp), _rng_probe()
    res["saved_view"] = _view(rollout)  # consumes the stream / queue: after the save
    _train_step(ddp, opt, sched)  # the weights and RNG move on
    fresh = _rollout(par)
    restored = ckpt.Checkpointer(run_dir, actor, {"rollout": fresh}, parallel=par).load(path)
    res["restored"] = (restored.step, restored.tracking_run_id)
    res["params_loaded"], res["probe_loaded"] = _params(ddp), _rng_probe()
    res["loaded_view"] = _view(fresh)
    res["layout"] = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)["layout"]
    # (1b) batch mode with prompt skipping: its skipper and the replicated prompt queue round-trip
    batch = _rollout(par, streaming=False)
    _put_in_state(batch)
    path = ckpt.Checkpointer(run_dir, actor, {"rollout": batch}, parallel=par).save(4, tracking_run_id=None)
    res["batch_saved_view"] = _view(batch)
    fresh = _rollout(par, streaming=False)
    ckpt.Checkpointer(run_dir, actor, {"rollout": fresh}, parallel=par).load(path)
    res["batch_loaded_view"] = _view(fresh)

    # (2) the layout e9128fc wrote: DAPOTrainer.save's dict, flat, through save_checkpoint
    old = _rollout(par)
    _put_in_state(old)
    old_dir = ckpt.save_checkpoint(run_dir, 5, [ddp], opt, sched,
                                   {"step": 5, **old.state_dict(), "mlflow_run_id": "run-old"}, parallel=par)
    res["old_saved_view"] = _view(old)
    again = _rollout(par)
    restored = ckpt.Checkpointer(run_dir, actor, {"rollout": again}).load(old_dir)
    res["old_restored"] = (restored.step, restored.tracking_run_id)
    res["old_loaded_view"] = _view(again)

    # (3) what must fail, with the message
    def error(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the type is checked below
            return type(e).__name__, str(e)
        return None

    batch_dir = ckpt.save_checkpoint(run_dir, 6, [ddp], opt, sched,
                                     {"step": 6, **_rollout(par, streaming=False).state_dict(), "mlflow_run_id": None})
    res["batch_into_streamed"] = error(lambda: ckpt.Checkpointer(run_dir, actor, {"rollout": _rollout(par)}).load(
        batch_dir))
    streamed = _rollout(par)
    _put_in_state(streamed)  # one partial group to continue
    streamed_dir = ckpt.save_checkpoint(run_dir, 7, [ddp], opt, sched,
                                        {"step": 7, **streamed.state_dict(), "mlflow_run_id": None})
    # into a batch run without skipping, which would drop the partial group (with skipping the skipper's
    # refusal would answer first); without partial groups nothing is lost and the same switch loads
    res["streamed_into_batch"] = error(lambda: ckpt.Checkpointer(
        run_dir, actor, {"rollout": _rollout(par, streaming=False, prompt_skip=False)}).load(streamed_dir))
    no_partial = _rollout(par)
    no_partial.stream.next_batch()
    no_partial_dir = ckpt.save_checkpoint(run_dir, 8, [ddp], opt, sched,
                                          {"step": 8, **no_partial.state_dict(), "mlflow_run_id": None})
    as_batch = _rollout(par, streaming=False, prompt_skip=False)
    res["no_partial_into_batch"] = (ckpt.Checkpointer(run_dir, actor, {"rollout": as_batch}).load(no_partial_dir).step,
                                    [x.index for x in as_batch.stream.next_batch()],
                                    [x.index for x in no_partial.stream.next_batch()])
    for name, state in (("unknown_layout", {"layout": 9, "step": 5, "components": {}}),
                        ("no_rollout", {"layout": 2, "step": 5, "tracking_run_id": None, "components": {"x": {}}}),
                        ("not_a_state", ["step", 5])):
        broken = os.path.join(run_dir, "checkpoints", f"step_{name}")
        shutil.copytree(old_dir, broken)
        torch.save(state, os.path.join(broken, "trainer_state.pt"))
        res[name] = error(lambda: ckpt.Checkpointer(run_dir, actor, {"rollout": _rollout(par)}).load(broken))
    torch.save(res, out_path)


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpointer")
    spawn(_worker, 1, str(out / "res.pt"), str(out / "run"))
    return torch.load(out / "res.pt", weights_only=False)


def test_every_component_round_trips(res):
    assert res["layout"] == 2
    assert res["restored"] == (3, "run-abc")
    saved, loaded = res["saved_view"], res["loaded_view"]
    assert saved == loaded
    # the state is not the initial one: every part was moved
    assert saved["gen_batches_done"] == 1 and saved["surplus"] and saved["partial"]
    assert saved["candidates"] == [1] and saved["encounters"][1] == 3 and saved["encounters"][4] == 1
    assert saved["keep_rate"] == pytest.approx((1.5 + 1) / (3.25 + 1))
    assert saved["next_queue"][:3] == [1, 2, 3]  # the leftover of the fetched batch, then the next one
    # the actor's weights and this rank's RNG are the saved ones, not those of the step after
    assert all(torch.equal(res["params_saved"][n], res["params_loaded"][n]) for n in res["params_saved"])
    p, q = res["probe_saved"], res["probe_loaded"]
    assert p["random"] == q["random"] and torch.equal(p["torch"], q["torch"])


def test_batch_mode_keeps_the_skip_history_and_the_prompt_queue(res):
    saved, loaded = res["batch_saved_view"], res["batch_loaded_view"]
    assert saved == loaded and "partial" not in saved
    assert saved["candidates"] == [1] and saved["encounters"][1] == 3 and saved["encounters"][4] == 1
    assert saved["next_queue"][:3] == [1, 2, 3] and saved["gen_batches_done"] == 1


def test_the_layout_written_by_e9128fc_loads(res):
    assert res["old_restored"] == (5, "run-old")
    assert res["old_loaded_view"] == res["old_saved_view"]


def test_a_streamed_checkpoint_without_partial_groups_resumes_as_a_batch_run(res):
    step, restored_next, saved_next = res["no_partial_into_batch"]
    assert step == 8 and restored_next == saved_next  # the stream goes on where the streamed run left it


@pytest.mark.parametrize("case,needles", [
    ("batch_into_streamed", ("step_6/trainer_state.pt", "rollout.streaming=false", "trainer.resume_mode")),
    ("streamed_into_batch", ("step_7/trainer_state.pt", "1 partial group(s)", "rollout.streaming=true",
                             "trainer.resume_mode")),
    ("unknown_layout", ("step_unknown_layout/trainer_state.pt", "layout 9", "trainer.resume_mode=disable")),
    ("no_rollout", ("step_no_rollout/trainer_state.pt", "no 'rollout' state", "trainer.resume_mode=disable")),
    ("not_a_state", ("step_not_a_state/trainer_state.pt", "no trainer state", "trainer.resume_mode=disable")),
])
def test_a_checkpoint_that_cannot_load_names_the_file_and_the_fix(res, case, needles):
    kind, message = res[case]
    assert kind == "CheckpointError", message
    for needle in needles:
        assert needle in message, (needle, message)

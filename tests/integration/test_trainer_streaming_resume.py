"""DAPOTrainer with the streamed rollout: a process killed inside a step that continues partial
rollouts, then resumed from the last checkpoint, repeats the uninterrupted run exactly
(metrics of every step, the partial rollouts carried out of the last step, the GRESO skip
history).

World of one on CPU, HF engine, a tiny random Llama with SmolLM2's tokenizer. A random model
never ends a response on its own, and groups that all run to the length budget finish in the
same round: nothing would be in flight when the step has its N groups. So the tiny model stops
at any of 16,384 token ids (HF's list-valued ``eos_token_id``, as Llama 3 has two), about one
token in three: responses end at varied lengths, and with ``buffer.filter_metric=reward`` the
soft overlong punishment gives groups with mixed and with equal scores, so some are dropped,
the collector over-submits, and rows are in flight at the end of every step.

The kill is ``os._exit`` from inside the engine poll of step 3 (the rows continued from the
step-2 checkpoint are running): the process dies without cleanup, as under SIGKILL, at a
point that does not depend on timing.
"""

import os

import pytest
import torch

from dapo_megatron.platform import spawn
from integration.test_trainer_e2e import _metrics  # metrics.jsonl by step, the last row of a step wins

STEPS, KILL_IN_STEP = 4, 3
CONFIG = [
    f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "trainer.save_freq=1",
    "buffer.train_batch_size=2", "buffer.n=2", "buffer.gen_batch_size=4", "buffer.max_num_gen_batches=4",
    "buffer.on_cap=train_on_kept", "buffer.filter_metric=reward", "buffer.max_staleness=1",
    "buffer.prompt_skip.enable=true", "buffer.prompt_skip.skip_probability=0.5",
    "actor.ppo_mini_batch_size=1", "actor.ppo_max_token_len_per_gpu=512", "actor.optim.lr=1e-3",
    "actor.optim.lr_warmup_steps=0",
    "rollout.response_length=8", "buffer.overlong.max_response_length=8", "buffer.overlong.overlong_buffer_len=4",
    "rollout.streaming=true", "rollout.partial_rollout=true", "rollout.stream_poll_tokens=2",
    "data.arithmetic.num_train_problems=8", "data.arithmetic.num_val_problems=2", "model.params_dtype=float32",
    "model.transformer_impl=local", "reward.num_workers=1", "tracking.use_mlflow=false",
]
NUM_STOP_IDS = 16384


def _trainer(hf_dir, run_dir):
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.trainer import DAPOTrainer

    cfg = load_config(DAPOConfig, None, CONFIG + [f"model.hf_path={hf_dir}", f"trainer.default_local_dir={run_dir}"])
    return DAPOTrainer(cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))


def _final_state(trainer) -> dict:
    """What the next step would start from: the collector's carried work and skip history."""
    c = trainer.rollout.collector
    return {"skipper": c.skipper.state_dict(), "keep_rate": c.keep.value,
            "partial": [(g.prompt_seed, [(s.response_ids, s.rollout_logprobs, s.versions, s.finish_reason)
                                         for s in g.samples]) for g in c.partial],
            "surplus": [g.prompt_seed for g in trainer.rollout.buffer.surplus],
            "queue": trainer.rollout.prompt_queue.state_dict()}


def _killed_worker(hf_dir, run_dir):
    trainer = _trainer(hf_dir, run_dir)
    client = trainer.rollout.row_client  # the streamed rollout's client (rollout.streaming.EngineClient)
    real_poll, polls = client.poll, [0]

    def poll(max_tokens):
        if trainer.step == KILL_IN_STEP - 1:  # inside step 3, its rollout under way
            polls[0] += 1
            if polls[0] == 2:
                os._exit(9)
        return real_poll(max_tokens)

    client.poll = poll
    trainer.fit()


def _full_then_resume_worker(hf_dir, full_dir, killed_dir):
    for run_dir in (full_dir, killed_dir):  # the uninterrupted run; the killed one resumed
        trainer = _trainer(hf_dir, run_dir)
        start = trainer.step
        trainer.fit()
        torch.save({"start": start, **_final_state(trainer)}, os.path.join(run_dir, "final_state.pt"))


@pytest.fixture(scope="module")
def runs(smollm2_gguf, tmp_path_factory):
    from transformers import AutoConfig

    from conftest import tiny_llama_with_smollm2_tokenizer_dir

    hf_dir = tiny_llama_with_smollm2_tokenizer_dir(smollm2_gguf, tmp_path_factory.mktemp("tiny_hf"), hidden_size=32,
                                                   intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                                   num_key_value_heads=1)
    config = AutoConfig.from_pretrained(hf_dir)
    config.eos_token_id = [config.eos_token_id] + list(range(1000, 1000 + NUM_STOP_IDS - 1))
    config.save_pretrained(hf_dir)
    out = tmp_path_factory.mktemp("stream_resume")
    full, killed = str(out / "full"), str(out / "killed")
    with pytest.raises(Exception, match="exit code 9|exitcode 9|exited with exit code"):
        spawn(_killed_worker, 1, hf_dir, killed)
    at_kill = _metrics(killed)
    ckpt_state = torch.load(os.path.join(killed, "checkpoints", f"step_{KILL_IN_STEP - 1}", "trainer_state.pt"),
                            weights_only=False)["components"]["rollout"]  # the rollout's part (Checkpointer layout 2)
    spawn(_full_then_resume_worker, 1, hf_dir, full, killed)
    return {"full": full, "killed": killed, "at_kill": at_kill, "ckpt_state": ckpt_state}


def test_the_kill_lands_inside_a_step_that_continues_partial_rollouts(runs):
    assert sorted(runs["at_kill"]) == list(range(1, KILL_IN_STEP))  # step 3 never finished
    latest = open(os.path.join(runs["killed"], "checkpoints", "latest")).read().strip()
    assert latest == str(STEPS)  # the resumed run wrote the later checkpoints
    state = runs["ckpt_state"]["streaming"]
    assert state["partial"], "the step-2 checkpoint carries no partial rollout: the kill would test nothing"
    assert any(s["response_ids"] and s["finish_reason"] == "" for g in state["partial"] for s in g["samples"])
    assert state["skipper"]["streak"], "no skip history in the checkpoint"
    assert torch.load(os.path.join(runs["killed"], "final_state.pt"), weights_only=False)["start"] == KILL_IN_STEP - 1


def test_resumed_run_repeats_the_uninterrupted_one_exactly(runs):
    full, resumed = _metrics(runs["full"]), _metrics(runs["killed"])
    assert sorted(full) == sorted(resumed) == list(range(1, STEPS + 1))
    for step in full:
        a = {k: v for k, v in full[step].items() if k != "time" and not k.startswith(("time/", "perf/"))}
        b = {k: v for k, v in resumed[step].items() if k != "time" and not k.startswith(("time/", "perf/"))}
        assert a == b, (step, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
    # the scenario is the one meant: rows aborted and carried, continued next step, prompts skipped
    assert sum(full[s]["rollout/partial_out"] for s in full) > 0
    assert sum(full[s]["rollout/partial_in"] for s in full) > 0
    assert sum(full[s]["rollout/skipped_prompts"] for s in full) > 0
    assert all(full[s]["rollout/kept_groups"] == 2 for s in full)
    fresh_gaps = [full[s]["rollout/logprob_diff_fresh_max"] for s in full if "rollout/logprob_diff_fresh_max" in full[s]]
    assert fresh_gaps and max(fresh_gaps) < 1e-4  # a step of carried work only has no fresh sample
    assert any(full[s]["train/staleness_max"] == 1 for s in full)
    # the state a fifth step would start from, skip history and carried partial rollouts included
    a, b = (torch.load(os.path.join(runs[k], "final_state.pt"), weights_only=False) for k in ("full", "killed"))
    a.pop("start"), b.pop("start")
    assert a == b

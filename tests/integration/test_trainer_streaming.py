"""DAPOTrainer (world of one, tiny random Llama with SmolLM2's tokenizer): how many model
forwards a step runs, and the streamed rollout with partial rollouts and skipping.

The oracle of "no recompute forward ran" is independent of the trainer's own metric: a spy on
``MegatronActor.compute_logprobs`` (the recompute pass) counts its calls, and a spy on
``MegatronActor.train_mini_batch`` adds up the model calls each update reports.
"""

import os

import pytest
import torch

from dapo_megatron.platform import spawn

BASE = [
    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
    "buffer.n=2", "buffer.gen_batch_size=2", "buffer.max_num_gen_batches=2", "buffer.on_cap=train_on_kept",
    "buffer.filter_groups=false",  # a random model solves nothing: keep every group
    "actor.ppo_max_token_len_per_gpu=512", "actor.optim.lr=1e-3", "actor.optim.lr_warmup_steps=0",
    "rollout.response_length=6", "buffer.overlong.max_response_length=6", "buffer.overlong.overlong_buffer_len=2",
    "data.arithmetic.num_train_problems=8", "data.arithmetic.num_val_problems=2", "model.params_dtype=float32",
    "model.transformer_impl=local", "reward.num_workers=1", "tracking.use_mlflow=false",
]
VARIANTS = {
    # two mini-batches: pi_old must be recomputed before the first update changes the weights
    "recompute": ["trainer.total_training_steps=2", "buffer.train_batch_size=2", "actor.ppo_mini_batch_size=1"],
    # verl's bypass mode: the engine's logprobs are pi_old
    "bypass": ["trainer.total_training_steps=2", "buffer.train_batch_size=2", "actor.ppo_mini_batch_size=1",
               "actor.old_logprob_source=rollout"],
    # one mini-batch, one epoch: pi_old = sg(pi_theta) of the training forward, no recompute
    "one_update": ["trainer.total_training_steps=2", "buffer.train_batch_size=2", "actor.ppo_mini_batch_size=2"],
    # streamed, partial rollouts carried, skipping on
    "streaming": ["trainer.total_training_steps=6", "buffer.train_batch_size=2", "actor.ppo_mini_batch_size=1",
                  "rollout.streaming=true", "rollout.partial_rollout=true", "rollout.stream_poll_tokens=2",
                  "buffer.prompt_skip.enable=true", "buffer.prompt_skip.skip_probability=0.9"],
}


def _worker(hf_dir, out_dir):
    for variant in VARIANTS:  # one process for all runs: imports dominate the cost
        _run(hf_dir, os.path.join(out_dir, variant), variant)


def _run(hf_dir, out_dir, variant):
    import dapo_megatron.trainer as trainer_mod
    from dapo_megatron.actor.actor import MegatronActor
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed

    os.makedirs(out_dir)
    calls = {"recompute": 0, "train_model_calls": 0}
    real_compute, real_train = MegatronActor.compute_logprobs, MegatronActor.train_mini_batch

    def compute_spy(self, *a, **kw):
        calls["recompute"] += 1
        return real_compute(self, *a, **kw)

    def train_spy(self, *a, **kw):
        out = real_train(self, *a, **kw)
        metrics = out[0] if isinstance(out, tuple) else out
        calls["train_model_calls"] += metrics["num_model_calls"]
        return out

    MegatronActor.compute_logprobs, MegatronActor.train_mini_batch = compute_spy, train_spy
    try:
        cfg = load_config(DAPOConfig, None, BASE + VARIANTS[variant] + [
            f"model.hf_path={hf_dir}", f"trainer.default_local_dir={out_dir}/run"])
        parallel = init_distributed(cfg.parallel, seed=cfg.trainer.seed)
        trainer = trainer_mod.DAPOTrainer(cfg, parallel)
        rows = []
        while trainer.step < cfg.trainer.total_training_steps:
            before = dict(calls)
            m = trainer.train_step()
            m["spy/recompute_calls"] = calls["recompute"] - before["recompute"]
            m["spy/train_model_calls"] = calls["train_model_calls"] - before["train_model_calls"]
            rows.append(m)
        state = {"skipper": trainer.collector.skipper.state_dict() if trainer.collector else None}
        trainer.reward_pool.close()
        trainer.tracker.finish()
    finally:
        MegatronActor.compute_logprobs, MegatronActor.train_mini_batch = real_compute, real_train
    torch.save({"rows": rows, "state": state}, os.path.join(out_dir, "res.pt"))


@pytest.fixture(scope="module")
def runs(smollm2_gguf, tmp_path_factory):
    from conftest import tiny_llama_with_smollm2_tokenizer_dir

    hf_dir = tiny_llama_with_smollm2_tokenizer_dir(smollm2_gguf, tmp_path_factory.mktemp("tiny_hf"), hidden_size=32,
                                                   intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                                   num_key_value_heads=1)
    out = tmp_path_factory.mktemp("trainer_streaming")
    spawn(_worker, 1, hf_dir, str(out))
    return {v: torch.load(out / v / "res.pt") for v in VARIANTS}


def test_model_calls_per_step_with_and_without_the_recompute(runs):
    for variant, recomputes in (("recompute", True), ("bypass", False), ("one_update", False)):
        for m in runs[variant]["rows"]:
            assert m["spy/recompute_calls"] == (1 if recomputes else 0), (variant, m["spy/recompute_calls"])
            assert m["actor/recomputed_old_logprobs"] == float(recomputes)
            if recomputes:  # the recompute's micro-batch forwards come on top of the updates'
                assert m["actor/num_model_calls"] > m["spy/train_model_calls"] > 0
            else:
                assert m["actor/num_model_calls"] == m["spy/train_model_calls"] > 0, variant
    # the mismatch gap is measured all the same (from the first update's forward when nothing was
    # recomputed); the engine holds the actor's weights: round-off only
    for variant in ("recompute", "bypass", "one_update"):
        for m in runs[variant]["rows"]:
            assert m["rollout/logprob_diff_fresh_max"] < 1e-4, (variant, m["rollout/logprob_diff_fresh_max"])


def test_streamed_steps_train_exactly_n_groups_and_record_skip_history(runs):
    """(Partial rollouts through the trainer need groups that finish at different times: the
    main job's kill-and-resume test covers them with the real SmolLM2.)"""
    rows = runs["streaming"]["rows"]
    assert all(m["rollout/kept_groups"] == 2 for m in rows)
    for m in rows:
        assert m["rollout/rounds"] == 3  # 6-token responses, 2 tokens per round
        assert m["train/staleness_max"] == 0 and m["rollout/logprob_diff_fresh_max"] < 1e-4
        assert m["actor/num_model_calls"] > m["spy/train_model_calls"]  # two mini-batches: recomputed
    assert runs["streaming"]["state"]["skipper"]["streak"]  # all-wrong groups of a random model: zero variance
    assert sum(m["rollout/skipped_prompts"] for m in rows) > 0  # 8 prompts, 2 a step: steps 5-6 revisit them

"""A short DAPO run of a tiny random DeepSeek-V3 (multi-head latent attention, a dense first
layer, an MoE layer with a shared expert and a sigmoid router with a score-correction bias)
through the main loop: 3 steps on CPU with the HF engine and routing replay (R3) on, every
metric finite, and a run stopped after step 2 and resumed from its checkpoint repeats step 3 of
the uninterrupted run exactly: with megatron-core's aux-loss-free bias update on
(``model.moe_router_bias_update_rate``), the moved router bias travels in the checkpoint and the
weight sync (a resume that dropped the checkpoint's bias gives other step-3 metrics: checked by
planting it in ``Checkpointer.load``, not kept).

World of one; SmolLM2's tokenizer (vocab 49,152) on the tiny model (tests/conftest.py
``tiny_mla_config`` sizes).
"""

import math
import os

import pytest
import torch

from dapo_megatron.platform import spawn
from integration.test_trainer_e2e import _metrics  # metrics.jsonl by step, the last row of a step wins

STEPS = 3
CONFIG = [
    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=1",
    "buffer.train_batch_size=2", "buffer.n=2", "buffer.gen_batch_size=2", "buffer.max_num_gen_batches=2",
    "buffer.on_cap=train_on_kept", "buffer.filter_groups=false",
    "actor.ppo_mini_batch_size=1", "actor.ppo_max_token_len_per_gpu=512", "actor.optim.lr=1e-3",
    "actor.optim.lr_warmup_steps=0", "actor.routing_replay=rollout",
    "rollout.response_length=8", "buffer.overlong.max_response_length=8", "buffer.overlong.overlong_buffer_len=4",
    "buffer.filter_metric=reward",
    "data.arithmetic.num_train_problems=8", "data.arithmetic.num_val_problems=2", "model.params_dtype=float32",
    "model.transformer_impl=local", "reward.num_workers=1", "tracking.use_mlflow=false",
    # the aux-loss-free bias update on: the bias moves every step, so the resumed run repeats step 3 only
    # if the checkpoint (and then the sync) carries the moved bias, not the HF checkpoint's
    "model.moe_router_bias_update_rate=0.01",
]


def _mla_dir(smollm2_gguf, out_dir) -> str:
    from transformers import AutoTokenizer

    from conftest import random_hf_model, smollm2_tokenizer_dir, tiny_mla_config

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(smollm2_gguf))  # cached: 0.7 s; from the GGUF 8.6 s
    # a random model never stops: 16,384 stop ids (about one token in three, as in
    # test_trainer_streaming_resume.py) give responses of varied lengths, so the soft overlong
    # punishment gives groups mixed scores, non-zero advantages and a real update every step
    cfg = tiny_mla_config(vocab_size=len(tok), max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                          eos_token_id=[tok.eos_token_id] + list(range(1000, 1000 + 16383)))
    random_hf_model(cfg, seed=0).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


def _worker(hf_dir, full_dir, split_dir):
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.trainer import DAPOTrainer

    for run_dir, steps in ((full_dir, STEPS), (split_dir, STEPS - 1), (split_dir, STEPS)):
        cfg = load_config(DAPOConfig, None, CONFIG + [f"model.hf_path={hf_dir}", f"trainer.default_local_dir={run_dir}",
                                                      f"trainer.total_training_steps={steps}"])
        trainer = DAPOTrainer(cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))
        start = trainer.step
        trainer.fit()
        torch.save({"start": start}, os.path.join(run_dir, f"state_{steps}.pt"))


@pytest.fixture(scope="module")
def runs(smollm2_gguf, tmp_path_factory):
    hf_dir = _mla_dir(smollm2_gguf, tmp_path_factory.mktemp("tiny_mla"))
    out = tmp_path_factory.mktemp("mla_runs")
    full, split = str(out / "full"), str(out / "split")
    spawn(_worker, 1, hf_dir, full, split)
    return {"full": full, "split": split}


@pytest.mark.slow
def test_three_steps_with_finite_metrics_and_routing_replay(runs):
    full = _metrics(runs["full"])
    assert sorted(full) == list(range(1, STEPS + 1))
    for step, row in full.items():
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (step, bad)
        # R3 on; the actor's own (biased, grouped) choice against the engine's: nearly all of them (the
        # second mini-batch of a step routes after an update of the weights and, at 0.01, of the bias)
        assert row["moe/route_agreement"] >= 0.98, (step, row["moe/route_agreement"])
    # real updates (the overlong punishment gives mixed scores once responses reach its buffer)
    assert sum(row["actor/grad_norm"] > 0 for row in full.values()) >= 2, [r["actor/grad_norm"] for r in full.values()]


@pytest.mark.slow
def test_resumed_run_repeats_the_uninterrupted_one(runs):
    full, split = _metrics(runs["full"]), _metrics(runs["split"])
    assert torch.load(os.path.join(runs["split"], f"state_{STEPS}.pt"), weights_only=False)["start"] == STEPS - 1
    assert sorted(split) == sorted(full)
    for step in full:
        a = {k: v for k, v in full[step].items() if k != "time" and not k.startswith(("time/", "perf/"))}
        b = {k: v for k, v in split[step].items() if k != "time" and not k.startswith(("time/", "perf/"))}
        assert a == b, (step, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})

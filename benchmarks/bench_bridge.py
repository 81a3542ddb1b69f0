"""Bridge export throughput: every weight of a TP=2 actor as full HF tensors, vs memcpy.

Measures, in one run on the same machine:

- export GB/s: HF bytes produced by ``dapo_megatron.bridge.iter_hf_weights`` (TP all-gather,
  QKV / gate-up de-interleave, vocab trim, bucketed) divided by the wall time of a full pass;
- memcpy GB/s: a plain ``dst.copy_(src)`` of the same number of bytes;

and prints their ratio as the last line (``ratio export/memcpy: X.XXX``). Absolute numbers
from a 2-core CPU box mean little; the ratio says how much the bridge costs over moving
the bytes once.

Usage::

    python benchmarks/bench_bridge.py                      # spawns 2 local gloo ranks
    torchrun --nproc_per_node=2 benchmarks/bench_bridge.py  # same under torchrun
    python benchmarks/bench_bridge.py --hidden 1024 --layers 8 --vocab 49152 --bucket-mb 128
"""

from __future__ import annotations

import argparse
import os
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="bridge export GB/s vs memcpy GB/s at TP=2")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3, help="timed passes (best of)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig

    from dapo_megatron.bridge import iter_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed

    parallel = init_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=0)
    hf_config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = build_gpt_model(hf_config, ModelConfig(), parallel=parallel)
    bucket_bytes = int(args.bucket_mb * 2**20)

    def export_pass() -> int:
        total = 0
        for _, tensor in iter_hf_weights(model, parallel=parallel, bucket_bytes=bucket_bytes):
            total += tensor.numel() * tensor.element_size()
        return total

    nbytes = export_pass()  # warm-up (allocator, process-group setup)
    export_s = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        export_pass()
        dist.barrier()
        export_s.append(time.perf_counter() - t0)

    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: fault the pages in
    copy_s = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_s.append(time.perf_counter() - t0)

    if dist.get_rank() == 0:
        gb = nbytes / 1e9
        export_gbs, copy_gbs = gb / min(export_s), gb / min(copy_s)
        print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, TP=2; "
              f"{gb:.3f} GB of HF tensors ({hf_config.vocab_size} vocab rows, padding trimmed)")
        print(f"export GB/s: {export_gbs:.3f} (best of {args.repeats}, bucket {args.bucket_mb} MiB)")
        print(f"memcpy GB/s: {copy_gbs:.3f}")
        print(f"ratio export/memcpy: {export_gbs / copy_gbs:.3f}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # under torchrun
        run(args)
    else:
        from dapo_megatron.platform import spawn

        spawn(run, 2, args)


if __name__ == "__main__":
    main()

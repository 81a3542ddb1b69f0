"""Full weight sync from an EP=2 mixture-of-experts actor into HFEngine: sync GB/s vs the
transport floor measured in the same run.

Both ranks of an EP=2 world (TP=1, 2 gloo processes on CPU, the layout of
examples/configs/dapo_smollm2_moe_cpu.yaml) build the same Mixtral-shaped actor, each rank
holding half of every layer's experts, and an HFEngine each (the colocated engines, every one
needs every expert), then time ``engine.update_weights(iter_hf_weights(actor))``: each expert
bucket broadcast from the EP rank that holds it, the Megatron → HF layout conversion (QKV
de-interleave, gate/up split, vocab trim), the bucketing, and the engine's checked copy into
its fused expert parameters through per-expert names. The floor is what any sync of these
bytes must pay on this transport: the expert bytes moved over the EP group by a bare
``all_gather_into_tensor`` (each rank contributing the half it holds, one collective per
bucket; ``all_gather`` into views where the backend lacks it), the non-expert bytes (whole on
every rank at TP=1) not moved at all, and one copy of every synced byte into preallocated
parameters; no layout conversion, no checks. A second floor with the bridge's own primitive
(each expert bucket broadcast from its owner) is measured beside it; the floor is the faster of
the two (on gloo here the broadcast is). The ratio is sync ÷ floor (GB/s over GB/s, the
median over rounds of each round's ratio), higher is better (the sync verified at the default period,
as in bench_sync.py), next to the verification overhead, verified ÷ unverified sync time
(bench_sync.py's ``print_verify``); the last line states both (bench_sync.py's ``last_line``).

    python benchmarks/bench_sync_moe.py [--hidden 512 --layers 8 --experts 4 --bucket-mb 64 --repeats 11 --pairs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from bench_sync import (_default_period, all_gather_floor, interleaved, paired_ratio,  # benchmarks/ is sys.path[0]
                        print_verify, verify_figures)


def _worker(args: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, MixtralConfig

    from dapo_megatron.bridge import ExportBuffers, iter_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.bridge.verify import SyncDigest

    parallel = init_distributed(ParallelConfig(1, 1, 2), seed=0)  # TP=1, PP=1, EP=2 (= DP=2)
    hf_config = MixtralConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=512, tie_word_embeddings=False,
        num_local_experts=args.experts, num_experts_per_tok=2, sliding_window=None,
    )
    actor = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=parallel)
    engine = HFEngine(AutoModelForCausalLM.from_config(hf_config), eos_token_ids=[2])
    bucket = args.bucket_mb * 2**20
    buffers = ExportBuffers()  # kept from sync to sync, as the trainer does for a CPU actor

    versions = iter(range(1, 10**6))
    inside: dict = {}  # period -> checksum seconds of every verified sync

    def sync(period=args.verify_period) -> tuple[int, int]:
        nbytes, expert_bytes = 0, 0
        version = next(versions)
        digest = SyncDigest(version, period) if period else None

        def counted():
            nonlocal nbytes, expert_bytes
            for name, t in iter_hf_weights(actor, parallel=parallel, bucket_bytes=bucket, buffers=buffers,
                                           digest=digest, param_views=engine.copies_on_load):
                n = t.numel() * t.element_size()
                nbytes += n
                expert_bytes += n if ".experts." in name else 0
                yield name, t
                del t  # as the trainer does: the bridge reuses bucket memory nobody holds

        engine.update_weights(counted(), version=version, digest=digest)
        if digest is not None:
            inside.setdefault(period, []).append(digest.seconds)
        return nbytes, expert_bytes

    nbytes, expert_bytes = sync()  # warm-up, and the byte counts

    group, ep = parallel.ep_group, parallel.ep_size
    dtype = next(actor.parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    total, experts_total = nbytes // elem, expert_bytes // elem
    chunk = max(ep, bucket // elem // ep * ep)
    sizes = [n for n in (min(chunk, experts_total - off) // ep * ep for off in range(0, experts_total, chunk)) if n]
    shards = [torch.randn(n // ep, dtype=dtype) for n in sizes]  # the half of each bucket this rank holds
    gathered = [torch.empty(n, dtype=dtype) for n in sizes]
    dense_src = torch.randn(total - sum(sizes), dtype=dtype)  # the non-expert bytes, whole on every rank
    params = torch.empty(total, dtype=dtype)  # the engine's parameters, flat and preallocated
    gather_experts, primitive = all_gather_floor(shards, gathered, params, group)

    def floor() -> None:
        gather_experts()
        params[sum(sizes):].copy_(dense_src)

    def floor_broadcast() -> None:
        # the bridge's primitive: bucket k whole from EP rank k % EP (the owner), then one copy
        off = 0
        for k, out in enumerate(gathered):
            dist.broadcast(out, src=parallel.ep_ranks[k % ep], group=group)
            params[off:off + out.numel()].copy_(out)
            off += out.numel()
        params[off:].copy_(dense_src)

    floor()  # warm-up
    floor_broadcast()
    # sync and floors alternate, so that load from outside the benchmark hits all alike; the ratio is the
    # median of each round's, against the floor whose median is the faster
    rounds, ratios = interleaved(args.repeats, [sync, lambda: sync(0), floor, floor_broadcast, lambda: sync(1)],
                                 args.pairs)
    sync_s, plain_s, floor_s, bcast_s, full_s = (statistics.median(r[i] for r in rounds) for i in range(5))
    floor_bytes = params.numel() * elem
    if dist.get_rank() == 0:
        torch.save({"sync_GBps": nbytes / sync_s / 1e9, "floor_GBps": floor_bytes / floor_s / 1e9,
                    "floor_ratio": paired_ratio(rounds, nbytes, floor_bytes, 2 if floor_s <= bcast_s else 3),
                    "floor_bcast_GBps": floor_bytes / bcast_s / 1e9,
                    "floor_primitive": primitive,
                    "bytes": nbytes, "expert_bytes": expert_bytes,
                    "experts_here": [list(layer.mlp.local_expert_indices) for layer in actor.decoder.layers][0],
                    **verify_figures(sync_s, plain_s, full_s, inside, args, ratios)},
                   out_path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=4, help="experts per layer (even: EP=2)")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--pairs", type=int, default=3,
                   help="verified / unverified pairs per round (the overhead is the median of all pairs' ratios)")
    p.add_argument("--verify-period", type=int, default=_default_period(),
                   help="rollout.check_weight_update_period of the verified sync (default: the config's)")
    args = p.parse_args(argv)
    import torch

    from dapo_megatron.platform import spawn

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.pt")
        spawn(_worker, 2, args, out)
        r = torch.load(out)
    print(f"weights synced: {r['bytes'] / 2**20:.1f} MiB, {r['expert_bytes'] / 2**20:.1f} MiB of it experts "
          f"(EP=2 -> HFEngine, rank 0 holds experts {r['experts_here']} of {args.experts}, bucket {args.bucket_mb} MiB)")
    print(f"sync GB/s:   {r['sync_GBps']:.3f}")
    print(f"floor GB/s, broadcast from the owner + one copy: {r['floor_bcast_GBps']:.3f}")
    print(f"floor GB/s ({r['floor_primitive']} of the experts over EP=2 + one copy): {r['floor_GBps']:.3f}")
    print(f"ratio sync/floor (the faster floor, verified, median of the rounds' ratios; ratio of the medians "
          f"{r['sync_GBps'] / max(r['floor_GBps'], r['floor_bcast_GBps']):.3f}): {r['floor_ratio']:.3f}")
    print_verify(r, args)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()

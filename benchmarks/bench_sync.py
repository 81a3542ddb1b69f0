"""Full weight sync from a TP=2 Megatron actor into HFEngine: sync GB/s vs memcpy GB/s.

Both ranks of a TP=2 world (2 gloo processes on CPU) build the same Llama-shaped actor
and an HFEngine each, then time ``engine.update_weights(iter_hf_weights(actor))``: the
TP all-gather, the Megatron → HF layout conversion (QKV de-interleave, gate/up split,
vocab trim), the bucketing and the engine's checked copy. The reference is a plain
``copy_`` of the same bytes (one tensor per HF parameter) measured in the same run, and
the transport floor: a bare ``all_gather_into_tensor`` of the same bytes over the actor's
TP group (each rank contributing its half, one collective per bucket; ``all_gather`` into
a list where the backend has no ``all_gather_into_tensor``, as the bridge does on gloo)
plus one copy into preallocated parameters; no layout conversion, no checks. The last
ratio is sync ÷ floor (GB/s over GB/s; the median over rounds of each round's ratio, the floor
measured in the same round), higher is better; the goal is >= 0.9. The sync is
verified as the trainer verifies it by default (``rollout.check_weight_update``, period
``rollout.check_weight_update_period``; ``bridge/verify.py``); the same sync without
verification, and with every tensor checked (period 1), alternate with it in the same run; the
verification overhead at the default period is the median of verified ÷ unverified sync time over
``--pairs`` pairs per round, each pair run back to back in alternating order (goal <= 1.02), printed
with the quartiles of those ratios and the checksum seconds timed inside the sync. The last line states both
ratios of the run: sync ÷ floor and the verification overhead.

    python benchmarks/bench_sync.py [--hidden 512 --layers 8 --bucket-mb 64 --repeats 11 --pairs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def all_gather_floor(shards: list, gathered: list, params, group) -> tuple:
    """The transport floor of a bucketed sync over ``group``: each rank's ``shards[k]`` (1-D)
    all-gathered into ``gathered[k]`` (``world ×`` as long), then one copy into the flat
    preallocated ``params`` from offset 0, bucket after bucket. Returns ``(floor, primitive)``:
    the zero-argument function doing it once, and the collective's name
    (``all_gather_into_tensor`` where the backend has it, else ``all_gather`` into chunks)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    into_tensor = dist.get_backend(group) == "nccl"
    try:  # gloo gained all_gather_into_tensor in recent torch releases
        dist.all_gather_into_tensor(gathered[0], shards[0], group=group)
        into_tensor = True
    except (RuntimeError, NotImplementedError, ValueError):
        pass

    def floor() -> None:
        off = 0
        for shard, out in zip(shards, gathered):
            if into_tensor:
                dist.all_gather_into_tensor(out, shard, group=group)
            else:
                dist.all_gather(list(out.chunk(world)), shard, group=group)
            params[off:off + out.numel()].copy_(out)
            off += out.numel()

    return floor, "all_gather_into_tensor" if into_tensor else "all_gather"


def timed(fn) -> float:
    """Seconds of one ``fn()`` between two world barriers (every rank's share counted)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(args: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dapo_megatron.bridge import ExportBuffers, iter_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.bridge.verify import SyncDigest

    parallel = init_distributed(ParallelConfig(2, 1), seed=0)
    hf_config = LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    actor = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=parallel)
    engine = HFEngine(AutoModelForCausalLM.from_config(hf_config), eos_token_ids=[2])
    bucket = args.bucket_mb * 2**20
    buffers = ExportBuffers()  # kept from sync to sync, as the trainer does for a CPU actor
    versions = iter(range(1, 10**6))
    inside: dict = {}  # period -> checksum seconds of every verified sync

    def sync(period=args.verify_period) -> int:
        nbytes = 0
        version = next(versions)
        digest = SyncDigest(version, period) if period else None

        def counted():
            nonlocal nbytes
            for name, t in iter_hf_weights(actor, parallel=parallel, bucket_bytes=bucket, buffers=buffers,
                                           digest=digest, param_views=engine.copies_on_load):
                nbytes += t.numel() * t.element_size()
                yield name, t
                del t  # as the trainer does: the bridge reuses bucket memory nobody holds

        engine.update_weights(counted(), version=version, digest=digest)
        if digest is not None:
            inside.setdefault(period, []).append(digest.seconds)
        return nbytes

    nbytes = sync()  # warm-up, and the byte count

    # memcpy reference: the same bytes, tensor by tensor, into preallocated destinations
    src = [p.detach().clone() for p in engine.model.parameters()]
    dst = [torch.empty_like(p) for p in src]
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        for d, s in zip(dst, src):
            d.copy_(s)
    copy_s = (time.perf_counter() - t0) / args.repeats
    copy_bytes = sum(s.numel() * s.element_size() for s in src)

    # transport floor: the sync's bytes all-gathered bucket by bucket over the TP group, then
    # one copy of each gathered bucket into preallocated (flat) parameters
    group = parallel.tp_group
    tp = dist.get_world_size(group)
    dtype = next(actor.parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    total = nbytes // elem
    chunk = max(tp, bucket // elem // tp * tp)
    sizes = [min(chunk, total - off) // tp * tp for off in range(0, total, chunk)]
    shards = [torch.randn(n // tp, dtype=dtype) for n in sizes if n]
    gathered = [torch.empty(n, dtype=dtype) for n in sizes if n]
    params = torch.empty(sum(g.numel() for g in gathered), dtype=dtype)
    floor, primitive = all_gather_floor(shards, gathered, params, group)

    floor()  # warm-up
    # sync and floor alternate, so that load from outside the benchmark hits both alike; the ratios are
    # the medians of each round's (sync against the floor of the same round; the verification overhead:
    # the two syncs run back to back)
    rounds, ratios = interleaved(args.repeats, [sync, lambda: sync(0), floor, lambda: sync(1)], args.pairs)
    sync_s, plain_s, floor_s, full_s = (statistics.median(r[i] for r in rounds) for i in range(4))
    floor_bytes = params.numel() * elem
    if dist.get_rank() == 0:
        torch.save({"sync_GBps": nbytes / sync_s / 1e9, "memcpy_GBps": copy_bytes / copy_s / 1e9,
                    "floor_ratio": paired_ratio(rounds, nbytes, floor_bytes, 2),
                    "floor_GBps": floor_bytes / floor_s / 1e9, "floor_primitive":
                    primitive, "bytes": nbytes, **verify_figures(sync_s, plain_s, full_s, inside, args, ratios)}, out_path)


def interleaved(repeats: int, arms: list, pairs: int = 1) -> tuple[list[tuple[float, ...]], list[float]]:
    """``repeats`` rounds of :func:`timed` over every arm (zero-argument functions). Returns the seconds
    of each round in the order of ``arms`` (the first pair's for the first two arms), and the ratio
    arm 0 ÷ arm 1 of every pair. The first two arms (the verified and the unverified sync) run back to
    back ``pairs`` times in every round, in alternating order (A B, then B A, across pairs and rounds):
    what runs before a sync (the floor's buffers evicting the caches, the other sync's memory) then
    weighs on both alike, and the overhead's median is taken over ``repeats x pairs`` ratios; the
    other arms follow."""
    rounds, ratios, n = [], [], 0
    for _ in range(repeats):
        seconds: dict = {}
        for p in range(pairs):
            pair = {i: timed(arms[i]) for i in ([0, 1] if n % 2 == 0 else [1, 0])}
            n += 1
            ratios.append(pair[0] / pair[1])
            if p == 0:
                seconds.update(pair)
        for i in range(2, len(arms)):
            seconds[i] = timed(arms[i])
        rounds.append(tuple(seconds[i] for i in range(len(arms))))
    return rounds, ratios


def paired_ratio(rounds: list, nbytes: int, floor_bytes: int, floor_arm: int) -> float:
    """Sync GB/s ÷ floor GB/s as the median over rounds of each round's ratio, the verified sync (arm 0)
    against the floor arm ``floor_arm`` of the same round: load from outside that drifts between rounds
    weighs on both terms of a round alike (the ratio of the medians is printed beside it)."""
    return statistics.median((nbytes / r[0]) / (floor_bytes / r[floor_arm]) for r in rounds)


def quartiles(values) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``values`` (``statistics.quantiles``, inclusive)."""
    values = list(values)
    if len(values) < 2:
        return (values[0],) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def verify_figures(sync_s: float, plain_s: float, full_s: float, inside: dict, args, ratios=None) -> dict:
    """The verification overhead figures: verified ÷ unverified sync time at the default period
    (the median of ``ratios``, each a pair of syncs run back to back (:func:`interleaved`), with their
    quartiles; else the ratio of the medians) and at period 1, and the checksum seconds timed inside the
    syncs (rank 0's) ÷ the unverified sync time."""
    spread = quartiles(ratios) if ratios else (sync_s / plain_s,) * 3
    return {"verify_ratio": spread[1], "verify_quartiles": spread, "rounds": len(ratios or ()),
            "verify_full_ratio": full_s / plain_s,
            "verify_inside": statistics.median(inside.get(args.verify_period, [0.0])) / plain_s,
            "verify_full_inside": statistics.median(inside.get(1, [0.0])) / plain_s, "plain_s": plain_s}


def print_verify(r: dict, args) -> None:
    """The verification lines, then the last line: sync ÷ floor and the verification overhead at the
    default period, both measured in this run (:func:`last_line`)."""
    q1, _, q3 = r["verify_quartiles"]
    print(f"verification, every tensor (period 1): verified / unverified sync time {r['verify_full_ratio']:.3f} "
          f"(checksums timed inside: {100 * r['verify_full_inside']:.1f} % of the unverified sync)")
    print(f"verification overhead at the default period {args.verify_period} (checksums timed inside: "
          f"{100 * r['verify_inside']:.2f} % of the unverified sync): verified / unverified sync time "
          f"{r['verify_ratio']:.3f} (median of {r['rounds']} paired ratios, quartiles {q1:.3f}-{q3:.3f})")
    print(last_line(r, args))


def last_line(r: dict, args) -> str:
    """The benchmark's last line: both ratios of this run (goals: sync ÷ floor >= 0.9, verified ÷
    unverified <= 1.02 at the default period)."""
    return (f"ratio sync/floor {r['floor_ratio']:.3f} (goal >= 0.9); verification overhead at period "
            f"{args.verify_period}: verified/unverified sync time {r['verify_ratio']:.3f} (goal <= 1.02)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
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
    print(f"weights synced: {r['bytes'] / 2**20:.1f} MiB (TP=2 -> HFEngine, bucket {args.bucket_mb} MiB)")
    print(f"sync GB/s:   {r['sync_GBps']:.3f}")
    print(f"memcpy GB/s: {r['memcpy_GBps']:.3f}")
    print(f"ratio sync/memcpy: {r['sync_GBps'] / r['memcpy_GBps']:.3f}")
    print(f"floor GB/s ({r['floor_primitive']} over TP=2 + one copy): {r['floor_GBps']:.3f}")
    print(f"ratio sync/floor (verified, median of the rounds' ratios; ratio of the medians "
          f"{r['sync_GBps'] / r['floor_GBps']:.3f}): {r['floor_ratio']:.3f}")
    print_verify(r, args)


def _default_period() -> int:
    from dapo_megatron.rollout.config import RolloutConfig

    return RolloutConfig().check_weight_update_period


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()

"""One torchrun worker that builds a colocated SGLang engine the way the trainer and
``tools/eval.py`` do (``rollout.factory.build_engine`` -> ``SGLangEngine`` -> ``sglang.Engine``)
and writes what happened to ``OUT_DIR/rank<r>.json``.

    torchrun --standalone --nproc_per_node 2 tests/fake_sglang/torchrun_engine.py OUT_DIR MODEL_DIR \\
        [--dist-timeout S] [--real-sglang] [--tp N] [--sync]

Without ``--real-sglang`` the fake SGLang of this directory is imported (it goes first on
``sys.path``; CPU, gloo); with it the installed one (GPU image). Steps, each timed:

1. the default process group over torchrun's agent store (the trainer's own store);
2. a reward grader pool (``tools/eval.py`` builds it before the engine);
3. the engine, with ``engine_kwargs={"dist_timeout": S}`` so a scheduler whose
   ``init_process_group`` cannot meet fails after S seconds instead of 30 minutes;
4. with ``--sync`` (fake or real): a weight sync of a few random tensors in buckets of 1 MiB,
   each bucket read back from the engine (``get_weights_by_name``) right after it is loaded
   and again after the last one (a reused payload buffer shows as a changed early bucket);
5. ``SGLangEngine.shutdown()``, then whether the engine's processes and the grader pool's
   workers are alive, one grading call, and a barrier on the default group.

The report: ``agent_store_env`` (what torchrun set), ``engine_error`` / ``engine_seconds``,
``scheduler_env`` and ``init_seconds`` (fake only), ``env_after`` (the variable after the
engine), ``readback`` (per bucket: tensors equal right after / at the end),
``engine_alive`` / ``graders_alive`` / ``grader_pids_same`` / ``grade_acc`` after shutdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sync_with_readback(engine, report) -> None:
    import torch

    from dapo_megatron.rollout.flat_bucket import FlatBucketPacker

    device = torch.device("cuda", engine.base_gpu_id) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    named = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(256, 384, generator=g)) for i in range(6)]
    packer = FlatBucketPacker(2**20, device)  # 384 KiB tensors: two per bucket, three buckets
    loaded, rows = [], []
    for bucket in packer.buckets((n, t.to(device)) for n, t in named):
        engine._update_from_payloads([_serialize(bucket)])
        names = bucket.names
        now = [engine.engine.get_weights_by_name(n, truncate_size=64) for n in names]
        loaded.append(names)
        rows.append(all(v == dict(named)[n].flatten()[:64].tolist() for n, v in zip(names, now)))
    end = [all(engine.engine.get_weights_by_name(n, truncate_size=64) == dict(named)[n].flatten()[:64].tolist()
               for n in names) for names in loaded]
    packer.release()
    report["readback"] = {"buckets": len(loaded), "after_each": rows, "at_end": end}


def _serialize(bucket):
    from dapo_megatron.rollout.flat_bucket import serialize_for_engine, sglang_bucket_dict

    return serialize_for_engine(sglang_bucket_dict(bucket))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("model_dir")
    p.add_argument("--dist-timeout", type=int, default=20)
    p.add_argument("--real-sglang", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sync", action="store_true")
    args = p.parse_args()
    if not args.real_sglang:
        sys.path.insert(0, HERE)  # the fake sglang
    import torch
    import torch.distributed as dist

    report = {"agent_store_env": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from dapo_megatron.rewards import RewardPool
    from dapo_megatron.rollout.factory import EngineSpec, build_engine

    pool = RewardPool(num_workers=1, timeout_s=30)
    pool.wait_ready()
    grader_pids = [w.process.pid for w in pool._workers]
    gpu = (int(os.environ["LOCAL_RANK"]) * args.tp) % max(1, torch.cuda.device_count())
    t0 = time.perf_counter()
    engine = None
    try:
        engine = build_engine(EngineSpec(name="sglang", model_path=args.model_dir, dtype=torch.bfloat16,
                                         eos_token_ids=(2,), base_gpu_id=gpu, tp_size=args.tp,
                                         engine_kwargs={"dist_timeout": args.dist_timeout}))
        report["engine_error"] = None
    except Exception as err:
        report["engine_error"] = f"{type(err).__name__}: {err}"
    report["engine_seconds"] = time.perf_counter() - t0
    report["env_after"] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    if engine is not None:
        report["scheduler_env"] = getattr(engine.engine, "scheduler_env", None)
        report["init_seconds"] = getattr(engine.engine, "init_seconds", None)
        if args.sync:
            _sync_with_readback(engine, report)
        pids = list(engine.engine.get_all_child_pids())
        engine.shutdown()
        report["engine_alive"] = [_alive(p) for p in pids]
    report["graders_alive"] = [w.process.poll() is None for w in pool._workers]
    report["grader_pids_same"] = [w.process.pid for w in pool._workers] == grader_pids
    report["grade_acc"] = pool.grade([("arithmetic", "Answer: 12", "12", None)])[0]["acc"]
    pool.close()
    dist.barrier()
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

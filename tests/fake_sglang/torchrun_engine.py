"""One torchrun worker that builds a colocated SGLang engine the way the trainer and
``tools/eval.py`` do (``rollout.engines.factory.build_engine`` -> ``SGLangEngine`` -> ``sglang.Engine``)
and writes what happened to ``OUT_DIR/rank<r>.json``.

    torchrun --standalone --nproc_per_node 2 tests/fake_sglang/torchrun_engine.py OUT_DIR MODEL_DIR \\
        [--dist-timeout S] [--real-sglang] [--tp N] [--sync]

Without ``--real-sglang`` the fake SGLang of this directory is imported (it goes first on
``sys.path``; CPU, gloo); with it the installed one (GPU image). Steps, each timed:

1. the default process group over torchrun's agent store (the trainer's own store);
2. a reward grader pool (``tools/eval.py`` builds it before the engine);
3. the engine, with ``engine_kwargs={"dist_timeout": S}`` so a scheduler whose
   ``init_process_group`` cannot meet fails after S seconds instead of 30 minutes;
4. with ``--sync`` (fake or real): a weight sync in buckets of 64 KiB through the engine's own
   loop (``sync_flat_buckets``), every tensor loaded so far read back from the engine
   (``get_weights_by_name``) after each bucket and again after the last one (a reused payload
   buffer shows as a changed earlier bucket);
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
BUCKET_BYTES = 2**16


def _alive(pid: int) -> bool:
    from dapo_megatron.platform.sglang_env import pid_alive

    return pid_alive(pid)


def _sync_stream(model_dir):
    """``(name, tensor)`` pairs of a fresh random model of ``model_dir``'s config (bf16, what the
    bridge sends; the names and shapes the engine serves), or, without a config, six 24 KiB
    tensors (two per bucket; the fake serves any names)."""
    import torch

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        g = torch.Generator().manual_seed(0)
        return [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(64, 96, generator=g)) for i in range(6)]
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    tied = getattr(cfg, "tie_word_embeddings", False)
    return [(n, t.detach()) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]


def _sync_with_readback(engine, model_dir, report) -> None:
    """The engine's own sync loop (``sync_flat_buckets``, 64 KiB buckets on this rank's device: a
    tiny model makes several, packed ones and tensors larger than a bucket);
    after each bucket every tensor loaded so far is read back (``get_weights_by_name``, first 64
    values) and compared with what was sent: a payload buffer refilled while the engine still
    reads it shows as a changed earlier bucket."""
    import torch

    from dapo_megatron.rollout.engines.engine_group import sync_flat_buckets
    from dapo_megatron.bridge.flat_bucket import FlatBucketPacker

    device = torch.device("cuda", engine.base_gpu_id) if torch.cuda.is_available() else torch.device("cpu")
    named = _sync_stream(model_dir)
    # sglang 0.5.11 models/llama.py get_weights_by_name: param.tolist()[:truncate_size], the first rows
    want = {n: t[:64].flatten().float().tolist() for n, t in named}
    sent, rows = [], []

    def stream():
        for n, t in named:
            sent.append(n)
            yield n, t.to(device)

    def apply(payloads):
        engine._update_from_payloads(payloads)
        loaded = {n: engine.engine.get_weights_by_name(n, truncate_size=64) for n in sent}
        loaded = {n: v for n, v in loaded.items() if v is not None}
        rows.append((len(loaded), sorted(n for n, v in loaded.items() if not _close(v, want[n]))))

    buckets = sync_flat_buckets(stream(), engine.group, FlatBucketPacker(BUCKET_BYTES, device), apply=apply)
    end = [n for n in want if not _close(engine.engine.get_weights_by_name(n, truncate_size=64), want[n])]
    report["readback"] = {"buckets": buckets, "tensors": len(named), "loaded_after_each": [r[0] for r in rows],
                          "wrong_after_each": [r[1] for r in rows], "wrong_at_end": end}


def _flat(x):
    return [v for row in x for v in _flat(row)] if isinstance(x, list) else [x]


def _close(got, want) -> bool:
    """Equal up to the engine's dtype (a bf16 model stores what was sent exactly)."""
    got = None if got is None else _flat(got)
    return got is not None and len(got) == len(want) and all(abs(a - b) <= 1e-6 * max(1.0, abs(b))
                                                           for a, b in zip(got, want))


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
    from dapo_megatron.rollout.engines.factory import EngineSpec, build_engine

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
            _sync_with_readback(engine, args.model_dir, report)
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

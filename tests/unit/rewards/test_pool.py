"""The sandboxed grading pool: order, wall-clock timeouts with worker replacement,
code-injection attempts, bad text, real datasets (skipped when absent)."""

import json
import os
import pathlib
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO

from dapo_megatron.rewards import TIMEOUT_RESULT, RewardPool, compute_score
from dapo_megatron.rewards.registry import grade_in_process, normalize_request

DATA = pathlib.Path(REPO) / ".." / "shared" / "data"
TIMEOUT_S = 1.5
PATHOLOGICAL = "We get $\\boxed{9^{9^{9^{9^{9}}}}}$"  # sympy evaluates this integer power for hours


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S) as p:
        p.wait_ready()
        yield p


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_results_keep_input_order(pool):
    requests, expected = [], []
    for i in range(60):
        correct = i % 3 == 0
        answer = i if correct else i + 1
        kind = i % 4
        if kind == 0:
            requests.append(("math_dapo", f"work {i}\nAnswer: {answer}", str(i), None))
        elif kind == 1:
            requests.append(("openai/gsm8k", f"#### {answer}", str(i), {"split": "train"}))
        elif kind == 2:
            requests.append(("arithmetic", f"It is {answer}", str(i), None))
        else:
            requests.append(("math", f"so \\boxed{{{answer}}}", str(i), None))
        expected.append(correct)
    results = pool.grade(requests)
    assert [r["acc"] for r in results] == expected
    assert [r["score"] for r in results] == [1.0 if c else -1.0 for c in expected]
    assert [r["pred"] for r in results[:5]] == ["0", "2", "3", "3", "5"]


def test_pathological_power_times_out_within_twice_the_timeout(pool):
    pool.wait_ready()  # time the grading, not the start-up of workers replaced by earlier tests
    pids = {w.process.pid for w in pool._workers}
    restarts = pool.num_restarts
    start = time.monotonic()
    results = pool.grade(
        [("arithmetic", "7", "7", None), ("math", PATHOLOGICAL, "1", None), ("openai/gsm8k", "#### 3", "3", None)]
    )
    elapsed = time.monotonic() - start
    assert elapsed < 2 * TIMEOUT_S
    assert results[1] == TIMEOUT_RESULT
    assert results[0]["acc"] and results[2]["acc"]
    # the hung worker was killed and replaced; the pool keeps working
    assert pool.num_restarts == restarts + 1
    dead = [pid for pid in pids if not _alive(pid)]
    assert len(dead) == 1
    assert pool.grade([("math", "\\boxed{\\frac{1}{2}}", "0.5", None)])[0]["acc"]


def test_several_hung_items_in_one_batch(pool):
    pool.wait_ready()
    start = time.monotonic()
    results = pool.grade([("math", PATHOLOGICAL, "1", None)] * 2 + [("arithmetic", "5", "5", None)])
    elapsed = time.monotonic() - start
    assert [r.get("timeout", False) for r in results] == [True, True, False]
    # the two hang in parallel on the two workers; the last item waits for a replacement worker
    assert elapsed < 2 * TIMEOUT_S + 5.0
    assert pool.grade([]) == []


def test_worker_killed_from_outside_is_replaced_and_item_retried(pool):
    pool.wait_ready()
    restarts = pool.num_restarts
    victim = pool._workers[0].process.pid
    os.kill(victim, 9)  # e.g. the OOM killer
    time.sleep(0.2)
    results = pool.grade([("arithmetic", str(i), str(i), None) for i in range(6)])
    assert [r["acc"] for r in results] == [True] * 6  # nothing scored -1 for the dead worker
    assert pool.num_restarts == restarts + 1
    assert victim not in {w.process.pid for w in pool._workers}


@pytest.mark.parametrize(
    "template",
    [
        "\\boxed{__import__('os').system('touch {path}')}",
        "Answer: __import__('os').system('touch {path}')",
        "#### __import__('os').system('touch {path}')",
        "\\boxed{exec(\"open('{path}', 'w').write('x')\")}",
        "Answer: eval(\"__import__('os').system('touch {path}')\")",
        "{path}: __import__('os').system('touch {path}')",
    ],
)
def test_code_in_responses_is_never_executed(pool, tmp_path, template):
    target = tmp_path / "pwned"
    payload = template.replace("{path}", str(target))
    requests = [(source, payload, "12", None) for source in ("math_dapo", "aime24", "math", "openai/gsm8k", "arithmetic")]
    requests.append(("math", "\\boxed{1}", payload, None))  # poisoned ground truth
    requests.append(("math_dapo", "Answer: 1", payload, None))
    results = pool.grade(requests)
    assert all(r["score"] == -1.0 for r in results)
    assert not target.exists()


def test_bad_text_and_bytes_never_crash(pool):
    requests = [
        ("math_dapo", b"Answer: 5\xff\xfe", "5", None),
        ("math", "\\boxed{\ud800}", "5", None),
        ("openai/gsm8k", "#### \ufffd\ufffd 5", "5", None),
        ("arithmetic", "\x00" * 10 + "5", "5", None),
        ("math", "\\boxed{" * 5000, "5", None),
        ("math_dapo", "Answer: " + "9" * 100_000, "5", None),
    ]
    results = pool.grade(requests)
    assert [r["acc"] for r in results] == [False, False, False, True, False, False]
    assert results[0]["pred"] == "5\ufffd\ufffd"


@settings(max_examples=5, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["math_dapo", "math", "openai/gsm8k", "arithmetic"]), st.text(max_size=80)), min_size=1, max_size=20))
def test_arbitrary_text_gets_a_valid_result(pool, items):
    results = pool.grade([(source, text, "3", None) for source, text in items])
    assert len(results) == len(items)
    for r in results:
        assert r["score"] in (1.0, -1.0) and isinstance(r["acc"], bool) and (r["pred"] is None or isinstance(r["pred"], str))
        assert r["acc"] == (r["score"] == 1.0)


def test_pool_matches_in_process_grading(pool):
    cases = [
        ("math_dapo", "Answer: $\\frac{3}{4}$", "0.75"),
        ("aime-2024", "Answer: 033", "33"),
        ("math", "\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),
        ("openai/gsm8k", "#### 1,000", "1000"),
        ("arithmetic", "-12", "-12"),
    ]
    expected = [grade_in_process(*normalize_request(s, sol, gt)[:3]) for s, sol, gt in cases]
    assert pool.grade([(s, sol, gt, None) for s, sol, gt in cases]) == expected
    assert [e["acc"] for e in expected] == [True, True, True, True, True]


def test_invalid_requests_raise_before_grading(pool):
    with pytest.raises(ValueError, match=r"requests\[1\].*'squad'"):
        pool.grade([("math", "\\boxed{1}", "1", None), ("squad", "x", "y", None)])
    with pytest.raises(TypeError, match=r"requests\[0\].*solution_str"):
        pool.grade([("math", None, "1", None)])
    with pytest.raises(TypeError, match=r"requests\[0\].*extra_info"):
        pool.grade([("math", "x", "1", "not a dict")])
    assert pool.grade([]) == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_workers=0), "num_workers"),
        (dict(timeout_s=0), "timeout_s"),
        (dict(memory_limit_mb=0), "memory_limit_mb"),
    ],
)
def test_pool_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardPool(**kwargs)


def test_closed_pool_refuses_work():
    p = RewardPool(num_workers=1, timeout_s=5.0)
    pid = p._workers[0].process.pid
    p.close()
    p.close()
    assert not _alive(pid)
    with pytest.raises(RuntimeError, match="closed"):
        p.grade([("arithmetic", "1", "1", None)])


def test_compute_score_single_call():
    assert compute_score("aime-2024", "Answer: 540", "540") == {"score": 1.0, "acc": True, "pred": "540"}
    assert compute_score("openai/gsm8k", b"#### 7\xff", "7", {"index": 0}) == {"score": 1.0, "acc": True, "pred": "7"}
    assert compute_score("arithmetic", "no idea", "3") == {"score": -1.0, "acc": False, "pred": None}
    with pytest.raises(ValueError, match="'unknown/source'"):
        compute_score("unknown/source", "x", "y")


def test_real_aime_2024(pool):
    path = DATA / "aime-2024.parquet"
    if not path.exists():
        pytest.skip(f"shared test data {path} is absent")
    import pandas as pd

    df = pd.read_parquet(path)
    rows = {row["reward_model"]["ground_truth"]: row["data_source"] for _, row in df.iterrows()}
    assert len(rows) >= 25  # 30 problems x 32 copies, a few answers coincide at most
    requests = []
    for gt, source in rows.items():
        requests.append((source, f"Long reasoning...\nAnswer: {gt}", gt, None))
        requests.append((source, f"Answer: {gt}\nActually no.\nAnswer: {int(gt) + 1}", gt, None))
    results = pool.grade(requests)
    assert [r["acc"] for r in results] == [True, False] * len(rows)


def test_real_gsm8k(pool):
    path = DATA / "gsm8k_train.jsonl"
    if not path.exists():
        pytest.skip(f"shared test data {path} is absent")
    with open(path) as f:
        rows = [json.loads(line) for _, line in zip(range(200), f)]
    requests = []
    for row in rows:
        number = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        requests.append(("openai/gsm8k", row["answer"], row["answer"], None))  # gt as full text
        requests.append(("openai/gsm8k", f"... #### {number}", number, None))  # gt as bare number
        requests.append(("openai/gsm8k", f"#### {int(number) + 1}", row["answer"], None))
    results = pool.grade(requests)
    assert [r["acc"] for r in results] == [True, True, False] * len(rows)

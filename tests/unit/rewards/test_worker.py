"""Grader worker processes (``python -m dapo_megatron.rewards.worker``): any caller
can grade (a script without a ``__main__`` guard, ``python -`` on stdin, IPython),
start-up failures are reported, and the JSON-lines protocol survives a grader
that prints. The callers run as real subprocesses."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO

from dapo_megatron.rewards import RewardPool
from dapo_megatron.rewards import pool as pool_module

ROOT = pathlib.Path(REPO)

# graded at top level, no guard: with multiprocessing's spawn the worker re-imported
# this script (or failed to find "<stdin>") and crashed
CALLER = textwrap.dedent(
    """
    import json
    from dapo_megatron.rewards import RewardPool, compute_score

    print("RESULT", json.dumps([
        compute_score("aime-2024", "Answer: 540", "540"),
        compute_score("math", "so $\\\\boxed{\\\\frac{1}{2006!}}$", "\\\\frac{1}{2004!}"),
        compute_score("openai/gsm8k", "#### 9{,}500", "9500"),
    ]))
    pool = RewardPool(num_workers=2, timeout_s=10.0)
    print("RESULT", json.dumps(pool.grade([("math", "\\\\boxed{0.5}", "\\\\frac{1}{2}", None), ("arithmetic", "7", "8", None)])))
    pool.close()
    """
)
EXPECTED = [
    [
        {"score": 1.0, "acc": True, "pred": "540"},
        {"score": -1.0, "acc": False, "pred": "\\frac{1}{2006!}"},
        {"score": 1.0, "acc": True, "pred": "9500"},
    ],
    [{"score": 1.0, "acc": True, "pred": "0.5"}, {"score": -1.0, "acc": False, "pred": "7"}],
]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _results(completed: subprocess.CompletedProcess) -> list:
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    return [json.loads(line[len("RESULT ") :]) for line in lines]


def test_script_without_main_guard(tmp_path):
    script = tmp_path / "grade_answers.py"
    script.write_text(CALLER)
    completed = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert _results(completed) == EXPECTED


def test_code_fed_on_stdin(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-"], input=CALLER, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert _results(completed) == EXPECTED


def test_ipython_session(tmp_path):
    """A notebook kernel runs cells in IPython's namespace, with no file behind __main__."""
    pytest.importorskip("IPython")
    completed = subprocess.run(
        [sys.executable, "-m", "IPython", "--quick", "--no-banner", "--colors=NoColor", "-c", CALLER],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert _results(completed) == EXPECTED


def test_start_up_failure_is_reported(monkeypatch):
    monkeypatch.setattr(pool_module, "_worker_command", lambda _mb: [sys.executable, "-c", "import sys; sys.exit(3)"])
    pool = RewardPool(num_workers=1, timeout_s=5.0)
    try:
        with pytest.raises(RuntimeError, match="exit code 3"):
            pool.wait_ready()
    finally:
        pool.close()


def test_worker_importing_another_package_is_refused():
    pool = RewardPool(num_workers=1, timeout_s=5.0)
    pool._package_dir = "/elsewhere/dapo_megatron"
    try:
        with pytest.raises(RuntimeError, match="imported dapo_megatron from .* this process from /elsewhere"):
            pool.wait_ready()
    finally:
        pool.close()


def test_a_grader_that_prints_does_not_corrupt_the_protocol(monkeypatch):
    noisy = (
        "import sys\n"
        "from dapo_megatron.rewards import registry, worker\n"
        "warmup = registry.warmup\n"
        "def noisy_warmup():\n"
        "    print('a grader printing to stdout', flush=True)\n"
        "    warmup()\n"
        "registry.warmup = noisy_warmup\n"
        "worker.main(sys.argv[1:])\n"
    )
    monkeypatch.setattr(pool_module, "_worker_command", lambda _mb: [sys.executable, "-c", noisy, "--parent-pid", str(os.getpid())])
    with RewardPool(num_workers=1, timeout_s=10.0) as pool:
        assert pool.grade([("arithmetic", "12", "12", None)]) == [{"score": 1.0, "acc": True, "pred": "12"}]


def test_worker_exits_when_its_stdin_closes():
    """The protocol by hand: one request, one reply, then end of stdin stops it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dapo_megatron.rewards.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
    )
    try:
        ready = json.loads(process.stdout.readline())
        assert ready["ready"] == process.pid and ready["package"] == str(ROOT / "dapo_megatron")
        request = {"index": 7, "key": "math_dapo", "solution": "Answer: \u00e9 42\n", "ground_truth": "42"}
        process.stdin.write((json.dumps(request) + "\n").encode())
        process.stdin.flush()
        reply = json.loads(process.stdout.readline())
        assert reply == {"index": 7, "result": {"score": -1.0, "acc": False, "pred": "\u00e942"}}
        process.stdin.close()
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        process.wait()


def test_workers_die_with_a_killed_parent(tmp_path):
    """A parent killed with SIGKILL (OOM killer, scheduler) leaves no worker behind,
    not even one busy with a power tower."""
    code = textwrap.dedent(
        """
        import os, signal, threading
        from dapo_megatron.rewards import RewardPool

        pool = RewardPool(num_workers=2, timeout_s=600.0)
        pool.wait_ready()
        print(" ".join(str(w.process.pid) for w in pool._workers), flush=True)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        pool.grade([("math", "\\\\boxed{9^{9^{9^{9^{9}}}}}", "1", None)] * 2)
        """
    )
    # files, not pipes: a surviving worker would hold a pipe open and hang the test
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        parent = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=_env(), stdout=stdout, stderr=stderr)
        assert parent.wait(timeout=300) == -9, err.read_text()[-3000:]
    pids = [int(p) for p in out.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if _alive(pid)]
    for pid in survivors:  # do not leave them computing after a failure
        os.kill(pid, 9)
    assert not survivors


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead but not yet reaped by init
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False

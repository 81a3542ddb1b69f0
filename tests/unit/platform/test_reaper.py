"""Processes left behind by a killed child are reaped: by ``launch.spawn`` when one of its ranks dies
without cleanup, and by the suite's session-end check (tests/conftest.py), which also fails the run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from dapo_megatron.platform import launch, reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl / procfs are Linux's")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _alive(pid: int) -> bool:
    st = reaper._stat(pid)
    return st is not None and st[0] != "Z"


def _rank_leaves_a_child_and_dies(pid_file: str) -> None:
    """A rank that starts a long child and exits without cleanup, as a killed trainer rank does."""
    child = subprocess.Popen(["sleep", "300"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    os._exit(3)


def test_spawn_kills_what_a_dead_rank_left(tmp_path):
    pid_file = str(tmp_path / "pid")
    with pytest.raises(Exception, match="exit code 3|exitcode 3|exited with"):
        launch.spawn(_rank_leaves_a_child_and_dies, 1, pid_file)
    orphan = int(open(pid_file).read())
    assert not _alive(orphan), f"the dead rank's child {orphan} ({reaper.cmdline(orphan)}) is still running"


def test_reap_children_kills_adopted_orphans_and_keeps_the_rest():
    was = reaper.set_subreaper(True)
    keep_proc = subprocess.Popen(["sleep", "300"])  # a child the caller still owns
    try:
        before = set(reaper.child_pids())
        # the shell exits at once: its background sleep is adopted by this (subreaper) process
        out = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
        orphan = int(out.stdout)
        deadline = time.monotonic() + 5
        while orphan not in reaper.child_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orphan in reaper.child_pids()
        left = reaper.reap_children(keep=before)
        assert left == [f"{orphan} sleep 300"]
        assert not _alive(orphan) and orphan not in reaper.child_pids()  # killed and waited for
        assert keep_proc.poll() is None  # the kept child is untouched, still its owner's to wait for
    finally:
        keep_proc.kill()
        keep_proc.wait()
        reaper.set_subreaper(was)


def test_a_process_left_after_the_last_test_fails_the_session(tmp_path):
    """The suite's own hook, run on a two-test session whose first test leaves a grandchild running."""
    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent("""
        import subprocess

        def test_leaks(tmp_path_factory):
            out = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
            open(str(tmp_path_factory.getbasetemp().parent / "leaked.pid"), "w").write(out.stdout)

        def test_passes():
            pass
        """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path),
                          f"--basetemp={tmp_path / 'base'}"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 passed" in out.stdout
    leaked = int(open(tmp_path / "leaked.pid").read())
    assert "tests left these processes running (killed now; the run fails):" in out.stderr
    assert f"  {leaked} sleep 300" in out.stderr
    assert not _alive(leaked)


def test_a_worker_in_its_own_session_dies_with_its_killed_launcher(tmp_path):
    """torchrun starts each worker with ``start_new_session=True``, so a SIGKILL of the launcher's
    process group misses the workers; ``die_with_parent`` (what ``train.py`` calls under torchrun)
    makes the kernel kill them with their agent, as it does the grader workers."""
    pid_file = tmp_path / "worker.pid"
    worker = (f"import os, time; from dapo_megatron.platform.reaper import die_with_parent; "
              f"assert die_with_parent(os.getppid()); open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)")
    agent = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); "
             f"time.sleep(300)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    before = set(reaper.child_pids())  # other tests' children (session fixtures): not ours to reap
    launcher = subprocess.Popen([sys.executable, "-c", agent], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        assert _alive(pid) and os.getsid(pid) == pid != os.getsid(launcher.pid)  # a session of its own
        os.killpg(launcher.pid, 9)  # what the kill/resume tests do to a launcher
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"the worker {pid} outlived its launcher"
    finally:
        launcher.kill()
        launcher.wait()
        reaper.reap_children(keep=before)  # the worker was adopted by this (subreaper) session: wait for it

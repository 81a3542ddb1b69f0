"""The Python tool's sandbox: one model-written program per call, in a killable process that
bubblewrap confines.

Contract (docs/design.md §4.1 says how each point is enforced and what is not covered):

* The program never runs in the caller's process: each call starts ``bwrap``, which starts a
  fresh interpreter; the caller only reads its output.
* Limits per call: wall time (``wall_timeout_s``, measured by the caller, which then kills the
  sandbox), CPU time (``RLIMIT_CPU``), address space (``RLIMIT_AS``), size of any file written
  (``RLIMIT_FSIZE``) and of the private ``/tmp`` (a tmpfs of ``tmp_size_mb``), and output:
  stdout and stderr share one pipe, the caller keeps the first ``output_limit_bytes`` and kills
  the program as soon as it writes more, so it never holds more than that in memory.
* Isolation: new user (where the kernel allows), mount, pid, network, IPC, UTS and cgroup
  namespaces (``--unshare-all``); the root file system is an empty read-only tmpfs holding only
  the interpreter's prefix and the system libraries, bound read-only, and a private writable
  ``/tmp``. The run directory, the checkpoints, the home directory, ``/proc`` and ``/sys`` are
  not there. No network: the new network namespace has only a loopback device, which is down.
  Every capability is dropped; a seccomp filter (:mod:`dapo_megatron.tools.seccomp`) refuses
  new processes (threads are allowed) and the kernel key-ring calls.
* Nothing outlives the call: the program runs in a new pid namespace whose init is bwrap; when
  the program ends, or when the caller kills the sandbox's process group on a limit, the kernel
  kills every process left in that namespace; ``--die-with-parent`` does the same when the
  caller dies.

Without a working bwrap on ``PATH`` (or at ``bwrap``), :class:`Sandbox` refuses to start, naming
``sandbox.allow_unsandboxed``: with that key set it runs the program in a plain child process with
the same resource limits, a private working directory and its process group killed at the end,
but with no file-system, network or process isolation (development only).

Design: docs/design.md §4.1 (tool calls in a sandbox).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

from dapo_megatron.tools.seccomp import no_new_processes_filter

logger = logging.getLogger(__name__)

__all__ = ["SandboxConfig", "SandboxResult", "Sandbox", "SandboxPool", "SandboxUnavailable", "RESULT_KINDS"]

RESULT_KINDS = ("ok", "timeout", "memory", "output_truncated", "nonzero_exit", "sandbox_error")
"""Every :attr:`SandboxResult.kind`, in the order a call's outcome is classified."""


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run on this machine (bwrap missing or not working) and running
    unsandboxed was not allowed."""


@dataclass
class SandboxConfig:
    """The ``sandbox.*`` keys: limits and isolation of one tool call (:class:`Sandbox`)."""

    wall_timeout_s: float = 5.0
    """wall-clock limit per call (seconds, > 0), from the start of ``bwrap`` to the program's exit;
    the sandbox is killed when it passes (kind ``timeout``)."""
    cpu_time_limit_s: int = 5
    """CPU-time limit per call (whole seconds, >= 1; ``RLIMIT_CPU``, kind ``timeout``)."""
    memory_limit_mb: int = 1024
    """address-space limit of the program (MiB, >= 64; ``RLIMIT_AS``): an allocation over it raises
    ``MemoryError`` (kind ``memory``)."""
    output_limit_bytes: int = 65536
    """bytes of stdout + stderr kept (>= 1); a program that writes more is killed at once (kind
    ``output_truncated``, the first ``output_limit_bytes`` kept)."""
    tmp_size_mb: int = 64
    """size of the private writable ``/tmp`` (MiB, >= 1; also the largest file, ``RLIMIT_FSIZE``)."""
    max_concurrent: int = 4
    """calls a :class:`SandboxPool` runs at once (>= 1); more wait their turn."""
    python: str | None = None
    """interpreter that runs the programs (its prefix is bound read-only); default: the trainer's
    own base interpreter (a virtual environment's packages are not visible, only its base's)."""
    bwrap: str = "bwrap"
    """the bubblewrap executable (a name on ``PATH`` or a path)."""
    allow_unsandboxed: bool = False
    """run programs without bwrap when it is missing or cannot start a sandbox here: a child process with the same resource
    limits but no file-system, network or process isolation. For development only."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad key (``sandbox.<key>``) and its domain."""
        if not self.wall_timeout_s > 0:
            raise ValueError(f"sandbox.wall_timeout_s={self.wall_timeout_s!r} must be > 0 seconds")
        for key, low in (("cpu_time_limit_s", 1), ("memory_limit_mb", 64), ("output_limit_bytes", 1),
                         ("tmp_size_mb", 1), ("max_concurrent", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"sandbox.{key}={value!r} must be an int >= {low}")
        if self.python is not None and not os.path.isfile(self.python):
            raise ValueError(f"sandbox.python={self.python!r} is not a file: give a Python interpreter's path "
                             "or leave it unset for the trainer's own")


@dataclass(frozen=True)
class SandboxResult:
    """What one call produced.

    Attributes:
        output: stdout and stderr interleaved as written (UTF-8, undecodable bytes replaced), at
            most ``output_limit_bytes`` bytes before decoding; for a ``sandbox_error`` the
            sandbox's own message.
        kind: one of :data:`RESULT_KINDS`: ``ok`` (exit 0), ``timeout`` (wall or CPU limit),
            ``memory`` (the program died of ``MemoryError``), ``output_truncated`` (killed for
            writing more than the limit), ``nonzero_exit`` (a traceback, ``sys.exit(n)``, a
            signal), ``sandbox_error`` (the sandbox itself failed; the program may not have run).
        wall_s: seconds from the start of the sandbox to its end (or kill).
        exit_code: the program's exit status (128 + N for signal N, bwrap's convention), or
            None when it was killed by the caller or never started.
        detail: one line for logs and the tool message, e.g. ``"wall time over 2.0 s"``.
        call_id: a fresh id for this call; the sandbox's environment carries it as
            ``DAPO_SANDBOX_CALL`` (tests look for leftover processes by it).
    """

    output: str
    kind: str
    wall_s: float
    exit_code: int | None
    detail: str
    call_id: str


# Runs first inside the sandbox, in the directory that holds main.py (argv: address-space bytes,
# CPU seconds, file-size bytes): sets the limits, then execs a fresh interpreter on main.py, so
# tracebacks show the program's own lines and nothing of this launcher.
_BOOTSTRAP = r"""
import os, resource, sys
as_bytes, cpu_s, fsize = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
os.execv(sys.executable, [sys.executable, "-I", "-B", "main.py"])
"""


def _memfd(name: str, data: bytes) -> int:
    """A memory file holding ``data``, offset 0, for bwrap to read (no pipe buffer to fill)."""
    fd = os.memfd_create(name)
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


_INTERPRETER_QUERY = ("import json, os, sys; print(json.dumps([os.path.realpath(sys.executable), "
                      "sys.base_prefix, sys.base_exec_prefix]))")


def _interpreter_paths(python: str) -> tuple[str, list[str]]:
    """(real path of ``python``, the directories it needs, read-only) by asking it (a trusted
    interpreter, not model text)."""
    out = subprocess.run([python, "-I", "-c", _INTERPRETER_QUERY], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    executable, *prefixes = json.loads(out)
    dirs = sorted({os.path.realpath(p) for p in prefixes} | {os.path.dirname(executable)})
    # drop a directory that another one holds (binding both would be redundant)
    keep = [d for d in dirs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs)]
    return executable, keep


def _system_binds() -> list[str]:
    """bwrap arguments that make the dynamic loader and the C libraries visible, read-only, in
    the host's own layout (merged ``/usr`` or not): ``/usr/lib*`` and ``/lib*``, nothing else
    of ``/usr`` (``/usr/local`` and ``/usr/bin`` stay out)."""
    args = []
    for d in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32"):
        if os.path.isdir(d) and not os.path.islink(d):
            args += ["--ro-bind", d, d]
    for d in ("/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


class Sandbox:
    """Runs one program per :meth:`run` call under :class:`SandboxConfig`'s limits.

    Thread-safe: each call owns its processes and pipes, so calls from several threads run
    concurrently (:class:`SandboxPool` bounds how many).

    Raises:
        ValueError: a bad config key (named).
        SandboxUnavailable: bwrap is missing or cannot start a sandbox here, and
            ``sandbox.allow_unsandboxed`` is false.
    """

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.config.validate()
        python = self.config.python or sys.executable
        self.python, self.python_dirs = _interpreter_paths(python)
        bwrap = shutil.which(self.config.bwrap)
        if bwrap is None and not self.config.allow_unsandboxed:
            raise SandboxUnavailable(
                f"the Python tool needs bubblewrap, and sandbox.bwrap={self.config.bwrap!r} is not on PATH: install it "
                "(Debian/Ubuntu: apt-get install bubblewrap; tools/setup_cpu.sh does) or set "
                "sandbox.allow_unsandboxed=true to run model-written programs without isolation (development only)")
        self.bwrap = bwrap
        self._seccomp = no_new_processes_filter() if bwrap else b""
        if bwrap is not None:
            probe = self._run("print(6 * 7)", wall_timeout_s=max(self.config.wall_timeout_s, 60.0))
            if (probe.kind != "ok" or probe.output != "42\n") and self.config.allow_unsandboxed:
                logger.warning("bwrap (%s) cannot start a sandbox here (%s: %s); sandbox.allow_unsandboxed=true: "
                               "running tool programs WITHOUT isolation", bwrap, probe.kind, probe.output[:300])
                self.bwrap = None
            elif probe.kind != "ok" or probe.output != "42\n":
                raise SandboxUnavailable(
                    f"bwrap ({bwrap}) cannot start a sandbox on this machine ({probe.kind}: {probe.detail}; "
                    f"output {probe.output[:500]!r}); on a host that forbids user namespaces run as root or set "
                    "sandbox.allow_unsandboxed=true (development only)")

    python: str
    """real path of the interpreter that runs the programs."""
    python_dirs: list[str]
    """the directories of that interpreter bound read-only into the sandbox (its prefixes)."""

    @property
    def sandboxed(self) -> bool:
        """True when calls run under bwrap (False only with ``sandbox.allow_unsandboxed``)."""
        return self.bwrap is not None

    # -- one call -------------------------------------------------------------

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` (a whole Python program, UTF-8) and return its :class:`SandboxResult`.

        Never raises for anything the program does; an OS failure to start the sandbox is a
        ``sandbox_error`` result.
        """
        return self._run(code, self.config.wall_timeout_s)

    def _run(self, code: str, wall_timeout_s: float) -> SandboxResult:
        cfg = self.config
        call_id = uuid.uuid4().hex
        limits = [str(cfg.memory_limit_mb << 20), str(cfg.cpu_time_limit_s), str(cfg.tmp_size_mb << 20)]
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1", "DAPO_SANDBOX_CALL": call_id}
        program = code.encode("utf-8", "replace")
        fds_to_close: list[int] = []
        workdir = None
        try:
            if self.bwrap is not None:
                status_r, status_w = os.pipe()
                fds_to_close += [status_r, status_w]
                seccomp = _memfd("dapo-sandbox-seccomp", self._seccomp)
                fds_to_close.append(seccomp)
                source = _memfd("dapo-sandbox-main", program)
                fds_to_close.append(source)
                argv = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
                argv += _system_binds()
                for d in self.python_dirs:
                    argv += ["--ro-bind", d, d]
                argv += ["--dev", "/dev", "--size", str(cfg.tmp_size_mb << 20), "--tmpfs", "/tmp",
                         "--file", str(source), "/tmp/main.py", "--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
                for key, value in env.items():
                    argv += ["--setenv", key, value]
                argv += ["--seccomp", str(seccomp), "--json-status-fd", str(status_w), "--",
                         self.python, "-I", "-c", _BOOTSTRAP, *limits]
                popen = dict(pass_fds=(seccomp, source, status_w))
            else:
                workdir = tempfile.mkdtemp(prefix="dapo-tool-")
                env.update(HOME=workdir, TMPDIR=workdir)  # the host's /tmp is shared: keep to the private one
                with open(os.path.join(workdir, "main.py"), "wb") as f:
                    f.write(program)
                status_r = None
                argv = [self.python, "-I", "-c", _BOOTSTRAP, *limits]
                popen = dict(cwd=workdir, env=env)
            started = time.monotonic()
            try:
                process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, start_new_session=True, **popen)
            except OSError as e:
                return SandboxResult(f"cannot start the sandbox: {e}", "sandbox_error", 0.0, None, str(e), call_id)
            if self.bwrap is not None:  # the child holds its own copies now; EOF on status needs ours closed
                os.close(status_w)
                fds_to_close.remove(status_w)
            return self._collect(process, started, wall_timeout_s, status_r, call_id)
        finally:
            for fd in fds_to_close:
                os.close(fd)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

    def _collect(self, process: subprocess.Popen, started: float, wall_timeout_s: float, status_r: int | None,
                 call_id: str) -> SandboxResult:
        cfg = self.config
        deadline = started + wall_timeout_s
        output = bytearray()
        status = _BwrapStatus(status_r)
        verdict = None  # "timeout" / "output_truncated" when the caller killed it
        fd = process.stdout.fileno()
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(fd, selectors.EVENT_READ)
                if status_r is not None:
                    selector.register(status_r, selectors.EVENT_READ)
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        verdict = "timeout"
                        break
                    ready = [key.fd for key, _ in selector.select(left)]
                    if status_r in ready and not status.read():
                        selector.unregister(status_r)
                    if fd not in ready:
                        continue
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        break
                    room = cfg.output_limit_bytes - len(output)
                    output += chunk[:room]
                    if len(chunk) > room:
                        verdict = "output_truncated"
                        break
            if verdict is None:
                try:
                    process.wait(timeout=max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:  # closed its output but still runs
                    verdict = "timeout"
            if verdict is not None or self.bwrap is None:  # unsandboxed: also whatever the program left behind
                self._kill(process, status)
            wall_s = time.monotonic() - started
            status.read()
        finally:
            process.stdout.close()
            status.close()
        text = output.decode("utf-8", "replace")
        if verdict == "timeout":
            return SandboxResult(text, "timeout", wall_s, None, f"wall time over {wall_timeout_s:g} s", call_id)
        if verdict == "output_truncated":
            return SandboxResult(text, "output_truncated", wall_s, None,
                                 f"output over {cfg.output_limit_bytes} bytes", call_id)
        code_ = process.returncode
        if status_r is not None and "child-pid" not in status.fields:  # bwrap failed before starting the program
            return SandboxResult(text, "sandbox_error", wall_s, code_, f"bwrap exited {code_} before the program ran",
                                 call_id)
        if "exit-code" in status.fields:
            code_ = status.fields["exit-code"]
        elif code_ < 0:  # unsandboxed: Popen reports signal N as -N
            code_ = 128 - code_
        if code_ == 0:
            return SandboxResult(text, "ok", wall_s, 0, "exit 0", call_id)
        if code_ == 128 + signal.SIGXCPU:  # RLIMIT_CPU's soft limit
            return SandboxResult(text, "timeout", wall_s, code_, f"CPU time over {cfg.cpu_time_limit_s} s", call_id)
        if code_ == 128 + signal.SIGKILL:
            return SandboxResult(text, "nonzero_exit", wall_s, code_, "killed by SIGKILL (the CPU limit's hard "
                                 "limit or the kernel's out-of-memory killer)", call_id)
        last = text.rstrip().rsplit("\n", 1)[-1]
        if code_ == 1 and last.startswith("MemoryError"):
            return SandboxResult(text, "memory", wall_s, code_, f"address space over {cfg.memory_limit_mb} MiB",
                                 call_id)
        return SandboxResult(text, "nonzero_exit", wall_s, code_, f"exit {code_}", call_id)

    @staticmethod
    def _kill(process: subprocess.Popen, status: _BwrapStatus) -> None:
        """Kill the sandbox and return once nothing of it is left.

        Sandboxed, SIGKILL goes to the pid namespace's init (bwrap's pid 1): the kernel then kills
        every process in the namespace and waits until they are reaped before the init is gone
        (kernel/pid_namespace.c, ``zap_pid_ns_processes``), and the outer bwrap exits only after
        reaping the init, so ``process.wait`` returning means no process of the call remains.
        Killing the outer bwrap instead would leave the namespace's teardown running after the
        call returned. Without an init (unsandboxed, or bwrap still setting up) the process group
        is killed."""
        def reaped() -> bool:  # bounded: a process stuck in D state must not hang the rollout
            try:
                process.wait(timeout=10)
                return True
            except subprocess.TimeoutExpired:
                return False

        if status.init_pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(status.init_pidfd, signal.SIGKILL)
            if reaped():
                return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        reaped()


class _BwrapStatus:
    """bwrap's ``--json-status-fd`` stream (one JSON object a line): ``child-pid`` (the pid
    namespace's init, as this process sees it) when the sandbox is set up, ``exit-code`` at the
    end. Holds a pidfd of the init from the moment it is reported, so a kill can never reach a
    recycled pid."""

    def __init__(self, fd: int | None):
        self.fd = fd
        self.fields: dict = {}
        self.init_pidfd: int | None = None
        self._buffer = bytearray()
        if fd is not None:
            os.set_blocking(fd, False)

    def read(self) -> bool:
        """Consume what is readable now; False at end of stream (or without a stream)."""
        if self.fd is None:
            return False
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self._buffer += chunk
            *lines, rest = self._buffer.split(b"\n")
            self._buffer = bytearray(rest)
            for line in lines:
                try:
                    self.fields.update(json.loads(line))
                except ValueError:
                    continue
                if "child-pid" in self.fields and self.init_pidfd is None:
                    try:
                        self.init_pidfd = os.pidfd_open(self.fields["child-pid"])
                    except ProcessLookupError:  # already gone: nothing to kill
                        pass

    def close(self) -> None:
        if self.init_pidfd is not None:
            os.close(self.init_pidfd)
            self.init_pidfd = None


class SandboxPool:
    """Bounded concurrent calls for the rollout loop: at most ``sandbox.max_concurrent``
    sandboxes at once, from threads (:meth:`submit`, :meth:`map`) or asyncio (:meth:`arun`).

    A call waits for a free slot before its wall-clock limit starts. :meth:`close` (or the
    ``with`` block's end) waits for the calls in flight; each ends within its limits.
    """

    def __init__(self, config: SandboxConfig | None = None, sandbox: Sandbox | None = None):
        self.sandbox = sandbox or Sandbox(config)
        self.config = self.sandbox.config
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.config.max_concurrent,
                                                               thread_name_prefix="dapo-sandbox")

    def submit(self, code: str) -> concurrent.futures.Future:
        """Queue one program; the future's result is its :class:`SandboxResult`."""
        return self._executor.submit(self.sandbox.run, code)

    def map(self, codes: list[str]) -> list[SandboxResult]:
        """Run every program (``max_concurrent`` at a time); results in input order."""
        return [f.result() for f in [self.submit(c) for c in codes]]

    async def arun(self, code: str) -> SandboxResult:
        """Await one program's result without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(code))

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

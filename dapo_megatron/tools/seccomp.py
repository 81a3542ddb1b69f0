"""A seccomp filter that forbids new processes, for bubblewrap's ``--seccomp FD``.

The sandbox (:mod:`dapo_megatron.tools.sandbox`) runs tool programs as root on machines where
the trainer is root, and ``RLIMIT_NPROC`` does not bind root (kernel/fork.c, ``copy_process``:
the check is skipped for ``INIT_USER``), so a fork bomb needs a limit that holds for every user:
this filter makes ``fork``, ``vfork`` and a ``clone`` without ``CLONE_THREAD`` fail with
``EPERM`` (Python raises ``PermissionError``) and ``clone3`` fail with ``ENOSYS``, whose flags a
classic BPF filter cannot read (they sit behind a pointer); glibc then falls back to ``clone``,
so threads still start. The kernel key-ring calls (``add_key``, ``request_key``, ``keyctl``) fail
with ``EPERM`` too: key rings are per user and not namespaced, and a sandbox of a root trainer
runs as uid 0 (without capabilities). Every other system call is allowed; a system call of another ABI
(i386 or x32 on x86-64) kills the process, so the filter cannot be bypassed through them.

The program is classic BPF (``struct sock_filter``: u16 code, u8 jt, u8 jf, u32 k, native
byte order), the format ``seccomp_export_bpf`` writes and bwrap's ``--seccomp`` reads
(bubblewrap 0.8.0, bwrap.xml: "compiled cBPF program").

Design: docs/design.md §4.1 (tool calls in a sandbox).
"""

from __future__ import annotations

import platform
import struct

__all__ = ["no_new_processes_filter"]

# linux/filter.h
_BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_BPF_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_BPF_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_BPF_RET_K = 0x06  # BPF_RET | BPF_K
# linux/seccomp.h
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LOW = 0, 4, 16  # args[0]'s low word on a little-endian machine

# machine -> (AUDIT_ARCH_*, numbers denied with EPERM: fork, vfork (x86-64 only), add_key, request_key,
# keyctl; clone; clone3) from arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h
_ARCHES = {
    "x86_64": (0xC000003E, (57, 58, 248, 249, 250), 56, 435),
    "aarch64": (0xC00000B7, (217, 218, 219), 220, 435),
}
_X32_SYSCALL_BIT = 0x40000000


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def no_new_processes_filter(machine: str | None = None) -> bytes:
    """The compiled filter for ``machine`` (default ``platform.machine()``).

    Raises:
        RuntimeError: on a machine other than x86_64 or aarch64 (the syscall numbers differ).
    """
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise RuntimeError(f"the tool sandbox's seccomp filter supports x86_64 and aarch64, not {machine!r}")
    arch, deny, clone, clone3 = _ARCHES[machine]
    # Layout (jump offsets are relative to the next instruction):
    #   0 ld arch; 1 jeq arch ? 2 : KILL; 2 ld nr; [3 jge x32 bit ? KILL]; then
    #   one jeq per denied number -> EPERM; jeq clone3 -> ENOSYS; jeq clone -> CHECK; ret ALLOW;
    #   CHECK: ld arg0; jset CLONE_THREAD ? ALLOW : EPERM; ALLOW; EPERM; ENOSYS; KILL
    body: list[tuple[str, int, object, object]] = []  # (op, k, jt label, jf label)
    body.append(("ld", _OFF_ARCH, None, None))
    body.append(("jeq", arch, None, "kill"))
    body.append(("ld", _OFF_NR, None, None))
    if machine == "x86_64":
        body.append(("jge", _X32_SYSCALL_BIT, "kill", None))
    for n in deny:
        body.append(("jeq", n, "eperm", None))
    body.append(("jeq", clone3, "enosys", None))
    body.append(("jeq", clone, "check", None))
    body.append(("ret", _RET_ALLOW, None, None))
    labels = {}
    labels["check"] = len(body)
    body.append(("ld", _OFF_ARG0_LOW, None, None))
    body.append(("jset", _CLONE_THREAD, "allow", "eperm"))
    labels["allow"] = len(body)
    body.append(("ret", _RET_ALLOW, None, None))
    labels["eperm"] = len(body)
    body.append(("ret", _RET_ERRNO | _EPERM, None, None))
    labels["enosys"] = len(body)
    body.append(("ret", _RET_ERRNO | _ENOSYS, None, None))
    labels["kill"] = len(body)
    body.append(("ret", _RET_KILL_PROCESS, None, None))

    codes = {"ld": _BPF_LD_W_ABS, "jeq": _BPF_JEQ_K, "jge": _BPF_JGE_K, "jset": _BPF_JSET_K, "ret": _BPF_RET_K}
    out = []
    for i, (op, k, jt, jf) in enumerate(body):
        jumps = [0 if label is None else labels[label] - (i + 1) for label in (jt, jf)]
        assert all(0 <= j < 256 for j in jumps), (i, jumps)
        out.append(_insn(codes[op], *jumps, k))
    return b"".join(out)

"""Run a program inside one emulated host (``pdlink.testing.hosts``): enter the host's network, pid
and mount namespaces, then fork the program and wait for it.

Usage (run as a script, ``python -S -E _nsenter.py PID NETNS_INODE PROGRAM [ARGS...]``): PID is the
host's anchor (its pid namespace's init, as the machine sees it); NETNS_INODE is the inode of that
anchor's network namespace, checked so a reused pid never sends the program into another namespace.

Contract: the program runs in the host's namespaces, in the caller's working directory where that
exists there (else ``/``), with the caller's environment and open descriptors. This process stays
its parent and exits with its exit status (or dies of the signal that killed it); SIGTERM, SIGINT,
SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are passed on to it, and SIGKILL of this process kills it
(PR_SET_PDEATHSIG), so no program outlives the pid it was started as. Exit status 125 (with a line
on stderr) when the host is gone or cannot be entered; 127 when the program cannot be executed.
Standard library only, no import of pdlink: it runs before every program started in a host.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _fail(why: str) -> None:
    sys.stderr.write(f"pdlink hosts: cannot enter the host: {why}\n")
    sys.stderr.flush()
    os._exit(125)


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        _fail("usage: _nsenter.py PID NETNS_INODE PROGRAM [ARGS...]")
    pid, inode, program = argv[0], int(argv[1]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    fds = {}
    try:
        for kind in ("net", "pid", "mnt"):
            fds[kind] = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        _fail(f"anchor {pid}: {e}")
    if os.fstat(fds["net"]).st_ino != inode:
        _fail(f"pid {pid} no longer holds the host's network namespace")
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    for kind, flag in (("net", CLONE_NEWNET), ("pid", CLONE_NEWPID), ("mnt", CLONE_NEWNS)):
        if libc.setns(fds[kind], flag) != 0:
            _fail(f"setns({kind}): {os.strerror(ctypes.get_errno())}")
        os.close(fds[kind])
    try:
        os.chdir(cwd if cwd is not None else "/")
    except OSError:
        os.chdir("/")
    child = os.fork()
    if child == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != 0:  # the parent (outside this pid namespace) died before the prctl
            os._exit(125)
        try:
            os.execvp(program[0], program)
        except OSError as e:
            sys.stderr.write(f"pdlink hosts: cannot execute {program[0]}: {e}\n")
            sys.stderr.flush()
        os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except OSError:
            pass

    for s in FORWARDED:
        signal.signal(s, forward)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        for s in FORWARDED:
            signal.signal(s, signal.SIG_DFL)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])

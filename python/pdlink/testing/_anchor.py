"""The processes that hold an emulated host's namespaces (``pdlink.testing.hosts``); run as a script:
``python -S -E _anchor.py OWNER_PID host STAGE_DIR`` or ``... OWNER_PID switch`` or ``... probe``.

Contract: an anchor dies with its owner (PR_SET_PDEATHSIG=SIGKILL, set first, then the owner pid
checked so an owner that died before it is noticed), and with the anchor everything it holds goes:

- ``switch``: a network namespace of its own (the switch's); the anchor itself holds it and sleeps.
- ``host``: new network, mount and pid namespaces. The anchor forks the pid namespace's init, which
  dies with the anchor (PR_SET_PDEATHSIG again); when the init dies the kernel kills every process of
  the host. The init makes the mount namespace a slave of the machine's (later machine mounts show
  through, nothing made here goes back), mounts the host's own /proc and /sys, and a private /tmp: an
  overlay whose lower layer is the machine's /tmp (a Python install, a virtual environment or a
  clone under /tmp stays visible) and whose upper layer is a tmpfs mounted on STAGE_DIR inside this
  mount namespace only (so what the host writes under /tmp is its own, and goes with the namespace).
  Then it reaps orphans for ever.

Either prints one line ``ready PID NETNS_INODE`` on stdout once the namespaces exist (PID: the
process to enter, as the machine sees it), or ``error WHY`` and exits 1. ``probe`` makes the three
namespaces and a veth pair and a bridge in them, prints ``ready`` or ``error WHY``, and exits.
IPv6 is switched off in every namespace made here: the hosts speak IPv4 only, so no frame but the
test's own (and no neighbour discovery) crosses the switch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MS_REC = 0x4000
MS_SLAVE = 1 << 19
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {fstype or ''} on {target}",
    )


def _no_ipv6() -> None:
    for conf in ("all", "default"):
        try:
            with open(f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6", "w") as f:
                f.write("1")
        except OSError:
            pass  # a kernel without IPv6


def _die_with(owner: int) -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if owner and os.getppid() != owner:
        os._exit(1)


def _netns_inode() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _sleep_for_ever() -> None:
    while True:
        signal.pause()


def _init(stage: str, ready_w: int) -> None:
    """The pid namespace's init (pid 1 there): mounts, says ready through ``ready_w``, reaps."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    try:
        _mount("none", "/", None, MS_REC | MS_SLAVE, None)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        try:
            _mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        except OSError:
            pass  # /sys shows the machine's interfaces then; nothing depends on it
        _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        os.mkdir(os.path.join(stage, "upper"), 0o1777)
        os.chmod(os.path.join(stage, "upper"), 0o1777)
        os.mkdir(os.path.join(stage, "work"))
        lower = os.path.realpath("/tmp")
        _mount("overlay", "/tmp", "overlay", 0, f"lowerdir={lower},upperdir={stage}/upper,workdir={stage}/work")
    except OSError as e:
        os.write(ready_w, f"error {e}\n".encode())
        os._exit(1)
    os.write(ready_w, b"ok\n")
    os.close(ready_w)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        signal.sigwait({signal.SIGCHLD})
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def host(owner: int, stage: str) -> None:
    _die_with(owner)
    _check(_libc.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID), "unshare(net, mount, pid)")
    _no_ipv6()
    inode = _netns_inode()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        _init(stage, w)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline().strip()
    if line != "ok":
        _say(line if line.startswith("error") else f"error the host's init died ({line!r})")
        os._exit(1)
    _say(f"ready {child} {inode}")
    os.waitpid(child, 0)
    os._exit(0)


def switch(owner: int) -> None:
    _die_with(owner)
    _check(_libc.unshare(CLONE_NEWNET), "unshare(net)")
    _no_ipv6()
    _say(f"ready {os.getpid()} {_netns_inode()}")
    _sleep_for_ever()


def probe() -> None:
    try:
        _check(_libc.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID), "unshare(net, mount, pid)")
        # one child only: the first one is the new pid namespace's init, and none follows its death
        cmd = ["ip", "-batch", "-"]
        script = "link add pdlprobe0 type veth peer name pdlprobe1\nlink add pdlprobe2 type bridge\n"
        run = subprocess.run(cmd, input=script, capture_output=True, text=True)
        if run.returncode != 0:
            raise OSError(0, f"ip link add (veth, bridge): {run.stderr.strip()}")
    except OSError as e:
        _say(f"error {e.strerror or e}")
        os._exit(1)
    _say("ready")
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        probe()
    elif sys.argv[2] == "host":
        host(int(sys.argv[1]), sys.argv[3])
    else:
        switch(int(sys.argv[1]))

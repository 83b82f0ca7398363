"""Many hosts on one machine: network, pid and mount namespaces joined by one switch, with an
emulated wire between them (docs/hosts.md)::

    from pdlink.testing.hosts import Hosts

    with Hosts(2, profile="dc") as hosts:
        server = hosts[0].spawn(["iperf3", "-s", "-1"])
        print(hosts[1].run(["iperf3", "-c", hosts[0].ip]).stdout)

What it makes. Host ``i`` is a network namespace, a pid namespace and a mount namespace of its own
(a private /tmp, its own /proc), with ``lo`` up and one interface ``eth0`` at ``198.18.0.(i+1)/15``
(the benchmarking range, never routed; no default route, so nothing but the other hosts is
reachable). Every ``eth0`` is cabled to one switch: a bridge in a network namespace of its own.
Nothing is added to the machine's own network namespace: no interface, no route, no named
namespace. Every process started on one host shares the host's pid namespace (two processes on one
host see each other as a same-host pair would); processes on two hosts do not see each other.

How it is torn down. Every namespace is held only by anchor processes (``_anchor.py``) that die
with the process that made the set (PR_SET_PDEATHSIG=SIGKILL, tied to the thread that made it: make
a set in a thread that lives as long as the set), and when a pid namespace's init dies the kernel
kills every process of that host. So the kernel tears a set down on ``close()``, on an exception
and on SIGKILL of the owner alike. A small state directory (``<state root>/pdl<owner pid>-<n>``: the
per-host entry scripts) is removed by ``close()``, and a stale one (owner dead) by the next set made.

Root (CAP_SYS_ADMIN, CAP_NET_ADMIN), util-linux and iproute2 (``ip``, ``tc``) are needed;
``unavailable_reason()`` says what is missing, and ``Hosts`` raises ``HostsUnavailable`` with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "PROFILES",
    "Host",
    "HostProcess",
    "Hosts",
    "HostsUnavailable",
    "Wire",
    "unavailable_reason",
    "state_root",
    "remove_stale",
    "wire_binary",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
_ANCHOR = os.path.join(_HERE, "_anchor.py")
_NSENTER = os.path.join(_HERE, "_nsenter.py")
_CALL = os.path.join(_HERE, "_call.py")

SUBNET = "198.18.0.0/15"
PREFIX = 15
MAX_HOSTS = 250  # 198.18.0.1 .. 198.18.0.250
_SETUP_TIMEOUT = 60.0  # seconds for one anchor to say ready / one configuration batch


class HostsUnavailable(RuntimeError):
    """Hosts cannot be made here; ``str(e)`` (and ``e.reason``) says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Wire:
    """What one host's link to the switch does to the frames on it, in each direction.

    ``delay_us`` and ``jitter_us`` are one way, host to host (each of the two links a frame crosses
    adds half); ``loss`` is the fraction of frames lost host to host, in bursts of ``loss_burst``
    frames on average (1.0: independent losses); ``reorder`` the fraction of frames sent ahead of the
    ones queued before them; ``rate_mbit`` caps each direction of the link (None: no cap); ``mtu``
    is the hosts' interface MTU; ``queue_bytes`` bounds the buffer in front of each direction of
    the link (frames beyond it are dropped, like a switch's full buffer; None: ``buffer_bytes()``);
    ``relay`` puts the link behind the userspace relay even when nothing asks for it (to measure
    the relay's own floor).
    """

    rate_mbit: float | None = None
    delay_us: int = 0
    jitter_us: int = 0
    loss: float = 0.0
    loss_burst: float = 1.0
    reorder: float = 0.0
    mtu: int = 1500
    queue_bytes: int | None = None
    relay: bool = False

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, not {self.rate_mbit}")
        if self.delay_us < 0 or self.jitter_us < 0:
            raise ValueError("delay_us and jitter_us must be >= 0")
        if not 0.0 <= self.loss < 1.0 or not 0.0 <= self.reorder <= 1.0:
            raise ValueError("loss must be in [0, 1) and reorder in [0, 1]")
        if self.loss_burst < 1.0:
            raise ValueError("loss_burst (mean frames per loss burst) must be >= 1")
        if not 576 <= self.mtu <= 65000:
            raise ValueError("mtu must be in [576, 65000]")
        if self.queue_bytes is not None and not 1 << 16 <= self.queue_bytes <= 1 << 30:
            raise ValueError("queue_bytes must be in [64 KiB, 1 GiB] or None")

    def replace(self, **changes: Any) -> Wire:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def buffer_bytes(self) -> int:
        """The buffer in front of each direction of a link: ``queue_bytes``, else with a rate twice
        the bandwidth-delay product of the round trip, at least 256 KiB; without a rate 32 MiB (what
        the relay may hold in flight)."""
        if self.queue_bytes is not None:
            return self.queue_bytes
        if self.rate_mbit is None:
            return 32 << 20
        bdp = self.rate_mbit * 1e6 / 8 * (2 * self.delay_us + 2 * self.jitter_us) / 1e6
        return max(256 << 10, int(2 * bdp))

    @property
    def needs_relay(self) -> bool:
        """Whether the wire needs the userspace relay (delay, jitter, loss or reordering)."""
        return bool(self.relay or self.delay_us or self.jitter_us or self.loss or self.reorder)


PROFILES: dict[str, Wire] = {
    "loopback": Wire(),
    "rack": Wire(rate_mbit=1000, delay_us=50),
    "dc": Wire(rate_mbit=500, delay_us=200, loss=1e-5),
    "wan": Wire(rate_mbit=100, delay_us=10_000, loss=1e-3),
}


def _wire_of(wire: str | Wire) -> Wire:
    if isinstance(wire, Wire):
        return wire
    try:
        return PROFILES[wire]
    except KeyError:
        raise ValueError(f"unknown wire profile {wire!r}; known: {', '.join(PROFILES)}") from None


def state_root() -> str:
    """The folder holding one state directory per live set: ``/run/pdlink-hosts`` where /run is
    writable, else ``pdlink-hosts`` in the temporary folder."""
    if os.access("/run", os.W_OK):
        return "/run/pdlink-hosts"
    return os.path.join(tempfile.gettempdir(), "pdlink-hosts")


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), to tell a pid from a reused one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when hosts can be made here; else why not (not root, a missing tool, namespaces or veth
    refused, no /dev/net/tun). Probes once per process (a child that makes the namespaces)."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux network namespaces (this is {sys.platform})"
    missing = [name for name, bit in (("CAP_SYS_ADMIN", 21), ("CAP_NET_ADMIN", 12)) if not _effective_caps() >> bit & 1]
    if missing:
        return f"needs root: no {' and '.join(missing)} in this process's effective capabilities (uid {os.geteuid()})"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"needs {tool} ({package})"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun (TAP devices for the emulated wire)"
    try:
        probe = subprocess.run(
            [sys.executable, "-S", "-E", _ANCHOR, "probe"], capture_output=True, text=True, timeout=_SETUP_TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"probing namespaces failed: {e}"
    line = probe.stdout.strip()
    if line != "ready":
        return f"namespaces refused: {line.removeprefix('error ') or probe.stderr.strip()}"
    return None


def remove_stale(root: str | None = None) -> list[str]:
    """Remove every set under ``root`` whose owner is dead (kill anchors still alive, delete its
    state directory); returns the names removed. Called by every new set."""
    root = root or state_root()
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, "state.json")) as f:
                state = json.load(f)
        except (OSError, ValueError):
            # a set half made (no state yet): stale when the pid in its name is dead
            try:
                owner = int(name.removeprefix("pdl").split("-")[0])
            except ValueError:
                continue
            if _start_time(owner) is None:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
            continue
        if _start_time(state["owner"]) == state["owner_start"]:
            continue  # alive
        for pid, start in state.get("anchors", []):
            if _start_time(pid) == start:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


class HostProcess:
    """A function running in a host (``Host.spawn``): like ``multiprocessing.Process`` once started.

    ``pid`` is the machine's pid of the process that entered the host (killing it kills the
    function's process); ``exitcode`` is None while it runs, then 0 (returned), 1 (raised) or
    ``-signal``; ``result(timeout)`` waits and returns the function's value or raises its exception.
    """

    def __init__(self, popen: subprocess.Popen[bytes], result_r: int, name: str) -> None:
        self._popen = popen
        self._name = name
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, args=(result_r,), daemon=True, name=f"{name}-result")
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            while chunk := f.read(1 << 16):
                self._chunks.append(chunk)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self._popen.kill()

    def terminate(self) -> None:
        with contextlib.suppress(OSError):
            self._popen.terminate()

    def result(self, timeout: float | None = None) -> Any:
        """The function's return value (waits up to ``timeout`` s; TimeoutError then, the process is
        left running); its exception raised again, the remote traceback chained as the cause."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self._name} still running after {timeout} s") from None
        self._reader.join(timeout=10)
        blob = b"".join(self._chunks)
        if not blob:
            raise RuntimeError(f"{self._name} ended with exit code {self._popen.returncode} and no result")
        outcome = pickle.loads(blob)
        if outcome[0] == "ok":
            return outcome[1]
        _, exc, text = outcome
        raise exc from _RemoteTraceback(text)


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n--- in the host ---\n{self.text}"


@dataclasses.dataclass
class Host:
    """One emulated host (``hosts[i]``). ``python`` runs this interpreter inside the host
    (``sys.executable`` semantics: ``multiprocessing.spawn.set_executable(host.python)`` places
    spawned processes there); SIGKILL of the pid it runs as kills the interpreter it started."""

    index: int
    ip: str
    name: str
    python: str
    enter: str  # a program that runs its arguments inside the host (``command`` prefixes it)
    anchor_pid: int

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this host (for ``subprocess.Popen``)."""
        return [self.enter, *argv]

    def run(self, target: Callable[..., Any] | Sequence[str], *args: Any, timeout: float = 60, **kwargs: Any) -> Any:
        """Run ``target`` inside this host and wait (at most ``timeout`` s; ``TimeoutError`` then,
        and the process is killed). A callable must be a module-level function: it travels by
        reference, its arguments and result are pickled, and an exception it raises is raised again
        here (the host's traceback chained as the cause). A command (a sequence of strings) returns
        ``subprocess.CompletedProcess`` with stdout/stderr captured (``kwargs`` go to
        ``subprocess.run``: ``text=True``, ``input=...``, ``check=True``)."""
        if callable(target):
            proc = self.spawn(target, *args, **kwargs)
            try:
                return proc.result(timeout)
            except TimeoutError:
                proc.kill()
                proc.join(10)
                raise
        if args:
            raise TypeError("a command takes no positional arguments after it")
        kwargs.setdefault("capture_output", True)
        try:
            return subprocess.run(self.command(list(target)), timeout=timeout, **kwargs)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"{list(target)} on {self.name} still running after {timeout} s") from e

    def spawn(self, target: Callable[..., Any] | Sequence[str], *args: Any, **kwargs: Any) -> Any:
        """Start ``target`` inside this host and return at once: a function gives a ``HostProcess``
        (``pid``, ``join``, ``kill``, ``exitcode``, ``result``); a command gives ``subprocess.Popen``
        (``kwargs`` go to it)."""
        if not callable(target):
            if args:
                raise TypeError("a command takes no positional arguments after it")
            return subprocess.Popen(self.command(list(target)), **kwargs)
        payload = pickle.dumps(list(sys.path)) + pickle.dumps((target, args, kwargs))
        result_r, result_w = os.pipe()
        try:
            popen = subprocess.Popen(
                [self.python, _CALL, str(result_w)], stdin=subprocess.PIPE, pass_fds=(result_w,), close_fds=True
            )
        except BaseException:
            os.close(result_r)
            os.close(result_w)
            raise
        os.close(result_w)
        proc = HostProcess(popen, result_r, f"{getattr(target, '__qualname__', target)} on {self.name}")
        assert popen.stdin is not None
        try:
            popen.stdin.write(payload)
            popen.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; result() says so
        return proc


def _run_checked(argv: Sequence[str], what: str, stdin: str | None = None, check: bool = True) -> str:
    run = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=_SETUP_TIMEOUT)
    if check and run.returncode != 0:
        raise RuntimeError(f"{what}: {' '.join(argv)} exited {run.returncode}: {run.stderr.strip()}")
    return run.stdout


class Hosts:
    """``n`` emulated hosts joined by one switch, the links shaped by ``profile`` (a name of
    ``PROFILES`` or a ``Wire``); a context manager (``close()`` tears it down). Raises
    ``HostsUnavailable`` (with the reason) when hosts cannot be made here."""

    _sequence = 0
    _sequence_lock = threading.Lock()

    def __init__(self, n: int, profile: str | Wire = "loopback") -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"n must be in [1, {MAX_HOSTS}], not {n}")
        wire = _wire_of(profile)
        reason = unavailable_reason()
        if reason is not None:
            raise HostsUnavailable(reason)
        self._n = n
        self._closed = False
        self._anchors: list[subprocess.Popen[str]] = []
        self._hosts: list[Host] = []
        self._init_fds: list[int] = []  # a pidfd per host's init: close() waits on them
        self._wires: list[Wire] = [wire] * n
        self._down: set[int] = set()
        self._cut: set[frozenset[int]] = set()
        self._lock = threading.RLock()
        self._relay: _Relay | None = None
        self._relayed: set[int] = set()
        root = state_root()
        os.makedirs(root, mode=0o755, exist_ok=True)
        remove_stale(root)
        with Hosts._sequence_lock:
            Hosts._sequence += 1
            seq = Hosts._sequence
        self.name = f"pdl{os.getpid()}-{seq}"
        self.state_dir = os.path.join(root, self.name)
        os.makedirs(self.state_dir, mode=0o755)
        try:
            self._build(wire)
        except BaseException:
            self.close()
            raise

    # -- building ---------------------------------------------------------------------------------

    def _start_anchor(self, *args: str) -> tuple[int, int]:
        popen = subprocess.Popen(
            [sys.executable, "-S", "-E", _ANCHOR, str(os.getpid()), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._anchors.append(popen)
        assert popen.stdout is not None
        ready, _, _ = select.select([popen.stdout], [], [], _SETUP_TIMEOUT)
        line = popen.stdout.readline().split() if ready else ["error", f"no answer within {_SETUP_TIMEOUT} s"]
        if len(line) != 3 or line[0] != "ready":
            popen.kill()
            err = popen.stderr.read() if popen.stderr else ""
            raise HostsUnavailable(f"making a namespace failed: {' '.join(line)} {err.strip()}".strip())
        return int(line[1]), int(line[2])

    def _write_state(self) -> None:
        anchors = []
        for a in self._anchors:
            anchors.append([a.pid, _start_time(a.pid)])
        for h in self._hosts:
            anchors.append([h.anchor_pid, _start_time(h.anchor_pid)])
        if self._relay is not None:
            anchors.append([self._relay.pid, _start_time(self._relay.pid)])
        state = {
            "owner": os.getpid(),
            "owner_start": _start_time(os.getpid()),
            "anchors": anchors,
            "switch": self._switch_pid,
            "hosts": [{"index": h.index, "ip": h.ip, "name": h.name, "pid": h.anchor_pid} for h in self._hosts],
        }
        tmp = os.path.join(self.state_dir, "state.json.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, os.path.join(self.state_dir, "state.json"))

    def _in(self, pid: int, argv: Sequence[str], what: str, stdin: str | None = None, check: bool = True) -> str:
        """Run ``argv`` in the network namespace of ``pid`` (configuration: ip, tc)."""
        return _run_checked(["nsenter", "-t", str(pid), "-n", *argv], what, stdin, check)

    def _switch(self, batch: list[str], what: str) -> None:
        if batch:
            self._in(self._switch_pid, ["ip", "-batch", "-"], what, "\n".join(batch) + "\n")

    def _build(self, wire: Wire) -> None:
        self._switch_pid, self._switch_ino = self._start_anchor("switch")
        self._write_state()
        batch = ["link add br0 type bridge", "link set br0 up", "link set lo up"]
        for i in range(self._n):
            stage = os.path.join(self.state_dir, f"h{i}")
            os.makedirs(stage, mode=0o755)
            pid, ino = self._start_anchor("host", stage)
            # Opened while the anchor waits on its init (so the pid still names that init): the init
            # dies by PR_SET_PDEATHSIG only some time after its anchor, so close() kills it directly
            # and waits on this until it has exited with every process of the host.
            self._init_fds.append(os.pidfd_open(pid))
            ip = f"198.18.0.{i + 1}"
            enter = os.path.join(self.state_dir, f"h{i}.enter")
            python = os.path.join(self.state_dir, f"h{i}.python")
            prefix = f"exec {_sh_quote(sys.executable)} -S -E {_sh_quote(_NSENTER)} {pid} {ino}"
            _write_script(enter, f'{prefix} "$@"\n')
            _write_script(python, f'{prefix} {_sh_quote(sys.executable)} "$@"\n')
            self._hosts.append(Host(i, ip, f"{self.name}-h{i}", python, enter, pid))
            self._write_state()
        for i, h in enumerate(self._hosts):
            batch.append(
                f"link add p{i} address {_mac(i, 1)} type veth peer name eth0 address {_mac(i, 0)} netns {h.anchor_pid}"
            )
            batch.append(f"link set p{i} master br0 up")
        self._switch(batch, "cabling the switch")
        for i, h in enumerate(self._hosts):
            cmds = ["link set lo up", f"addr add {h.ip}/{PREFIX} dev eth0", "link set eth0 up"]
            for j, other in enumerate(self._hosts):
                if j != i:
                    cmds.append(f"neigh replace {other.ip} lladdr {_mac(j, 0)} dev eth0 nud permanent")
            self._in(h.anchor_pid, ["ip", "-batch", "-"], f"configuring host {i}", "\n".join(cmds) + "\n")
        self._apply_all()

    # -- the wire and faults ----------------------------------------------------------------------

    def _apply_all(self) -> None:
        for i in range(self._n):
            self._apply_link(i)

    def _apply_link(self, i: int, wire_changed: bool = True) -> None:
        """Make host i's link what ``_wires[i]``, ``_down`` and ``_cut`` say (``wire_changed``
        False: only the partitions and the link state changed)."""
        wire = self._wires[i]
        h = self._hosts[i]
        port = f"p{i}"
        if wire_changed:
            self._in(h.anchor_pid, ["ip", "link", "set", "eth0", "mtu", str(wire.mtu)], f"mtu of host {i}")
            self._in(self._switch_pid, ["ip", "link", "set", port, "mtu", str(wire.mtu)], f"mtu of port {i}")
            # uplink rate: on the host's eth0
            self._in(h.anchor_pid, ["tc", "qdisc", "del", "dev", "eth0", "root"], "", check=False)
            if wire.rate_mbit is not None:
                self._in(h.anchor_pid, ["tc", "qdisc", "add", "dev", "eth0", "root", *_tbf(wire)], f"rate of host {i}")
            self._apply_relay(i, wire)
        # downlink: rate and the partitions, on the switch's port toward host i
        cut_from = sorted(j for pair in self._cut if i in pair for j in pair if j != i)
        self._in(self._switch_pid, ["tc", "qdisc", "del", "dev", port, "root"], "", check=False)
        if cut_from or self._kernel_rate(wire):
            rate = f"{wire.rate_mbit}mbit" if self._kernel_rate(wire) else "100gbit"
            burst = _burst_bytes(wire)
            tc = [
                f"qdisc add dev {port} root handle 1: htb default 10",
                f"class add dev {port} parent 1: classid 1:10 htb rate {rate} ceil {rate} burst {burst} cburst {burst}",
            ]
            if cut_from:
                tc += [
                    f"class add dev {port} parent 1: classid 1:20 htb rate 8kbit",
                    f"qdisc add dev {port} parent 1:20 handle 20: pfifo limit 0",
                ]
                for j in cut_from:
                    match = f"u32 match ip src {self._hosts[j].ip}/32"
                    tc.append(f"filter add dev {port} parent 1: protocol ip prio 1 {match} flowid 1:20")
            self._in(self._switch_pid, ["tc", "-batch", "-"], f"shaping port {i}", "\n".join(tc) + "\n")
        state = "down" if i in self._down else "up"
        self._in(self._switch_pid, ["ip", "link", "set", port, state], f"link {state} of host {i}")

    @staticmethod
    def _kernel_rate(wire: Wire) -> bool:
        """Whether the kernel caps this wire's rate toward the host (htb on the switch's port); a
        relayed link is paced there by the relay instead. From the host it is always tbf."""
        return wire.rate_mbit is not None and not wire.needs_relay

    def _apply_relay(self, i: int, wire: Wire) -> None:
        """Put port i behind the relay (delay, jitter, loss, reordering) or take it out."""
        port, tap = f"p{i}", f"t{i}"
        if wire.needs_relay:
            if self._relay is None:
                self._relay = _Relay(self._switch_pid)
                self._write_state()
            if i not in self._relayed:
                self._relay.command(f"add {i} {port} {tap}")
                self._switch(
                    [f"link set {tap} mtu {wire.mtu}", f"link set {tap} master br0 up", f"link set {port} nomaster"],
                    f"relaying port {i}",
                )
                self._relayed.add(i)
            else:
                self._switch([f"link set {tap} mtu {wire.mtu}"], f"mtu of relayed port {i}")
            self._relay.command(f"wire {i} {_relay_params(wire)}")
        elif i in self._relayed:
            assert self._relay is not None
            self._switch([f"link set {port} master br0"], f"unrelaying port {i}")
            self._relay.command(f"del {i}")
            self._relayed.discard(i)

    def relay_stats(self, i: int) -> dict[str, int] | None:
        """Frames the relay saw on host i's link, per direction (``up``: from the host; ``down``: to
        it): frames ``in`` and ``out``, segments ``lost`` (by the wire's loss; a GSO frame is several)
        and frames ``dropped`` (the queue full, the link down);
        None when the link is not relayed."""
        i = self._index(i)
        with self._lock:
            if self._relay is None or i not in self._relayed:
                return None
            words = self._relay.command(f"stats {i}").split()[1:]
        keys = [f"{d}_{k}" for d in ("up", "down") for k in ("in", "out", "lost", "dropped")]
        return dict(zip(keys, map(int, words)))

    def set_wire(self, wire: str | Wire, hosts: Sequence[int] | None = None) -> None:
        """Change the wire of the given hosts' links (all when None), while traffic runs."""
        w = _wire_of(wire)
        with self._lock:
            self._check_open()
            targets = range(self._n) if hosts is None else [self._index(i) for i in hosts]
            for i in targets:
                self._wires[i] = w
                self._apply_link(i)

    def wire(self, i: int) -> Wire:
        """The wire of host i's link now."""
        return self._wires[self._index(i)]

    def partition(self, a: int, b: int) -> None:
        """From now on no frame passes between host a and host b (both directions)."""
        a, b = self._index(a), self._index(b)
        if a == b:
            raise ValueError("a host cannot be partitioned from itself")
        with self._lock:
            self._check_open()
            self._cut.add(frozenset((a, b)))
            self._apply_link(a, wire_changed=False)
            self._apply_link(b, wire_changed=False)

    def isolate(self, i: int) -> None:
        """Cut host i from every other host (its link stays up)."""
        i = self._index(i)
        with self._lock:
            self._check_open()
            for j in range(self._n):
                if j != i:
                    self._cut.add(frozenset((i, j)))
            for j in range(self._n):
                self._apply_link(j, wire_changed=False)

    def heal(self) -> None:
        """Undo every partition, isolation and link_down."""
        with self._lock:
            self._check_open()
            touched = {j for pair in self._cut for j in pair} | self._down
            self._cut.clear()
            self._down.clear()
            for i in sorted(touched):
                self._apply_link(i, wire_changed=False)

    def link_down(self, i: int) -> None:
        """Take host i's link down at the switch (the host sees no carrier)."""
        i = self._index(i)
        with self._lock:
            self._check_open()
            self._down.add(i)
            self._in(self._switch_pid, ["ip", "link", "set", f"p{i}", "down"], f"link down of host {i}")

    def link_up(self, i: int) -> None:
        """Bring host i's link back up."""
        i = self._index(i)
        with self._lock:
            self._check_open()
            self._down.discard(i)
            self._in(self._switch_pid, ["ip", "link", "set", f"p{i}", "up"], f"link up of host {i}")

    @contextlib.contextmanager
    def flap(self, i: int, down_s: float, up_s: float) -> Iterator[None]:
        """Within the with-block, host i's link goes down for ``down_s`` s, up for ``up_s`` s, and
        again, starting down; it is left up when the block ends."""
        i = self._index(i)
        if down_s <= 0 or up_s <= 0:
            raise ValueError("down_s and up_s must be > 0")
        stop = threading.Event()

        def flapper() -> None:
            while not stop.is_set():
                self.link_down(i)
                if stop.wait(down_s):
                    break
                self.link_up(i)
                stop.wait(up_s)

        t = threading.Thread(target=flapper, daemon=True, name=f"{self.name}-flap{i}")
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            if not self._closed:
                self.link_up(i)

    # -- access and teardown ----------------------------------------------------------------------

    def _index(self, i: int) -> int:
        if not -self._n <= i < self._n:
            raise IndexError(f"host {i} out of range (n={self._n})")
        return i % self._n

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")

    def anchor_pids(self) -> list[int]:
        """The machine's pids of the processes holding this set's namespaces (the switch's anchor,
        each host's anchor, each host's init): when they are gone, so is everything of the set."""
        pids = [a.pid for a in self._anchors] + [h.anchor_pid for h in self._hosts]
        return sorted(set(pids))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Host:
        return self._hosts[self._index(i)]

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Tear everything down: every process of every host killed (the kernel kills a pid
        namespace with its init), the switch and every link gone, the state directory removed.
        Idempotent; returns when the anchors are reaped and every host's init has exited (at most
        30 s)."""
        if self._closed:
            return
        self._closed = True
        if self._relay is not None:
            self._relay.close()
        for fd in self._init_fds:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        for a in self._anchors:
            with contextlib.suppress(OSError):
                a.kill()
        deadline = time.monotonic() + 30
        for a in self._anchors:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.wait(max(0.0, deadline - time.monotonic()))
            for stream in (a.stdout, a.stderr):
                if stream is not None:
                    stream.close()
        for fd in self._init_fds:  # readable once that init has exited (its host's processes with it)
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            os.close(fd)
        self._init_fds.clear()
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"Hosts({self._n}, {self.name}, closed={self._closed})"


def _relay_params(wire: Wire) -> str:
    """The relay's per-link ``wire`` arguments: each of the two links a frame crosses between two
    hosts does half the delay and jitter and the share of loss and reordering that composes to the
    wire's own (1 - (1 - x) ** 0.5). The rate toward the host is the relay's (the switch port's
    buffer, drop-tail: where several senders meet); the rate from the host is the kernel's tbf on
    its interface (the host's own NIC: its TCP is held back by its queue, not by loss)."""
    half = lambda x: 1.0 - (1.0 - x) ** 0.5  # noqa: E731
    down_bps = int(wire.rate_mbit * 1e6) if wire.rate_mbit is not None else 0
    return (
        f"{wire.delay_us * 500} {wire.jitter_us * 500} {half(wire.loss):.12g} {wire.loss_burst:.6g} "
        f"{half(wire.reorder):.12g} {wire.buffer_bytes()} 0 {down_bps}"
    )


_WIRE_SOURCE = os.path.join(_HERE, "wire.c")
_WIRE_LOCK = threading.Lock()


def wire_binary() -> str:
    """The relay program, ``pdlink-wire`` (``wire.c``), built once with the system C compiler (``CC``,
    default ``cc``) into a cache folder named by the source's hash (``$XDG_CACHE_HOME/pdlink`` or
    ``~/.cache/pdlink``). HostsUnavailable when it cannot be."""
    import hashlib

    with open(_WIRE_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(cache, "pdlink", f"wire-{digest}")
    binary = os.path.join(folder, "pdlink-wire")
    with _WIRE_LOCK:
        if os.access(binary, os.X_OK):
            return binary
        cc = os.environ.get("CC", "cc")
        if shutil.which(cc) is None:
            raise HostsUnavailable(f"the emulated wire needs a C compiler ({cc}) to build pdlink-wire")
        os.makedirs(folder, exist_ok=True)
        tmp = f"{binary}.{os.getpid()}.{threading.get_ident()}"
        run = subprocess.run([cc, "-O2", "-o", tmp, _WIRE_SOURCE], capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise HostsUnavailable(f"building pdlink-wire failed: {run.stderr.strip()[-2000:]}")
        os.replace(tmp, binary)
    return binary


class _Relay:
    """The set's relay process (``pdlink-wire``) in the switch's namespace; it dies with the owner."""

    def __init__(self, switch_pid: int) -> None:
        self._popen = subprocess.Popen(
            ["nsenter", "-t", str(switch_pid), "-n", wire_binary(), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.pid = self._popen.pid
        self._lock = threading.Lock()

    def command(self, line: str) -> str:
        assert self._popen.stdin is not None and self._popen.stdout is not None
        with self._lock:
            try:
                self._popen.stdin.write(line + "\n")
                self._popen.stdin.flush()
                answer = self._popen.stdout.readline().strip()
            except OSError as e:
                raise RuntimeError(f"the wire relay is gone ({e}); it said nothing to: {line}") from e
        if not answer.startswith("ok"):
            raise RuntimeError(f"the wire relay refused {line!r}: {answer or 'it exited'}")
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(30)
        for stream in (self._popen.stdin, self._popen.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _tbf(wire: Wire) -> list[str]:
    burst = _burst_bytes(wire)
    return ["tbf", "rate", f"{wire.rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]


def _burst_bytes(wire: Wire) -> int:
    """A token bucket as deep as 1 ms at the rate, but at least two 64 KiB GSO frames."""
    rate = wire.rate_mbit or 100_000
    return max(int(rate * 1e6 / 8 / 1000), 2 * 65536 + 2 * wire.mtu)


def _mac(i: int, side: int) -> str:
    """Host i's eth0 (side 0) and the switch's port toward it (side 1)."""
    return f"02:70:64:{side:02x}:{(i >> 8) & 0xFF:02x}:{i & 0xFF:02x}"


def _sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _write_script(path: str, body: str) -> None:
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, 0o755)


if __name__ == "__main__":  # ``python -m pdlink.testing.hosts``: can hosts be made here?
    _why = unavailable_reason()
    print("hosts can be made here" if _why is None else f"hosts cannot be made here: {_why}")
    raise SystemExit(0 if _why is None else 1)

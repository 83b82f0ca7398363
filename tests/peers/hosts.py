"""Code that runs inside emulated hosts (``pdlink.testing.hosts``, tests/hosts/): what a host sees
of the network, of processes and of /tmp, plus small servers and clients for the wire tests."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

_HELD: dict[str, Any] = {}  # state a peer keeps between calls (a Hosts set made by an owner peer)


def identity() -> dict[str, Any]:
    """This process's pid (as its own pid namespace sees it) and its namespaces' ids."""
    return {
        "pid": os.getpid(),
        "pid_ns": os.readlink("/proc/self/ns/pid"),
        "net_ns": os.readlink("/proc/self/ns/net"),
        "mnt_ns": os.readlink("/proc/self/ns/mnt"),
    }


def processes_with(token: str) -> list[int]:
    """The pids (as this host sees them) of processes whose command line holds ``token``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def connect_error(ip: str, port: int, timeout: float = 5.0) -> str | None:
    """None when a TCP connection to ip:port is accepted; else the error's name."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return None
    except OSError as e:
        return type(e).__name__ if not isinstance(e, socket.timeout) else "timeout"


def listen_once(ip: str, port: int, seconds: float) -> str:
    """Accept one TCP connection on ip:port within ``seconds`` and answer b'hi'; 'accepted' or 'none'."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port))
        s.listen(1)
        s.settimeout(seconds)
        try:
            conn, _ = s.accept()
        except TimeoutError:
            return "none"
        with conn:
            conn.sendall(b"hi")
        return "accepted"


def exchange(ip: str, port: int, timeout: float = 10.0) -> bytes:
    """Connect to ip:port and return what the server says."""
    with socket.create_connection((ip, port), timeout=timeout) as s:
        return s.recv(16)


def write_tmp(name: str, data: str) -> list[str]:
    """Write /tmp/NAME, return the listing of /tmp."""
    with open(os.path.join("/tmp", name), "w") as f:
        f.write(data)
    return sorted(os.listdir("/tmp"))


def read_file(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def fail(message: str) -> None:
    raise ValueError(message)


def add(a: int, b: int = 0) -> int:
    return a + b


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def udp_echo(ip: str, port: int, seconds: float) -> int:
    """Echo UDP datagrams on ip:port for ``seconds``; returns how many."""
    n = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((ip, port))
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                data, peer = s.recvfrom(65536)
            except TimeoutError:
                break
            s.sendto(data, peer)
            n += 1
    return n


def udp_probe(
    ip: str, port: int, count: int, size: int = 64, wait_s: float = 1.0, gap_s: float = 0.0
) -> dict[str, Any]:
    """Send ``count`` numbered datagrams to an echo at ip:port one at a time (each waits up to
    ``wait_s`` for its echo). Returns the round trips in microseconds of those answered and how many
    were lost."""
    rtts: list[float] = []
    lost = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, port))
        pad = b"\0" * max(0, size - 12)
        for seq in range(count):
            sent = time.perf_counter()
            s.send(struct.pack("!Id", seq, sent) + pad)
            deadline = sent + wait_s
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    lost += 1
                    break
                s.settimeout(left)
                try:
                    data = s.recv(65536)
                except (TimeoutError, ConnectionRefusedError):
                    continue
                got, _ = struct.unpack("!Id", data[:12])
                if got == seq:
                    rtts.append((time.perf_counter() - sent) * 1e6)
                    break
            if gap_s:
                time.sleep(gap_s)
    return {"rtts_us": rtts, "lost": lost}


def make_hosts(n: int, profile: str) -> dict[str, Any]:
    """Make a Hosts set held by this process (an owner to be killed); its state dir and anchors."""
    from pdlink.testing.hosts import Hosts

    hosts = Hosts(n, profile)
    _HELD["hosts"] = hosts
    return {"name": hosts.name, "state_dir": hosts.state_dir, "anchors": hosts.anchor_pids()}


def unavailable_reason() -> str | None:
    from pdlink.testing.hosts import unavailable_reason as reason

    return reason()

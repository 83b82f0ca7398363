"""Code that runs inside emulated hosts (``pdlink.testing.hosts``, tests/hosts/): what a host sees
of the network, of processes and of /tmp, plus small servers and clients for the wire tests."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from pdlink.testing.probes import udp_echo, udp_probe, udp_receive, udp_send  # noqa: F401 (peers)

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


def make_hosts(n: int, profile: str) -> dict[str, Any]:
    """Make a Hosts set held by this process (an owner to be killed); its state dir and anchors."""
    from pdlink.testing.hosts import Hosts

    hosts = Hosts(n, profile)
    _HELD["hosts"] = hosts
    return {"name": hosts.name, "state_dir": hosts.state_dir, "anchors": hosts.anchor_pids()}


def unavailable_reason() -> str | None:
    from pdlink.testing.hosts import unavailable_reason as reason

    return reason()


def report_identity(queue: Any) -> None:
    """A multiprocessing target: put this process's identity on ``queue``."""
    queue.put(identity())

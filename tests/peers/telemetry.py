"""Peer functions for the telemetry tests (tests/native/test_telemetry.py): transfers timed where
they run, failures caught with their code, the engine's typed snapshot, and the process's metrics
endpoint (pdlink.Metrics)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pdlink
from peers import native


def _timed(move: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    move()
    return time.perf_counter() - t0


def post(tag: str, local: list[int], remote_blocks: list[int], op: str) -> float:
    """``native.post``; the seconds it took, measured around the call."""
    return _timed(lambda: native.post(tag, local, remote_blocks, op))


def descriptors(peer: int, name: str, local: list[tuple[int, ...]], remote: list[tuple[int, ...]], op: str) -> float:
    """``native.descriptors``; the seconds it took."""
    return _timed(lambda: native.descriptors(peer, name, local, remote, op))


def failing(call: str, *args: Any) -> str:
    """Runs ``native.<call>(*args)``, which must fail: the LLMStatusCode name it raised."""
    try:
        getattr(native, call)(*args)
    except pdlink.LLMException as e:
        return pdlink.LLMStatusCode(e.status_code).name
    raise AssertionError(f"native.{call}{args} did not fail")


def read_peer(peer: int, tag: str, name: str, remote_region: pdlink.RemoteRegion, blocks: int) -> None:
    """Prepares ``tag`` from region ``name`` to the peer's region and reads its first ``blocks``
    blocks into the same blocks here."""
    native.prepare(tag, peer, name, remote_region)
    native.post(tag, list(range(blocks)), list(range(blocks)), "read")


def stats() -> Any:
    """The engine's typed snapshot (``pdlink.EngineStats``; it pickles)."""
    return native._engine().stats()


def metrics_port() -> int:
    """The port of this process's metrics endpoint (started by PDLINK_METRICS)."""
    running = pdlink.Metrics.running()
    assert running is not None, "no metrics endpoint runs in this process"
    return running.port


def threads_and_descriptors() -> tuple[int, int]:
    """This process's threads and open descriptors."""
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def served_connections(port: int) -> int:
    """How many established TCP connections this process holds on its local ``port`` (the ones the
    metrics endpoint has accepted and not yet closed), from /proc: the sockets among this process's
    descriptors that /proc/net/tcp lists as ESTABLISHED with that local port."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01" and fields[9] in mine:
                count += 1
    return count

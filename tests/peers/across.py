"""Peer-side functions for tests across emulated hosts (tests/paths/test_wire_faults.py): large
transfers judged in the peer that owns the memory, and what this host's network saw.

A 256 MiB region is never shipped to the test: ``digests`` reads it whole here (a snapshot,
tests/verify.py, guards included) and answers one digest per row and whether every guard byte
holds the guard pattern. ``start_read`` / ``finish_read`` time one read on a thread of this peer.
Regions and the engine are tests/peers/native.py's (same process).
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from typing import Any

import numpy as np

import pdlink
from peers import native
from peers.memory import direct_write
from verify import GUARD_BYTES, guard_pattern

_read: dict[str, Any] = {}


def digests(name: str) -> tuple[list[str], bool]:
    """One digest per row of region ``name`` (one tensor), and whether both its guards are intact."""
    snap = native.snapshot(name)
    region, start = snap.tensors[0]
    mem = snap.regions[region]
    tensor = mem[start:start + snap.tensor_bytes]
    n = snap.row_bytes
    rows = [hashlib.blake2b(tensor[i * n:(i + 1) * n].tobytes(), digest_size=16).hexdigest() for i in range(snap.rows)]
    end = start + snap.tensor_bytes
    guards = np.concatenate([mem[start - GUARD_BYTES:start], mem[end:end + GUARD_BYTES]])
    return rows, bool(np.array_equal(guards, np.tile(guard_pattern(), 2)))


def fill(name: str, nbytes: int, seed: int) -> None:
    """Fills the first ``nbytes`` of region ``name`` (host memory) with random bytes from ``seed``
    (verify.pattern is too slow for hundreds of MiB)."""
    direct_write(native.addresses(name)[0], np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8), False)


def start_read(peer: int, name: str, offset: int, remote_address: int, length: int) -> None:
    """``Engine.read`` of ``length`` bytes from ``remote_address`` on ``peer`` into region ``name``
    at ``offset``, on a thread of its own; ``finish_read`` waits for it."""

    def run() -> None:
        t0 = time.monotonic()
        try:
            native.descriptors(peer, name, [(offset, length)], [(remote_address, length)], "read")
            _read["code"] = int(pdlink.LLMStatusCode.LLM_SUCCESS)
        except pdlink.LLMException as e:
            _read["code"] = int(e.status_code)
        _read["seconds"] = time.monotonic() - t0

    _read.clear()
    thread = threading.Thread(target=run)
    thread.start()
    _read["thread"] = thread


def finish_read(within_s: float) -> tuple[int, float]:
    """The ``start_read`` read's status code and how long it took (it must end within ``within_s``)."""
    thread = _read["thread"]
    thread.join(within_s)
    assert not thread.is_alive(), f"the read did not end within {within_s} s"
    return int(_read["code"]), float(_read["seconds"])


def received_bytes() -> int:
    """Bytes received on this host's interfaces other than lo (/proc/net/dev: this network
    namespace's counters)."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, counters = line.split(":", 1)
            if name.strip() != "lo":
                total += int(counters.split()[0])
    return total


def reachable(ip: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to ``ip:port`` is accepted within ``timeout_s``."""
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return True
    except OSError:
        return False

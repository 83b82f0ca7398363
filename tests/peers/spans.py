"""Peer-side functions for the raw-span tests (tests/hostile/test_raw_spans.py): a victim that
registers one guarded buffer as many adjacent regions (pdlink's own API, on the engine of
tests/peers/native.py), its peak memory, registrations timed from a thread, and an attacker loop
that keeps one frame going on a raw link (tests/peers/hostile.py) and records every answer.
"""

from __future__ import annotations

import hashlib
import re
import socket
import struct
import threading
from typing import Any

import numpy as np

import rawwire
from peers import hostile, native
from peers.memory import GuardedTensors
from verify import Snapshot

_state: dict[str, Any] = {"memory": None, "regions": [], "registers": [], "extra": []}


def register_slices(count: int, slice_bytes: int, seed: int) -> int:
    """One guarded buffer of ``count`` x ``slice_bytes`` bytes (``verify.pattern(.., seed)``),
    registered as ``count`` regions that follow each other exactly; returns its address."""
    memory = GuardedTensors(1, count * slice_bytes, count, seed, False)
    base = memory.addrs[0]
    engine = native._engine()
    _state["memory"] = memory
    _state["regions"] = [engine.register(address=base + i * slice_bytes, length=slice_bytes, placement="HOST",
                                         block_size=slice_bytes) for i in range(count)]
    return base


def snapshot() -> Snapshot:
    """The sliced buffer with its guard bytes (canaries) on either side."""
    return _state["memory"].snapshot("slices")


def digest(offset: int, length: int, times: int) -> str:
    """sha256 of the buffer's bytes [offset, +length), ``times`` over: what a read of that range
    repeated ``times`` times must answer."""
    data = bytes(_state["memory"].snapshot("slices").tensor(0)[offset:offset + length])
    h = hashlib.sha256()
    for _ in range(times):
        h.update(data)
    return h.hexdigest()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))  # type: ignore[union-attr]


def reset_peak() -> int:
    """Resets this process's peak resident memory (VmHWM) to what it holds now; returns that (KiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def peak_kib() -> int:
    """The peak resident memory since the last reset_peak (VmHWM, KiB)."""
    return _status_kib("VmHWM")


def start_register(nbytes: int) -> int:
    """Registers a fresh buffer of ``nbytes`` from a thread (what serving code does while peers
    request); returns its number for ``registered``."""
    done = threading.Event()
    n = len(_state["registers"])
    _state["registers"].append(done)

    def run() -> None:
        buf = np.zeros(nbytes, np.uint8)
        region = native._engine().register(buf, block_size=nbytes)
        _state["extra"].append((buf, region))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return n


def registered(n: int) -> bool:
    return bool(_state["registers"][n].is_set())


def deregister_extra() -> int:
    """Deregisters what start_register added; how many."""
    engine = native._engine()
    for _buf, region in _state["extra"]:
        engine.deregister(region)
    count = len(_state["extra"])
    _state["extra"].clear()
    return count


# ---------------------------------------------------------------- attacker side

_attack: dict[str, Any] = {"running": threading.Event(), "answers": [], "thread": None}


def raw_read(runs: list[tuple[int, int]] | tuple[tuple[int, int], int]) -> bytes:
    """A read of registered memory by address (a kRaw target, one tensor): ``runs`` as a list, or
    (run, count) for one run repeated."""
    if isinstance(runs, tuple):
        (offset, length), count = runs
        packed = struct.pack("<QQ", offset, length) * count
        n = count
    else:
        packed = b"".join(struct.pack("<QQ", o, n) for o, n in runs)
        n = len(runs)
    body = rawwire.body_header(kind=rawwire.KIND_RAW) + struct.pack("<II", 1, 0) + struct.pack("<I", n) + packed
    return rawwire.request(rawwire.OP_READ, body)


def _exchange_digest(frame: bytes) -> tuple[int, str, int, str] | str:
    """Sends one request; (status, message, payload bytes, sha256 of the payload), or "closed". The
    payload is read into one buffer as it arrives (it may be tens of MiB)."""
    client = hostile._client
    assert client is not None
    s: socket.socket = client.fwd
    try:
        s.sendall(frame)
        status, mlen, plen, _tag = rawwire.response_header(rawwire.recv_exact(s, rawwire.RESPONSE_HEADER_BYTES))
        message = rawwire.recv_exact(s, mlen).decode()
        h = hashlib.sha256()
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        left = plen
        while left:
            got = s.recv_into(view, min(left, len(buf)))
            if not got:
                raise ConnectionError("closed mid-payload")
            h.update(view[:got])
            left -= got
        return status, message, plen, h.hexdigest()
    except (ConnectionError, OSError):
        return "closed"


def exchange(frame: bytes) -> tuple[int, str, int, str] | str:
    return _exchange_digest(frame)


def start_attack(frame: bytes) -> None:
    """Sends ``frame`` on the raw link again and again from a thread, reading each answer, until
    stop_attack."""
    _attack["running"].set()
    _attack["answers"] = []

    def run() -> None:
        while _attack["running"].is_set():
            answer = _exchange_digest(frame)
            _attack["answers"].append(answer)
            if answer == "closed":
                return

    _attack["thread"] = threading.Thread(target=run, daemon=True)
    _attack["thread"].start()


def attacks_answered() -> int:
    return len(_attack["answers"])


def stop_attack() -> list[tuple[int, str, int, str] | str]:
    """Stops the loop (after the frame in flight) and returns every answer."""
    _attack["running"].clear()
    if _attack["thread"] is not None:
        _attack["thread"].join(60)
    return list(_attack["answers"])

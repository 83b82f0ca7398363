"""Peer-side functions for tests/hostile/test_raw_rule.py: a victim that registers one guarded
buffer as overlapping regions (pdlink's own API, on the engine of tests/peers/native.py), in an
order the test chooses, so that the raw-range rule (csrc/core/spans.h) meets overlaps, equal
starts and shadowed ranges.
"""

from __future__ import annotations

from typing import Any

from peers import native
from peers.memory import GuardedTensors
from verify import Snapshot

_state: dict[str, Any] = {"memory": None, "regions": []}


def register_layout(total: int, layout: list[tuple[int, int]], seed: int) -> int:
    """One guarded buffer of ``total`` bytes (``verify.pattern(.., seed)``), registered as one region
    per ``(offset, length)`` of ``layout``, in that order; returns the buffer's address."""
    memory = GuardedTensors(1, total, 1, seed, False)
    base = memory.addrs[0]
    engine = native._engine()
    _state["memory"] = memory
    _state["regions"] = [engine.register(address=base + off, length=n, placement="HOST", block_size=n)
                         for off, n in layout]
    return base


def snapshot() -> Snapshot:
    """The buffer with its guard bytes (canaries) on either side."""
    return _state["memory"].snapshot("layout")


def local_covers(ranges: list[tuple[int, int]]) -> bool:
    """``Engine.local_memory().covers`` of the absolute ranges."""
    m = native._engine().local_memory()
    return m.covers([a for a, _ in ranges], [n for _, n in ranges])


def local_table() -> list[tuple[int, int]]:
    return [(int(a), int(n)) for a, n in native._engine().local_memory().ranges]


def remote_covers(peer: int, ranges: list[tuple[int, int]]) -> bool:
    """``Engine.remote_memory(peer).covers`` of the absolute ranges."""
    m = native._engine().remote_memory(peer)
    return m.covers([a for a, _ in ranges], [n for _, n in ranges])


def digest(offset: int, length: int) -> str:
    """sha256 of the buffer's bytes [offset, +length): what a read of that one range must answer."""
    import hashlib

    return hashlib.sha256(bytes(snapshot().tensor(0)[offset:offset + length])).hexdigest()

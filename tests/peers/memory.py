"""Peer-side test memory: guarded buffers for registered caches, and reads that bypass pdlink.

``direct_read``/``direct_write`` touch memory without pdlink's backend: host memory through a
pointer; on the Ascend backend, DEVICE memory through the fake ACL's test-only ``fake_acl_peek`` /
``fake_acl_poke`` (tests/fake_ascend/fake_control.h), which copy from the fake's own view of device
memory. Test data is written and checked this way, so a symmetric offset bug in pdlink's copies
cannot cancel out.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from internals import DeviceMemory
from peers import fake_ascend
from verify import GUARD_BYTES, Snapshot, guard_pattern, pattern


def device_memory_is_remote() -> bool:
    """DEVICE caches are device memory the host cannot touch (the Ascend backend); on the CPU
    backend they are host memory."""
    return os.environ.get("PDLINK_BACKEND") == "ascend"


def direct_read(addr: int, nbytes: int, device: bool) -> np.ndarray:
    """A copy of [addr, +nbytes); ``device``: DEVICE memory of a device backend."""
    out = np.empty(nbytes, dtype=np.uint8)
    if nbytes == 0:
        return out
    if device:
        read = fake_ascend.peek(addr, out.ctypes.data, nbytes)
        assert read, f"fake_acl_peek({addr:#x}, {nbytes}): not inside one live device allocation"
    else:
        ctypes.memmove(out.ctypes.data, addr, nbytes)
    return out


def direct_write(addr: int, data: np.ndarray, device: bool) -> None:
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.size == 0:
        return
    if device:
        written = fake_ascend.poke(addr, data.ctypes.data, data.size)
        assert written, f"fake_acl_poke({addr:#x}, {data.size}): not inside one live device allocation"
    else:
        ctypes.memmove(addr, data.ctypes.data, data.size)


class GuardedTensors:
    """``count`` tensors of ``tensor_bytes`` each, every one with ``GUARD_BYTES`` of guard pattern
    before and after it, in device memory (``device``) or host memory. Filled with
    ``verify.pattern(.., seed)``, or zeros when ``seed`` is None. ``addrs`` are what a cache
    registers; the memory lives as long as this object."""

    def __init__(self, count: int, tensor_bytes: int, rows: int, seed: int | None, device: bool):
        self.tensor_bytes, self.rows, self.device = tensor_bytes, rows, device
        self._keep: list[Any] = []
        self.bases: list[int] = []
        span = GUARD_BYTES + tensor_bytes + GUARD_BYTES
        for _ in range(count):
            if device:
                mem = DeviceMemory(span)
                self._keep.append(mem)
                base = mem.addr
            else:
                buf = np.empty(span + 63, dtype=np.uint8)  # 64-byte aligned tensors, like allocators give
                self._keep.append(buf)
                base = (buf.ctypes.data + 63) // 64 * 64
            direct_write(base, guard_pattern(), device)
            direct_write(base + GUARD_BYTES + tensor_bytes, guard_pattern(), device)
            self.bases.append(base)
        fill_tensors(self.addrs, tensor_bytes, seed, device)

    @property
    def addrs(self) -> list[int]:
        return [b + GUARD_BYTES for b in self.bases]

    def snapshot(self, label: str) -> Snapshot:
        span = GUARD_BYTES + self.tensor_bytes + GUARD_BYTES
        return Snapshot(label, "guarded", [direct_read(b, span, self.device) for b in self.bases],
                        [(i, GUARD_BYTES) for i in range(len(self.bases))], self.tensor_bytes, self.rows)


def pool_snapshot(label: str, base: int, capacity: int, tensor_addrs: list[int], tensor_bytes: int, rows: int,
                  device: bool) -> Snapshot:
    """The whole pool holding a pool-allocated cache, and where the cache's tensors lie in it."""
    region = direct_read(base, capacity, device)
    offsets = [a - base for a in tensor_addrs]
    assert all(0 <= o and o + tensor_bytes <= capacity for o in offsets), "a tensor outside its pool"
    return Snapshot(label, "pool", [region], [(0, o) for o in offsets], tensor_bytes, rows)


def fill_tensors(tensor_addrs: list[int], tensor_bytes: int, seed: int | None, device: bool) -> None:
    """``verify.pattern(.., seed)`` (zeros for None) into each tensor."""
    for i, a in enumerate(tensor_addrs):
        direct_write(a, pattern(tensor_bytes, i, seed) if seed is not None else np.zeros(tensor_bytes, np.uint8),
                     device)

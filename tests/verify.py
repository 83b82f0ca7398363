"""Whole-memory checks for every transfer test.

A ``Snapshot`` is a copy of every byte a cache may touch, read in the peer that owns it
(``tests/peers/kv.py`` ``snapshot``): for a registered cache, each tensor with the guard bytes
before and after it; for a pool-allocated cache, the whole pool (everything around its tensors is
then the guard). On the Ascend backend the bytes are read straight from the fake library's memory,
never through pdlink's own copies, so an offset bug cannot cancel out between writing test data and
checking it.

A transfer test takes snapshots before, derives what the destination must hold afterwards (its old
bytes with the moved ranges replaced by the source's), and compares whole snapshots::

    src0, dst0 = pair.prefill.call(kv.snapshot, "kv"), pair.decode.call(kv.snapshot, "kv")
    pair.decode.call(kv.pull_blocks, KEY, "kv", [0, 1], [3, 4])
    assert_same(pair.decode.call(kv.snapshot, "kv"), dst0.with_rows(src0, [(0, 3), (1, 4)]), "destination")
    assert_same(pair.prefill.call(kv.snapshot, "kv"), src0, "source")

``check_transfer`` does exactly that around one action. A mismatch names the tensor, row and byte
(or the guard, or the pool byte outside every tensor) where it starts, and how many bytes differ.

This module is imported by tests and by peer modules alike: numpy only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence

import numpy as np

GUARD_BYTES = 64  # before and after every registered tensor
_GUARD_PATTERN = np.frombuffer(b"\xa5\x5a\xc3\x3c" * (GUARD_BYTES // 4), dtype=np.uint8)


def guard_pattern() -> np.ndarray:
    """What the guard bytes hold (never zero, never a data pattern)."""
    return _GUARD_PATTERN.copy()


# pattern()'s bytes repeat every PATTERN_PERIOD bytes: adding 256 * 251 to an offset adds a multiple
# of 251 to both i * 31 and (i >> 8) * 7 (the latter exactly 251 * 7), so the value mod 251 is the same.
PATTERN_PERIOD = 256 * 251


def pattern_formula(nbytes: int, tensor: int, seed: int) -> np.ndarray:
    """``pattern``'s definition, byte by byte (int64 arithmetic: slow for large ``nbytes``)."""
    i = np.arange(nbytes, dtype=np.int64)
    return ((i * 31 + (i >> 8) * 7 + tensor * 53 + seed * 101) % 251 + 1).astype(np.uint8)


@functools.lru_cache(maxsize=64)
def _pattern_period(tensor: int, seed: int) -> np.ndarray:
    period = pattern_formula(PATTERN_PERIOD, tensor, seed)
    period.flags.writeable = False
    return period


def pattern(nbytes: int, tensor: int, seed: int) -> np.ndarray:
    """Deterministic test data for tensor ``tensor`` of a cache filled with ``seed``: byte ``i`` is
    ``(i * 31 + (i >> 8) * 7 + tensor * 53 + seed * 101) % 251 + 1`` (``pattern_formula``), so it
    depends on its offset, the tensor and the seed and a shifted or swapped range shows (a shift
    by a multiple of ``PATTERN_PERIOD`` bytes excepted). Built by repeating one period, which
    equals the formula (tests/test_plumbing.py) at a fraction of its cost for large buffers; a new
    array each call."""
    period = _pattern_period(tensor, seed)
    if nbytes <= PATTERN_PERIOD:
        return period[:nbytes].copy()
    return np.resize(period, nbytes)


@dataclasses.dataclass(frozen=True)
class Copy:
    """``nbytes`` from source tensor ``src_tensor`` at ``src_offset`` to destination tensor
    ``dst_tensor`` at ``dst_offset`` (offsets within the tensors)."""

    src_tensor: int
    src_offset: int
    dst_tensor: int
    dst_offset: int
    nbytes: int


@dataclasses.dataclass
class Snapshot:
    """Every byte of the memory around one cache, and where its tensors lie in it.

    ``regions``: the bytes read (uint8 arrays); ``tensors[i]`` = (region index, offset) of tensor
    i's first byte; every tensor has ``tensor_bytes`` bytes made of ``rows`` rows (blocks of a
    blocks cache, batch slots of a plain cache): ``row_bytes`` each. ``kind`` says what surrounds
    the tensors: "guarded" (registered memory, ``GUARD_BYTES`` each side) or "pool"."""

    label: str
    kind: str
    regions: list[np.ndarray]
    tensors: list[tuple[int, int]]
    tensor_bytes: int
    rows: int

    @property
    def row_bytes(self) -> int:
        return self.tensor_bytes // self.rows

    def tensor(self, i: int) -> np.ndarray:
        """Tensor ``i``'s bytes (a view into the snapshot)."""
        region, offset = self.tensors[i]
        return self.regions[region][offset:offset + self.tensor_bytes]

    def copy(self) -> Snapshot:
        return dataclasses.replace(self, regions=[r.copy() for r in self.regions], tensors=list(self.tensors))

    # ------------------------------------------------------------------ expectations

    def with_bytes(self, src: Snapshot, copies: Iterable[Copy]) -> Snapshot:
        """A copy of this snapshot with the given ranges of ``src`` copied in."""
        out = self.copy()
        for c in copies:
            assert 0 <= c.src_offset and c.src_offset + c.nbytes <= src.tensor_bytes, c
            assert 0 <= c.dst_offset and c.dst_offset + c.nbytes <= self.tensor_bytes, c
            out.tensor(c.dst_tensor)[c.dst_offset:c.dst_offset + c.nbytes] = \
                src.tensor(c.src_tensor)[c.src_offset:c.src_offset + c.nbytes]
        return out

    def with_rows(self, src: Snapshot, rows: Iterable[tuple[int, int]],
                  tensors: Iterable[tuple[int, int]] | None = None, nbytes: int | None = None) -> Snapshot:
        """A copy with ``src`` rows moved in: for each (src_row, dst_row) and each (src_tensor,
        dst_tensor) of ``tensors`` (default: tensor i to tensor i, all of them), the first
        ``nbytes`` (default: a whole row) of the row."""
        assert src.row_bytes == self.row_bytes or nbytes is not None, (src.row_bytes, self.row_bytes)
        n = self.row_bytes if nbytes is None else nbytes
        pairs = list(tensors) if tensors is not None else [(i, i) for i in range(len(self.tensors))]
        return self.with_bytes(src, [Copy(st, sr * src.row_bytes, dt, dr * self.row_bytes, n)
                                     for sr, dr in rows for st, dt in pairs])

    def with_tensor_bytes(self, tensor: int, offset: int, data: np.ndarray) -> Snapshot:
        """A copy with ``data`` written into tensor ``tensor`` at ``offset``."""
        out = self.copy()
        out.tensor(tensor)[offset:offset + len(data)] = data
        return out

    # ------------------------------------------------------------------ describing a place

    def where(self, region: int, offset: int) -> str:
        """Names byte ``offset`` of region ``region``: a tensor's row and byte, a guard, or a pool
        byte outside every tensor."""
        for i, (r, start) in enumerate(self.tensors):
            if r != region:
                continue
            if start <= offset < start + self.tensor_bytes:
                o = offset - start
                return f"tensor {i}, row {o // self.row_bytes}, byte {o % self.row_bytes} (tensor byte {o})"
            if self.kind == "guarded" and start - GUARD_BYTES <= offset < start:
                return f"the guard before tensor {i} (byte {offset - start + GUARD_BYTES})"
            if self.kind == "guarded" and start + self.tensor_bytes <= offset < start + self.tensor_bytes + GUARD_BYTES:
                return f"the guard after tensor {i} (byte {offset - start - self.tensor_bytes})"
        return f"region {region} byte {offset:#x}, outside every tensor of this cache"


def differences(actual: Snapshot, expected: Snapshot) -> list[str]:
    """One line per region that differs: where the first difference is and how many bytes differ."""
    assert len(actual.regions) == len(expected.regions), (len(actual.regions), len(expected.regions))
    assert actual.tensors == expected.tensors, "snapshots of different layouts"
    out = []
    for r, (a, e) in enumerate(zip(actual.regions, expected.regions)):
        assert a.shape == e.shape, (r, a.shape, e.shape)
        bad = np.flatnonzero(a != e)
        if bad.size:
            first = int(bad[0])
            out.append(f"{bad.size} byte(s) differ, first at {expected.where(r, first)}: "
                       f"{int(a[first]):#04x} where {int(e[first]):#04x} was expected")
    return out


def assert_same(actual: Snapshot, expected: Snapshot, what: str) -> None:
    """Every byte of ``actual`` equals ``expected`` (tensors, guards, the rest of the pool)."""
    diff = differences(actual, expected)
    assert not diff, f"{what} ({expected.label}): " + "; ".join(diff)


def assert_guards_intact(snapshot: Snapshot) -> None:
    """The guard bytes of a registered cache hold the guard pattern."""
    assert snapshot.kind == "guarded", snapshot.kind
    g = guard_pattern()
    for i, (r, start) in enumerate(snapshot.tensors):
        region = snapshot.regions[r]
        before, after = region[start - GUARD_BYTES:start], region[start + snapshot.tensor_bytes:][:GUARD_BYTES]
        assert np.array_equal(before, g) and np.array_equal(after, g), f"{snapshot.label}: guard of tensor {i} changed"


def check_transfer(read_src: Callable[[], Snapshot], read_dst: Callable[[], Snapshot], action: Callable[[], object],
                   expect: Callable[[Snapshot, Snapshot], Snapshot]) -> object:
    """Snapshot both sides, run ``action``, snapshot again; the destination must equal
    ``expect(dst_before, src_before)`` and the source must be unchanged. Returns what ``action``
    returned. An ``action`` that raises must have moved nothing (``expect`` is then ``nothing``,
    whatever was given): both sides are checked before its exception goes on."""
    src0, dst0 = read_src(), read_dst()
    try:
        result = action()
    except Exception:
        assert_same(read_dst(), dst0, "the destination of a transfer that raised")
        assert_same(read_src(), src0, "the source of a transfer that raised")
        raise
    assert_same(read_dst(), expect(dst0, src0), "destination")
    assert_same(read_src(), src0, "source")
    return result


def rows(pairs: Sequence[tuple[int, int]], tensors: Sequence[tuple[int, int]] | None = None,
         nbytes: int | None = None) -> Callable[[Snapshot, Snapshot], Snapshot]:
    """The usual ``expect`` for ``check_transfer``: rows moved from source to destination."""
    return lambda dst0, src0: dst0.with_rows(src0, pairs, tensors, nbytes)


def nothing(dst0: Snapshot, src0: Snapshot) -> Snapshot:
    """``expect`` for a transfer that must not change the destination (a refused or failed one)."""
    return dst0

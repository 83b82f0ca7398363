"""Memory pools, cache ids and local copies (llm_datadist_api.md §8.2, §8.6, §10.1), byte for byte.

Each test runs its own engine in a peer process (one LLMDataDist per process, peers/kv.py; the
local operations in peers/local_ops.py), on the CPU backend and on the Ascend backend over the fake
libraries (``backend`` fixture): there DEVICE memory (pools, registered tensors) is NPU memory and
every copy is an aclrtMemcpy of the right kind. Every copy and swap is checked on the whole
destination (the moved bytes equal the source, every other byte, the guards and the rest of the
pool unchanged) and the source unchanged; every refused one changes nothing (verify.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from backend_env import peer_env
from conftest import reader
from llm_datadist import BlocksCacheKey, CacheKey, DataType, Placement
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import kv, local_ops
from verify import Copy, Snapshot, assert_same, check_transfer, pattern, rows

S = LLMStatusCode
MiB = 1 << 20
I8 = DataType.DT_INT8
HOST, DEVICE = Placement.HOST, Placement.DEVICE


@contextmanager
def llm_error(code: LLMStatusCode, op: str | None = None) -> Iterator[pytest.ExceptionInfo[LLMException]]:
    with pytest.raises(LLMException) as info:
        yield info
    assert info.value.status_code == code, f"{info.value.status_code}: {info.value}"
    if op is not None:
        assert str(info.value).startswith(f"{op} failed, error code is {code}"), str(info.value)


def engine(peers: Callable[..., Peer], backend: str, name: str = "local", pool: int | None = None,
           host_pool: int | None = None) -> Peer:
    """A peer with a PROMPT engine (cluster 1, not listening) and the given pools."""
    p: Peer = peers(name, env=peer_env(backend))
    p.call(kv.start, "prompt", 1, pool=pool, host_pool=host_pool)
    return p


def copied(p: Peer, src: str, dst: str, action: Callable[[], object],
           expect: Callable[[Snapshot, Snapshot], Snapshot]) -> None:
    """``action`` copies from cache ``src`` to cache ``dst`` of peer ``p``: the whole destination is
    what ``expect`` says, the source unchanged (verify.check_transfer)."""
    check_transfer(reader(p, src), reader(p, dst), action, expect)


def within(p: Peer, name: str, action: Callable[[], object], moves: Sequence[tuple[int, int]]) -> None:
    """``action`` copies rows (src_row, dst_row) inside cache ``name`` (one cache is source and
    destination): every other byte, the guards and the rest of its pool unchanged."""
    before = p.call(kv.snapshot, name)
    action()
    assert_same(p.call(kv.snapshot, name), before.with_rows(before, moves), name)


@contextmanager
def unchanged(p: Peer, names: Sequence[str]) -> Iterator[None]:
    """Every byte of these caches (tensors, guards, pools) is the same after the block."""
    before = p.call(local_ops.snapshots, names)
    yield
    for name, b, a in zip(names, before, p.call(local_ops.snapshots, names)):
        assert_same(a, b, f"{name} after a refused call")


def refused(p: Peer, names: Sequence[str], expected: LLMStatusCode | type[Exception], fn: Callable[..., object],
            *args: object, **kwargs: object) -> None:
    """``fn(*args, **kwargs)`` in ``p`` raises ``expected`` (an LLMException of that status code, or
    an exception of that class) and changes no byte of the caches ``names``."""
    with unchanged(p, names):
        if isinstance(expected, LLMStatusCode):
            with llm_error(expected):
                p.call(fn, *args, **kwargs)
        else:
            with pytest.raises(expected):
                p.call(fn, *args, **kwargs)


# ---------------------------------------------------------------------------- pools


def test_allocation_needs_a_pool_of_its_placement(peers: Callable[..., Peer], backend: str) -> None:
    p = engine(peers, backend, "nopool")
    for placement, blocks in [(DEVICE, False), (DEVICE, True), (HOST, False)]:
        with llm_error(S.LLM_PARAM_INVALID):
            p.call(kv.allocate, "x", 1, (2, 64), I8, blocks=blocks, placement=placement)
    # registration needs no pool
    assert p.call(kv.register, "r", 1, (2, 64), I8, seed=None) == 1

    # a device pool serves DEVICE only; HOST needs host_mem_pool_cfg
    p.call(local_ops.restart, pool=MiB)
    assert p.call(kv.allocate, "d", 1, (2, 64), I8) == 1  # ids restart with the engine
    for blocks in (False, True):
        with llm_error(S.LLM_PARAM_INVALID):
            p.call(kv.allocate, "x", 1, (2, 64), I8, blocks=blocks, placement=HOST)

    p.call(local_ops.restart, host_pool=MiB)
    p.call(kv.allocate, "h", 2, (4, 64), I8, blocks=True, placement=HOST)
    assert p.call(local_ops.describe, "h") == (1, True, 2, HOST)
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(kv.allocate, "x", 1, (2, 64), I8)
    with llm_error(S.LLM_PARAM_INVALID):  # zero tensors
        p.call(kv.allocate, "x", 0, (2, 64), I8, placement=HOST)
    # the memory is usable: what is written lands in the cache's tensors and nowhere else in the pool
    before = p.call(kv.snapshot, "h")
    p.call(kv.overwrite, "h", 5)
    want = before.with_tensor_bytes(0, 0, pattern(256, 0, 5)).with_tensor_bytes(1, 0, pattern(256, 1, 5))
    assert_same(p.call(kv.snapshot, "h"), want, "a written HOST pool cache")


@pytest.mark.parametrize("placement", [DEVICE, HOST], ids=["DEVICE-pool", "HOST-host_pool"])
def test_pool_exhaustion_and_reuse(peers: Callable[..., Peer], backend: str, placement: Placement) -> None:
    pools = {"pool": 4 * MiB} if placement == DEVICE else {"host_pool": 4 * MiB}
    p = engine(peers, backend, "pool", **pools)

    def alloc(name: str, num: int, shape: tuple[int, ...], **kw: Any) -> int:
        return p.call(kv.allocate, name, num, shape, I8, placement=placement, **kw)

    full = (1024, 4096)  # exactly the 4 MiB pool
    # the whole pool, twice in a row with a deallocation in between
    alloc("a", 1, full)
    with llm_error(S.LLM_OUT_OF_MEMORY, "allocate_cache"):
        alloc("y", 1, (1, 4096))
    p.call(kv.deallocate, "a")
    alloc("a", 1, full)
    p.call(kv.deallocate, "a")
    # failed allocations leak nothing: a partial fit (first tensor fits, second does not),
    # a request above the pool and a bad key list
    alloc("x", 1, (3, 1024 * 1024 // 4))  # 768 KiB
    for num, shape, blocks in [(2, (3, 1024 * 1024), False),  # 2 x 3 MiB
                               (1, (8, 1024 * 1024), True),
                               (1, (1, 2**40), False)]:
        with llm_error(S.LLM_OUT_OF_MEMORY):
            alloc("y", num, shape, blocks=blocks)
    with llm_error(S.LLM_PARAM_INVALID):
        alloc("y", 1, (2, 1024 * 1024), keys=[CacheKey(1, 1), CacheKey(1, 1)])
    p.call(kv.deallocate, "x")
    alloc("a", 1, full)
    p.call(kv.deallocate, "a")
    # an allocate/deallocate loop of big caches keeps fitting
    p.call(local_ops.churn, 40, 3, (16, 65536), I8, placement)
    # a cache stays alive while a key references it; removing the key frees it
    alloc("k", 1, full, keys=[CacheKey(1, 7)])
    p.call(kv.deallocate, "k")
    assert p.call(local_ops.tensor_addrs, "k") == []
    with llm_error(S.LLM_OUT_OF_MEMORY):
        alloc("y", 1, (1, 4096))
    p.call(kv.remove_cache_key, CacheKey(1, 7))
    alloc("a", 1, full)


def test_pool_frees_coalesce_and_allocations_do_not_overlap(peers: Callable[..., Peer], backend: str) -> None:
    p = engine(peers, backend, "coalesce", pool=4 * MiB, host_pool=MiB)
    # four 1 MiB caches fill the pool; free them out of order, then the whole pool fits again
    for i in range(4):
        p.call(kv.allocate, f"c{i}", 1, (256, 4096), I8)
    with llm_error(S.LLM_OUT_OF_MEMORY):
        p.call(kv.allocate, "y", 1, (1, 4096), I8)
    p.call(kv.allocate, "h", 1, (256, 4096), I8, placement=HOST)  # the host pool is separate
    for i in (1, 3, 0, 2):
        p.call(kv.deallocate, f"c{i}")
    p.call(kv.allocate, "big", 1, (1024, 4096), I8)
    p.call(kv.deallocate, "big")
    # many small caches of several tensors: every tensor has its own memory (each written with
    # its own pattern, in allocation order; all read back afterwards)
    small = [f"small{i}" for i in range(40)]
    for i, name in enumerate(small):
        p.call(kv.allocate, name, 3, (2, 100 + 7 * i), I8, seed=i)
    got = p.call(local_ops.read_tensors, small)
    for i, name in enumerate(small):
        _, data = got[name]
        assert len(data) == 3
        for t, d in enumerate(data):
            assert d == pattern(2 * (100 + 7 * i), t, i).tobytes(), (i, t)
    spans = sorted((a, a + 2 * (100 + 7 * i)) for i, name in enumerate(small) for a in got[name][0])
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    for name in small:
        p.call(kv.deallocate, name)
    p.call(kv.allocate, "big", 1, (1024, 4096), I8)


def test_cache_ids_count_from_one_in_call_order(peers: Callable[..., Peer], backend: str) -> None:
    p = engine(peers, backend, "ids", pool=MiB, host_pool=MiB)
    ids = [p.call(kv.register, "r", 2, (4, 64), I8, seed=None),
           p.call(kv.allocate, "a2", 1, (2, 64), I8),
           p.call(kv.register_blocks, "rb", 2, (4, 64), I8, seed=None, key=BlocksCacheKey(1, 0)),
           p.call(kv.allocate, "ab", 1, (4, 64), I8, blocks=True, placement=HOST),
           p.call(kv.allocate, "a5", 1, (2, 64), I8)]
    assert ids == [1, 2, 3, 4, 5]
    # ids are never reused, even after deallocation / unregistration
    assert p.call(kv.allocate, "c", 1, (2, 64), I8) == 6
    p.call(kv.deallocate, "c")
    p.call(kv.unregister, "r")
    assert p.call(kv.allocate, "a7", 1, (2, 64), I8) == 7
    p.call(kv.cpu_cache, "cpu", 1, (2, 64), I8)
    assert p.call(local_ops.cache_id, "cpu") == -1
    assert p.call(kv.allocate, "a8", 1, (2, 64), I8) == 8


# ---------------------------------------------------------------------------- local copies


def test_copy_cache(peers: Callable[..., Peer], backend: str) -> None:
    p = engine(peers, backend, "copy", pool=MiB)
    p.call(kv.register, "cs", 2, (2, 64), I8, seed=3)
    p.call(kv.register, "cd", 2, (3, 64), I8, seed=4)  # distinct data: an untouched byte shows
    copied(p, "cs", "cd", lambda: p.call(local_ops.copy_cache, "cd", "cs", 2, 1), rows([(1, 2)]))
    copied(p, "cs", "cd", lambda: p.call(local_ops.copy_cache, "cd", "cs", 0, 0, offset=16, size=32, req_id=99),
           lambda dst0, src0: dst0.with_bytes(src0, [Copy(t, 16, t, 16, 32) for t in (0, 1)]))
    # the rest of the slot from the offset
    copied(p, "cs", "cd", lambda: p.call(local_ops.copy_cache, "cd", "cs", 1, 0, offset=60),
           lambda dst0, src0: dst0.with_bytes(src0, [Copy(t, 60, t, 64 + 60, 4) for t in (0, 1)]))
    # registered -> allocated -> registered (the allocated side: the whole pool is checked)
    p.call(kv.allocate, "ca", 2, (2, 64), I8, seed=5)
    copied(p, "cs", "ca", lambda: p.call(local_ops.copy_cache, "ca", "cs", 1, 0), rows([(0, 1)]))
    copied(p, "ca", "cd", lambda: p.call(local_ops.copy_cache, "cd", "ca", 0, 1), rows([(1, 0)]))
    # default indices: slot 0 to slot 0
    copied(p, "cs", "cd", lambda: p.call(local_ops.copy_cache, "cd", "cs"), rows([(0, 0)]))

    p.call(kv.register_blocks, "blk", 2, (4, 64), I8, seed=6)
    p.call(kv.allocate, "one", 1, (2, 64), I8, seed=7)
    every = ["cs", "cd", "blk", "ca"]  # "ca"'s snapshot is the pool, "one" included
    for args, kwargs in [
        (("cd", "cs", 3, 0), {}),  # dst index out of range
        (("cd", "cs", 0, 2), {}),  # src index out of range
        (("cd", "cs", 0, 0), {"offset": 64}),  # nothing left after the offset
        (("cd", "cs", 0, 0), {"offset": 48, "size": 17}),  # beyond the slot
        (("cd", "cs", 0, 0), {"offset": -1}),
        (("cd", "cs", 0, 0), {"size": 0}),
        (("cd", "cs", 0, 0), {"size": 65}),
        (("blk", "cs", 0, 0), {}),
        (("cd", "blk", 0, 0), {}),
        (("one", "cs", 0, 0), {}),  # different num_tensors
    ]:
        refused(p, every, S.LLM_PARAM_INVALID, local_ops.copy_cache, *args, **kwargs)
    refused(p, every, TypeError, local_ops.copy_cache, "cd", "cs", 0, 0, req_id="r")
    p.call(kv.deallocate, "one")
    # a deallocated handle is dead
    refused(p, every, S.LLM_PARAM_INVALID, local_ops.copy_cache, "one", "one")


def test_copy_blocks(peers: Callable[..., Peer], backend: str) -> None:
    p = engine(peers, backend, "copyblk", pool=MiB)
    p.call(kv.register_blocks, "blk", 3, (8, 32), I8, seed=4)
    # block 6 to no block: nothing
    within(p, "blk", lambda: p.call(local_ops.copy_blocks, "blk", {0: [3, 5], 2: [7], 6: []}),
           [(0, 3), (0, 5), (2, 7)])
    # allocated blocks cache, same semantics (the rest of the pool unchanged)
    p.call(kv.allocate, "ab", 1, (4, 128), I8, seed=6, blocks=True)
    within(p, "ab", lambda: p.call(local_ops.copy_blocks, "ab", {3: [0]}), [(3, 0)])
    p.call(kv.register, "c", 3, (8, 32), I8, seed=5)
    every = ["blk", "c", "ab"]
    for info in [{0: [8]}, {8: [0]}, {-1: [0]}, {0: [-1]}, {1: [2], 0: [9]}]:
        refused(p, every, S.LLM_PARAM_INVALID, local_ops.copy_blocks, "blk", info)
    # not a blocks cache
    refused(p, every, S.LLM_PARAM_INVALID, local_ops.copy_blocks, "c", {0: [1]})


def test_swap_blocks_between_device_and_cpu_cache(peers: Callable[..., Peer], backend: str) -> None:
    p = engine(peers, backend, "swap", pool=MiB, host_pool=MiB)
    p.call(kv.register_blocks, "dev", 2, (6, 48), I8, seed=7)
    p.call(kv.cpu_cache, "host", 2, (4, 48), I8, seed=8)
    # swap out, then in
    copied(p, "dev", "host", lambda: p.call(local_ops.swap_blocks, "dev", "host", {1: 0, 5: 2}),
           rows([(1, 0), (5, 2)]))
    copied(p, "host", "dev", lambda: p.call(local_ops.swap_blocks, "host", "dev", {3: 0, 0: 4}),
           rows([(3, 0), (0, 4)]))
    # an allocated DEVICE cache and an allocated HOST cache swap too (both pools checked whole)
    p.call(kv.allocate, "ad", 1, (4, 64), I8, seed=9, blocks=True)
    p.call(kv.allocate, "ah", 1, (2, 64), I8, seed=10, blocks=True, placement=HOST)
    copied(p, "ad", "ah", lambda: p.call(local_ops.swap_blocks, "ad", "ah", {2: 1}), rows([(2, 1)]))
    copied(p, "ah", "ad", lambda: p.call(local_ops.swap_blocks, "ah", "ad", {0: 3}), rows([(0, 3)]))

    p.call(kv.cpu_cache, "host2", 2, (4, 48), I8, seed=11)
    p.call(kv.register_blocks, "dev_b", 2, (6, 48), I8, seed=12)
    p.call(kv.cpu_cache, "wide", 2, (4, 96), I8, seed=13)
    p.call(kv.cpu_cache, "one", 1, (4, 48), I8, seed=14)
    p.call(kv.register, "contig", 2, (6, 48), I8, seed=15)
    every = ["dev", "host", "host2", "dev_b", "wide", "one", "contig"]
    for src, dst, mapping in [
        ("dev", "host", {6: 0}),  # src index out of range
        ("dev", "host", {0: 4}),  # dst index out of range
        ("host", "dev", {-1: 0}),
        ("dev", "host", {0: 0, 1: 9}),
        ("host", "host2", {0: 1}),  # HOST -> HOST
        ("dev", "dev_b", {0: 1}),  # DEVICE -> DEVICE
        ("dev", "wide", {0: 0}),  # different block sizes
        ("dev", "one", {0: 0}),  # different num_tensors
        ("contig", "host", {0: 0}),  # not a blocks cache
    ]:
        refused(p, every, S.LLM_PARAM_INVALID, local_ops.swap_blocks, src, dst, mapping)
    refused(p, every, AttributeError, local_ops.swap_blocks, None, "host", {0: 0})
    refused(p, every, TypeError, local_ops.swap_blocks, "dev", "host", {0: "1"})


# ---------------------------------------------------------------------------- no-ops and misuse


def test_noops_and_unregister_misuse(peers: Callable[..., Peer], backend: str) -> None:
    p = engine(peers, backend, "noop", pool=MiB)
    p.call(kv.allocate, "a", 1, (2, 64), I8, keys=[CacheKey(1, 3)])
    p.call(kv.register, "r", 1, (2, 64), I8, seed=None, keys=[CacheKey(1, 4)])
    p.call(kv.allocate, "b", 1, (2, 64), I8, blocks=True)
    assert p.call(kv.cache_count) == 3
    # removing a missing key: a no-op, repeatedly
    for key in (CacheKey(1, 999), CacheKey(1, 3, 5), CacheKey(1, 999)):
        p.call(kv.remove_cache_key, key)
    # deallocating an unknown id: a no-op
    p.call(local_ops.deallocate_unknown, 4242, False)
    p.call(local_ops.deallocate_unknown, 4243, True)
    assert p.call(kv.cache_count) == 3
    # unregistering an allocated cache is refused
    for name in ("a", "b"):
        with llm_error(S.LLM_PARAM_INVALID, "unregister_cache"):
            p.call(kv.unregister, name)
    # the wrong deallocate kind is refused
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(kv.deallocate, "b")
    with llm_error(S.LLM_PARAM_INVALID):
        p.call(local_ops.deallocate_blocks, "a")
    assert p.call(kv.cache_count) == 3
    assert len(p.call(local_ops.tensor_addrs, "a")) == len(p.call(local_ops.tensor_addrs, "b")) == 1
    # key held: deallocate keeps the cache, remove_cache_key frees it; a second deallocate is a no-op
    p.call(kv.deallocate, "a")
    assert p.call(kv.cache_count) == 3
    p.call(kv.remove_cache_key, CacheKey(1, 3))
    p.call(kv.deallocate, "a")
    assert p.call(kv.cache_count) == 2
    p.call(local_ops.deallocate_blocks, "b")
    p.call(local_ops.deallocate_blocks, "b")
    assert p.call(kv.cache_count) == 1
    # deallocating a registered (user-owned) cache is a silent no-op for the engine
    p.call(kv.deallocate, "r")
    assert p.call(kv.cache_count) == 1
    with llm_error(S.LLM_PARAM_INVALID):  # its key is still bound
        p.call(kv.allocate, "x", 1, (2, 64), I8, keys=[CacheKey(1, 4)])
    # unregister of the registered cache works, and its key is gone with it
    p.call(kv.unregister, "r")
    assert p.call(kv.cache_count) == 0
    p.call(local_ops.register_again, "r", [CacheKey(1, 4)])


"""The per-call cost of ``pull_blocks`` (one 4 KiB block per call), and of ``pull_cache`` (one 4 KiB
slot by ``CacheKeyByIdAndIndex``, a call that is not prepared), through ``llm_datadist`` only, so
the same script runs on any pdlink version (an A/B between two virtualenvs, run alternately).

Two processes on one host; p50 of 5000 calls after 500 warm-up calls, for cma and tcp. What each
call pulled is verified once. The cma rows end with the floor under them: the same 4 KiB read by a
bare ``process_vm_readv`` from Python (through ctypes, so it includes a ctypes call's cost).

    python bench/bench_pull_blocks.py LABEL   # "LABEL cma pull_blocks 4 KiB p50 X us", pull_cache, the floor, tcp
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

BLOCKS, BLOCK = 16, 4096
TARGET_ID, INITIATOR_ID = 3, 4


def content() -> np.ndarray:
    return (np.arange(BLOCKS * BLOCK, dtype=np.uint64) % 251).astype(np.uint8).reshape(BLOCKS, BLOCK)


def target(conn: Any) -> None:
    os.environ["PDLINK_TRANSPORT"] = "auto"
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole

    dd = LLMDataDist(LLMRole.PROMPT, TARGET_ID)
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    cfg.listen_ip_info = "127.0.0.1:0"
    dd.init(cfg.generate_options())
    data = content()
    dd.cache_manager.register_blocks_cache(CacheDesc(1, [BLOCKS, BLOCK], DataType.DT_UINT8), [data.ctypes.data],
                                           BlocksCacheKey(TARGET_ID, 0))
    slots = content()
    plain = dd.cache_manager.register_cache(CacheDesc(1, [BLOCKS, BLOCK], DataType.DT_UINT8), [slots.ctypes.data])
    conn.send((dd.listen_port, plain.cache_id, os.getpid(), data.ctypes.data))
    conn.recv()
    dd.finalize()


def initiator(conn: Any, transport: str, port: int, slot_cache: int, floor: tuple[int, int] | None) -> None:
    try:
        rows = measure(transport, port, slot_cache)
        if floor is not None:
            rows.append(("process_vm_readv", syscall_floor(*floor)))
        conn.send([f"{op} 4 KiB p50 {us:.2f} us" for op, us in rows])
    except Exception as e:  # noqa: BLE001 - reported by the parent (cma not permitted here, say)
        conn.send([f"failed: {type(e).__name__}: {e}"])


def p50(call: Any) -> float:
    for _ in range(500):
        call()
    times = []
    for _ in range(5000):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def measure(transport: str, port: int, slot_cache: int) -> list[tuple[str, float]]:
    os.environ["PDLINK_TRANSPORT"] = transport
    from llm_datadist import (
        BlocksCacheKey,
        CacheDesc,
        CacheKeyByIdAndIndex,
        DataType,
        LLMClusterInfo,
        LLMConfig,
        LLMDataDist,
        LLMRole,
    )

    dd = LLMDataDist(LLMRole.DECODER, INITIATOR_ID)
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    dd.init(cfg.generate_options())
    mine = np.zeros((BLOCKS, BLOCK), np.uint8)
    cache = dd.cache_manager.register_blocks_cache(CacheDesc(1, [BLOCKS, BLOCK], DataType.DT_UINT8),
                                                   [mine.ctypes.data])
    peer = LLMClusterInfo()
    peer.remote_cluster_id = TARGET_ID
    peer.append_local_ip_info("127.0.0.1", 0)
    peer.append_remote_ip_info("127.0.0.1", port)
    ret, _ = dd.link_clusters([peer], 5000)
    if ret != 0:
        raise RuntimeError(f"link_clusters over {transport}: {ret}")
    cm, key = dd.cache_manager, BlocksCacheKey(TARGET_ID, 0)
    src, dst = [3], [3]
    blocks_us = p50(lambda: cm.pull_blocks(key, cache, src, dst))
    if not np.array_equal(mine[3], content()[3]):
        raise AssertionError(f"{transport}: the pulled block differs")
    slots = np.zeros((BLOCKS, BLOCK), np.uint8)
    plain = cm.register_cache(CacheDesc(1, [BLOCKS, BLOCK], DataType.DT_UINT8), [slots.ctypes.data])
    slot_key = CacheKeyByIdAndIndex(TARGET_ID, slot_cache, 5)
    cache_us = p50(lambda: cm.pull_cache(slot_key, plain, 2))
    if not np.array_equal(slots[2], content()[5]):
        raise AssertionError(f"{transport}: the pulled slot differs")
    dd.finalize()
    return [("pull_blocks", blocks_us), ("pull_cache", cache_us)]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def syscall_floor(pid: int, remote_addr: int) -> float:
    """p50 of one bare process_vm_readv of block 3 (4 KiB) from the target, verified once."""
    libc = ctypes.CDLL(None, use_errno=True)
    readv = libc.process_vm_readv
    readv.restype = ctypes.c_ssize_t
    mine = np.zeros(BLOCK, np.uint8)
    local, remote = _Iovec(mine.ctypes.data, BLOCK), _Iovec(remote_addr + 3 * BLOCK, BLOCK)

    def call() -> None:
        if readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != BLOCK:
            raise OSError(ctypes.get_errno(), "process_vm_readv")

    us = p50(call)
    if not np.array_equal(mine, content()[3]):
        raise AssertionError("process_vm_readv: the block read differs")
    return us


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "pdlink"
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    t = ctx.Process(target=target, args=(b,), daemon=True)
    t.start()
    port, slot_cache, pid, addr = a.recv()
    try:
        for transport in ("cma", "tcp"):
            x, y = ctx.Pipe()
            floor = (pid, addr) if transport == "cma" else None
            p = ctx.Process(target=initiator, args=(y, transport, port, slot_cache, floor), daemon=True)
            p.start()
            for line in x.recv():
                print(f"{label} {transport} {line}", flush=True)
            p.join(30)
    finally:
        a.send("stop")
        t.join(30)


if __name__ == "__main__":
    main()

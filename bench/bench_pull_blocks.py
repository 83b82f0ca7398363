"""The per-call cost of ``pull_blocks``: one 4 KiB block per call through ``llm_datadist`` only, so
the same script runs on any pdlink version (an A/B between two virtualenvs, run alternately).

Two processes on one host; p50 of 5000 calls after 500 warm-up calls, for cma and tcp. The pulled
block is verified once.

    python bench/bench_pull_blocks.py LABEL      # prints "LABEL cma pull_blocks 4 KiB p50 X us", and tcp
"""

from __future__ import annotations

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
    conn.send(dd.listen_port)
    conn.recv()
    dd.finalize()


def initiator(conn: Any, transport: str, port: int) -> None:
    try:
        conn.send(f"p50 {measure(transport, port):.2f} us")
    except Exception as e:  # noqa: BLE001 - reported by the parent (cma not permitted here, say)
        conn.send(f"failed: {type(e).__name__}: {e}")


def measure(transport: str, port: int) -> float:
    os.environ["PDLINK_TRANSPORT"] = transport
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole

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
    for _ in range(500):
        cm.pull_blocks(key, cache, src, dst)
    if not np.array_equal(mine[3], content()[3]):
        raise AssertionError(f"{transport}: the pulled block differs")
    times = []
    for _ in range(5000):
        t0 = time.perf_counter()
        cm.pull_blocks(key, cache, src, dst)
        times.append(time.perf_counter() - t0)
    times.sort()
    dd.finalize()
    return times[len(times) // 2] * 1e6


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "pdlink"
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    t = ctx.Process(target=target, args=(b,), daemon=True)
    t.start()
    port = a.recv()
    try:
        for transport in ("cma", "tcp"):
            x, y = ctx.Pipe()
            p = ctx.Process(target=initiator, args=(y, transport, port), daemon=True)
            p.start()
            print(f"{label} {transport} pull_blocks 4 KiB {x.recv()}", flush=True)
            p.join(30)
    finally:
        a.send("stop")
        t.join(30)


if __name__ == "__main__":
    main()

"""Many engines (``pdlink.Engine``) in one peer process, for the load tests (paths/test_load.py): llm_datadist allows
one LLMDataDist per process, the engine itself has no such limit, so a few processes give many
links. Each engine has a blocks cache in guarded memory (device memory on a device backend) under
pdlink's CacheManager, and pulls on a thread of its own.
"""

from __future__ import annotations

import threading
from typing import Any

import internals
import pdlink
from llm_datadist import BlocksCacheKey, CacheDesc, DataType, Placement
from peers import addr
from peers.memory import GuardedTensors, device_memory_is_remote
from verify import Snapshot

SHAPE = (8, 512)  # 8 blocks of 512 bytes per tensor, 2 tensors

_ENGINES: list[tuple[Any, Any, Any, GuardedTensors]] = []  # (engine, manager, cache, memory)
_ERRORS: list[str] = []


def start_engines(count: int, first_id: int) -> None:
    """``count`` engines with cluster ids ``first_id``..., on this peer's backend and transport."""
    cfg = internals.parse_engine_options({})  # PDLINK_BACKEND / PDLINK_TRANSPORT of this peer
    for i in range(count):
        e = pdlink.Engine(pdlink.EngineOptions(
            cluster_id=first_id + i, role="DECODER", backend=cfg["backend"], transport=cfg["transport"],
            secret=cfg["link_secret"], timeout_ms=30000))
        cm = internals.cache_manager(e)
        desc = CacheDesc(2, list(SHAPE), DataType.DT_UINT8, Placement.DEVICE)
        mem = GuardedTensors(2, desc.size, SHAPE[0], None, device_memory_is_remote())
        _ENGINES.append((e, cm, cm.register_blocks_cache(desc, mem.addrs), mem))


def link_all(port: int, timeout_ms: int = 10000) -> list[int]:
    """Every engine links to the prompt (cluster 1) at ``port``; their status codes."""
    at = f"{addr.of(port)}:{port}"
    return [int(e.connect_each([(1, at)], timeout_ms=timeout_ms)[0].status) for e, _, _, _ in _ENGINES]


def _worker(i: int, pulls: int) -> None:
    _, cm, cache, _ = _ENGINES[i]
    try:
        for n in range(pulls):
            blocks = [(4 * n + k) % SHAPE[0] for k in range(4)]  # two pulls cover every block
            cm.pull_blocks(BlocksCacheKey(1, 0), cache, blocks, blocks)
    except Exception as e:  # noqa: BLE001 (reported to the test)
        _ERRORS.append(f"engine {i}: {e!r}")


def pull_concurrently(pulls: int, timeout_s: float) -> list[str]:
    """Every engine pulls ``pulls`` times on its own thread, all at once; the errors (none: [])."""
    threads = [threading.Thread(target=_worker, args=(i, pulls)) for i in range(len(_ENGINES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    stuck = sum(t.is_alive() for t in threads)
    return list(_ERRORS) + ([f"{stuck} pulling threads still running after {timeout_s} s"] if stuck else [])


def snapshots() -> list[Snapshot]:
    return [mem.snapshot(f"engine {i}") for i, (_, _, _, mem) in enumerate(_ENGINES)]


def finalize_all() -> None:
    for e, _, _, _ in _ENGINES:
        e.close()


def cycles(port: int, n: int) -> None:
    """The first engine links to the prompt and unlinks again, ``n`` times."""
    e = _ENGINES[0][0]
    for _ in range(n):
        e.connect(f"{addr.of(port)}:{port}", cluster_id=1)
        e.disconnect(1)


def first_engine_stats() -> dict[str, Any]:
    return _ENGINES[0][0].stats().as_dict()



"""Peer-side functions for one engine's local cache operations (tests/compat/llm_datadist/test_local_ops.py): pools,
cache ids, ``copy_cache``, ``copy_blocks`` and ``swap_blocks`` within one process.

The engine and the named caches are ``peers.kv``'s (``kv.start``, ``kv.register``,
``kv.allocate``, ``kv.cpu_cache``, ``kv.snapshot``); what is here works on those names. Memory is
read without pdlink (``peers.memory.direct_read``), so a wrong copy cannot hide behind a wrong read.
"""

from __future__ import annotations

from collections.abc import Sequence

from llm_datadist import Cache, CacheDesc, CacheKey, DataType, Placement
from peers import kv
from peers.memory import device_memory_is_remote, direct_read
from verify import Snapshot

Shape = Sequence[int]

_KEEP: list[Cache] = []  # handles made here that must outlive the call (re-registrations)


def restart(pool: int | None = None, host_pool: int | None = None) -> None:
    """``finalize`` and ``init`` again, on the same LLMDataDist, with other pools. The caches
    ``peers.kv`` knows by name belong to the old engine: use new names afterwards."""
    dd = kv.engine()
    dd.finalize()
    dd.init(kv.options(pool=pool, host_pool=host_pool))


# ---------------------------------------------------------------------------- handles


def describe(name: str) -> tuple[int, bool, int, Placement]:
    """(cache_id, is_blocks_cache, number of tensor addresses, placement) of cache ``name``'s handle."""
    c = kv.cache(name)
    return int(c.cache_id), bool(c.is_blocks_cache), len(c.tensor_addrs), c.cache_desc.placement


def cache_id(name: str) -> int:
    return int(kv.cache(name).cache_id)


def tensor_addrs(name: str) -> list[int]:
    """The handle's addresses now (``[]`` once it was deallocated)."""
    return list(kv.cache(name).tensor_addrs)


def read_tensors(names: Sequence[str]) -> dict[str, tuple[list[int], list[bytes]]]:
    """For each cache: its tensors' addresses and bytes, read straight from memory."""
    out = {}
    for name in names:
        c = kv.cache(name)
        desc = c.cache_desc
        device = desc.placement == Placement.DEVICE and device_memory_is_remote()
        addrs = list(c.tensor_addrs)
        out[name] = (addrs, [direct_read(a, desc.size, device).tobytes() for a in addrs])
    return out


def snapshots(names: Sequence[str]) -> list[Snapshot]:
    """``kv.snapshot`` of several caches in one call."""
    return [kv.snapshot(n) for n in names]


# ---------------------------------------------------------------------------- allocation


def deallocate_blocks(name: str) -> None:
    kv.engine().cache_manager.deallocate_blocks_cache(kv.cache(name))


def churn(count: int, num: int, shape: Shape, dtype: DataType, placement: Placement) -> None:
    """``count`` rounds of allocate_blocks_cache + deallocate_blocks_cache of one cache."""
    cm = kv.engine().cache_manager
    desc = CacheDesc(num, list(shape), dtype, placement)
    for _ in range(count):
        cm.deallocate_blocks_cache(cm.allocate_blocks_cache(desc))


def deallocate_unknown(cache_id: int, blocks: bool) -> None:
    """Deallocates a handle the engine never gave out (an id it does not know)."""
    c = Cache(cache_id, CacheDesc(1, [2, 64], DataType.DT_INT8, Placement.DEVICE), [1], is_blocks_cache=blocks)
    cm = kv.engine().cache_manager
    if blocks:
        cm.deallocate_blocks_cache(c)
    else:
        cm.deallocate_cache(c)


def register_again(name: str, keys: Sequence[CacheKey] = ()) -> int:
    """Registers the memory of cache ``name`` once more (a plain cache of its descriptor, e.g. after
    it was unregistered); returns the new id."""
    c = kv.engine().cache_manager.register_cache(kv.cache(name).cache_desc, kv.tensor_addresses(name), list(keys))
    _KEEP.append(c)
    return int(c.cache_id)


# ---------------------------------------------------------------------------- local copies


def copy_cache(dst: str, src: str, dst_batch_index: int = 0, src_batch_index: int = 0, **kwargs: object) -> None:
    """``copy_cache`` between two named caches (``offset``, ``size``, ``req_id`` as given)."""
    cm = kv.engine().cache_manager
    cm.copy_cache(kv.cache(dst), kv.cache(src), dst_batch_index, src_batch_index, **kwargs)


def copy_blocks(name: str, copy_block_info: dict[int, list[int]]) -> None:
    kv.engine().cache_manager.copy_blocks(kv.cache(name), copy_block_info)


def swap_blocks(src: str | None, dst: str, src_to_dst: dict[int, int]) -> None:
    """``swap_blocks`` of two named caches; ``src`` None passes None (llm_datadist raises AttributeError)."""
    src_cache = kv.cache(src) if src is not None else None
    kv.engine().cache_manager.swap_blocks(src_cache, kv.cache(dst), src_to_dst)

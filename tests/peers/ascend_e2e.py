"""Peer-side helpers for the Ascend end-to-end tests (backends/test_ascend_e2e.py): the fake vendor
libraries' control API (tests/fake_ascend/fake_control.h) for call counters, device memory in use
and whether an address is device memory; an engine whose init may fail (device memory
exhaustion); and the v1 KV-cache-manager API over device memory. Everything else (the engine,
caches, transfers, snapshots) is ``peers.kv``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from llm_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole
from peers import fake_ascend, kv
from peers.memory import direct_write


def in_device_memory(name: str) -> list[bool]:
    """For each tensor of cache ``name`` (peers.kv): whether it lies in live (fake) device memory;
    host memory is not, the fake's peek refuses it."""
    out = []
    probe = np.empty(1, dtype=np.uint8)
    for addr in kv.tensor_addresses(name):
        out.append(fake_ascend.peek(addr, probe.ctypes.data, 1))
    return out


def leak_state() -> tuple[tuple[int, int], int]:
    """(open descriptors, threads) of this process, and the device memory it holds allocated."""
    return kv.resources(), fake_ascend.bytes_in_use()


# ---------------------------------------------------------------------------- an init that may fail

_created: list[LLMDataDist] = []


def create(role: str, cluster_id: int) -> None:
    """An LLMDataDist, not initialised yet (``init_engine`` initialises it)."""
    assert not _created, "create() already ran in this peer"
    _created.append(LLMDataDist(kv.ROLES[role], cluster_id))


def init_engine(pool: int) -> None:
    """Initialises the ``create``d engine as a listening CacheManager engine with a DEVICE pool of
    ``pool`` bytes; once that worked it is peers.kv's engine. Raises what init raised."""
    dd = _created[0]
    dd.init(kv.options("127.0.0.1:0", pool=pool))
    kv.adopt(dd)


def no_engine_instance() -> bool:
    """No LLMDataDist of this process is the live engine instance."""
    return LLMDataDist.llm_engine_instance is None


def touch_cache_manager() -> None:
    """Reads the ``create``d engine's cache_manager (raises while it is not initialised)."""
    _created[0].cache_manager  # noqa: B018 - the property access is the test


# ---------------------------------------------------------------------------- v1 KV cache manager

_v1: dict[str, Any] = {}


def v1_allocate(cluster_id: int, num: int, shape: Sequence[int]) -> None:
    """A DECODER engine in the v1 mode (no cache manager), device 0, and a float16 cache of ``num``
    tensors of ``shape`` from its kv_cache_manager."""
    cfg = LLMConfig()
    cfg.device_id = 0
    dd = LLMDataDist(LLMRole.DECODER, cluster_id)
    dd.init(cfg.generate_options())
    km = dd.kv_cache_manager
    _v1.update(dd=dd, km=km, cache=km.allocate_cache(CacheDesc(num, list(shape), DataType.DT_FLOAT16)))


def v1_poke_tensor(index: int, values: Sequence[float]) -> None:
    """Writes ``values`` (float16) into tensor ``index`` of the v1 cache, straight into the fake's
    device memory (fake_acl_poke), not through pdlink's copies."""
    data = np.asarray(values, dtype=np.float16).view(np.uint8)
    direct_write(_v1["cache"].per_device_tensor_addrs[0][index], data, True)


def v1_tensor_values(index: int) -> list[Any]:
    """``get_cache_tensors(cache, index)[0].numpy(copy=True)``: the tensor read back through pdlink
    (a device-to-host copy), as nested lists."""
    tensors = _v1["km"].get_cache_tensors(_v1["cache"], index)
    return list(tensors[0].numpy(copy=True).tolist())


def v1_tensor_text(index: int) -> str:
    return str(_v1["km"].get_cache_tensors(_v1["cache"], index)[0])

"""Keyed KV caches on an engine: the part of the native API that llm_datadist-style serving code
needs beyond ``Engine.register`` and descriptor lists (docs/native_api.md, "KV caches").

An engine's ``kv`` (``Engine.kv``, a ``KvCaches``) registers caches of several equal tensors
from the caller's memory or allocates them from the engine's pools (``EngineOptions.device_pool``,
``host_pool``); publishes them under request keys (a batch slot each), or as a blocks cache under a
model id; and moves them by a ``TransferSpec``: a remote cache by key (``Target``), slots or blocks
or explicit byte runs, the tensors to use on each side::

    from pdlink import kv
    caches = engine.kv
    layout = kv.CacheLayout(2, 1 << 20, 256, True, kv.placement("HOST"))   # tensors, bytes, blocks
    cache_id, addresses = caches.allocate(layout, [], 7)                # a blocks cache, model 7
    spec = kv.TransferSpec(peer_cluster_id=2, target=kv.Target(kind=kv.TargetKind.BLOCKS, model_id=7),
                           local_cache_id=cache_id, mode=kv.TransferMode.BLOCKS_TO_BLOCKS,
                           local_blocks=[0, 1], remote_blocks=[5, 6])
    caches.pull(spec)

The spec types (``CacheLayout``, ``Target``, ``TargetKind``, ``TransferSpec``, ``TransferMode``)
are the native module's bound classes, read from it on first use: Python never re-types them.
Errors are ``pdlink.LLMException`` subclasses carrying the engine's status code.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .native import core, placement_of

if TYPE_CHECKING:  # what the module __getattr__ below returns
    from ._core import (  # noqa: F401
        ANY_CLUSTER,
        INVALID_ID,
        CacheHandle,
        CacheLayout,
        Target,
        TargetKind,
        TransferMode,
        TransferSpec,
    )

__all__ = [
    "ANY_CLUSTER", "CacheHandle", "CacheLayout", "KvCaches", "Target", "TargetKind", "TransferMode", "TransferSpec",
    "placement",
]

# Names read from the native module on first use (module __getattr__), so that importing this
# module does not load it.
_NATIVE_NAMES = ("CacheHandle", "CacheLayout", "Target", "TargetKind", "TransferSpec", "TransferMode", "ANY_CLUSTER",
                 "INVALID_ID")

def placement(value: str | enum.Enum) -> Any:
    """The native placement by name (``"HOST"``, ``"DEVICE"``, or an enum whose name is that)."""
    return placement_of(value)


def __getattr__(name: str) -> Any:
    if name in _NATIVE_NAMES:
        return getattr(core(), name)
    raise AttributeError(f"module 'pdlink.kv' has no attribute {name!r}")


class KvCaches:
    """The keyed caches of one engine (``Engine.kv``). Thread-safe as the engine is; every call
    releases the GIL while the engine works.

    The methods are the native engine's own (each call costs no Python frame):

    - ``register(layout, addresses, keys, blocks_model, remote_accessible) -> CacheHandle``:
      the caller's memory, one address per tensor; ``keys[i]`` publishes batch slot ``i`` under a
      ``(req_id, prefix_id, model_id)`` key (``INVALID_ID``: unset); ``blocks_model`` publishes a
      blocks cache under that model id; ``remote_accessible=False`` refuses peers' reads and writes
      of it.
    - ``allocate(layout, keys, blocks_model) -> CacheHandle``: the same, the tensors taken
      from the engine's pool of the layout's placement (``LLM_OUT_OF_MEMORY`` when it has no room).
    - ``deallocate(cache_id, blocks)``: returns an allocated cache to its pool (``blocks``:
      whether it is a blocks cache). ``unregister(cache_id)``: withdraws a registered one.
    - ``remove_key(req_id, prefix_id, model_id)``: unpublishes a key (its slot stays registered).
    - ``pull(spec)`` / ``push(spec)``: one transfer; nothing is committed at either end unless every
      byte arrived.
    - ``prepare(spec, block_size=0, remote_base=0, remote_bytes=0)``: a prepared blocks transfer
      whose ``post(local_blocks, remote_blocks, push)`` moves blocks by index (not a pin: a
      registry change on either side fails the next post cleanly).
    - ``copy_local(dst_addresses, dst_placement, src_addresses, src_placement, runs)``: copies
      ``(dst_offset, src_offset, length)`` runs between two local caches' tensors.

    A ``CacheHandle`` (the native module's bound class) has the cache's ``cache_id`` and its
    ``addresses`` (one per tensor), and unpacks as ``cache_id, addresses = handle``.

    A failed call raises the ``pdlink.LLMException`` subclass of its status code, with the engine's
    message.
    """

    register: Callable[..., CacheHandle]
    allocate: Callable[..., CacheHandle]
    deallocate: Callable[..., None]
    unregister: Callable[[int], None]
    remove_key: Callable[[int, int, int], None]
    pull: Callable[..., None]
    push: Callable[..., None]
    prepare: Callable[..., Any]
    copy_local: Callable[..., None]

    def __init__(self, native: Any) -> None:
        self.register = native.register_cache
        self.allocate = native.allocate_cache
        self.deallocate = native.deallocate_cache
        self.unregister = native.unregister_cache
        self.remove_key = native.remove_cache_key
        self.pull = native.pull
        self.push = native.push
        self.prepare = native.prepare
        self.copy_local = native.copy_local
        self._native = native

    @property
    def count(self) -> int:
        """How many caches the engine holds (registered and allocated, keyed or not)."""
        return int(self._native.cache_count)

    def pools(self) -> list[dict[str, Any]]:
        """The engine's pools, one dict each: ``placement`` (a native ``Placement``), ``base``,
        ``capacity`` and ``used`` (bytes; the fields of the engine's ``PoolInfo``)."""
        return [pool.as_dict() for pool in self._native.pools()]


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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .native import core, placement_of
from .tp import (
    LAYOUTS,
    GeometryMismatch,
    KvGeometry,
    Row,
    TpPlan,
    TpRead,
    check_pair,
    check_views,
    plan_rows,
    tensor_parts,
    tp_plan,
)

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
    "ANY_CLUSTER", "CacheHandle", "CacheLayout", "GeometryMismatch", "Key", "KvCaches", "KvGeometry", "LAYOUTS",
    "PreparedBlocks", "Row", "Target", "TargetKind", "TpPlan", "TpRead", "TransferMode", "TransferSpec", "check_pair",
    "check_views", "placement", "plan_rows", "tensor_parts", "tp_plan",
]

Key = tuple[int, int, int]  # (req_id, prefix_id, model_id)
Indices = npt.NDArray[np.int64] | Sequence[int]

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


class PreparedBlocks:
    """A prepared blocks transfer (``KvCaches.prepare``): the local cache and the remote one (or
    the remote raw range) described once; each ``post`` moves blocks by index, ``local[i]`` <->
    ``remote[i]`` (index arrays: numpy int64, or anything numpy converts, passed to C++ without one
    Python object per element).

    Not a pin: a registry change on either side fails the next post cleanly and moves nothing.
    Thread-safe; each post releases the GIL while the engine works."""

    __slots__ = ("_native",)

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def peer_cluster_id(self) -> int:
        return int(self._native.peer_cluster_id)

    @property
    def block_size(self) -> int:
        """Bytes per block."""
        return int(self._native.block_size)

    @property
    def local_blocks(self) -> int:
        """How many blocks the local cache has (a local index must be below it)."""
        return int(self._native.local_blocks)

    @property
    def remote_blocks(self) -> int:
        """A raw remote range's blocks (a remote index must be below it); 0 for a keyed blocks
        cache, whose owner checks the indices at each post."""
        return int(self._native.remote_blocks)

    def post(self, local: Indices, remote: Indices, push: bool) -> None:
        """Moves remote blocks ``remote[i]`` into local blocks ``local[i]`` (``push``: the other way);
        all or nothing."""
        self._native.post(local, remote, push)


class KvCaches:
    """The keyed caches of one engine (``Engine.kv``). Thread-safe as the engine is; every call
    releases the GIL while the engine works. A failed call raises the ``pdlink.LLMException``
    subclass of its status code, with the engine's message."""

    __slots__ = ("_native",)

    def __init__(self, native: Any) -> None:
        self._native = native

    def register(self, layout: CacheLayout, addresses: Sequence[int], keys: Sequence[Key], blocks_model: int | None,
                 remote_accessible: bool) -> CacheHandle:
        """Registers the caller's memory as a cache, one address per tensor. ``keys[i]`` publishes
        batch slot ``i`` under a ``(req_id, prefix_id, model_id)`` key (``INVALID_ID``: unset);
        ``blocks_model`` publishes a blocks cache under that model id; ``remote_accessible=False``
        refuses peers' reads and writes of it. A ``CacheHandle`` has the cache's ``cache_id`` and
        its ``addresses`` (one per tensor), and unpacks as ``cache_id, addresses = handle``."""
        return self._native.register_cache(layout, addresses, keys, blocks_model, remote_accessible)

    def allocate(self, layout: CacheLayout, keys: Sequence[Key], blocks_model: int | None) -> CacheHandle:
        """As ``register``, the tensors taken from the engine's pool of the layout's placement
        (``LLM_OUT_OF_MEMORY`` when it has no room)."""
        return self._native.allocate_cache(layout, keys, blocks_model)

    def deallocate(self, cache_id: int, blocks: bool) -> None:
        """Returns an allocated cache to its pool (``blocks``: whether it is a blocks cache)."""
        self._native.deallocate_cache(cache_id, blocks)

    def unregister(self, cache_id: int) -> None:
        """Withdraws a registered cache."""
        self._native.unregister_cache(cache_id)

    def remove_key(self, req_id: int, prefix_id: int, model_id: int) -> None:
        """Unpublishes a key (its slot stays registered)."""
        self._native.remove_cache_key(req_id, prefix_id, model_id)

    def pull(self, spec: TransferSpec) -> None:
        """One transfer from the peer into a local cache; nothing is committed unless every byte
        arrived."""
        self._native.pull(spec)

    def push(self, spec: TransferSpec) -> None:
        """One transfer from a local cache into the peer's; nothing is committed unless every byte
        arrived."""
        self._native.push(spec)

    def prepare(self, spec: TransferSpec, block_size: int = 0, remote_base: int = 0,
                remote_bytes: int = 0) -> PreparedBlocks:
        """A prepared blocks transfer for ``spec`` (``block_size`` 0: the local cache's; a raw
        target's remote range is ``[remote_base, +remote_bytes)``). Nothing is sent until a post."""
        return PreparedBlocks(self._native.prepare(spec, block_size, remote_base, remote_bytes))

    def copy_local(self, dst_addresses: Sequence[int], dst_placement: Any, src_addresses: Sequence[int],
                   src_placement: Any, runs: Sequence[tuple[int, int, int]]) -> None:
        """Copies ``(dst_offset, src_offset, length)`` runs between two local caches' tensors."""
        self._native.copy_local(dst_addresses, dst_placement, src_addresses, src_placement, runs)

    @property
    def count(self) -> int:
        """How many caches the engine holds (registered and allocated, keyed or not)."""
        return int(self._native.cache_count)

    def pools(self) -> list[dict[str, Any]]:
        """The engine's pools, one dict each: ``placement`` (a native ``Placement``), ``base``,
        ``capacity`` and ``used`` (bytes; the fields of the engine's ``PoolInfo``)."""
        return [pool.as_dict() for pool in self._native.pools()]

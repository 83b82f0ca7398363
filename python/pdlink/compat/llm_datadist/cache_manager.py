"""``CacheManager``: llm_datadist's v2 ("CacheManager mode") cache API (llm_datadist_api.md §8).

This layer validates arguments exactly as llm_datadist does (``TypeError`` / ``ValueError`` /
``LLMException(LLM_PARAM_INVALID)``, llm_datadist_api.md §3.2), turns keys and layer ranges into the native
engine's terms, and calls ``pdlink.Engine`` (its keyed caches, ``Engine.kv``). Byte movement, bounds checks, key
indexes and reference counting live in the C++ core; native failures become ``LLMException``
in the binding (one place). No per-block Python objects are created: block lists go to the
core as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ... import kv
from ...status import LLMException, LLMStatusCode
from ._utils import (
    UINT32_MAX,
    check_dict,
    check_int64,
    check_isinstance,
    check_layer_range,
    check_list_int64,
    check_list_of,
    check_list_uint64,
    check_uint32,
    handle_llm_status,
    is_valid_id,
    llm_api,
    llm_failure,
    raise_if_false,
    raise_if_true,
    raising_as,
)
from .llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    MemInfo,
    Memtype,
    Placement,
)

if TYPE_CHECKING:
    from ...engine import Engine
    from .llm_types import LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig
    from .transfer import CacheTask

__all__ = ["CacheManager"]

logger = logging.getLogger("pdlink")


_PULL_KWARGS = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")

KeyLike = CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey


def remote_target(key: KeyLike | None) -> Any:
    """The ``_core.Target`` addressing a remote cache by ``key``; ``None``: raw remote memory."""
    kinds = kv.TargetKind
    if key is None:
        return kv.Target(kind=kinds.RAW, req_id=kv.INVALID_ID, prefix_id=kv.INVALID_ID)
    if isinstance(key, BlocksCacheKey):
        return kv.Target(kind=kinds.BLOCKS, model_id=key.model_id, req_id=kv.INVALID_ID, prefix_id=kv.INVALID_ID)
    if isinstance(key, CacheKeyByIdAndIndex):
        return kv.Target(kind=kinds.ID_INDEX, req_id=kv.INVALID_ID, prefix_id=kv.INVALID_ID, cache_id=key.cache_id,
                        batch_index=key.batch_index)
    req_ok, prefix_ok = is_valid_id(key.req_id), is_valid_id(key.prefix_id)
    raise_if_false(
        req_ok != prefix_ok,
        "exactly one of req_id and prefix_id must be valid in a pull key, got {}",
        key,
    )
    if req_ok:
        return kv.Target(kind=kinds.REQUEST_KEY, model_id=key.model_id, req_id=key.req_id, prefix_id=kv.INVALID_ID)
    return kv.Target(kind=kinds.PREFIX_KEY, model_id=key.model_id, req_id=kv.INVALID_ID, prefix_id=key.prefix_id)


def transfer_mode(name: str) -> Any:
    """``_core.TransferMode`` by name: SLOT_TO_SLOT, BLOCKS_TO_BLOCKS, SLOT_TO_BLOCKS, EXPLICIT."""
    return getattr(kv.TransferMode, name)


def _layer_tensors(
    cache: Cache,
    src_layer_range: range | None,
    dst_layer_range: range | None,
    tensor_num_per_layer: int,
) -> tuple[list[int], list[int]]:
    """Tensor indices for (src, dst) from layer ranges; ([], []) means every tensor i -> i."""
    check_uint32("tensor_num_per_layer", tensor_num_per_layer)
    raise_if_false(tensor_num_per_layer > 0, "tensor_num_per_layer must be > 0")
    check_layer_range("src_layer_range", src_layer_range)
    check_layer_range("dst_layer_range", dst_layer_range)
    if src_layer_range is None and dst_layer_range is None:
        return [], []
    n = tensor_num_per_layer
    raise_if_false(
        cache.cache_desc.num_tensors % n == 0,
        f"num_tensors {cache.cache_desc.num_tensors} is not a multiple of tensor_num_per_layer {n}",
    )
    src = src_layer_range if src_layer_range is not None else dst_layer_range
    dst = dst_layer_range if dst_layer_range is not None else src_layer_range
    assert src is not None and dst is not None  # not both None (returned above)
    raise_if_false(len(src) == len(dst), f"src_layer_range {src} and dst_layer_range {dst} differ in length")
    return list(range(src.start * n, src.stop * n)), list(range(dst.start * n, dst.stop * n))


def _check_cache(name: str, cache: Any) -> Cache:
    check_isinstance(name, cache, Cache, allow_none=False)
    if not (cache.cache_id > 0 and cache.tensor_addrs):
        raise_if_false(False, f"{name} is not a live registered cache: {cache}")
    return cache


def _block_list(name: str, blocks: Any) -> Sequence[int]:
    check_list_of(name, blocks, int)
    return blocks


def _check_block_pairs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
    """Blocks-to-blocks transfers pair src_blocks[i] with dst_blocks[i]."""
    raise_if_false(len(dst_blocks) > 0, "dst_blocks must not be empty")
    if len(src_blocks) != len(dst_blocks):
        raise_if_false(False, f"src_blocks ({len(src_blocks)}) and dst_blocks ({len(dst_blocks)}) differ in length")


@llm_api
class CacheManager:
    """Registers, allocates and moves KV caches of one ``LLMDataDist`` (llm_datadist_api.md §8).

    Obtain it from ``LLMDataDist.cache_manager``; do not construct it yourself.
    Threading: methods may be called from several threads; transfers on one link are
    serialised by the engine, transfers to different peers run in parallel.
    """

    def __init__(self, owner: Any, engine: Engine, remote_cache_accessible: bool, has_pool: dict[Placement, bool]):
        self._owner = owner
        self._engine = engine
        self._remote_cache_accessible = remote_cache_accessible
        self._has_pool = has_pool
        self._initialized = True
        # Blocks-to-blocks transfers by BlocksCacheKey, prepared once per (local cache, peer, remote
        # model, tensor pairs) and posted with the block lists (no spec is built per call). Not
        # pins: a prepared transfer over a cache that is gone fails like the unprepared call.
        self._prepared: dict[tuple[Any, ...], Any] = {}
        self._specs: dict[tuple[Any, ...], Any] = {}  # slot transfers' TransferSpecs, by what built them
        from .transfer import AsyncTasks

        self._async_tasks = AsyncTasks()  # running transfer_cache_async jobs (finalize and unlink stop them)

    # ------------------------------------------------------------------ helpers

    def _live_engine(self):
        # As in llm_datadist (CacheManager._check_is_inited): a manager outlives its engine's
        # finalize, and a re-init makes a new one, so a stale manager says so before doing anything.
        if not self._initialized:
            raise LLMException("this CacheManager's LLMDataDist was finalized; after init again, use its new "
                               "cache_manager", status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
        return self._engine

    def _invalidate(self) -> None:
        self._initialized = False

    def _new_cache(self, desc: CacheDesc, handle: kv.CacheHandle, is_blocks: bool) -> Cache:
        return Cache(handle.cache_id, desc, list(handle.addresses), is_blocks_cache=is_blocks)

    @staticmethod
    def _layout(desc: CacheDesc, is_blocks: bool) -> Any:
        shape = desc.shape
        raise_if_false(1 <= len(shape) <= 32, f"shape must have 1..32 dims, got {list(shape)}")
        raise_if_false(shape[0] > 0, f"shape[0] must be > 0, got {list(shape)}")
        return kv.CacheLayout(desc.num_tensors, desc.size, shape[0], is_blocks, kv.placement(desc.placement))

    @staticmethod
    def _keys(cache_keys: Sequence[CacheKey]) -> list[tuple[int, int, int]]:
        check_list_of("cache_keys", cache_keys, CacheKey)
        return [(k.req_id, k.prefix_id, k.model_id) for k in cache_keys]

    def _remote_accessible(self, desc: CacheDesc, remote_accessible: bool | None) -> bool:
        check_isinstance("remote_accessible", remote_accessible, bool)
        linked = getattr(self._owner, "_is_call_linked", False)
        if linked:
            raise_if_true(remote_accessible is True, "remote_accessible=True is not allowed after link()")
            return False
        if remote_accessible is None:
            return desc.placement == Placement.DEVICE
        return remote_accessible

    def _check_addrs(self, desc: CacheDesc, addrs: Any, exact: bool) -> list[int]:
        check_list_uint64("addrs", addrs)
        raise_if_false(len(addrs) > 0, "addrs must not be empty")
        raise_if_false(all(a != 0 for a in addrs), "addrs must not contain 0")
        if exact:
            raise_if_false(
                len(addrs) == desc.num_tensors,
                f"addrs has {len(addrs)} entries but cache_desc.num_tensors is {desc.num_tensors}",
            )
        return list(addrs)

    def _check_pool(self, desc: CacheDesc) -> None:
        raise_if_false(desc.num_tensors > 0, "cache_desc.num_tensors must be > 0")
        which = "mem_pool_cfg" if desc.placement == Placement.DEVICE else "host_mem_pool_cfg"
        raise_if_false(
            self._has_pool.get(desc.placement, False),
            f"config memory pool firstly: allocating a {desc.placement} cache needs LLMConfig.{which}",
        )

    def _transfer(self, op: str, is_push: bool, key: KeyLike | None, cache: Cache, mode_name: str, *, slot: int = 0,
                  size: int = -1, local_blocks: Sequence[int] = (), remote_blocks: Sequence[int] = (),
                  local_tensors: Sequence[int] = (), remote_tensors: Sequence[int] = (),
                  local_runs: Sequence[tuple[int, int]] = (), remote_runs: Sequence[tuple[int, int]] = (),
                  peer: int | None = None) -> None:
        """One native transfer (``mode_name``: a ``_core.TransferMode`` name). ``key=None``
        addresses raw remote memory (``peer`` then names the cluster and ``remote_runs`` hold
        absolute addresses)."""
        # A transfer of whole slots is described by a few small values, and its spec (several
        # microseconds to build) is kept for the next call with the same ones; keys are immutable
        # values. Specs are only read by the engine, so one may serve several threads at once.
        k = None
        if not (local_blocks or remote_blocks or local_runs or remote_runs):
            k = (key, cache.cache_id, mode_name, slot, size, tuple(local_tensors), tuple(remote_tensors), peer)
        spec = self._specs.get(k) if k is not None else None
        if spec is None:
            cluster = peer if key is None else key.cluster_id
            assert cluster is not None  # key=None comes with peer (raw remote memory)
            spec = kv.TransferSpec(
                peer_cluster_id=cluster, target=remote_target(key),
                local_cache_id=cache.cache_id, mode=transfer_mode(mode_name), local_slot=slot, size=size,
                local_blocks=local_blocks, remote_blocks=remote_blocks, local_tensors=local_tensors,
                remote_tensors=remote_tensors, local_runs=local_runs, remote_runs=remote_runs)
            if k is not None:
                if len(self._specs) >= self._PREPARED_MAX:
                    self._specs.clear()
                self._specs[k] = spec
        engine = self._live_engine()
        try:  # not raising_as: a hot path, and a try costs nothing until it raises
            (engine.kv.push if is_push else engine.kv.pull)(spec)
        except LLMException as e:
            raise llm_failure(op, e) from None

    # At most this many prepared transfers (and as many slot specs) are kept per manager; past it they
    # are made again.
    _PREPARED_MAX = 1024

    def _prepared_for(self, op: str, key: BlocksCacheKey, cache: Cache, local_tensors: Sequence[int] = (),
                      remote_tensors: Sequence[int] = ()) -> Any:
        """The prepared blocks transfer between local ``cache`` and the remote blocks cache ``key``
        (a ``pdlink.kv.PreparedBlocks``), made on first use."""
        engine = self._live_engine()
        k: tuple[Any, ...] = (cache.cache_id, key.cluster_id, key.model_id)  # what the plain calls look up
        if local_tensors or remote_tensors:
            k += (tuple(local_tensors), tuple(remote_tensors))
        prepared = self._prepared.get(k)
        if prepared is None:
            spec = kv.TransferSpec(peer_cluster_id=key.cluster_id, target=remote_target(key),
                                       local_cache_id=cache.cache_id, local_tensors=local_tensors,
                                       remote_tensors=remote_tensors)
            with raising_as(op):
                prepared = engine.kv.prepare(spec)
            if len(self._prepared) >= self._PREPARED_MAX:
                self._prepared.clear()
            self._prepared[k] = prepared
        return prepared

    def _stale(self, k: tuple[Any, ...], error: LLMException) -> bool:
        """Whether ``error`` is a prepared transfer's ``LLM_STALE_EPOCH`` (the peer switched its role
        since the transfer was prepared: docs/architecture.md, "Roles"); then the transfer kept under
        ``k`` is forgotten. A prepared transfer is only this layer's way of making a plain call
        cheaper, so a stale one is prepared again and the call goes on: an llm_datadist program
        never sees pdlink's own code."""
        if error.status_code != LLMStatusCode.LLM_STALE_EPOCH:
            return False
        self._prepared.pop(k, None)
        return True

    def _post_prepared(self, op: str, key: BlocksCacheKey, cache: Cache, local_tensors: Sequence[int],
                       remote_tensors: Sequence[int], local: Sequence[int], remote: Sequence[int],
                       is_push: bool) -> None:
        """Posts the prepared transfer of ``_prepared_for`` (prepared again once if it was stale)."""
        k: tuple[Any, ...] = (cache.cache_id, key.cluster_id, key.model_id)
        if local_tensors or remote_tensors:
            k += (tuple(local_tensors), tuple(remote_tensors))
        for again in (True, False):
            prepared = self._prepared_for(op, key, cache, local_tensors, remote_tensors)
            try:
                prepared.post(local, remote, is_push)
                return
            except LLMException as e:
                if not (again and self._stale(k, e)):
                    raise llm_failure(op, e) from None

    def _forget_prepared(self, cache_id: int) -> None:
        for k in [k for k in self._prepared if k[0] == cache_id]:
            self._prepared.pop(k, None)
        for k in [k for k in self._specs if k[1] == cache_id]:
            self._specs.pop(k, None)

    @staticmethod
    def _pull_kwargs(cache: Cache, kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
        if not kwargs:  # the common call: every tensor, no layer ranges
            return [], []
        unknown = sorted(set(kwargs) - set(_PULL_KWARGS))
        raise_if_false(not unknown, f"unsupported keyword arguments: {unknown}")
        return _layer_tensors(
            cache,
            kwargs.get("src_layer_range"),
            kwargs.get("dst_layer_range"),
            kwargs.get("tensor_num_per_layer", 2),
        )

    # ------------------------------------------------------------------ registration

    def register_cache(self, cache_desc: CacheDesc, addrs: list[int], cache_keys: Sequence[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache:
        """Register user memory as a contiguous cache; ``cache_keys[i]`` names batch slot ``i``."""
        engine = self._live_engine()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        addrs = self._check_addrs(cache_desc, addrs, exact=True)
        keys = self._keys(cache_keys)
        ra = self._remote_accessible(cache_desc, remote_accessible)
        with raising_as("register_cache"):
            handle = engine.kv.register(self._layout(cache_desc, False), addrs, keys, None, ra)
        return self._new_cache(cache_desc, handle, False)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """Register user memory as a blocks (paged) cache; a key publishes it under its model_id."""
        engine = self._live_engine()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        addrs = self._check_addrs(cache_desc, addrs, exact=True)
        ra = self._remote_accessible(cache_desc, remote_accessible)
        model = blocks_cache_key.model_id if blocks_cache_key is not None else None
        with raising_as("register_blocks_cache"):
            handle = engine.kv.register(self._layout(cache_desc, True), addrs, [], model, ra)
        return self._new_cache(cache_desc, handle, True)

    def unregister_cache(self, cache_id: int) -> None:
        """Remove a registered cache (and its keys). Call after unlinking its peers."""
        engine = self._live_engine()
        check_int64("cache_id", cache_id)
        with raising_as("unregister_cache"):
            engine.kv.unregister(cache_id)
        self._forget_prepared(cache_id)

    # ------------------------------------------------------------------ pool allocation

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """Allocate a contiguous cache from the memory pool of its placement."""
        engine = self._live_engine()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        keys = self._keys(cache_keys)
        self._check_pool(cache_desc)
        with raising_as("allocate_cache"):
            handle = engine.kv.allocate(self._layout(cache_desc, False), keys, None)
        return self._new_cache(cache_desc, handle, False)

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        """Allocate a blocks cache from the memory pool of its placement."""
        engine = self._live_engine()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        self._check_pool(cache_desc)
        model = blocks_cache_key.model_id if blocks_cache_key is not None else None
        with raising_as("allocate_blocks_cache"):
            handle = engine.kv.allocate(self._layout(cache_desc, True), [], model)
        return self._new_cache(cache_desc, handle, True)

    def deallocate_cache(self, cache: Cache) -> None:
        """Drop the id reference of an allocated cache; freed once its keys are gone too."""
        engine = self._live_engine()
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_true(cache.is_blocks_cache,
                      "deallocate_cache does not accept a blocks cache; use deallocate_blocks_cache")
        with raising_as("deallocate_cache"):
            engine.kv.deallocate(cache.cache_id, False)
        self._forget_prepared(cache.cache_id)
        cache._invalidate()

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Free an allocated blocks cache."""
        engine = self._live_engine()
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_false(cache.is_blocks_cache, "deallocate_blocks_cache needs a blocks cache; use deallocate_cache")
        with raising_as("deallocate_blocks_cache"):
            engine.kv.deallocate(cache.cache_id, True)
        self._forget_prepared(cache.cache_id)
        cache._invalidate()

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unpublish a key; a no-op when it is absent (e.g. already consumed by a pull)."""
        engine = self._live_engine()
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        engine.kv.remove_key(cache_key.req_id, cache_key.prefix_id, cache_key.model_id)

    # ------------------------------------------------------------------ pull

    def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache, batch_index: int = 0,
                   size: int = -1, **kwargs: Any) -> None:
        """Copy one remote batch slot into slot ``batch_index`` of the local contiguous ``cache``."""
        self._live_engine()
        if self._remote_cache_accessible:
            check_isinstance("cache_key", cache_key, CacheKeyByIdAndIndex, allow_none=False)
        else:
            check_isinstance("cache_key", cache_key, [CacheKey, CacheKeyByIdAndIndex], allow_none=False)
        _check_cache("cache", cache)
        check_uint32("batch_index", batch_index)
        check_int64("size", size)
        raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, got {size}")
        raise_if_true(cache.is_blocks_cache, "pull_cache needs a non-blocks cache; use pull_blocks")
        src_t, dst_t = self._pull_kwargs(cache, kwargs)
        self._transfer("pull_cache", False, cache_key, cache, "SLOT_TO_SLOT", slot=batch_index, size=size,
                       local_tensors=dst_t, remote_tensors=src_t)

    def pull_blocks(self, src_cache_key: KeyLike, dst_cache: Cache, src_blocks: Sequence[int] = (),
                    dst_blocks: Sequence[int] = (), **kwargs: Any) -> None:
        """Copy remote blocks ``src_blocks[i]`` into local blocks ``dst_blocks[i]``.

        With a ``CacheKey`` / ``CacheKeyByIdAndIndex`` source, ``src_blocks`` must be empty and
        the remote slot is split into consecutive blocks (contiguous -> blocks).
        """
        # The common call, a BlocksCacheKey and two equally long lists for a cache already prepared
        # with that key, posts at once: the checks of the general path passed when it was prepared
        # and every one of them still holds (keys are immutable, an unregistered cache's prepared
        # transfers are forgotten); the native post checks that the elements are ints (TypeError
        # otherwise, and the general path then raises llm_datadist's error). push_blocks does the same.
        if (not kwargs and type(src_cache_key) is BlocksCacheKey and type(dst_cache) is Cache
                and type(src_blocks) is list and type(dst_blocks) is list and self._initialized
                and 0 < len(dst_blocks) == len(src_blocks)):
            k = (dst_cache.cache_id, src_cache_key.cluster_id, src_cache_key.model_id)
            prepared = self._prepared.get(k)
            if prepared is not None:
                try:
                    prepared.post(dst_blocks, src_blocks, False)
                    return
                except TypeError:
                    pass
                except LLMException as e:
                    if not self._stale(k, e):
                        raise llm_failure("pull_blocks", e) from None
        self._live_engine()
        check_isinstance("src_cache_key", src_cache_key, [CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey],
                         allow_none=False)
        _check_cache("dst_cache", dst_cache)
        src_blocks = _block_list("src_blocks", src_blocks)
        dst_blocks = _block_list("dst_blocks", dst_blocks)
        raise_if_false(dst_cache.is_blocks_cache, "pull_blocks needs a blocks dst_cache")
        if isinstance(src_cache_key, BlocksCacheKey):
            _check_block_pairs(src_blocks, dst_blocks)
            src_t, dst_t = self._pull_kwargs(dst_cache, kwargs)
            self._post_prepared("pull_blocks", src_cache_key, dst_cache, dst_t, src_t, dst_blocks, src_blocks, False)
            return
        else:
            raise_if_false(len(dst_blocks) > 0, "dst_blocks must not be empty")
            raise_if_false(len(src_blocks) == 0, "src_blocks must be empty when pulling from a contiguous cache key")
        src_t, dst_t = self._pull_kwargs(dst_cache, kwargs)
        self._transfer("pull_blocks", False, src_cache_key, dst_cache, "SLOT_TO_BLOCKS", local_blocks=dst_blocks,
                       local_tensors=dst_t, remote_tensors=src_t)

    # ------------------------------------------------------------------ push

    def _check_push_enabled(self) -> None:
        raise_if_false(self._remote_cache_accessible,
                       "push needs LLMConfig.enable_remote_cache_accessible = True at init")

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   size: int = -1, tensor_num_per_layer: int = 2) -> None:
        """Write local slot ``src_batch_index`` into the remote ``(cache_id, batch_index)`` slot."""
        self._live_engine()
        self._check_push_enabled()
        check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex, allow_none=False)
        _check_cache("src_cache", src_cache)
        check_uint32("src_batch_index", src_batch_index)
        check_int64("size", size)
        raise_if_false(size == -1, "push_cache only pushes whole slots: size must be -1")
        raise_if_true(src_cache.is_blocks_cache, "push_cache needs a non-blocks src_cache; use push_blocks")
        src_t, dst_t = _layer_tensors(src_cache, src_layer_range, dst_layer_range, tensor_num_per_layer)
        self._transfer("push_cache", True, dst_cache_key, src_cache, "SLOT_TO_SLOT", slot=src_batch_index,
                       local_tensors=src_t, remote_tensors=dst_t)

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache, src_blocks: Sequence[int] = (),
                    dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """Write local blocks ``src_blocks[i]`` into remote blocks ``dst_blocks[i]``."""
        if (src_layer_range is None and dst_layer_range is None and type(dst_cache_key) is BlocksCacheKey
                and type(src_cache) is Cache and type(src_blocks) is list and type(dst_blocks) is list
                and self._initialized and self._remote_cache_accessible and type(tensor_num_per_layer) is int
                and 0 < tensor_num_per_layer <= UINT32_MAX and 0 < len(dst_blocks) == len(src_blocks)):
            k = (src_cache.cache_id, dst_cache_key.cluster_id, dst_cache_key.model_id)
            prepared = self._prepared.get(k)
            if prepared is not None:  # the common call (see pull_blocks)
                try:
                    prepared.post(src_blocks, dst_blocks, True)
                    return
                except TypeError:
                    pass
                except LLMException as e:
                    if not self._stale(k, e):
                        raise llm_failure("push_blocks", e) from None
        self._live_engine()
        self._check_push_enabled()
        check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey, allow_none=False)
        _check_cache("src_cache", src_cache)
        src_blocks = _block_list("src_blocks", src_blocks)
        dst_blocks = _block_list("dst_blocks", dst_blocks)
        raise_if_false(src_cache.is_blocks_cache, "push_blocks needs a blocks src_cache")
        _check_block_pairs(src_blocks, dst_blocks)
        src_t, dst_t = _layer_tensors(src_cache, src_layer_range, dst_layer_range, tensor_num_per_layer)
        self._post_prepared("push_blocks", dst_cache_key, src_cache, src_t, dst_t, src_blocks, dst_blocks, True)

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
                             src_block_indices: Sequence[int] | None = None,
                             dst_block_indices: Sequence[int] | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """Push ``src_cache`` layer by layer as ``layer_synchronizer`` releases each layer
        (llm_datadist_api.md §8.5, §10.5).

        Configs are ``TransferWithCacheKeyConfig`` with ``enable_remote_cache_accessible`` and
        ``TransferConfig`` (raw remote addresses) without. Returns a ``CacheTask`` at once; see
        ``pdlink.transfer`` for the algorithm.
        """
        from .transfer import transfer_cache_async

        self._live_engine()
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        raise_if_true(src_cache.cache_desc.placement == Placement.HOST, "src cache not support placement HOST")
        return transfer_cache_async(self._transfer, src_cache, src_cache.is_blocks_cache, layer_synchronizer,
                                    transfer_configs, src_block_indices, dst_block_indices, dst_block_memory_size,
                                    remote_cache_accessible=self._remote_cache_accessible,
                                    timeout_code=LLMStatusCode.LLM_TIMEOUT, tasks=self._async_tasks)

    # ------------------------------------------------------------------ local copies

    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: int | None = None) -> None:
        """Copy one batch slot (from ``offset``, ``size`` bytes or the rest) between two local caches."""
        engine = self._live_engine()
        _check_cache("dst", dst)
        _check_cache("src", src)
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_int64("offset", offset)
        check_int64("size", size)
        check_isinstance("req_id", req_id, int)
        raise_if_true(dst.is_blocks_cache or src.is_blocks_cache, "copy_cache needs two non-blocks caches")
        raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, got {size}")
        raise_if_false(offset >= 0, f"offset must be >= 0, got {offset}")
        dd, sd = dst.cache_desc, src.cache_desc
        raise_if_false(dd.num_tensors == sd.num_tensors, "dst and src have different num_tensors")
        d_stride, s_stride = dd.size // dd.shape[0], sd.size // sd.shape[0]
        raise_if_false(dst_batch_index < dd.shape[0], f"dst_batch_index {dst_batch_index} out of range")
        raise_if_false(src_batch_index < sd.shape[0], f"src_batch_index {src_batch_index} out of range")
        length = size if size > 0 else s_stride - offset
        raise_if_false(length > 0 and offset + length <= min(d_stride, s_stride),
                       f"offset {offset} + size {length} exceeds the slot size ({min(d_stride, s_stride)} bytes)")
        runs = [(dst_batch_index * d_stride + offset, src_batch_index * s_stride + offset, length)]
        with raising_as("copy_cache"):
            engine.kv.copy_local(dst.tensor_addrs, kv.placement(dd.placement), src.tensor_addrs,
                                 kv.placement(sd.placement), runs)

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """Copy blocks within one blocks cache: ``{src_block: [dst_block, ...]}``."""
        engine = self._live_engine()
        _check_cache("cache", cache)
        check_dict("copy_block_info", copy_block_info, int, (list, tuple))
        raise_if_false(cache.is_blocks_cache, "copy_blocks needs a blocks cache")
        num_blocks = cache.cache_desc.shape[0]
        stride = cache.cache_desc.size // num_blocks
        runs: list[tuple[int, int, int]] = []
        for src, dsts in copy_block_info.items():
            check_list_int64("copy_block_info value", dsts)
            for dst in [src, *dsts]:
                raise_if_false(0 <= dst < num_blocks, f"block index {dst} out of range [0, {num_blocks})")
            runs.extend((dst * stride, src * stride, stride) for dst in dsts)
        placement = kv.placement(cache.cache_desc.placement)
        with raising_as("copy_blocks"):
            engine.kv.copy_local(cache.tensor_addrs, placement, cache.tensor_addrs, placement, runs)

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """Swap blocks in (HOST -> DEVICE) or out (DEVICE -> HOST); accepts ``create_cpu_cache`` handles."""
        engine = self._live_engine()
        # A None cache raises AttributeError here, as llm_datadist does (llm_datadist_api.md §3.2).
        src_desc, dst_desc = src_cache.cache_desc, dst_cache.cache_desc
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        check_dict("src_to_dst", src_to_dst, int, int)
        raise_if_false(src_cache.is_blocks_cache and dst_cache.is_blocks_cache, "swap_blocks needs two blocks caches")
        raise_if_false(src_desc.num_tensors == dst_desc.num_tensors, "src and dst have different num_tensors")
        s_block = src_desc.size // src_desc.batch_size
        d_block = dst_desc.size // dst_desc.batch_size
        raise_if_false(s_block == d_block, f"block sizes differ: src {s_block} bytes, dst {d_block} bytes")
        raise_if_false(
            {src_desc.placement, dst_desc.placement} == {Placement.HOST, Placement.DEVICE},
            "swap_blocks copies HOST -> DEVICE (swap in) or DEVICE -> HOST (swap out)",
        )
        s_n, d_n = src_desc.shape[0], dst_desc.shape[0]
        runs = []
        for s, d in src_to_dst.items():
            raise_if_false(0 <= s < s_n, f"src block {s} out of range [0, {s_n})")
            raise_if_false(0 <= d < d_n, f"dst block {d} out of range [0, {d_n})")
            runs.append((d * d_block, s * s_block, s_block))
        with raising_as("swap_blocks"):
            engine.kv.copy_local(dst_cache.tensor_addrs, kv.placement(dst_desc.placement), src_cache.tensor_addrs,
                                 kv.placement(src_desc.placement), runs)

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Reserved in llm_datadist (DEVICE memory after a UCE fault); not supported by pdlink."""
        self._live_engine()
        infos = mem_infos if isinstance(mem_infos, (list, tuple)) else [mem_infos]
        check_list_of("mem_infos", infos, MemInfo)
        for info in infos:
            raise_if_false(info.mem_type == Memtype.MEM_TYPE_DEVICE,
                           "remap_registered_memory supports DEVICE memory only")
            raise_if_false(info.addr != 0 and info.size > 0, "mem_info addr must be != 0 and size > 0")
        handle_llm_status(LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "remap_registered_memory",
                          "memory remapping is a reserved llm_datadist feature that pdlink does not provide")

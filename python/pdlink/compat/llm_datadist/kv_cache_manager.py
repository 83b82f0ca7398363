"""``KvCacheManager``: llm_datadist's v1 ("KvCacheManager mode") cache API (llm_datadist_api.md §9).

v1 runs on the same native engine as CacheManager mode. What is v1-specific lives here:

* **roles**: only a PROMPT publishes keys (``allocate_cache`` keys, ``remove_cache_key``), only a
  DECODER pulls (``pull_cache``, ``pull_blocks``) and a DECODER may not publish a blocks cache.
  A call from the wrong role is ``LLMException(LLM_PARAM_INVALID)`` naming the role it needs
  (the v1 engine's rule);
* **memory**: every cache comes from the device pool (HOST placement is rejected, except for
  ``create_cpu_cache`` handles in ``swap_blocks``), and one ``deallocate_cache`` frees both
  kinds; an unknown or already freed cache is ``LLM_KV_CACHE_NOT_EXIST``;
* **handles**: ``KvCache`` with ``per_device_tensor_addrs`` and auto-deallocation in ``__del__``;
* **devices**: in single-process multi-device mode there is one engine per device and every
  operation fans out to all of them (device ``i`` pulls from the peer's device ``i``).

Argument checks and transfers are delegated to one internal ``CacheManager`` per device, so the
rules shared with CacheManager mode are written once.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ... import kv as kv_api
from ...status import LLMException, LLMStatusCode
from ._utils import (
    check_dict,
    check_int32,
    check_int64,
    check_isinstance,
    check_list_of,
    check_uint32,
    check_uint64,
    llm_api,
    raise_if_false,
    raise_if_true,
    raising_as,
)
from .cache_manager import CacheManager, remote_target
from .configs import LLMRole
from .llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCache,
    Placement,
)

__all__ = ["KvCacheManager"]

logger = logging.getLogger("pdlink")

_T = TypeVar("_T")

_LAYER_KWARGS = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")
_OFFSET_KWARGS = ("src_cache_offset", "dst_cache_offset")

# One byte of process memory used to advance a device's cache-id counter (see _pad_ids).
_ID_PAD = ctypes.c_uint8(0)


def fan_out(count: int, fn: Callable[[int], _T]) -> list[_T]:
    """Run ``fn(i)`` for every device index ``i`` (in parallel when there are several) and
    return the results in order; re-raises the first device's exception after all finished."""
    if count == 1:
        return [fn(0)]
    results: list[Any] = [None] * count
    errors: list[BaseException | None] = [None] * count

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"pdlink-dev{i}", daemon=True) for i in range(1, count)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def _snapshot(desc: CacheDesc) -> CacheDesc:
    """A private copy of ``desc``: later ``update_dim`` calls on the user's object must not change
    the layout the manager computes byte ranges from."""
    return CacheDesc(desc.num_tensors, list(desc.shape), desc.data_type, desc.placement, desc.batch_dim,
                     desc.seq_len_dim_index, desc.kv_tensor_format)


def _offset(name: str, value: Any) -> int:
    """``src_cache_offset`` / ``dst_cache_offset``: None or -1 = unused, else an int64 >= 0."""
    if value is None:
        return -1
    check_int64(name, value)
    raise_if_false(value >= -1, f"{name} must be >= 0 (or -1: unused), got {value}")
    return value


@llm_api
class KvCacheManager:
    """Allocates, moves and frees the KV caches of a v1-mode ``LLMDataDist`` (llm_datadist_api.md §9).

    Obtain it from ``LLMDataDist.kv_cache_manager``; do not construct it yourself.
    Threading: methods may be called from several threads (llm_datadist documents most v1
    calls as not concurrency-safe; pdlink serialises per link in the engine).
    """

    def __init__(self, owner: Any, managers: Sequence[CacheManager], role: LLMRole) -> None:
        self._owner = owner
        self._cms: list[CacheManager] = list(managers)
        self._role = role
        self._initialized = True
        self._lock = threading.RLock()
        # public cache id -> (handle token, one internal Cache per device)
        self._live: dict[int, tuple[object, list[Cache]]] = {}

    # ------------------------------------------------------------------ state

    def is_initialized(self) -> bool:
        """False once the owning ``LLMDataDist`` was finalized."""
        return self._initialized

    @property
    def num_devices(self) -> int:
        """Number of devices (engines) this manager fans out to (pdlink extension)."""
        return len(self._cms)

    def _check_live(self) -> None:
        if not self._initialized:
            raise RuntimeError("llm datadist is not initialized")

    def _invalidate(self) -> None:
        with self._lock:
            self._initialized = False
            self._live.clear()
        for cm in self._cms:
            cm._invalidate()

    def _switch_role(self, role: LLMRole) -> None:
        logger.info("[switch_role] KvCacheManager %s -> %s", self._role, role)
        self._role = role

    def _check_role(self, op: str, role: LLMRole) -> None:
        raise_if_false(self._role == role,
                       f"{op} is not supported by {self._role}: it requires {role} (KvCacheManager mode)")

    def _entry(self, op: str, name: str, cache: KvCache,
               missing: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID) -> list[Cache]:
        """The per-device internal caches of a live handle allocated by this manager."""
        entry = self._live.get(cache.cache_id)
        if (cache._manager is not self or entry is None or entry[0] is not cache._token
                or not cache._valid):
            msg = (f"{op} failed, {name} (cache_id={cache.cache_id}) is not a live cache of this "
                   "KvCacheManager (deallocated, or allocated by another LLMDataDist)")
            logger.error(msg)
            raise LLMException(msg, status_code=missing)
        return entry[1]

    # ------------------------------------------------------------------ allocation

    def _allocate(self, op: str, desc: CacheDesc, keys: Sequence[CacheKey],
                  blocks_key: BlocksCacheKey | None, is_blocks: bool) -> KvCache:
        layout = _snapshot(desc)
        made: list[Cache] = []
        try:
            for cm in self._cms:
                if is_blocks:
                    made.append(cm.allocate_blocks_cache(layout, blocks_key))
                else:
                    made.append(cm.allocate_cache(layout, keys))
        except BaseException:
            self._rollback(made, keys)
            raise
        kv = KvCache(made[0].cache_id, desc, [list(c.tensor_addrs) for c in made], self)
        kv._token = token = object()
        with self._lock:
            self._live[kv.cache_id] = (token, made)
        if any(c.cache_id != kv.cache_id for c in made):
            logger.warning("%s: cache ids differ across devices: %s", op, [c.cache_id for c in made])
        logger.info("%s success, cache_id = %d", op, kv.cache_id)
        return kv

    def _rollback(self, made: list[Cache], keys: Sequence[CacheKey]) -> None:
        """Undo a multi-device allocation that failed on device ``len(made)``."""
        for i, cache in enumerate(made):
            try:
                self._free(i, cache)
                for key in keys:
                    self._cms[i].remove_cache_key(key)
            except Exception as e:  # noqa: BLE001 - the original error is what the caller sees
                logger.error("rollback of cache %d on device %d failed: %s", cache.cache_id, i, e)
        if made:
            self._pad_ids(range(len(made), len(self._cms)))

    def _pad_ids(self, devices: Any) -> None:
        """Cache ids count per engine. After a partial multi-device failure, the devices that did
        not allocate consume one id too (a one-byte placeholder registered and removed at once),
        so ids stay equal across devices (peers pull by ``CacheKeyByIdAndIndex`` per device)."""
        for i in devices:
            engine = self._cms[i]._engine
            try:
                layout = kv_api.CacheLayout(1, 1, 1, False, kv_api.placement(Placement.DEVICE))
                with raising_as("allocate_cache"):
                    cache_id, _ = engine.kv.register(layout, [ctypes.addressof(_ID_PAD)], [], None, False)
                with raising_as("unregister_cache"):
                    engine.kv.unregister(cache_id)
            except Exception as e:  # noqa: BLE001
                logger.error("could not realign cache ids on device %d: %s", i, e)

    def _free(self, device: int, cache: Cache) -> None:
        cm = self._cms[device]
        if cache.is_blocks_cache:
            cm.deallocate_blocks_cache(cache)
        else:
            cm.deallocate_cache(cache)

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> KvCache:
        """Allocate a contiguous cache from the device pool.

        ``cache_keys[i]`` publishes batch slot ``i`` for DECODER pulls (PROMPT only; pad unused
        slots with ``req_id = 2**64-1``). The cache is freed once ``deallocate_cache`` was called
        and every key was pulled or removed.
        """
        self._check_live()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_list_of("cache_keys", cache_keys, CacheKey)
        raise_if_false(cache_desc.num_tensors > 0, "num_tensors should be bigger than zero.")
        raise_if_false(cache_desc.placement == Placement.DEVICE, "Only support allocate device cache")
        if self._role != LLMRole.PROMPT:
            raise_if_true(len(cache_keys) > 0,
                          f"[allocate_cache] cache_keys are not supported by {self._role}: "
                          "publishing keys requires LLMRole.PROMPT")
        return self._allocate("[allocate_cache]", cache_desc, cache_keys, None, False)

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
                              ) -> KvCache:
        """Allocate a blocks (paged) cache from the device pool; a key publishes it under its
        ``model_id`` (not allowed for a DECODER)."""
        self._check_live()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        raise_if_false(cache_desc.num_tensors > 0, "num_tensors should be bigger than zero.")
        raise_if_false(cache_desc.placement == Placement.DEVICE, "Only support allocate device cache")
        if self._role == LLMRole.DECODER:
            raise_if_true(blocks_cache_key is not None,
                          f"[allocate_blocks_cache] blocks_cache_key is not supported by {self._role}: "
                          "publishing a blocks cache requires LLMRole.PROMPT")
        return self._allocate("[allocate_blocks_cache]", cache_desc, (), blocks_cache_key, True)

    def deallocate_cache(self, cache: KvCache) -> None:
        """Drop the cache id's reference (contiguous and blocks caches alike). Memory returns to
        the pool once no key refers to it. ``LLM_KV_CACHE_NOT_EXIST`` for an unknown cache."""
        self._check_live()
        check_isinstance("cache", cache, KvCache, allow_none=False)
        raise_if_true(cache.cache_desc.placement == Placement.HOST, "Only support device cache")
        with self._lock:
            caches = self._entry("[deallocate_cache]", "cache", cache, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
            del self._live[cache.cache_id]
        cache._invalidate()
        self._release(caches)
        logger.info("[deallocate_cache] success, cache_id = %d", cache.cache_id)

    def _release(self, caches: list[Cache]) -> None:
        # Sequential on purpose: freeing is a quick local operation, and this also runs from
        # KvCache.__del__, where starting threads is not safe (e.g. during interpreter exit).
        errors = []
        for i, cache in enumerate(caches):
            try:
                self._free(i, cache)
            except Exception as e:  # noqa: BLE001 - free the other devices first
                errors.append(e)
        if errors:
            raise errors[0]

    def _deallocate_on_del(self, cache: KvCache) -> None:
        """Called by ``KvCache.__del__``: free a still-valid handle silently. Nothing to do during
        interpreter exit: the engines release their pools as they go."""
        if not self._initialized or sys.is_finalizing():
            return
        with self._lock:
            entry = self._live.get(cache.cache_id)
            if entry is None or entry[0] is not cache._token:
                return
            del self._live[cache.cache_id]
        cache._valid = False
        self._release(entry[1])
        logger.info("KvCache %d deallocated by its finalizer", cache.cache_id)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unpublish a key (PROMPT only); a no-op when it was already pulled or removed."""
        self._check_live()
        self._check_role("[remove_cache_key]", LLMRole.PROMPT)
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        for cm in self._cms:
            cm.remove_cache_key(cache_key)

    # ------------------------------------------------------------------ pull

    def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, kv_cache: KvCache, batch_index: int = 0,
                   size: int = -1, **kwargs: Any) -> None:
        """Copy a remote batch slot into slot ``batch_index`` of ``kv_cache`` (DECODER only).

        kwargs: ``src_layer_range``, ``dst_layer_range``, ``tensor_num_per_layer`` (as in
        CacheManager mode) and ``src_cache_offset`` / ``dst_cache_offset`` (>= 0; -1 = unused).
        With an offset, ``size`` bytes per tensor (-1: the rest of the local slot after
        ``dst_cache_offset``) are copied from ``src_cache_offset`` in the remote slot to
        ``dst_cache_offset`` in local slot ``batch_index``; an unset offset counts as 0.
        A successful pull by ``CacheKey`` releases that key on the prompt side.
        """
        self._check_live()
        self._check_role("[pull_cache]", LLMRole.DECODER)
        check_isinstance("cache_key", cache_key, [CacheKey, CacheKeyByIdAndIndex], allow_none=False)
        check_isinstance("kv_cache", kv_cache, KvCache, allow_none=False)
        raise_if_true(kv_cache.cache_desc.placement == Placement.HOST, "Only support device cache")
        check_int64("size", size)
        check_uint32("batch_index", batch_index)
        raise_if_false(size == -1 or size > 0, f"[pull_cache] size ({size}) is invalid, should be -1 or > 0")
        unknown = sorted(set(kwargs) - set(_LAYER_KWARGS) - set(_OFFSET_KWARGS))
        raise_if_false(not unknown, f"[pull_cache] unsupported keyword arguments: {unknown}")
        src_off = _offset("src_cache_offset", kwargs.get("src_cache_offset"))
        dst_off = _offset("dst_cache_offset", kwargs.get("dst_cache_offset"))
        layer_kwargs = {k: v for k, v in kwargs.items() if k in _LAYER_KWARGS}
        remote_target(cache_key)  # exactly one of req_id / prefix_id must be valid
        caches = self._entry("[pull_cache]", "kv_cache", kv_cache)
        if src_off < 0 and dst_off < 0:
            fan_out(len(caches), lambda i: self._cms[i].pull_cache(cache_key, caches[i], batch_index, size,
                                                                   **layer_kwargs))
            return
        layout = caches[0]
        raise_if_true(layout.is_blocks_cache, "[pull_cache] needs a non-blocks cache; use pull_blocks")
        num_slots = layout.cache_desc.shape[0]
        stride = layout.cache_desc.size // num_slots
        raise_if_false(batch_index < num_slots,
                       f"[pull_cache] batch_index {batch_index} out of range: batch size is {num_slots}")
        src_off, dst_off = max(src_off, 0), max(dst_off, 0)
        length = size if size > 0 else stride - dst_off
        raise_if_false(length > 0 and dst_off + length <= stride,
                       f"[pull_cache] dst_cache_offset ({dst_off}) + size ({length}) exceeds the slot size "
                       f"({stride} bytes)")
        src_t, dst_t = CacheManager._pull_kwargs(layout, layer_kwargs)
        local_runs = [(batch_index * stride + dst_off, length)]
        remote_runs = [(src_off, length)]
        fan_out(len(caches), lambda i: self._cms[i]._transfer(
            "pull_cache", False, cache_key, caches[i], "EXPLICIT", local_runs=local_runs,
            remote_runs=remote_runs, local_tensors=dst_t, remote_tensors=src_t))

    def pull_blocks(self, prompt_cache_key: BlocksCacheKey, decoder_kv_cache: KvCache, prompt_blocks: list[int],
                    decoder_blocks: list[int], **kwargs: Any) -> None:
        """Copy the prompt's blocks ``prompt_blocks[i]`` into local blocks ``decoder_blocks[i]``
        (DECODER only). Both lists must be ``list`` objects, non-empty and of equal length.
        kwargs: ``src_layer_range``, ``dst_layer_range``, ``tensor_num_per_layer``."""
        self._check_live()
        self._check_role("[pull_blocks]", LLMRole.DECODER)
        check_isinstance("prompt_cache_key", prompt_cache_key, BlocksCacheKey, allow_none=False)
        check_isinstance("decoder_kv_cache", decoder_kv_cache, KvCache, allow_none=False)
        check_list_of("prompt_blocks", prompt_blocks, int, seq_types=list)
        check_list_of("decoder_blocks", decoder_blocks, int, seq_types=list)
        raise_if_true(decoder_kv_cache.cache_desc.placement == Placement.HOST, "Only support device cache")
        raise_if_false(len(prompt_blocks) > 0, "prompt_blocks can not be empty.")
        raise_if_false(len(decoder_blocks) > 0, "decoder_blocks can not be empty.")
        raise_if_false(len(prompt_blocks) == len(decoder_blocks),
                       "Param prompt_blocks and decoder_blocks size should be same.")
        caches = self._entry("[pull_blocks]", "decoder_kv_cache", decoder_kv_cache)
        fan_out(len(caches), lambda i: self._cms[i].pull_blocks(prompt_cache_key, caches[i], prompt_blocks,
                                                                decoder_blocks, **kwargs))

    # ------------------------------------------------------------------ local copies

    def copy_cache(self, dst: KvCache, src: KvCache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: int | None = None) -> None:
        """Copy one batch slot (from byte ``offset``, ``size`` bytes or the rest) between two
        contiguous caches of this manager, on every device."""
        self._check_live()
        check_isinstance("dst", dst, KvCache, allow_none=False)
        raise_if_true(dst.cache_desc.placement == Placement.HOST, "Only support device cache")
        check_isinstance("src", src, KvCache, allow_none=False)
        raise_if_true(src.cache_desc.placement == Placement.HOST, "Only support device cache")
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_uint64("offset", offset)
        check_int64("size", size)
        raise_if_false(size == -1 or size > 0, f"[copy_cache] size ({size}) is invalid, should be -1 or > 0")
        check_isinstance("req_id", req_id, int)
        d = self._entry("[copy_cache]", "dst", dst)
        s = self._entry("[copy_cache]", "src", src)
        for i, cm in enumerate(self._cms):
            cm.copy_cache(d[i], s[i], dst_batch_index, src_batch_index, offset, size, req_id)

    def copy_blocks(self, cache: KvCache, copy_block_info: dict[int, list[int]]) -> None:
        """Copy blocks within one blocks cache: ``{src_block: [dst_block, ...]}``, on every device."""
        self._check_live()
        check_isinstance("cache", cache, KvCache, allow_none=False)
        check_dict("copy_block_info", copy_block_info, int, list)
        raise_if_true(cache.cache_desc.placement == Placement.HOST, "Only support device cache")
        for src_block, dst_blocks in copy_block_info.items():
            check_uint64("src_block", src_block)
            for dst_block in dst_blocks:
                check_uint64("dst_block", dst_block)
        caches = self._entry("[copy_blocks]", "cache", cache)
        for i, cm in enumerate(self._cms):
            cm.copy_blocks(caches[i], copy_block_info)

    def swap_blocks(self, src: KvCache, dst: KvCache, src_to_dst: dict[int, int]) -> None:
        """Swap blocks in (HOST -> DEVICE) or out (DEVICE -> HOST). The HOST side is a
        ``KvCache.create_cpu_cache`` handle with one address list per device; the DEVICE side
        must be a live cache of this manager."""
        self._check_live()
        # A None cache raises AttributeError here, as llm_datadist does (llm_datadist_api.md §3.2).
        src_desc, dst_desc = src.cache_desc, dst.cache_desc
        check_isinstance("src", src, KvCache, allow_none=False)
        check_isinstance("dst", dst, KvCache, allow_none=False)
        check_dict("src_to_dst", src_to_dst, int, int)
        sides = []
        for name, kv, desc in (("src", src, src_desc), ("dst", dst, dst_desc)):
            if desc.placement == Placement.DEVICE:
                caches = self._entry("[swap_blocks]", name, kv)
                sides.append([Cache(-1, c.cache_desc, c.tensor_addrs, is_blocks_cache=True) for c in caches])
            else:
                addrs = kv.per_device_tensor_addrs
                raise_if_false(len(addrs) == len(self._cms),
                               f"[swap_blocks] {name} has addresses for {len(addrs)} device(s), "
                               f"this LLMDataDist has {len(self._cms)}")
                sides.append([Cache(-1, desc, list(a), is_blocks_cache=True) for a in addrs])
        for i, cm in enumerate(self._cms):
            cm.swap_blocks(sides[0][i], sides[1][i], src_to_dst)

    # ------------------------------------------------------------------ tensors

    def transfer_cache_async(self, src_cache: KvCache, layer_synchronizer: Any, transfer_configs: Sequence[Any],
                             src_block_indices: Sequence[int] | None = None,
                             dst_block_indices: Sequence[int] | None = None,
                             dst_block_memory_size: int | None = None) -> Any:
        """Push ``src_cache`` layer by layer into raw remote addresses (``TransferConfig`` only).

        PROMPT only; single device only (``LLM_FEATURE_NOT_ENABLED`` in multi-device mode); the
        returned ``CacheTask`` reports ``LLM_WAIT_PROCESS_TIMEOUT`` on timeout (llm_datadist_api.md §9).
        """
        from .transfer import transfer_cache_async

        self._check_live()
        check_isinstance("src_cache", src_cache, KvCache, allow_none=False)
        self._check_role("[transfer_cache_async]", LLMRole.PROMPT)
        if len(self._cms) > 1:
            raise LLMException("transfer_cache_async is not supported in single-process multi-device mode",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        cache = self._entry("[transfer_cache_async]", "src_cache", src_cache)[0]
        return transfer_cache_async(self._cms[0]._transfer, cache, cache.is_blocks_cache, layer_synchronizer,
                                    transfer_configs, src_block_indices, dst_block_indices, dst_block_memory_size,
                                    remote_cache_accessible=False,
                                    timeout_code=LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
                                    tasks=self._cms[0]._async_tasks)

    def get_cache_tensors(self, cache: KvCache, tensor_index: int = 0) -> list[Any]:
        """Deprecated: one ``Tensor`` per device viewing tensor ``tensor_index`` of ``cache``.

        The tensors view the cache memory (no copy) and keep the handle alive; they are valid
        until the cache is deallocated. On a backend whose device memory the host cannot address
        (Ascend), ``numpy()`` returns a copy read through the backend instead of a view.
        """
        from .tensor import Tensor, TensorDesc

        self._check_live()
        check_isinstance("cache", cache, KvCache, allow_none=False)
        check_int32("tensor_index", tensor_index)
        raise_if_false(0 <= tensor_index < cache.cache_desc.num_tensors,
                       f"[get_cache_tensors] tensor_index ({tensor_index}) out of range, "
                       f"[0, {cache.cache_desc.num_tensors})")
        caches = self._entry("[get_cache_tensors]", "cache", cache)
        out = []
        for cm, c in zip(self._cms, caches):
            desc = c.cache_desc
            # Device memory the host cannot address (Ascend) is read through the backend, as a copy.
            engine = cm._engine
            device = engine if engine.capabilities()["device_memory"] else None
            out.append(Tensor._view(c.tensor_addrs[tensor_index], TensorDesc(desc.data_type, list(desc.shape)), cache,
                                    device))
        return out

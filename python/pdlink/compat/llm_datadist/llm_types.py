"""Descriptors, keys, cache handles and transfer configs (llm_datadist_api.md §2.4, §7).

Public names:
    Placement, RegisterMemStatus, Memtype, PushType, register_mem_status_from_int,
    CacheDesc, CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey, Cache, KvCache, MemInfo,
    TransferConfig, TransferWithCacheKeyConfig, LayerSynchronizer

These classes only hold and validate values; they never talk to the engine.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum
from typing import Any, cast

from ..._enum import NamedIntEnum
from ...status import LLMException, LLMStatusCode, raise_if_false, raise_if_true
from ._utils import (
    INT64_MAX,
    check_int32,
    check_int64,
    check_isinstance,
    check_layer_range,
    check_list_int64,
    check_list_of,
    check_list_uint64,
    check_uint32,
    check_uint64,
    invalid_id,
)
from .data_type import DataType, itemsize

__all__ = [
    "Placement",
    "RegisterMemStatus",
    "Memtype",
    "PushType",
    "register_mem_status_from_int",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "BlocksCacheKey",
    "Cache",
    "KvCache",
    "MemInfo",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "LayerSynchronizer",
]

logger = logging.getLogger("pdlink")


# ---------------------------------------------------------------------------- enums


class Placement(NamedIntEnum):
    """Where a cache lives. ``str(Placement.HOST) == "Placement.HOST"``."""

    HOST = 0
    DEVICE = 1


class RegisterMemStatus(Enum):
    """Result of ``query_register_mem_status``."""

    OK = 0
    PREPARING = 1
    FAILED = 2


def register_mem_status_from_int(value: int) -> RegisterMemStatus:
    """Map a native status integer to ``RegisterMemStatus``; unknown values give ``FAILED``."""
    for member in RegisterMemStatus:
        if member.value == value:
            return member
    return RegisterMemStatus.FAILED


class Memtype(Enum):
    """Memory type of a ``MemInfo``."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class PushType(Enum):
    """Internal: how a push addresses the remote cache."""

    NO_CACHE_KEY = 0
    BLOCKS_CACHE_KEY = 1
    CACHE_KEY_BY_ID = 2


# ---------------------------------------------------------------------------- CacheDesc


class CacheDesc:
    """Description of a cache: ``num_tensors`` tensors sharing one shape and dtype (llm_datadist_api.md §7.1).

    Validation (in this order):
      * ``num_tensors``: uint32 (``TypeError`` / ``ValueError``);
      * ``shape``: list or tuple of ints (``TypeError``);
      * ``data_type``: ``DataType``; ``placement``: ``Placement``; ``kv_tensor_format``: str or
        None (``TypeError``);
      * ``batch_dim_index``: int32 (``TypeError`` / ``ValueError``), then in ``[0, len(shape))``
        (``LLMException(LLM_PARAM_INVALID)``);
      * ``seq_len_dim_index``: int32, then ``-1`` or in ``[0, len(shape))`` (``LLMException``);
      * each dim of ``shape``: int64 (``ValueError``).

    ``shape`` returns the very object that was passed in. ``batch_size`` is
    ``shape[batch_dim_index]`` taken at construction and is not updated by ``update_dim``.
    """

    def __init__(
        self,
        num_tensors: int,
        shape: tuple[int, ...] | list[int],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        check_uint32("num_tensors", num_tensors)
        check_list_of("shape", shape, int)
        # [INF] None is rejected for data_type/placement/batch_dim_index (the reference
        # lets None through and fails later with an unrelated error).
        check_isinstance("data_type", data_type, DataType, allow_none=False)
        check_isinstance("placement", placement, Placement, allow_none=False)
        check_int32("batch_dim_index", batch_dim_index)
        check_int32("seq_len_dim_index", seq_len_dim_index)
        check_isinstance("kv_tensor_format", kv_tensor_format, str)
        raise_if_false(
            0 <= batch_dim_index < len(shape),
            f"batch_dim_index {batch_dim_index} out of range, [0, {len(shape)})",
        )
        raise_if_false(
            seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
            f"seq_len_dim_index {seq_len_dim_index} is invalid, should be -1 or in range [0, {len(shape)})",
        )
        check_list_int64("shape", shape)
        self._num_tensors = num_tensors
        self._shape = shape
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._batch_size = shape[batch_dim_index]
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    @property
    def num_tensors(self) -> int:
        """Number of tensors in the cache."""
        return self._num_tensors

    @property
    def shape(self) -> list[int] | tuple[int, ...]:
        """Shape of every tensor (the object passed to the constructor)."""
        return self._shape

    @property
    def data_type(self) -> DataType:
        """Element type."""
        return self._data_type

    @property
    def placement(self) -> Placement:
        """HOST or DEVICE."""
        return self._placement

    @property
    def batch_dim(self) -> int:
        """The ``batch_dim_index`` given at construction."""
        return self._batch_dim

    @property
    def batch_size(self) -> int:
        """``shape[batch_dim_index]`` as it was at construction."""
        return self._batch_size

    @property
    def seq_len_dim_index(self) -> int:
        """The ``seq_len_dim_index`` given at construction (-1: none)."""
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        """Optional tensor format string."""
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes per tensor: ``prod(shape) * itemsize(data_type)`` (no alignment).

        Raises ``LLMException(LLM_PARAM_INVALID)`` when not computable: ``DT_STRING``, a
        negative dim, or a result above int64.
        """
        # Computed on each access (cheap), so it always reflects the current shape,
        # including after update_dim().
        computable = self._data_type is not DataType.DT_STRING
        total = 0
        if computable:
            total = itemsize(self._data_type)
            for dim in self._shape:
                if dim < 0:
                    computable = False
                    break
                total *= dim
            if total > INT64_MAX:
                computable = False
        if not computable:
            raise LLMException(
                f"Failed to calc tensor size, shape = {self._shape}, data_type = {self._data_type}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        return total

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set ``shape[dim_index] = dim_value`` in place (``size`` follows; ``batch_size`` does not).

        ``dim_index`` must be an int in ``[0, len(shape))`` (``LLMException`` otherwise) and
        ``dim_value`` an int64. [INF] A tuple shape is replaced by an equal list first.
        """
        check_isinstance("dim_index", dim_index, int, allow_none=False)
        raise_if_false(
            0 <= dim_index < len(self._shape),
            f"dim_index {dim_index} out of range, [0, {len(self._shape)})",
        )
        check_int64("dim_value", dim_value)
        if isinstance(self._shape, tuple):
            self._shape = list(self._shape)
        self._shape[dim_index] = dim_value

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
            f"data_type={self._data_type}, placement={self._placement!s}, "
            f"batch_dim_index={self._batch_dim}, seq_len_dim_index={self._seq_len_dim_index}, "
            f"kv_tensor_format={self._kv_tensor_format!r})"
        )


# ---------------------------------------------------------------------------- keys


def _collect_key_params(
    key_class: str,
    args: tuple,
    kwargs: dict[str, Any],
    positional_names: Sequence[str],
) -> tuple[dict[str, Any], str]:
    """Merge positional and keyword params of a key constructor.

    ``prompt_cluster_id`` is an alias of ``cluster_id``. Returns the merged params (keyed
    by canonical name) and the keyword used for the cluster id (``"cluster_id"`` when given
    positionally).
    """
    raise_if_false(
        len(args) + len(kwargs) <= len(positional_names),
        f"{key_class}: Param num is over limit, at most {len(positional_names)} params are supported.",
    )
    valid_keywords = ("prompt_cluster_id",) + tuple(positional_names)
    for k in kwargs:
        raise_if_false(k in valid_keywords, f"{key_class}: Unsupported param:{k}")
    params: dict[str, Any] = dict(zip(positional_names, args))
    cluster_key_name = "cluster_id"
    if "cluster_id" not in params and "cluster_id" not in kwargs and "prompt_cluster_id" in kwargs:
        cluster_key_name = "prompt_cluster_id"
    for k, v in kwargs.items():
        canonical = "cluster_id" if k == "prompt_cluster_id" else k
        if canonical in params:
            # [INF] the same param given twice (positionally and by keyword, or as both
            # cluster_id and prompt_cluster_id) is accepted only with the same value.
            raise_if_false(
                params[canonical] == v and type(params[canonical]) is type(v),
                f"{key_class}: Param {canonical} is given more than once with different values.",
            )
            continue
        params[canonical] = v
    return params, cluster_key_name


class CacheKey:
    """Key of one request's slot in a contiguous cache (llm_datadist_api.md §7.2).

    ``CacheKey(*args, **kwargs)``; positional order ``(cluster_id, req_id, model_id=0,
    prefix_id=2**64-1)``; keywords ``prompt_cluster_id | cluster_id, req_id, model_id,
    prefix_id``; at most 4 params. Missing cluster id / req_id, an unknown keyword or too
    many params -> ``LLMException(LLM_PARAM_INVALID)``. All values are uint64
    (``TypeError`` / ``ValueError``).

    Keys compare equal (and hash equal) when all four fields are equal.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        params, cluster_name = _collect_key_params(
            "CacheKey", args, kwargs, ("cluster_id", "req_id", "model_id", "prefix_id")
        )
        raise_if_false("cluster_id" in params, "Param prompt_cluster_id or cluster_id is required")
        raise_if_false("req_id" in params, "Param req_id is required")
        self._cluster_id = params["cluster_id"]
        self._req_id = params["req_id"]
        self._model_id = params.get("model_id", 0)
        self._prefix_id = params.get("prefix_id", invalid_id())
        check_uint64(cluster_name, self._cluster_id)
        check_uint64("req_id", self._req_id)
        check_uint64("model_id", self._model_id)
        check_uint64("prefix_id", self._prefix_id)

    @property
    def cluster_id(self) -> int:
        """Remote (prompt) cluster id; ignored when the key is used to allocate/register."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same value as ``cluster_id``."""
        return self._cluster_id

    @property
    def req_id(self) -> int:
        """Request id (``2**64-1`` = padding / no request)."""
        return self._req_id

    @property
    def model_id(self) -> int:
        """Model id (default 0)."""
        return self._model_id

    @property
    def prefix_id(self) -> int:
        """Prefix id (default ``2**64-1`` = none)."""
        return self._prefix_id

    def _fields(self) -> tuple[int, int, int, int]:
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheKey):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(("CacheKey",) + self._fields())

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"prefix_id={self._prefix_id}, model_id={self._model_id})"
        )


class CacheKeyByIdAndIndex:
    """Key addressing a remote cache by its id and batch slot (llm_datadist_api.md §7.3).

    ``cluster_id`` uint64, ``cache_id`` int64, ``batch_index`` uint32
    (``TypeError`` / ``ValueError``).
    """

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint64("cluster_id", cluster_id)
        check_int64("cache_id", cache_id)
        check_uint32("batch_index", batch_index)
        self._cluster_id = cluster_id
        self._cache_id = cache_id
        self._batch_index = batch_index

    @property
    def cluster_id(self) -> int:
        """Cluster that holds the cache."""
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        """Id of the remote cache."""
        return self._cache_id

    @property
    def batch_index(self) -> int:
        """Batch slot in the remote cache."""
        return self._batch_index

    def _fields(self) -> tuple[int, int, int]:
        return (self._cluster_id, self._cache_id, self._batch_index)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheKeyByIdAndIndex):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(("CacheKeyByIdAndIndex",) + self._fields())

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
            f"batch_index={self._batch_index})"
        )


class BlocksCacheKey:
    """Key of a blocks (paged) cache (llm_datadist_api.md §7.4).

    ``BlocksCacheKey(*args, **kwargs)``; positional order ``(cluster_id, model_id=0)``;
    keywords ``prompt_cluster_id | cluster_id, model_id``; at most 2 params. The cluster id
    is required (``LLMException`` otherwise). Both values are only type-checked as ``int``
    (``TypeError``); there is no range check. ``repr`` echoes the keyword used.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        params, cluster_name = _collect_key_params("BlocksCacheKey", args, kwargs, ("cluster_id", "model_id"))
        raise_if_false("cluster_id" in params, "Param prompt_cluster_id or cluster_id is required")
        self._cluster_id = params["cluster_id"]
        self._model_id = params.get("model_id", 0)
        self._cluster_id_key = cluster_name
        check_isinstance(cluster_name, self._cluster_id, int, allow_none=False)
        check_isinstance("model_id", self._model_id, int, allow_none=False)

    @property
    def cluster_id(self) -> int:
        """Remote cluster id at pull/push time (ignored at registration)."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same value as ``cluster_id``."""
        return self._cluster_id

    @property
    def model_id(self) -> int:
        """Distinguishes several blocks caches of one instance (default 0)."""
        return self._model_id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlocksCacheKey):
            return NotImplemented
        return (self._cluster_id, self._model_id) == (other._cluster_id, other._model_id)

    def __hash__(self) -> int:
        return hash(("BlocksCacheKey", self._cluster_id, self._model_id))

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self._cluster_id_key}={self._cluster_id}, model_id={self._model_id})"


# ---------------------------------------------------------------------------- handles


def _as_addr_list(name: str, addrs: Any) -> list[int]:
    check_list_of(name, addrs, int)
    return addrs if isinstance(addrs, list) else list(addrs)


class Cache:
    """Handle of a v2 cache (llm_datadist_api.md §7.5). Created by the CacheManager; users should not
    construct it directly (``Cache(cache_id, cache_desc, tensor_addrs, is_blocks_cache=False)``).

    After deallocation/unregistration the manager calls ``_invalidate()``, which sets
    ``tensor_addrs`` to ``[]``. ``Cache`` has no ``__del__``.
    """

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: list[int],
        is_blocks_cache: bool = False,
    ) -> None:
        check_int64("cache_id", cache_id)
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("is_blocks_cache", is_blocks_cache, bool, allow_none=False)
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = _as_addr_list("tensor_addrs", tensor_addrs)
        self._is_blocks_cache = is_blocks_cache
        self._valid = True

    @property
    def cache_id(self) -> int:
        """Engine cache id (ids start at 1; -1 for ``create_cpu_cache`` handles)."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """The descriptor the cache was created with."""
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        """One address per tensor; ``[]`` after deallocation."""
        return self._tensor_addrs

    @property
    def is_blocks_cache(self) -> bool:
        """True for blocks (paged) caches."""
        return self._is_blocks_cache

    def _invalidate(self) -> None:
        """Internal: mark the handle as released (``tensor_addrs`` becomes ``[]``)."""
        self._tensor_addrs = []
        self._valid = False

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """Wrap user-owned host memory for ``swap_blocks`` (not registered with the engine).

        Requires ``cache_desc.placement == HOST`` and ``len(addrs) == num_tensors``
        (``LLMException(LLM_PARAM_INVALID)`` otherwise); ``TypeError`` for wrong types.
        Returns a blocks ``Cache`` with ``cache_id == -1``.
        """
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        # [INF] a tuple of addresses is accepted too (copied to a list).
        check_list_of("addrs", addrs, int)
        raise_if_false(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        raise_if_false(
            cache_desc.num_tensors == len(addrs),
            f"cache_desc num_tensors:{cache_desc.num_tensors} not equal addrs num:{len(addrs)}",
        )
        check_list_uint64("addrs", addrs)
        return cls(-1, cache_desc, addrs, is_blocks_cache=True)

    def __repr__(self) -> str:
        return (
            f"Cache(cache_id={self._cache_id}, num_tensors={self._cache_desc.num_tensors}, "
            f"is_blocks_cache={self._is_blocks_cache})"
        )


class KvCache:
    """Handle of a v1 (KvCacheManager) cache (llm_datadist_api.md §7.6).

    ``KvCache(cache_id, cache_desc, per_device_tensor_addrs, kv_cache_manager=None)``; created by
    ``KvCacheManager.allocate_cache`` / ``allocate_blocks_cache`` (users should not construct it,
    except through ``create_cpu_cache``).

    ``per_device_tensor_addrs`` holds one list of tensor addresses per device (``[0]`` for a
    single device). When the handle is garbage collected while it is still valid and its
    manager is initialised, ``__del__`` deallocates it (llm_datadist does the same); explicit
    ``deallocate_cache`` is recommended. ``__del__`` never raises, also at interpreter exit.
    """

    def __init__(self, cache_id: int, cache_desc: CacheDesc, per_device_tensor_addrs: list[list[int]],
                 kv_cache_manager: Any = None) -> None:
        check_int64("cache_id", cache_id)
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_list_of("per_device_tensor_addrs", per_device_tensor_addrs, (list, tuple))
        for addrs in per_device_tensor_addrs:
            check_list_of("per_device_tensor_addrs", addrs, int)
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._per_device_tensor_addrs = per_device_tensor_addrs
        self._valid = True
        # The owning KvCacheManager (None: not managed, e.g. create_cpu_cache). The manager
        # also sets _token, which identifies this handle in its table of live caches.
        self._manager: Any = kv_cache_manager
        self._token: Any = None

    def __del__(self) -> None:
        # Safety net, as in llm_datadist: free a cache the user forgot to deallocate. Must never
        # raise (it may run on any thread, during garbage collection or at interpreter exit).
        try:
            manager = getattr(self, "_manager", None)
            if manager is None or not getattr(self, "_valid", False):
                return
            manager._deallocate_on_del(self)
        except Exception:  # noqa: BLE001 - nothing may escape a finalizer
            pass

    @property
    def cache_id(self) -> int:
        """Engine cache id (-1 for ``create_cpu_cache`` handles)."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """The descriptor the cache was created with."""
        return self._cache_desc

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        """Tensor addresses, one inner list per device; ``[]`` after deallocation."""
        return self._per_device_tensor_addrs

    def _invalidate(self) -> None:
        """Internal: mark the handle as released (addresses become ``[]``)."""
        self._per_device_tensor_addrs = []
        self._valid = False

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int] | list[list[int]]) -> KvCache:
        """Wrap user-owned host memory (not registered with the engine).

        ``addrs`` is a flat list of ``num_tensors`` addresses (one device) or a list of such
        lists (one per device); mixing both forms is rejected. Requires HOST placement and a
        non-empty ``addrs``. ``TypeError`` for wrong types, ``LLMException(LLM_PARAM_INVALID)``
        otherwise. Returns a ``KvCache`` with ``cache_id == -1``.
        """
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        raise_if_false(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        check_isinstance("addrs", addrs, list, allow_none=False)
        raise_if_false(len(addrs) > 0, "addrs length should be bigger than zero.")
        nested = isinstance(addrs[0], list)
        for addr in addrs:
            check_isinstance("the internal element of addrs", addr, [list, int], allow_none=False)
            raise_if_false(
                isinstance(addr, list) == nested,
                "the type of the internal element of addrs should be consistent.",
            )
            if nested:
                inner = cast("list[int]", addr)  # isinstance(addr, list) == nested, checked above
                check_list_of("the internal element of addrs", inner, int, seq_types=list)
                raise_if_false(
                    cache_desc.num_tensors == len(inner),
                    f"cache_desc num_tensors:{cache_desc.num_tensors} "
                    f"should be equal to size of the internal element of addrs:{len(inner)}",
                )
        if not nested:
            raise_if_false(
                cache_desc.num_tensors == len(addrs),
                f"cache_desc num_tensors:{cache_desc.num_tensors} should be equal to size of addrs:{len(addrs)}",
            )
        # Every element is a list when nested, an int otherwise (checked above).
        return cls(-1, cache_desc, cast("list[list[int]]", addrs) if nested else [cast("list[int]", addrs)])

    def __repr__(self) -> str:
        return f"KvCache(cache_id={self._cache_id}, num_devices={len(self._per_device_tensor_addrs)})"


class MemInfo:
    """A memory region for ``remap_registered_memory`` (llm_datadist_api.md §7.7).

    ``mem_type`` must be a ``Memtype``; ``addr`` and ``size`` ints (``TypeError`` otherwise).
    """

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype, allow_none=False)
        check_isinstance("addr", addr, int, allow_none=False)
        check_isinstance("size", size, int, allow_none=False)
        self._mem_type = mem_type
        self._addr = addr
        self._size = size

    @property
    def mem_type(self) -> Memtype:
        """Device or host memory."""
        return self._mem_type

    @property
    def addr(self) -> int:
        """Start address."""
        return self._addr

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"


# ---------------------------------------------------------------------------- transfer configs


class TransferConfig:
    """Push target given as raw remote addresses, for ``transfer_cache_async`` (llm_datadist_api.md §7.8).

    ``dst_cluster_id`` uint64; ``dst_addrs`` list/tuple of uint64; ``src_layer_range`` None or
    a ``range`` with step 1 and ``0 <= start < stop`` (``LLMException`` otherwise);
    ``src_batch_index`` uint32. Every field has a validating setter. ``dst_layer_range`` is a
    plain attribute set to None.
    """

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: list[int],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        check_uint64("dst_cluster_id", dst_cluster_id)
        check_list_uint64("dst_addrs", dst_addrs)
        check_layer_range("src_layer_range", src_layer_range)
        check_uint32("src_batch_index", src_batch_index)
        self._dst_cluster_id = dst_cluster_id
        self._dst_addrs = dst_addrs
        self._src_layer_range = src_layer_range
        self._src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    @property
    def dst_cluster_id(self) -> int:
        """Destination cluster id."""
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, dst_cluster_id: int) -> None:
        check_uint64("dst_cluster_id", dst_cluster_id)
        self._dst_cluster_id = dst_cluster_id

    @property
    def dst_addrs(self) -> list[int] | tuple[int, ...]:
        """Remote tensor addresses (2 per transferred layer)."""
        return self._dst_addrs

    @dst_addrs.setter
    def dst_addrs(self, dst_addrs: list[int]) -> None:
        check_list_uint64("dst_addrs", dst_addrs)
        self._dst_addrs = dst_addrs

    @property
    def src_layer_range(self) -> range | None:
        """Source layers to transfer (None: all)."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, src_layer_range: range | None) -> None:
        check_layer_range("src_layer_range", src_layer_range)
        self._src_layer_range = src_layer_range

    @property
    def src_batch_index(self) -> int:
        """Source batch slot."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, src_batch_index: int) -> None:
        check_uint32("src_batch_index", src_batch_index)
        self._src_batch_index = src_batch_index

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, dst_addrs={self._dst_addrs}, "
            f"src_layer_range={self._src_layer_range}, src_batch_index={self._src_batch_index})"
        )


class TransferWithCacheKeyConfig:
    """Push target given as a remote cache key, remote-accessible mode (llm_datadist_api.md §7.9).

    * ``cache_key``: ``BlocksCacheKey`` or ``CacheKeyByIdAndIndex`` (``TypeError``; None rejected);
    * ``src_layer_range`` / ``dst_layer_range``: required ``range`` objects (None ->
      ``TypeError``), step 1 and ``0 <= start < stop``, equal lengths (``LLMException``);
    * ``src_batch_index``: uint32, and 0 for a ``BlocksCacheKey`` (``LLMException``).

    Attribute ``dst_cluster_id`` is ``cache_key.cluster_id``.
    """

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range | None = None,  # required: None -> TypeError
        dst_layer_range: range | None = None,  # required: None -> TypeError
        src_batch_index: int = 0,
    ) -> None:
        self._check_cache_key(cache_key)
        src_layer_range = check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        dst_layer_range = check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        raise_if_false(
            len(src_layer_range) == len(dst_layer_range),
            f"src_layer_range size should be equal to dst_layer_range size, "
            f"but got {src_layer_range} and {dst_layer_range}.",
        )
        check_uint32("src_batch_index", src_batch_index)
        self._check_blocks_batch_index(cache_key, src_batch_index)
        self._cache_key = cache_key
        self._src_layer_range = src_layer_range
        self._dst_layer_range = dst_layer_range
        self._src_batch_index = src_batch_index
        self.dst_cluster_id: int = cache_key.cluster_id

    @staticmethod
    def _check_cache_key(cache_key: Any) -> None:
        check_isinstance("cache_key", cache_key, [BlocksCacheKey, CacheKeyByIdAndIndex], allow_none=False)

    @staticmethod
    def _check_blocks_batch_index(cache_key: Any, src_batch_index: int) -> None:
        raise_if_true(
            isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0,
            "src_batch_index should be 0 when cache_key is BlocksCacheKey.",
        )

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        """Key of the remote cache."""
        return self._cache_key

    @cache_key.setter
    def cache_key(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex) -> None:
        self._check_cache_key(cache_key)
        self._check_blocks_batch_index(cache_key, self._src_batch_index)
        self._cache_key = cache_key
        # [INF] keep dst_cluster_id in step with the key (the reference leaves it stale).
        self.dst_cluster_id = cache_key.cluster_id

    # [INF] The range setters reject None like the constructor does. They cannot check the
    # equal-length rule (the two ranges are set one at a time); the transfer code re-checks it.
    @property
    def src_layer_range(self) -> range:
        """Source layers."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, src_layer_range: range) -> None:
        check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        self._src_layer_range = src_layer_range

    @property
    def dst_layer_range(self) -> range:
        """Destination layers."""
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, dst_layer_range: range) -> None:
        check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        self._dst_layer_range = dst_layer_range

    @property
    def src_batch_index(self) -> int:
        """Source batch slot (0 for blocks caches)."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, src_batch_index: int) -> None:
        check_uint32("src_batch_index", src_batch_index)
        self._check_blocks_batch_index(self._cache_key, src_batch_index)
        self._src_batch_index = src_batch_index

    def __repr__(self) -> str:
        return (
            f"TransferWithCacheKeyConfig(cache_key={self._cache_key!r}, "
            f"src_layer_range={self._src_layer_range}, dst_layer_range={self._dst_layer_range}, "
            f"src_batch_index={self._src_batch_index})"
        )


class LayerSynchronizer(ABC):
    """User hook for layer-wise ``transfer_cache_async`` (llm_datadist_api.md §7.10)."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Block until layer ``layer_index`` is computed. Return False to abort the transfer.

        The framework currently always passes ``timeout_in_millis=None``.
        """

"""pdlink: move KV caches between prefill and decode instances.

An open implementation of the ``llm_datadist`` Python API (Huawei Ascend LLM-DataDist) on a
portable C++ core, and pdlink's own engine API (``pdlink.Engine``, docs/native_api.md).
``import pdlink`` is light: the native module and the heavier submodules
load on first use of a name that needs them.

    from pdlink import LLMDataDist, LLMRole, LLMConfig, CacheDesc, BlocksCacheKey
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> submodule that defines it. Mirrors llm_datadist's eager export list (llm_datadist_api.md §1.1).
_EXPORTS = {
    "LLMStatusCode": "status",
    "LLMException": "status",
    "Status": "status",
    "code_2_status": "status",
    "LLMRole": "compat.llm_datadist.configs",
    "LLMClusterInfo": "compat.llm_datadist.configs",
    "LlmConfig": "compat.llm_datadist.configs",
    "LLMConfig": "compat.llm_datadist.configs",
    "DataType": "compat.llm_datadist.data_type",
    "Placement": "compat.llm_datadist.llm_types",
    "RegisterMemStatus": "compat.llm_datadist.llm_types",
    "Memtype": "compat.llm_datadist.llm_types",
    "MemInfo": "compat.llm_datadist.llm_types",
    "CacheDesc": "compat.llm_datadist.llm_types",
    "CacheKey": "compat.llm_datadist.llm_types",
    "CacheKeyByIdAndIndex": "compat.llm_datadist.llm_types",
    "BlocksCacheKey": "compat.llm_datadist.llm_types",
    "Cache": "compat.llm_datadist.llm_types",
    "KvCache": "compat.llm_datadist.llm_types",
    "LayerSynchronizer": "compat.llm_datadist.llm_types",
    "TransferConfig": "compat.llm_datadist.llm_types",
    "TransferWithCacheKeyConfig": "compat.llm_datadist.llm_types",
    "CacheTask": "compat.llm_datadist.transfer",
    "CacheManager": "compat.llm_datadist.cache_manager",
    "KvCacheManager": "compat.llm_datadist.kv_cache_manager",
    "TensorDesc": "compat.llm_datadist.tensor",
    "Tensor": "compat.llm_datadist.tensor",
    "LLMDataDist": "compat.llm_datadist.llm_datadist",
    # pdlink's own engine API (docs/native_api.md)
    "BatchTransfer": "engine",
    "Engine": "engine",
    "EngineOptions": "engine",
    "Limits": "engine",
    "LinkInfo": "engine",
    "MemoryMap": "engine",
    "MemoryPool": "engine",
    "KvCaches": "kv",
    "Notification": "engine",
    "Pending": "engine",
    "PreparedTransfer": "engine",
    "Region": "engine",
    "RemoteRegion": "engine",
    "InvalidArgument": "status",
    "NotFound": "status",
    "TransferTimeout": "status",
    "LinkError": "status",
    "OutOfMemory": "status",
    "NotSupported": "status",
}

if TYPE_CHECKING:  # what the lazy __getattr__ below returns, spelled out for type checkers
    from .compat.llm_datadist.cache_manager import CacheManager  # noqa: F401
    from .compat.llm_datadist.configs import LLMClusterInfo, LLMConfig, LlmConfig, LLMRole  # noqa: F401
    from .compat.llm_datadist.data_type import DataType  # noqa: F401
    from .compat.llm_datadist.kv_cache_manager import KvCacheManager  # noqa: F401
    from .compat.llm_datadist.llm_datadist import LLMDataDist  # noqa: F401
    from .compat.llm_datadist.llm_types import (  # noqa: F401
        BlocksCacheKey,
        Cache,
        CacheDesc,
        CacheKey,
        CacheKeyByIdAndIndex,
        KvCache,
        LayerSynchronizer,
        MemInfo,
        Memtype,
        Placement,
        RegisterMemStatus,
        TransferConfig,
        TransferWithCacheKeyConfig,
    )
    from .compat.llm_datadist.tensor import Tensor, TensorDesc  # noqa: F401
    from .compat.llm_datadist.transfer import CacheTask  # noqa: F401
    from .engine import (  # noqa: F401
        BatchTransfer,
        Engine,
        EngineOptions,
        Limits,
        LinkInfo,
        MemoryMap,
        MemoryPool,
        Notification,
        Pending,
        PreparedTransfer,
        Region,
        RemoteRegion,
    )
    from .kv import KvCaches  # noqa: F401
    from .status import (  # noqa: F401
        InvalidArgument,
        LinkError,
        LLMException,
        LLMStatusCode,
        NotFound,
        NotSupported,
        OutOfMemory,
        Status,
        TransferTimeout,
        code_2_status,
    )

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pdlink' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

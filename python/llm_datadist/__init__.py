"""Drop-in ``llm_datadist`` package backed by pdlink.

Serving code written for Huawei's LLM-DataDist imports this package unchanged:

    from llm_datadist import LLMDataDist, LLMRole, LLMConfig, CacheDesc, BlocksCacheKey

Everything here is re-exported from ``pdlink``; see pdlink's docs for what differs.
"""

import os as _os

# llm_datadist sets this on import when it is unset (llm_datadist_api.md §1.1).
_os.environ.setdefault("AUTO_USE_UC_MEMORY", "0")

from pdlink.compat.llm_datadist.configs import LLMClusterInfo, LLMConfig, LlmConfig, LLMRole  # noqa: E402
from pdlink.compat.llm_datadist.data_type import DataType  # noqa: E402
from pdlink.compat.llm_datadist.llm_datadist import LLMDataDist  # noqa: E402
from pdlink.compat.llm_datadist.llm_types import (  # noqa: E402
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
from pdlink.compat.llm_datadist.transfer import CacheTask  # noqa: E402
from pdlink.status import LLMException, LLMStatusCode, Status  # noqa: E402

__all__ = [
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "Status", "LLMRole", "LlmConfig", "LLMConfig",
    "DataType", "Placement", "RegisterMemStatus", "Memtype", "MemInfo", "CacheDesc", "CacheKey",
    "CacheKeyByIdAndIndex", "BlocksCacheKey", "Cache", "KvCache", "LayerSynchronizer", "TransferConfig",
    "TransferWithCacheKeyConfig", "CacheTask", "LLMDataDist",
]


# The v2 ("CacheManager mode") names, as upstream lists them for its tests.
v2_list = [
    "LLMDataDist", "CacheManager", "Cache", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey",
    "RegisterMemStatus", "Memtype", "MemInfo", "Placement", "LayerSynchronizer", "TransferConfig",
    "TransferWithCacheKeyConfig", "CacheTask",
]

# Deprecated v1 names upstream imports lazily from llm_datadist_v1 (llm_datadist_api.md §1.1).
_HERE = "pdlink.compat.llm_datadist."
_LAZY = {"TensorDesc": _HERE + "tensor", "Tensor": _HERE + "tensor", "KvCacheManager": _HERE + "kv_cache_manager",
         "CacheTask": _HERE + "transfer", "CacheManager": _HERE + "cache_manager"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llm_datadist' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

"""pdlink: move KV caches between prefill and decode instances.

pdlink's own engine API (``pdlink.Engine``, docs/native_api.md) on a portable C++ core. The
drop-ins sit on top of it: ``import llm_datadist`` (Huawei Ascend LLM-DataDist's Python API) and
``import hixl`` (CANN's hixl), also reachable as ``pdlink.compat.llm_datadist`` and
``pdlink.compat.hixl``; this package exports none of their own names. ``import pdlink`` is light:
the native module and the heavier submodules load on first use of a name that needs them.

    with pdlink.Engine(pdlink.EngineOptions(cluster_id=2)) as engine:
        engine.connect("127.0.0.1:26000")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> submodule that defines it: pdlink's status codes and exceptions, and its engine API
# (docs/native_api.md).
_EXPORTS = {
    "LLMStatusCode": "status",
    "LLMException": "status",
    "BatchTransfer": "engine",
    "Engine": "engine",
    "EngineOptions": "engine",
    "EngineStats": "engine",
    "Metrics": "metrics",
    "Limits": "engine",
    "LinkInfo": "engine",
    "LinkResult": "engine",
    "MemoryMap": "engine",
    "MemoryPool": "engine",
    "KvCaches": "kv",
    "Notification": "engine",
    "Pending": "engine",
    "PreparedPlan": "engine",
    "PreparedTransfer": "engine",
    "Region": "engine",
    "RemoteRegion": "engine",
    "RoleState": "engine",
    "Scope": "engine",
    "TransferCancelled": "engine",
    "InvalidArgument": "status",
    "NotFound": "status",
    "TransferTimeout": "status",
    "LinkError": "status",
    "OutOfMemory": "status",
    "NotSupported": "status",
    "OfferReleased": "status",
    "Offer": "engine",
    "Ticket": "engine",
    "HandoffEvent": "engine",
    # the engine's constants (read from the native module on first use)
    "ANY_CLUSTER": "constants",
    "BACKENDS": "constants",
    "INVALID_ID": "constants",
    "LATENCY_BOUNDS": "constants",
    "LATEST_LINK_MARK": "constants",
    "LIMITS": "constants",
    "PROTOCOL_VERSION": "constants",
    "TRANSPORTS": "constants",
}

if TYPE_CHECKING:  # what the lazy __getattr__ below returns, spelled out for type checkers
    from .constants import (  # noqa: F401
        ANY_CLUSTER,
        BACKENDS,
        INVALID_ID,
        LATENCY_BOUNDS,
        LATEST_LINK_MARK,
        LIMITS,
        PROTOCOL_VERSION,
        TRANSPORTS,
    )
    from .engine import (  # noqa: F401
        BatchTransfer,
        Engine,
        EngineOptions,
        EngineStats,
        HandoffEvent,
        Limits,
        LinkInfo,
        LinkResult,
        MemoryMap,
        MemoryPool,
        Notification,
        Offer,
        Pending,
        PreparedPlan,
        PreparedTransfer,
        Region,
        RemoteRegion,
        RoleState,
        Scope,
        Ticket,
        TransferCancelled,
    )
    from .kv import KvCaches  # noqa: F401
    from .metrics import Metrics  # noqa: F401
    from .status import (  # noqa: F401
        InvalidArgument,
        LinkError,
        LLMException,
        LLMStatusCode,
        NotFound,
        NotSupported,
        OfferReleased,
        OutOfMemory,
        TransferTimeout,
    )

__all__ = sorted(_EXPORTS) + ["__version__"]

# llm_datadist's own names, which this package exported once and no longer does: asking for one says
# where it is (docs/compatibility.md).
_LLM_DATADIST_NAMES = frozenset({
    "Status", "LLMRole", "LLMClusterInfo", "LlmConfig", "LLMConfig", "DataType", "Placement", "RegisterMemStatus",
    "Memtype", "MemInfo", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "Cache", "KvCache",
    "LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask", "CacheManager",
    "KvCacheManager", "TensorDesc", "Tensor", "LLMDataDist"})


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name in _LLM_DATADIST_NAMES:
            raise AttributeError(f"pdlink.{name} is llm_datadist's: `from llm_datadist import {name}`")
        if name == "code_2_status":
            raise AttributeError("pdlink.code_2_status is llm_datadist's: "
                                 "`from llm_datadist.status import code_2_status`")
        raise AttributeError(f"module 'pdlink' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

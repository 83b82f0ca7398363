"""``llm_datadist.v2.llm_types`` (re-exported from pdlink.compat.llm_datadist.llm_types)."""
from pdlink.compat.llm_datadist.llm_types import *  # noqa: F401,F403
from pdlink.compat.llm_datadist.llm_types import (  # noqa: F401
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    MemInfo,
    Memtype,
    Placement,
    PushType,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

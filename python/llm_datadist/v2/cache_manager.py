"""``llm_datadist.v2.cache_manager`` (re-exported from pdlink.compat.llm_datadist.cache_manager)."""
from pdlink.compat.llm_datadist.cache_manager import CacheManager  # noqa: F401

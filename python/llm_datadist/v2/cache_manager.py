"""``llm_datadist.v2.cache_manager`` (re-exported from pdlink.cache_manager)."""
from pdlink.cache_manager import CacheManager  # noqa: F401

"""The ``llm_datadist`` API (LLM-DataDist, CacheManager and KvCacheManager modes) on pdlink's
engine. Its modules mirror upstream's; the top-level ``llm_datadist`` package and ``pdlink``
re-export their public names. Nothing is imported here, so ``import pdlink`` stays light.
"""

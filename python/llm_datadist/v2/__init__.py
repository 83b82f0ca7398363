"""``llm_datadist.v2``: the CacheManager-mode modules, as upstream lays them out."""

"""Drop-in surfaces of vendor APIs, on pdlink's own (the layers: docs/architecture.md).

``pdlink.compat.llm_datadist`` is Huawei's LLM-DataDist Python API; the top-level
``llm_datadist`` package re-exports it. Nothing is imported here: each surface loads on first use.
"""

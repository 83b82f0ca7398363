"""``llm_datadist.v2.llm_datadist`` (re-exported from pdlink.compat.llm_datadist.llm_datadist)."""
from pdlink.compat.llm_datadist.llm_datadist import LLMDataDist  # noqa: F401

"""``llm_datadist.v2.llm_datadist`` (re-exported from pdlink.llm_datadist)."""
from pdlink.llm_datadist import LLMDataDist  # noqa: F401

"""``llm_datadist.configs`` (re-exported from pdlink.compat.llm_datadist.configs)."""
from pdlink.compat.llm_datadist.configs import LLMClusterInfo, LLMConfig, LlmConfig, LLMRole  # noqa: F401

"""``llm_datadist.configs`` (re-exported from pdlink.configs)."""
from pdlink.configs import LLMClusterInfo, LlmConfig, LLMConfig, LLMRole  # noqa: F401

"""``llm_datadist.configs`` (re-exported from pdlink.configs)."""
from pdlink.configs import LLMClusterInfo, LLMConfig, LlmConfig, LLMRole  # noqa: F401

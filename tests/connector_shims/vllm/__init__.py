"""Stand-in for vLLM's package: only what vllm-ascend's LLMDataDistCMgrConnector imports."""

"""vllm_ascend.distributed without its connector registry (it imports vLLM's factory)."""

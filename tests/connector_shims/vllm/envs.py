"""vllm.envs: the one variable the connector reads."""

import os

VLLM_NIXL_ABORT_REQUEST_TIMEOUT = int(os.getenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480"))

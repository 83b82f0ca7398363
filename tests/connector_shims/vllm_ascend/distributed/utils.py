"""vllm_ascend.distributed.utils without torch.distributed: the transfer timeout, by vllm-ascend's own
rule (ASCEND_TRANSFER_TIMEOUT, else derived from HCCL_RDMA_TIMEOUT and HCCL_RDMA_RETRY_CNT)."""

import os


def get_transfer_timeout_value() -> int:
    explicit = os.getenv("ASCEND_TRANSFER_TIMEOUT", "")
    if explicit:
        return int(explicit)
    timeout, retries = int(os.getenv("HCCL_RDMA_TIMEOUT", "20")), int(os.getenv("HCCL_RDMA_RETRY_CNT", "7"))
    return int((4.096 * (2**timeout)) * retries // 1000 + 3000)

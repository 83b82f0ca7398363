"""vllm.v1.core.kv_cache_manager: a request's blocks (scheduler side; the worker tests do not use it)."""


class KVCacheBlocks:
    def __init__(self, block_ids: list[int]) -> None:
        self._ids = block_ids

    def get_unhashed_block_ids(self) -> list[int]:
        return list(self._ids)

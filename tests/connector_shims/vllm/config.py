"""vllm.config: the fields of VllmConfig the connector reads."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class KVTransferConfig:
    kv_role: str
    engine_id: str = "engine"
    kv_connector: str = "LLMDataDistCMgrConnector"


@dataclasses.dataclass
class CacheConfig:
    block_size: int = 16


@dataclasses.dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size_local: int = 1
    data_parallel_rank: int = 0
    data_parallel_rank_local: int | None = None
    data_parallel_external_lb: bool = False


@dataclasses.dataclass
class VllmConfig:
    kv_transfer_config: KVTransferConfig
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

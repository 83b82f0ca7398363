"""Peer-side replays of serving code's llm_datadist use (llm_datadist_api.md §11): the SGLang fork's connector and
omni-infer's llmdatadist_manager, each with its options, key conventions, cluster-id arithmetic and
error handling. The engine and caches live in ``peers.kv``'s state, so ``kv.snapshot`` and friends
see them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from llm_datadist import (
    BlocksCacheKey,
    CacheKeyByIdAndIndex,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from peers import addr, kv

# ---------------------------------------------------------------------------- SGLang

SGLANG_LAYERS = 3
SGLANG_BUFFERS = 2  # K and V, one tensor per layer each; plus one aux buffer after them


def sglang_start(role: str, seed: int | None) -> int:
    """The SGLang fork's engine: cluster id 2 * (gpu + world * node) + (0 prompt, 1 decoder), a
    rank table as ``local_comm_res``, a prompt listening (on a free port; sglang uses 26000 + gpu).
    Two KV buffers and an aux buffer, published as BlocksCacheKey(own id, i). Returns the port."""
    gpu, world, node = 0, 1, 0
    llm_role = kv.ROLES[role]
    cluster_id = 2 * (gpu + world * node) + (0 if llm_role == LLMRole.PROMPT else 1)
    table = {"version": "1.2", "server_count": "1", "status": "completed",
             "server_list": [{"server_id": "127.0.0.1",
                              "device": [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "0"}]}]}
    cfg = LLMConfig()
    cfg.device_id = gpu
    cfg.sync_kv_timeout = 20000
    cfg.local_comm_res = json.dumps(table)
    if llm_role == LLMRole.PROMPT:
        cfg.listen_ip_info = addr.listen()
    dd = LLMDataDist(llm_role, cluster_id)
    dd.init(cfg.generate_options())
    kv.adopt(dd)
    for i in range(SGLANG_BUFFERS):
        kv.register_blocks(f"buf{i}", SGLANG_LAYERS, (8, 128), seed=None if seed is None else seed + i,
                           key=BlocksCacheKey(cluster_id, i))
    kv.register_blocks("aux", 1, (8, 16), seed=None if seed is None else seed + 9,
                       key=BlocksCacheKey(cluster_id, SGLANG_BUFFERS))
    return int(dd.listen_port)


def sglang_link_by_address(port: int) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    """The decode side dials with a remote ip only: no remote_cluster_id, no local ip."""
    info = LLMClusterInfo()
    info.append_remote_ip_info(addr.of(port), port)
    status, per = kv.engine().link_clusters([info], 20000)
    return status, list(per)


def sglang_unlink_by_address(port: int) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    info = LLMClusterInfo()
    info.append_remote_ip_info(addr.of(port), port)
    status, per = kv.engine().unlink_clusters([info])
    return status, list(per)


def sglang_push_all(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
    """The prefill pushes each buffer into the decoder's (cluster id + 1), tensor_num_per_layer=1."""
    cm = kv.engine().cache_manager
    decoder = kv.engine().cluster_id + 1
    for i, name in enumerate([f"buf{i}" for i in range(SGLANG_BUFFERS)] + ["aux"]):
        cache = kv.cache(name)
        n = cache.cache_desc.num_tensors
        cm.push_blocks(BlocksCacheKey(decoder, i), cache, list(src_blocks), list(dst_blocks), range(n), range(n), 1)


# ---------------------------------------------------------------------------- omni-infer

RETRYABLE = {LLMStatusCode.LLM_REPEAT_REQUEST, LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
             LLMStatusCode.LLM_PROCESSING_LINK, LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
             LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, LLMStatusCode.LLM_LINK_BUSY}
_ATTEMPTS: list[LLMStatusCode | str] = []


def pull_with_retry(key: BlocksCacheKey | CacheKeyByIdAndIndex, name: str, src: Sequence[object],
                    dst: Sequence[int], retries: int = 3, pause: float = 0.2) -> None:
    """omni-infer's llmdatadist_manager: retry on the listed codes (pausing as it does), re-raise
    TypeError/ValueError at once."""
    cm = kv.engine().cache_manager
    for attempt in range(retries):
        try:
            cm.pull_blocks(key, kv.cache(name), list(src), list(dst))
            _ATTEMPTS.append("ok")
            return
        except (TypeError, ValueError):
            raise
        except LLMException as e:
            _ATTEMPTS.append(LLMStatusCode(e.status_code))
            if e.status_code not in RETRYABLE or attempt == retries - 1:
                raise
            time.sleep(pause)  # the connector's own back-off, replayed as it is


def attempts() -> list[LLMStatusCode | str]:
    return list(_ATTEMPTS)

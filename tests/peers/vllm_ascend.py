"""Peer side of tests/programs/test_vllm_ascend_connector.py: one vllm-ascend ``LLMDataDistCMgrConnector``
(its own source, tests/vllm_ascend_source.py) per process, in the worker role, on pdlink's
``llm_datadist``, with CPU torch tensors for KV caches; each tensor sits in a larger buffer whose
64 bytes either side are guards (tests/verify.py)::

    port = prefill.call(vllm_ascend.start, "kv_producer", table, rpc_port, mla=False, seed=1)
    decode.call(vllm_ascend.start, "kv_consumer", table, rpc_port + 1, mla=False, seed=None)
    decode.call(vllm_ascend.load, "req-1", [0, 1], [5, 6], port)   # start_load_kv, as vLLM calls it

A failed load is reported as the connector reports it, by its log line ("KV transfer task failed:
...", logger ``vllm``), so a test sees which of the connector's branches handled the error.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import numpy as np

from verify import GUARD_BYTES, Snapshot, guard_pattern, pattern

_state: dict[str, Any] = {"connector": None, "buffers": [], "tensors": [], "failures": []}
ALIGN = 2 * 1024 * 1024  # the connector asserts 2 MiB aligned cache addresses (MHA)
BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM, LAYERS = 8, 16, 2, 32, 2
MLA_DIMS = (64, 16)  # k_normed, k_pe last dimensions (they differ: the connector's MLA test)


class _Failures(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("KV transfer task failed"):
            _state["failures"].append(message)


def _aligned(torch: Any, shape: tuple[int, ...], seed: int | None, index: int) -> Any:
    """A float16 tensor of ``shape`` at a 2 MiB aligned address inside a larger uint8 buffer,
    filled with ``verify.pattern(.., index, seed)`` (zeros for None), guards either side."""
    nbytes = int(np.prod(shape)) * 2
    buffer = torch.zeros(nbytes + ALIGN + 2 * GUARD_BYTES, dtype=torch.uint8)
    start = -(-(buffer.data_ptr() + GUARD_BYTES) // ALIGN) * ALIGN - buffer.data_ptr()
    view = buffer.numpy()
    view[start - GUARD_BYTES:start] = guard_pattern()
    view[start + nbytes:start + nbytes + GUARD_BYTES] = guard_pattern()
    if seed is not None:
        view[start:start + nbytes] = pattern(nbytes, index, seed)
    _state["buffers"].append((buffer, start, nbytes))
    return buffer[start:start + nbytes].view(torch.float16).view(shape)


def start(kv_role: str, rank_table_path: str, rpc_port: int, mla: bool, seed: int | None,
          timeout_ms: int = 3000) -> int:
    """The connector's worker, as vLLM makes it (``LLMDataDistCMgrConnector(config, WORKER)``), its
    caches registered (``register_kv_caches``: ``LAYERS`` layers of (K, V), or (k_normed, k_pe) with
    ``mla``); returns the port its metadata listener serves on."""
    import vllm_ascend_source

    sys.path[:0] = vllm_ascend_source.source_path()
    os.environ.update({"DISAGGREGATED_PREFILL_RANK_TABLE_PATH": rank_table_path,
                       "VLLM_ASCEND_LLMDD_RPC_IP": "127.0.0.1", "VLLM_ASCEND_LLMDD_RPC_PORT": str(rpc_port),
                       "ASCEND_TRANSFER_TIMEOUT": str(timeout_ms)})
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_ascend.distributed import llmdatadist_c_mgr_connector as c

    logging.getLogger("vllm").addHandler(_Failures())
    connector = c.LLMDataDistCMgrConnector(VllmConfig(KVTransferConfig(kv_role=kv_role)), KVConnectorRole.WORKER)
    caches: dict[str, tuple[Any, ...]] = {}
    for layer in range(LAYERS):
        if mla:
            shapes = [(BLOCKS, BLOCK_TOKENS, 1, dim) for dim in MLA_DIMS]
        else:
            shapes = [(BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM)] * 2
        caches[f"model.layers.{layer}.self_attn.attn"] = tuple(
            _aligned(torch, shape, seed, 2 * layer + i) for i, shape in enumerate(shapes))
    connector.register_kv_caches(caches)
    _state["connector"], _state["tensors"] = connector, [t for pair in caches.values() for t in pair]
    # the port the scheduler side advertises as remote_port (LLMDataDistCMgrConnectorScheduler):
    # RPC port + TP size for a rank without a DP rank; the listener serves on it + tp_rank.
    return rpc_port + 1


def load(request_id: str, local_blocks: list[int], remote_blocks: list[int], remote_port: int) -> dict[str, Any]:
    """One step of a decode worker for a request whose prefill ran remotely, as vLLM drives it: the
    connector's scheduler side takes the request's ``kv_transfer_params`` (``update_state_after_alloc``)
    and builds the step's metadata; the worker side binds it, ``start_load_kv``, and, once the
    connector's transfer thread is idle, ``get_finished``. Returns the requests reported done
    receiving and the connector's failure log lines of this step."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request
    from vllm_ascend.distributed import llmdatadist_c_mgr_connector as c

    connector = _state["connector"]
    scheduler = c.LLMDataDistCMgrConnectorScheduler(VllmConfig(KVTransferConfig(kv_role="kv_consumer")), "decode")
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": remote_blocks,
              "remote_engine_id": "prefill", "remote_host": "127.0.0.1", "remote_port": remote_port,
              "remote_tp_size": "1"}
    tokens = len(local_blocks) * BLOCK_TOKENS
    request = Request(request_id, list(range(tokens)), params)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (tokens, True)
    scheduler.update_state_after_alloc(request, KVCacheBlocks(local_blocks), tokens)
    _state["failures"].clear()
    connector.bind_connector_metadata(scheduler.build_connector_meta(SchedulerOutput()))
    connector.start_load_kv(ForwardContext())
    connector.connector_worker.executor.submit(lambda: None).result(timeout=60)  # the transfer ran
    _, receiving = connector.get_finished(set())
    return {"done": sorted(receiving or ()), "failures": list(_state["failures"])}


def finished() -> list[str]:
    """A prefill worker's ``get_finished``: the requests whose KV the decoder reported read."""
    sending, _ = _state["connector"].get_finished(set())
    return sorted(sending or ())


def finalize_engine() -> None:
    """The prefill's llm_datadist engine goes away (its links and caches with it) while its process,
    and the connector's metadata listener, stay up."""
    _state["connector"].connector_worker.llm_datadist.finalize()


def snapshot(label: str) -> Snapshot:
    """Every cache tensor with its guards: region i holds tensor i (the order of register_kv_caches:
    layer 0 K, layer 0 V, layer 1 K, ...)."""
    sizes = {n for _, _, n in _state["buffers"]}
    assert len(sizes) == 1, "snapshots of equal-sized tensors only (MHA)"
    regions = [buffer.numpy()[start - GUARD_BYTES:start + n + GUARD_BYTES].copy()
               for buffer, start, n in _state["buffers"]]
    return Snapshot(label, "guarded", regions, [(i, GUARD_BYTES) for i in range(len(regions))], sizes.pop(), BLOCKS)


def mla_snapshots(label: str) -> list[Snapshot]:
    """MLA caches: one snapshot per part (k_normed tensors, then k_pe tensors), each guarded."""
    out = []
    for part in range(2):
        picked = [b for i, b in enumerate(_state["buffers"]) if i % 2 == part]
        regions = [buffer.numpy()[start - GUARD_BYTES:start + n + GUARD_BYTES].copy() for buffer, start, n in picked]
        out.append(Snapshot(f"{label} part {part}", "guarded", regions, [(i, GUARD_BYTES) for i in range(len(regions))],
                            picked[0][2], BLOCKS))
    return out

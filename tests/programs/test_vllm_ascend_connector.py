"""vllm-ascend's ``LLMDataDistCMgrConnector``, its own source unchanged (the vllm-ascend 0.11.0
wheel, tests/vllm_ascend_source.py), run on pdlink between two real processes: a decode worker pulls
a prefill worker's KV blocks through the connector's metadata exchange, ``link()`` with the rank
table it builds, ``pull_blocks`` and its finished-request notice; MHA and MLA caches. The error
paths assert which of the connector's branches handled each failure: a program's branch must be the
one CANN's llm_datadist would send it down (an LLMException, never a ValueError, for a remote block
past the cache). Needs torch (the CPU wheel), msgspec and pyzmq (``.ci/connector.sh`` installs
them); without them the module is skipped, once, saying so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import vllm_ascend_source
from comm_util import free_port
from peer import Peer
from peers import vllm_ascend
from verify import assert_same

_MISSING = vllm_ascend_source.missing_modules()
if _MISSING and not __import__("os").environ.get("PDLINK_REQUIRE_CONNECTOR"):
    pytest.skip(f"vllm-ascend's connector needs {', '.join(_MISSING)} (.ci/connector.sh installs them)",
                allow_module_level=True)

# The connector's two branches around pull_blocks (llmdatadist_c_mgr_connector.py, _read_blocks).
LLM_EXCEPTION_BRANCH = "Timeout during pull_blocks"  # except LLMException
VALUE_ERROR_BRANCH = "Passing unexpected parameter to pull_blocks"  # except (TypeError, ValueError)
PREFILL, DECODE = 1, 2  # cluster ids in the rank table


def _rank_table(path: Path) -> str:
    """The offline rank table the connector reads (DISAGGREGATED_PREFILL_RANK_TABLE_PATH): one
    prefill and one decode device on this host, on loopback addresses of their own."""
    def device(device_id: str, ip: str, cluster: int) -> dict[str, str]:
        return {"server_id": "127.0.0.1", "device_id": device_id, "device_ip": ip, "cluster_id": str(cluster)}
    path.write_text(json.dumps({"prefill_device_list": [device("0", "127.0.0.1", PREFILL)],
                                "decode_device_list": [device("1", "127.0.0.2", DECODE)]}))
    return str(path)


class PD:
    """A prefill and a decode worker, each the connector in its own process, caches registered
    (prefill: seeded; decode: zeros)."""

    def __init__(self, peers: Callable[..., Peer], tmp_path: Path, mla: bool):
        env = {"PDLINK_LINK_PORT_BASE": str(free_port())}
        self.prefill, self.decode = peers("vllm-prefill", env=env), peers("vllm-decode", env=env)
        table = _rank_table(tmp_path / "ranktable.json")
        self.port = self.prefill.call(vllm_ascend.start, "kv_producer", table, free_port(), mla, seed=1)
        self.decode.call(vllm_ascend.start, "kv_consumer", table, free_port(), mla, seed=None)

    def load(self, request_id: str, local: list[int], remote: list[int]) -> dict[str, Any]:
        return self.decode.call_within(120, vllm_ascend.load, request_id, local, remote, self.port)


def test_a_decode_worker_pulls_the_prefills_blocks(peers: Callable[..., Peer], tmp_path: Path) -> None:
    pd = PD(peers, tmp_path, mla=False)
    src0, dst0 = pd.prefill.call(vllm_ascend.snapshot, "prefill"), pd.decode.call(vllm_ascend.snapshot, "decode")
    outcome = pd.load("req-1", [0, 1, 2], [5, 3, 7])
    assert outcome == {"done": ["req-1"], "failures": []}, outcome
    expected = dst0.with_rows(src0, [(5, 0), (3, 1), (7, 2)])
    assert_same(pd.decode.call(vllm_ascend.snapshot, "decode"), expected, "the decode worker's KV caches")
    assert_same(pd.prefill.call(vllm_ascend.snapshot, "prefill"), src0, "the prefill worker's KV caches")
    assert pd.prefill.call(vllm_ascend.finished) == []  # not a request it was holding (no reqs_to_send)
    # a second request over the link the first one made
    outcome = pd.load("req-2", [6], [0])
    assert outcome == {"done": ["req-2"], "failures": []}, outcome
    assert_same(pd.decode.call(vllm_ascend.snapshot, "decode"), expected.with_rows(src0, [(0, 6)]),
                "the decode worker's KV caches after a second request")


def test_an_mla_decode_worker_pulls_both_parts(peers: Callable[..., Peer], tmp_path: Path) -> None:
    pd = PD(peers, tmp_path, mla=True)
    src0, dst0 = pd.prefill.call(vllm_ascend.mla_snapshots, "prefill"), pd.decode.call(vllm_ascend.mla_snapshots,
                                                                                       "decode")
    outcome = pd.load("req-mla", [1, 2], [4, 0])
    assert outcome == {"done": ["req-mla"], "failures": []}, outcome
    after = pd.decode.call(vllm_ascend.mla_snapshots, "decode")
    for part in range(2):
        assert_same(after[part], dst0[part].with_rows(src0[part], [(4, 1), (0, 2)]), f"MLA part {part}")
    assert_same(pd.prefill.call(vllm_ascend.mla_snapshots, "prefill")[0], src0[0], "the prefill's k_normed")


def test_a_remote_block_past_the_cache_takes_the_llm_exception_branch(peers: Callable[..., Peer],
                                                                       tmp_path: Path) -> None:
    """CANN raises LLMException (LLM_PARAM_INVALID) for it: the connector reports a failed pull, not
    "unexpected parameter" (its TypeError/ValueError branch, for its own argument mistakes)."""
    pd = PD(peers, tmp_path, mla=False)
    dst0 = pd.decode.call(vllm_ascend.snapshot, "decode")
    outcome = pd.load("req-bad", [0], [vllm_ascend.BLOCKS])
    assert outcome["done"] == [], outcome
    (failure,) = outcome["failures"]
    assert LLM_EXCEPTION_BRANCH in failure and VALUE_ERROR_BRANCH not in failure, failure
    assert_same(pd.decode.call(vllm_ascend.snapshot, "decode"), dst0, "the decode caches after a refused pull")
    outcome = pd.load("req-good", [0], [1])  # the link is still good
    assert outcome == {"done": ["req-good"], "failures": []}, outcome


def test_a_prefill_whose_engine_is_gone_takes_the_llm_exception_branch(peers: Callable[..., Peer],
                                                                        tmp_path: Path) -> None:
    """The prefill's llm_datadist engine ends after the link was made (its metadata listener still
    answers, so the connector reaches pull_blocks): the pull fails within the transfer timeout with
    an LLMException, and the connector reports it from that branch; nothing lands."""
    pd = PD(peers, tmp_path, mla=False)
    assert pd.load("req-1", [0], [1])["done"] == ["req-1"]
    pd.prefill.call(vllm_ascend.finalize_engine)
    dst0 = pd.decode.call(vllm_ascend.snapshot, "decode")
    outcome = pd.load("req-2", [2], [3])
    assert outcome["done"] == [], outcome
    (failure,) = outcome["failures"]
    assert LLM_EXCEPTION_BRANCH in failure and VALUE_ERROR_BRANCH not in failure, failure
    assert_same(pd.decode.call(vllm_ascend.snapshot, "decode"), dst0, "the decode caches after a failed pull")


def test_engine_register_holds_a_torch_tensor_until_deregistered() -> None:
    """pdlink.Engine.register of a torch tensor registers its own memory (``data_ptr``, no copy)
    and keeps the tensor alive: dropped by its caller, it lives until deregistered."""
    import gc
    import weakref

    import torch

    import pdlink

    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, backend="cpu")) as engine:
        tensor = torch.arange(4096, dtype=torch.float16)
        address, alive = tensor.data_ptr(), weakref.ref(tensor)
        region = engine.register(tensor, block_size=1024)
        assert (region.address, region.length) == (address, 8192)
        del tensor
        gc.collect()
        assert alive() is not None
        engine.deregister(region)
        gc.collect()
        assert alive() is None

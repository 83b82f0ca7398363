"""Two-sided link() / unlink() / query_register_mem_status with HCCL rank tables (llm_datadist_api.md §6.7).

The connector flows (``backend`` fixture) run on the CPU backend and on the Ascend backend over
the fake libraries. (The official pull_blocks sample's flow is replayed in programs/test_programs.py.)"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import pytest

from backend_env import peer_env
from comm_util import free_port, rank_table, wait_ok
from internals import parse_rank_table
from llm_datadist import BlocksCacheKey, DataType, RegisterMemStatus
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import kv
from poll import hang_guard, wait_until
from verify import check_transfer, rows

F16 = DataType.DT_FLOAT16


def start(peers: Callable[..., Peer], role: str, cid: int, base: int, backend: str = "cpu",
          **options: Any) -> Peer:
    """An engine in CacheManager mode without a listen address; its rank endpoint at ``base``."""
    p = peers(f"cluster{cid}", env=peer_env(backend, PDLINK_LINK_PORT_BASE=str(base)))
    p.call(kv.start_program, role, cid, local_comm_res=False, cache_manager=True, **options)
    return p


def test_vllm_cmgr_flow_link_poll_pull_unlink(peers: Callable[..., Peer], backend: str) -> None:
    """vllm-ascend LLMDataDistCMgrConnector: MLA caches under two model_ids, link by rank table,
    poll query_register_mem_status, pull_blocks with the remote list trimmed, unlink."""
    base = free_port()
    p = start(peers, "prompt", 10, base, backend, remote_access=True)
    d = start(peers, "decoder", 11, base, backend, remote_access=True)
    shapes = {"k_normed": (16, 64), "k_pe": (16, 8)}
    for model, (name, shape) in enumerate(shapes.items()):
        p.call(kv.register_blocks, name, 4, shape, F16, seed=1 + model, key=BlocksCacheKey(10, model))
        d.call(kv.register_blocks, name, 4, shape, F16, seed=None)
    info, table = {10: 0, 11: 1}, rank_table()
    # D calls first: it keeps dialling until P has called link() too
    d_comm = d.call(kv.comm_link, "pd_comm_127.0.0.1_127.0.0.2", info, table)
    with pytest.raises(LLMException) as e:  # not linked yet: transfers fail with NOT_YET_LINK
        d.call(kv.pull_blocks, BlocksCacheKey(10, 0), "k_normed", [0], [0])
    assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    assert d.call(kv.comm_status, d_comm) == RegisterMemStatus.PREPARING
    p_comm = p.call(kv.comm_link, "pd_comm_127.0.0.1_127.0.0.2", info, table)
    assert p_comm == 1 and d_comm == 1  # comm ids count from 1
    wait_ok(d, d_comm)
    wait_ok(p, p_comm)
    # after link(), registration defaults to not remote accessible and rejects True
    with pytest.raises(LLMException) as e:
        d.call(kv.register_blocks, "late", 1, (2, 2), DataType.DT_INT8, seed=0, remote_accessible=True)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    remote_blocks, local_blocks = [5, 6, 7, 8, 9], [0, 1, 2]
    trimmed = remote_blocks[-len(local_blocks):]  # vllm tail-trims the remote list
    for model, name in enumerate(shapes):
        check_transfer(functools.partial(p.call, kv.snapshot, name), functools.partial(d.call, kv.snapshot, name),
                       functools.partial(d.call, kv.pull_blocks, BlocksCacheKey(10, model), name, trimmed,
                                         local_blocks),
                       rows(list(zip(trimmed, local_blocks))))
    d.call(kv.comm_unlink, d_comm)
    p.call(kv.comm_unlink, p_comm)  # the second unlink finds the link already gone: fine
    assert p.call(kv.links) == [] and d.call(kv.links) == []
    with pytest.raises(LLMException) as e:
        d.call(kv.comm_status, d_comm)
    assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK  # as upstream, for an unlinked comm id


def test_link_fails_after_link_total_time(peers: Callable[..., Peer]) -> None:
    d = start(peers, "decoder", 2, free_port(), link_total_time=1)
    comm = d.call(kv.comm_link, "lonely", {1: 0, 2: 1}, rank_table())
    assert d.call(kv.comm_status, comm) == RegisterMemStatus.PREPARING  # within the link time
    wait_until(lambda: d.call(kv.comm_status, comm) != RegisterMemStatus.PREPARING, hang_guard(1000),
               "the link time passed")
    assert d.call(kv.comm_status, comm) == RegisterMemStatus.FAILED


def _table(transform: Callable[[str], str] = lambda t: t) -> str:
    return transform(rank_table())


@pytest.mark.parametrize("name, info, table, exc, code", [
    ("", {1: 0, 2: 1}, _table(), LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("x" * 128, {1: 0, 2: 1}, _table(), LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("c", {1: 0}, _table(), LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("c", {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}, _table(), LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("c", {2: 1, 1: 0}, _table(), LLMException, LLMStatusCode.LLM_PARAM_INVALID),  # ranks not ascending
    ("c", {1: 0, 3: 1}, _table(), LLMException, LLMStatusCode.LLM_PARAM_INVALID),  # own cluster (2) absent
    ("c", {1: 0, 2: 5}, _table(), LLMException, LLMStatusCode.LLM_PARAM_INVALID),  # rank 5 not in the table
    ("c", {1: 0, 2: -1}, _table(), ValueError, None),
    ("c", {"1": 0, 2: 1}, _table(), TypeError, None),
    (5, {1: 0, 2: 1}, _table(), TypeError, None),
    ("c", {1: 0, 2: 1}, "{not json", LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("c", {1: 0, 2: 1}, _table(lambda t: t.replace("1.2", "9.9")), LLMException, LLMStatusCode.LLM_PARAM_INVALID),
])
def test_link_argument_rules(peers: Callable[..., Peer], name: Any, info: Any, table: str, exc: type[Exception],
                             code: LLMStatusCode | None) -> None:
    d = start(peers, "decoder", 2, free_port())
    with pytest.raises(exc) as e:
        d.call(kv.comm_link, name, info, table)
    if code is not None:
        assert isinstance(e.value, LLMException) and e.value.status_code == code


def test_rank_table_validation():
    ok = parse_rank_table(rank_table())
    assert ok == {0: ("127.0.0.1", 0), 1: ("127.0.0.2", 0)}
    bad = [
        json.dumps({"version": "1.0"}),
        rank_table().replace('"completed"', '"initializing"'),
        rank_table().replace('"127.0.0.2"', '"not-an-ip"'),
        rank_table().replace('"rank_id": "1"', '"rank_id": "0"'),
        rank_table().replace('"server_count": "2"', '"server_count": "3"'),
        rank_table(version="1.0", super_pod=True),
        rank_table().replace('"server_id": "host1"}]}]', '"server_id": "nohost"}]}]'),
        "[]",
    ]
    for t in bad:
        with pytest.raises(LLMException) as e:
            parse_rank_table(t)
        assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, t

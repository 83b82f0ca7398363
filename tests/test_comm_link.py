"""Two-sided link() / unlink() / query_register_mem_status with HCCL rank tables (spec 6.7).

The connector flows (``backend`` fixture) run on the CPU backend and on the Ascend backend over
the fake libraries."""

from __future__ import annotations

import json
import socket

import pytest

from backend_env import peer_env
from internals import parse_rank_table
from pdlink import LLMException, LLMStatusCode, RegisterMemStatus
from poll import hang_guard, wait_until


def free_port_base():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rank_table(version="1.2", super_pod=True, ips=("127.0.0.1", "127.0.0.2")):
    servers = [{"server_id": f"host{i}", "device": [{"device_id": "0", "device_ip": ip, "rank_id": str(i)}]}
               for i, ip in enumerate(ips)]
    table = {"version": version, "server_count": str(len(servers)), "server_list": servers, "status": "completed"}
    if super_pod:
        table["super_pod_list"] = [{"super_pod_id": "0",
                                    "server_list": [{"server_id": s["server_id"]} for s in servers]}]
    return json.dumps(table)


def start(peers, role, cid, base, remote=True, backend="cpu"):
    p = peers(f"cluster{cid}", env=peer_env(backend, PDLINK_LINK_PORT_BASE=str(base)))
    p.exec(f"dd = LLMDataDist(LLMRole.{role}, {cid}); dd.init(options(remote={remote})); cm = dd.cache_manager")
    return p


def wait_ok(p, comm_id, limit=20.0):
    def ok():
        st = p.eval(f"dd.query_register_mem_status({comm_id})")
        assert st in (RegisterMemStatus.PREPARING, RegisterMemStatus.OK), st
        return st == RegisterMemStatus.OK

    wait_until(ok, limit, f"comm {comm_id} OK")


def test_vllm_cmgr_flow_link_poll_pull_unlink(peers, backend):
    """vllm-ascend LLMDataDistCMgrConnector: MLA caches under two model_ids, link by rank table,
    poll query_register_mem_status, pull_blocks with the remote list trimmed, unlink."""
    base = free_port_base()
    p = start(peers, "PROMPT", 10, base, backend=backend)
    d = start(peers, "DECODER", 11, base, backend=backend)
    for peer, seed, key in ((p, 1, "BlocksCacheKey(cluster_id={cid}, model_id={m})"), (d, 2, None)):
        peer.exec(f"""
k_normed = tensors(4, (16, 64), seed={seed})
k_pe = tensors(4, (16, 8), seed={seed + 10})
c0 = cm.register_blocks_cache(CacheDesc(4, [16, 64], DataType.DT_FLOAT16), addrs(k_normed),
                              {key.format(cid='dd.cluster_id', m=0) if key else None})
c1 = cm.register_blocks_cache(CacheDesc(4, [16, 8], DataType.DT_FLOAT16), addrs(k_pe),
                              {key.format(cid='dd.cluster_id', m=1) if key else None})
""")
    table = rank_table()
    args = f"'pd_comm_127.0.0.1_127.0.0.2', {{10: 0, 11: 1}}, {table!r}"
    # D calls first: it keeps dialling until P has called link() too
    d_comm = d.eval(f"dd.link({args})")
    with pytest.raises(LLMException) as e:  # not linked yet: transfers fail with NOT_YET_LINK
        d.exec("cm.pull_blocks(BlocksCacheKey(10, 0), c0, [0], [0])")
    assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    assert d.eval(f"dd.query_register_mem_status({d_comm})") == RegisterMemStatus.PREPARING
    p_comm = p.eval(f"dd.link({args})")
    assert p_comm == 1 and d_comm == 1  # comm ids count from 1
    wait_ok(d, d_comm)
    wait_ok(p, p_comm)
    # after link(), registration defaults to not remote accessible and rejects True
    with pytest.raises(LLMException):
        d.exec("cm.register_blocks_cache(CacheDesc(1, [2, 2], DataType.DT_INT8), addrs(tensors(1, (2, 2), 0)), "
               "None, True)")
    remote_blocks, local_blocks = [5, 6, 7, 8, 9], [0, 1, 2]
    trimmed = remote_blocks[-len(local_blocks):]  # vllm tail-trims the remote list
    d.exec(f"cm.pull_blocks(BlocksCacheKey(cluster_id=10, model_id=0), c0, {trimmed}, {local_blocks})\n"
           f"cm.pull_blocks(BlocksCacheKey(cluster_id=10, model_id=1), c1, {trimmed}, {local_blocks})")
    for name in ("k_normed", "k_pe"):
        src, dst = p.eval(name), d.eval(name)
        for s, t in zip(src, dst):
            assert t[local_blocks].tobytes() == s[trimmed].tobytes()
    d.exec(f"dd.unlink({d_comm})")
    p.exec(f"dd.unlink({p_comm})")  # the second unlink finds the link already gone: fine
    assert p.eval("dd.links()") == [] and d.eval("dd.links()") == []
    with pytest.raises(LLMException) as e:
        d.exec(f"dd.query_register_mem_status({d_comm})")
    assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK  # as upstream, for an unlinked comm id


def test_pull_blocks_sample_with_swap_to_host(peers, backend):
    """Official pull_blocks_sample: link("link", {1: 0, 2: 1}), pull, then swap_blocks to a CPU cache."""
    base = free_port_base()
    p = start(peers, "PROMPT", 1, base, backend=backend)
    d = start(peers, "DECODER", 2, base, backend=backend)
    p.exec("kv = tensors(2, (4, 32), seed=3)\n"
           "cache = cm.register_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_FLOAT16), addrs(kv), "
           "BlocksCacheKey(1, 0))")
    d.exec("kv = zeros(2, (4, 32))\n"
           "cache = cm.register_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_FLOAT16), addrs(kv))")
    table = rank_table(version="1.0", super_pod=False)
    comm = {}
    for peer in (p, d):
        comm[peer] = peer.eval(f"dd.link('link', {{1: 0, 2: 1}}, {table!r})")
    wait_ok(d, comm[d])
    d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])\n"
           "host = zeros(2, (4, 32), host=True)\n"
           "cpu = Cache.create_cpu_cache(CacheDesc(2, [4, 32], DataType.DT_FLOAT16, Placement.HOST), addrs(host))\n"
           "cm.swap_blocks(cache, cpu, {0: 2, 1: 3})")
    src, host = p.eval("kv"), d.eval("host")
    assert all(h[2].tobytes() == s[0].tobytes() and h[3].tobytes() == s[1].tobytes() for s, h in zip(src, host))
    for peer in (d, p):
        peer.exec(f"dd.unlink({comm[peer]}); dd.finalize()")


def test_link_fails_after_link_total_time(peers):
    base = free_port_base()
    d = peers("decode", env={"PDLINK_LINK_PORT_BASE": str(base)})
    d.exec("cfg = LLMConfig(); cfg.device_id = 0; cfg.enable_cache_manager = True; cfg.link_total_time = 1\n"
           "dd = LLMDataDist(LLMRole.DECODER, 2); dd.init(cfg.generate_options())")
    comm = d.eval(f"dd.link('lonely', {{1: 0, 2: 1}}, {rank_table()!r})")
    assert d.eval(f"dd.query_register_mem_status({comm})") == RegisterMemStatus.PREPARING  # within the link time
    wait_until(lambda: d.eval(f"dd.query_register_mem_status({comm})") != RegisterMemStatus.PREPARING,
               hang_guard(1000), "the link time passed")
    assert d.eval(f"dd.query_register_mem_status({comm})") == RegisterMemStatus.FAILED


@pytest.mark.parametrize("args, exc, code", [
    ("'', {1: 0, 2: 1}, T", LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("'x' * 128, {1: 0, 2: 1}, T", LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("'c', {1: 0}, T", LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("'c', {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}, T", LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("'c', {2: 1, 1: 0}, T", LLMException, LLMStatusCode.LLM_PARAM_INVALID),  # ranks not ascending
    ("'c', {1: 0, 3: 1}, T", LLMException, LLMStatusCode.LLM_PARAM_INVALID),  # own cluster (2) absent
    ("'c', {1: 0, 2: 5}, T", LLMException, LLMStatusCode.LLM_PARAM_INVALID),  # rank 5 not in the table
    ("'c', {1: 0, 2: -1}, T", ValueError, None),
    ("'c', {'1': 0, 2: 1}, T", TypeError, None),
    ("5, {1: 0, 2: 1}, T", TypeError, None),
    ("'c', {1: 0, 2: 1}, '{not json'", LLMException, LLMStatusCode.LLM_PARAM_INVALID),
    ("'c', {1: 0, 2: 1}, T.replace('1.2', '9.9')", LLMException, LLMStatusCode.LLM_PARAM_INVALID),
])
def test_link_argument_rules(peers, args, exc, code):
    d = peers("decode")
    d.exec(f"dd = LLMDataDist(LLMRole.DECODER, 2); dd.init(options()); T = {rank_table()!r}")
    with pytest.raises(exc) as e:
        d.exec(f"dd.link({args})")
    if code is not None:
        assert e.value.status_code == code


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

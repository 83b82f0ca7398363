"""Same-host IPC for DEVICE memory on the Ascend backend (fake vendor libraries).

Two processes of one host with the IPC symbols (aclrtIpcMem*) move DEVICE caches without HCCL:
the serving side checks the access as always, exports the addressed regions, and the requester
maps them and copies device to device. `PDLINK_TRANSPORT=tcp` turns this off (the shared suite's
`[ascend]` cases run that way, over HCCL); a peer whose runtime lacks IPC makes the link fall
back to HCCL. The fakes' call counters show which path moved the bytes.
"""

from __future__ import annotations

import pytest

from backend_env import peer_env
from fake_ascend.build import build
from pdlink import LLMException
from pdlink import LLMStatusCode as S
from peer import wait_for

PROMPT_ID, DECODER_ID = 1, 2

SETUP = """
import ctypes
fake = ctypes.CDLL(os.path.join(os.environ["PDLINK_ASCEND_LIB_DIR"], "libascendcl.so"))
fake.fake_ascend_calls.restype = ctypes.c_long
calls = lambda fn: fake.fake_ascend_calls(fn.encode())
"""


def make(peers, transport="auto", prefill_extra=None, remote=True):
    p = peers("prefill", env={**peer_env("ascend", PDLINK_TRANSPORT=transport), **(prefill_extra or {})})
    d = peers("decode", env=peer_env("ascend", PDLINK_TRANSPORT=transport))
    for side in (p, d):
        side.exec(SETUP)
    opts = f"pool=1 << 22, remote={remote}"
    p.exec(f"dd = LLMDataDist(LLMRole.PROMPT, {PROMPT_ID}); dd.init(options(listen='127.0.0.1:0', {opts})); "
           "cm = dd.cache_manager")
    d.exec(f"dd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); dd.init(options({opts})); cm = dd.cache_manager")
    port = p.eval("dd.listen_port")
    ret = d.eval(f"dd.link_clusters([cluster({PROMPT_ID}, {port})], 5000)")
    assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), ret
    return p, d


def blocks(p, d, decoder_key="None"):
    p.exec("kv = tensors(2, (8, 512), seed=1)\n"
           "cache = cm.register_blocks_cache(CacheDesc(2, [8, 512], DataType.DT_FLOAT16), addrs(kv), "
           "BlocksCacheKey(1, 0))")
    d.exec(f"kv = tensors(2, (8, 512), seed=2)\n"
           f"cache = cm.register_blocks_cache(CacheDesc(2, [8, 512], DataType.DT_FLOAT16), addrs(kv), {decoder_key})")


def test_pull_and_push_blocks_over_ipc_without_hccl(peers):
    p, d = make(peers)
    blocks(p, d, decoder_key="BlocksCacheKey(2, 0)")
    before = d.eval("[a.copy() for a in kv]")
    d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0, 1, 2, 6], [3, 4, 5, 0])")
    src, dst = p.eval("kv"), d.eval("kv")
    for s, t, b in zip(src, dst, before):
        for sb, db in [(0, 3), (1, 4), (2, 5), (6, 0)]:
            assert t[db].tobytes() == s[sb].tobytes()
        for untouched in (1, 2, 6, 7):
            assert t[untouched].tobytes() == b[untouched].tobytes()
    p.exec("cm.push_blocks(BlocksCacheKey(2, 0), cache, [7, 5], [1, 2])")
    src, dst = p.eval("kv"), d.eval("kv")
    for s, t in zip(src, dst):
        assert t[1].tobytes() == s[7].tobytes() and t[2].tobytes() == s[5].tobytes()
    # IPC moved the bytes (decode imported the prompt's regions and vice versa); HCCL never ran and
    # no communicator was set up; every export was closed again.
    assert d.eval("calls('aclrtIpcMemImportByKey')") >= 2 and p.eval("calls('aclrtIpcMemImportByKey')") >= 2
    for side in (p, d):
        assert side.eval("calls('HcclBatchSendRecv')") == 0
        assert side.eval("calls('HcclCommInitRootInfo')") == 0
    exports = p.eval("calls('aclrtIpcMemGetExportKey')")
    assert exports >= 2


def test_pull_cache_slot_over_ipc(peers):
    p, d = make(peers)
    p.exec("src = tensors(2, (4, 64), seed=5)\n"
           "c = cm.register_cache(CacheDesc(2, [4, 64], DataType.DT_FLOAT16), addrs(src))")
    d.exec("dst = zeros(2, (2, 64))\n"
           "c = cm.register_cache(CacheDesc(2, [2, 64], DataType.DT_FLOAT16), addrs(dst))")
    d.exec(f"cm.pull_cache(CacheKeyByIdAndIndex(1, {p.eval('c.cache_id')}, 1), c, 1)")
    src, dst = p.eval("src"), d.eval("dst")
    for s, t in zip(src, dst):
        assert t[1].tobytes() == s[1].tobytes() and not t[0].any()
    assert d.eval("calls('HcclBatchSendRecv')") == 0


def test_a_refused_access_over_ipc_changes_nothing_and_keeps_the_link(peers):
    p, d = make(peers)
    blocks(p, d)
    before = d.eval("[a.copy() for a in kv]")
    with pytest.raises(LLMException) as e:
        d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [8], [0])")  # the prompt has 8 blocks
    assert e.value.status_code == S.LLM_PARAM_INVALID
    assert [a.tobytes() for a in d.eval("kv")] == [a.tobytes() for a in before]
    assert p.eval("calls('aclrtIpcMemGetExportKey')") == 0  # refused before anything was exported
    d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [7], [0])")
    assert [a[0].tobytes() for a in d.eval("kv")] == [a[7].tobytes() for a in p.eval("kv")]


def test_a_failed_import_is_an_error_and_the_next_pull_works(peers):
    p, d = make(peers)
    blocks(p, d)
    d.exec("fake.fake_ascend_inject(b'aclrtIpcMemImportByKey', 100000, 0, 1)")  # ACL_ERROR_INVALID_PARAM once
    with pytest.raises(LLMException) as e:
        d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [3], [3])")
    assert e.value.status_code == S.LLM_PARAM_INVALID
    assert "over IPC: aclrtIpcMemImportByKey failed: ACL_ERROR_INVALID_PARAM (100000)" in str(e.value)
    d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [3], [3])")
    assert [a[3].tobytes() for a in d.eval("kv")] == [a[3].tobytes() for a in p.eval("kv")]
    assert not d.eval("dd.links()")[0]["broken"]


def test_a_peer_without_ipc_makes_the_link_fall_back_to_hccl(peers):
    # The prompt's runtime lacks aclrtIpcMemGetExportKey (variant no_optional): it refuses IPC, and
    # the decode moves the bytes over an HCCL channel instead, from then on.
    p, d = make(peers, prefill_extra={"PDLINK_ASCEND_LIB_DIR": str(build("no_optional"))})
    blocks(p, d)
    for _ in range(2):
        d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [1, 2], [5, 6])")
    src, dst = p.eval("kv"), d.eval("kv")
    for s, t in zip(src, dst):
        assert t[5].tobytes() == s[1].tobytes() and t[6].tobytes() == s[2].tobytes()
    assert d.eval("calls('aclrtIpcMemImportByKey')") == 0
    assert d.eval("calls('HcclCommInitRootInfo')") == 1  # one channel, set up on first use
    assert d.eval("calls('HcclBatchSendRecv')") == 2


def test_forcing_tcp_uses_hccl_even_on_one_host(peers):
    p, d = make(peers, transport="tcp")
    blocks(p, d)
    d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [4], [4])")
    assert [a[4].tobytes() for a in d.eval("kv")] == [a[4].tobytes() for a in p.eval("kv")]
    assert d.eval("calls('aclrtIpcMemImportByKey')") == 0
    assert d.eval("calls('HcclBatchSendRecv')") == 1


def test_pull_by_request_key_over_ipc_releases_the_key_only_after_the_copy(peers):
    p, d = make(peers, remote=False)  # request keys: caches not remote accessible (llm_datadist's rule)
    p.exec("c_src = cm.allocate_cache(CacheDesc(2, [2, 4096], DataType.DT_INT8), [CacheKey(1, 5)])\n"
           "write_cache(c_src, 6)\nexpected = [a.tobytes() for a in read_cache(c_src)]\n"
           "cm.deallocate_cache(c_src)")  # only the request key holds it now
    d.exec("c_dst = cm.allocate_cache(CacheDesc(2, [2, 4096], DataType.DT_INT8))")
    d.exec("fake.fake_ascend_inject(b'aclrtIpcMemImportByKey', 100000, 0, 1)")  # the first copy fails
    with pytest.raises(LLMException):
        d.exec("cm.pull_cache(CacheKey(1, 5), c_dst, 1)")
    assert p.eval("dd._engine.cache_count") == 1  # the key still holds the cache
    d.exec("cm.pull_cache(CacheKey(1, 5), c_dst, 1)")
    got, expected = d.eval("read_cache(c_dst)"), p.eval("expected")
    for g, e in zip(got, expected):
        assert g[4096:].tobytes() == e[:4096]  # key slot 0 -> local slot 1
    assert wait_for(lambda: p.eval("dd._engine.cache_count") == 0)  # consumed by the pull: freed
    with pytest.raises(LLMException) as err:
        d.exec("cm.pull_cache(CacheKey(1, 5), c_dst, 0)")
    assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    assert d.eval("calls('HcclBatchSendRecv')") == 0

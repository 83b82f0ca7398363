"""HCCL one-sided access on the Ascend backend (fake vendor libraries): `pdlink.HcclOneSided=1`.

With both ends enabling it (option `pdlink.HcclOneSided` or PDLINK_HCCL_ONE_SIDED=1) and both
runtimes having the one-sided symbols, a device channel is prepared at its setup (each side
registers and binds its device pool and registered DEVICE caches, then HcclCommPrepare), and a
pull or push becomes: a checked request on the control connection answered with addresses, then
HcclBatchGet/HcclBatchPut by the requester alone. Memory registered after the link, or an end
that does not enable it, falls back to the two-sided HcclBatchSendRecv. The links here are
forced to TCP, so IPC (same host) stays out of the way; the fakes' call counters show the path.
"""

from __future__ import annotations

import pytest

from backend_env import peer_env
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

CACHE = """
kv = tensors(2, (8, 512), seed={seed})
cache = cm.register_blocks_cache(CacheDesc(2, [8, 512], DataType.DT_FLOAT16), addrs(kv), {key})
"""


class Pair:
    def __init__(self, peers, prompt_one_sided="1", decode_one_sided="1", remote=True):
        self.p = peers("prefill", env=peer_env("ascend", PDLINK_HCCL_ONE_SIDED=prompt_one_sided))
        self.d = peers("decode", env=peer_env("ascend", PDLINK_HCCL_ONE_SIDED=decode_one_sided))
        opts = f"pool=1 << 22, remote={remote}"
        for side in (self.p, self.d):
            side.exec(SETUP)
        self.p.exec(f"dd = LLMDataDist(LLMRole.PROMPT, {PROMPT_ID}); "
                    f"dd.init(options(listen='127.0.0.1:0', {opts})); cm = dd.cache_manager")
        self.d.exec(f"dd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); dd.init(options({opts})); cm = dd.cache_manager")
        self.port = self.p.eval("dd.listen_port")

    def link(self):
        ret = self.d.eval(f"dd.link_clusters([cluster({PROMPT_ID}, {self.port})], 5000)")
        assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), ret

    def unlink(self):
        assert self.d.eval(f"dd.unlink_clusters([cluster({PROMPT_ID}, {self.port})], 2000, force=True)")[0] \
            == S.LLM_SUCCESS

    def caches(self, decoder_key="None"):
        self.p.exec(CACHE.format(seed=1, key="BlocksCacheKey(1, 0)"))
        self.d.exec(CACHE.format(seed=2, key=decoder_key))


def same_blocks(pair, pairs):
    src, dst = pair.p.eval("kv"), pair.d.eval("kv")
    for s, t in zip(src, dst):
        for sb, db in pairs:
            assert t[db].tobytes() == s[sb].tobytes()


def test_pull_and_push_blocks_one_sided(peers):
    pair = Pair(peers)
    pair.caches(decoder_key="BlocksCacheKey(2, 0)")
    pair.link()
    pair.d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0, 1, 2, 6], [3, 4, 5, 0])")
    same_blocks(pair, [(0, 3), (1, 4), (2, 5), (6, 0)])
    pair.p.exec("cm.push_blocks(BlocksCacheKey(2, 0), cache, [7], [1])")
    same_blocks(pair, [(7, 1)])
    assert pair.d.eval("calls('HcclBatchGet')") == 1 and pair.p.eval("calls('HcclBatchPut')") == 1
    for side in (pair.p, pair.d):
        assert side.eval("calls('HcclBatchSendRecv')") == 0
        assert side.eval("calls('HcclCommPrepare')") == 2  # one channel per direction, both prepared


def test_memory_registered_after_the_link_goes_two_sided(peers):
    pair = Pair(peers)
    pair.p.exec(CACHE.format(seed=1, key="BlocksCacheKey(1, 0)"))
    pair.link()
    pair.d.exec(CACHE.format(seed=2, key="None"))  # not in the memory the channel prepared
    pair.d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [5], [2])")
    same_blocks(pair, [(5, 2)])
    assert pair.d.eval("calls('HcclBatchGet')") == 0 and pair.d.eval("calls('HcclBatchSendRecv')") == 1


@pytest.mark.parametrize("who", ["prompt", "decode"])
def test_one_end_without_it_means_two_sided(peers, who):
    pair = Pair(peers, prompt_one_sided="0" if who == "prompt" else "1",
                decode_one_sided="0" if who == "decode" else "1")
    pair.caches()
    pair.link()
    pair.d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [3], [3])")
    same_blocks(pair, [(3, 3)])
    for side in (pair.p, pair.d):
        assert side.eval("calls('HcclCommPrepare')") == 0
    assert pair.d.eval("calls('HcclBatchSendRecv')") == 1


def test_a_refused_access_changes_nothing_and_keeps_the_link(peers):
    pair = Pair(peers)
    pair.caches()
    pair.link()
    before = pair.d.eval("[a.tobytes() for a in kv]")
    with pytest.raises(LLMException) as e:
        pair.d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [8], [0])")
    assert e.value.status_code == S.LLM_PARAM_INVALID
    assert pair.d.eval("[a.tobytes() for a in kv]") == before
    pair.d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [7], [0])")
    same_blocks(pair, [(7, 0)])
    assert pair.d.eval("calls('HcclBatchGet')") == 1


def test_a_failed_get_breaks_the_link_and_a_relinked_pull_succeeds(peers):
    pair = Pair(peers)
    pair.caches()
    pair.link()
    before = pair.d.eval("[a.tobytes() for a in kv]")
    pair.d.exec("fake.fake_ascend_inject(b'HcclBatchGet', 21, 0, 1)")  # HCCL_E_REMOTE once
    with pytest.raises(LLMException) as e:
        pair.d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [1], [1])")
    assert e.value.status_code == S.LLM_LINK_FAILED and "HcclBatchGet failed: HCCL_E_REMOTE" in str(e.value)
    assert pair.d.eval("[a.tobytes() for a in kv]") == before
    assert pair.d.eval("dd.links()")[0]["broken"]
    pair.unlink()
    pair.link()
    pair.d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [1], [1])")
    same_blocks(pair, [(1, 1)])


def test_pull_by_request_key_one_sided_releases_the_key_after_the_copy(peers):
    pair = Pair(peers, remote=False)  # request keys: caches not remote accessible (llm_datadist's rule)
    pair.p.exec("c_src = cm.allocate_cache(CacheDesc(2, [2, 4096], DataType.DT_INT8), [CacheKey(1, 5)])\n"
                "write_cache(c_src, 6)\nexpected = [a.tobytes() for a in read_cache(c_src)]\n"
                "cm.deallocate_cache(c_src)")  # only the request key holds it now
    pair.d.exec("c_dst = cm.allocate_cache(CacheDesc(2, [2, 4096], DataType.DT_INT8))")
    pair.link()
    pair.d.exec("cm.pull_cache(CacheKey(1, 5), c_dst, 1)")
    got, expected = pair.d.eval("read_cache(c_dst)"), pair.p.eval("expected")
    for g, x in zip(got, expected):
        assert g[4096:].tobytes() == x[:4096]  # key slot 0 -> local slot 1
    assert wait_for(lambda: pair.p.eval("dd._engine.cache_count") == 0)  # consumed by the pull: freed
    assert pair.d.eval("calls('HcclBatchGet')") == 1 and pair.d.eval("calls('HcclBatchSendRecv')") == 0


def test_option_is_validated():
    from internals import parse_engine_options
    from pdlink import LLMException as E

    assert parse_engine_options({"pdlink.HcclOneSided": "1"})["hccl_one_sided"] is True
    assert parse_engine_options({})["hccl_one_sided"] is False
    with pytest.raises(E) as e:
        parse_engine_options({"pdlink.HcclOneSided": "yes"})
    assert e.value.status_code == S.LLM_PARAM_INVALID

"""Cross-process KV movement: every transfer kind of spec 10.2/10.3, verified byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from pdlink.status import LLMException, LLMStatusCode
from peer import wait_for

BLOCKS_SETUP = """
kv = tensors(4, (8, 64), seed={seed})
cache = cm.register_blocks_cache(CacheDesc(4, [8, 64], DataType.DT_FLOAT16), addrs(kv), {key})
"""


def setup_blocks(pd, prompt_key="BlocksCacheKey(1, 0)", decoder_key="None"):
    pd.prefill.exec(BLOCKS_SETUP.format(seed=1, key=prompt_key))
    pd.decode.exec(BLOCKS_SETUP.format(seed=2, key=decoder_key))
    pd.link()


def test_pull_blocks_moves_exact_bytes(pd):
    setup_blocks(pd)
    before = pd.decode.eval("[a.copy() for a in kv]")
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0, 1, 2, 5], [3, 4, 5, 0])")
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    for s, t, b in zip(src, dst, before):
        for sb, db in [(0, 3), (1, 4), (2, 5), (5, 0)]:
            assert t[db].tobytes() == s[sb].tobytes()
        for untouched in (1, 2, 6, 7):
            assert t[untouched].tobytes() == b[untouched].tobytes()


def test_push_blocks_moves_exact_bytes(pd):
    setup_blocks(pd, decoder_key="BlocksCacheKey(2, 0)")
    pd.prefill.exec("cm.push_blocks(BlocksCacheKey(2, 0), cache, [7, 6], [0, 1])")
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    for s, t in zip(src, dst):
        assert t[0].tobytes() == s[7].tobytes() and t[1].tobytes() == s[6].tobytes()


def test_link_is_symmetric_decoder_pushes_and_prompt_pulls(pd):
    setup_blocks(pd, decoder_key="BlocksCacheKey(2, 3)")
    pd.prefill.exec("cm.pull_blocks(BlocksCacheKey(2, 3), cache, [4], [4])")
    assert pd.prefill.eval("[a[4].tobytes() for a in kv]") == pd.decode.eval("[a[4].tobytes() for a in kv]")


def test_pull_blocks_with_layer_ranges(pd):
    setup_blocks(pd)
    before = pd.decode.eval("[a.copy() for a in kv]")
    # 4 tensors = 2 layers of (K, V); pull layer 1 of the source into layer 0 of the destination
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [1], [2], src_layer_range=range(1, 2), "
                   "dst_layer_range=range(0, 1))")
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    assert dst[0][2].tobytes() == src[2][1].tobytes()
    assert dst[1][2].tobytes() == src[3][1].tobytes()
    assert dst[2].tobytes() == before[2].tobytes() and dst[3].tobytes() == before[3].tobytes()


def test_tensor_num_per_layer_one(pd):
    setup_blocks(pd, decoder_key="BlocksCacheKey(2, 0)")
    # SGLang's push: tensor_num_per_layer=1, layer i = tensor i
    pd.prefill.exec("cm.push_blocks(BlocksCacheKey(2, 0), cache, [3], [3], range(2, 4), range(2, 4), 1)")
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    assert dst[2][3].tobytes() == src[2][3].tobytes() and dst[3][3].tobytes() == src[3][3].tobytes()
    assert dst[0][3].tobytes() != src[0][3].tobytes()




def test_pull_cache_by_request_key_and_by_id(pd):
    pd.prefill.exec("src = tensors(2, (4, 32), seed=5)\n"
                    "c_src = cm.register_cache(CacheDesc(2, [4, 32], DataType.DT_FLOAT16), addrs(src), "
                    "[CacheKey(1, 10), CacheKey(1, 11)])")
    pd.decode.exec("dst = zeros(2, (3, 32))\n"
                   "c_dst = cm.register_cache(CacheDesc(2, [3, 32], DataType.DT_FLOAT16), addrs(dst))")
    pd.link()
    pd.decode.exec("cm.pull_cache(CacheKeyByIdAndIndex(1, 1, 1), c_dst, 2)")
    src, dst = pd.prefill.eval("src"), pd.decode.eval("dst")
    assert all(d[2].tobytes() == s[1].tobytes() for s, d in zip(src, dst))
    # size: only the first 16 bytes of slot 0
    pd.decode.exec("cm.pull_cache(CacheKeyByIdAndIndex(1, 1, 0), c_dst, 0, size=16)")
    dst = pd.decode.eval("dst")
    assert all(d[0][:8].tobytes() == s[0][:8].tobytes() and not d[0][8:].any() for s, d in zip(src, dst))


def test_pull_cache_by_request_key_releases_allocated_key(make_pd):
    pd = make_pd(remote=False)  # request-key pulls are the non-remote-accessible mode
    pd.prefill.exec("c_src = cm.allocate_cache(CacheDesc(2, [2, 32], DataType.DT_FLOAT16), "
                    "[CacheKey(1, 42, 0), CacheKey(1, 43, 0)])\n"
                    "write_cache(c_src, 3)\n"
                    "cm.deallocate_cache(c_src)")  # only the keys keep it alive now
    pd.decode.exec("c_dst = cm.allocate_cache(CacheDesc(2, [2, 32], DataType.DT_FLOAT16))")
    pd.link()
    pd.decode.exec("cm.pull_cache(CacheKey(1, 42, 0), c_dst, 0)")
    # the key was consumed by the successful pull: a second pull finds nothing
    with pytest.raises(LLMException) as e:
        pd.decode.exec("cm.pull_cache(CacheKey(1, 42, 0), c_dst, 1)")
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    # the other key still works, and consuming it frees the cache
    pd.decode.exec("cm.pull_cache(CacheKey(1, 43, 0), c_dst, 1)")
    assert wait_for(lambda: pd.prefill.eval("dd._engine.cache_count") == 0)
    dst = pd.decode.eval("read_cache(c_dst)")
    for i, t in enumerate(dst):  # both slots hold what write_cache(c_src, 3) wrote
        full = ((np.arange(t.size, dtype=np.int64) * 13 + i * 5 + 3 * 101) % 251).astype(np.uint8)
        assert t.tobytes() == full.tobytes()


def test_pull_blocks_from_contiguous_cache(make_pd):
    pd = make_pd(remote=False)
    # official sample pull_from_cache_to_blocks: P allocates with a key, D pulls into blocks
    pd.prefill.exec("c_src = cm.allocate_cache(CacheDesc(2, [1, 4, 16], DataType.DT_FLOAT16), "
                    "[CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)])\nwrite_cache(c_src, 9)")
    pd.decode.exec("blk = zeros(2, (8, 16))\n"
                   "c_dst = cm.register_blocks_cache(CacheDesc(2, [8, 16], DataType.DT_FLOAT16), addrs(blk))")
    pd.link()
    # the source slot is 4*16 elements = 4 blocks of 16 elements; pull them into blocks 6, 7, 0, 1
    pd.decode.exec("cm.pull_blocks(CacheKey(1, 0, 0), c_dst, [], [6, 7, 0, 1])")
    src = pd.prefill.eval("read_cache(c_src)")
    dst = pd.decode.eval("blk")
    for s, d in zip(src, dst):
        s = s.view(np.float16).reshape(4, 16)
        assert d[6].tobytes() == s[0].tobytes() and d[7].tobytes() == s[1].tobytes()
        assert d[0].tobytes() == s[2].tobytes() and d[1].tobytes() == s[3].tobytes()
    pd.prefill.exec("cm.remove_cache_key(CacheKey(1, 0, 0)); cm.deallocate_cache(c_src)")  # no-op key removal


def test_push_cache_into_remote_slot(pd):
    pd.prefill.exec("src = tensors(2, (2, 32), seed=4)\n"
                    "c_src = cm.register_cache(CacheDesc(2, [2, 32], DataType.DT_FLOAT16), addrs(src))")
    pd.decode.exec("dst = zeros(2, (3, 32))\n"
                   "c_dst = cm.register_cache(CacheDesc(2, [3, 32], DataType.DT_FLOAT16), addrs(dst))")
    pd.link()
    pd.prefill.exec("cm.push_cache(CacheKeyByIdAndIndex(2, 1, 2), c_src, 1)")
    src, dst = pd.prefill.eval("src"), pd.decode.eval("dst")
    assert all(d[2].tobytes() == s[1].tobytes() and not d[0].any() for s, d in zip(src, dst))


def test_prefix_key_is_not_consumed(make_pd):
    pd = make_pd(remote=False)
    pd.prefill.exec("c_src = cm.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8), "
                    "[CacheKey(1, 2**64 - 1, 0, 77)])\nwrite_cache(c_src, 1)")
    pd.decode.exec("c_dst = cm.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_INT8))")
    pd.link()
    for slot in (0, 1):  # pulled twice: prefix keys survive pulls
        pd.decode.exec(f"cm.pull_cache(CacheKey(cluster_id=1, req_id=2**64 - 1, prefix_id=77), c_dst, {slot})")
    src, dst = pd.prefill.eval("read_cache(c_src)"), pd.decode.eval("read_cache(c_dst)")
    assert dst[0][:64].tobytes() == src[0].tobytes() == dst[0][64:].tobytes()


def test_many_blocks_are_coalesced_and_exact(pd):
    pd.prefill.exec("kv = tensors(2, (4096, 8), seed=3)\n"
                    "cache = cm.register_blocks_cache(CacheDesc(2, [4096, 8], DataType.DT_FLOAT16), addrs(kv), "
                    "BlocksCacheKey(1, 0))")
    pd.decode.exec("kv = zeros(2, (4096, 8))\n"
                   "cache = cm.register_blocks_cache(CacheDesc(2, [4096, 8], DataType.DT_FLOAT16), addrs(kv))")
    pd.link()
    rng = np.random.default_rng(0)
    src_blocks = rng.permutation(4096)[:3000].tolist()
    dst_blocks = list(range(100, 3100))  # consecutive on one side only: runs split where src jumps
    pd.decode.exec(f"cm.pull_blocks(BlocksCacheKey(1, 0), cache, {src_blocks}, {dst_blocks})")
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    for s, d in zip(src, dst):
        assert np.array_equal(d[100:3100], s[src_blocks])
        assert not d[:100].any() and not d[3100:].any()


def test_switch_roles_then_push_the_other_way(pd):
    """Official switch_role sample: after unlinking, P becomes DECODER, D becomes PROMPT and listens,
    they link the other way and the new prompt pushes."""
    setup_blocks(pd, decoder_key="BlocksCacheKey(2, 0)")
    assert pd.decode.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], force=True)")[0] == LLMStatusCode.LLM_SUCCESS
    assert pd.prefill.eval("dd.unlink_clusters([cluster(2, 0)], force=True)")[0] == LLMStatusCode.LLM_SUCCESS
    pd.prefill.exec("dd.switch_role(LLMRole.DECODER)")
    assert pd.prefill.eval("(dd.role, dd.listen_port)") == (2, 0)
    pd.decode.exec("opts = LLMConfig(); opts.listen_ip_info = '127.0.0.1:0'\n"
                   "dd.switch_role(LLMRole.PROMPT, opts.generate_options())")
    new_port = pd.decode.eval("dd.listen_port")
    assert new_port > 0
    assert pd.prefill.eval(f"dd.link_clusters([cluster(2, {new_port})])")[0] == LLMStatusCode.LLM_SUCCESS
    pd.decode.exec("cm.push_blocks(BlocksCacheKey(1, 0), cache, [0, 1], [6, 7])")
    src, dst = pd.decode.eval("kv"), pd.prefill.eval("kv")
    assert all(d[6].tobytes() == s[0].tobytes() and d[7].tobytes() == s[1].tobytes() for s, d in zip(src, dst))
    pd.prefill.exec("cm.pull_blocks(BlocksCacheKey(2, 0), cache, [2], [2])")
    assert pd.prefill.eval("[a[2].tobytes() for a in kv]") == pd.decode.eval("[a[2].tobytes() for a in kv]")


def test_concurrent_pulls_from_several_threads(pd):
    setup_blocks(pd)
    pd.decode.exec("""
import threading
errors = []
def worker(i):
    try:
        for _ in range(20):
            cm.pull_blocks(BlocksCacheKey(1, 0), cache, [i], [i])
    except Exception as e:
        errors.append(e)
threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
""")
    assert pd.decode.eval("errors") == []
    assert pd.decode.eval("[a.tobytes() for a in kv]") == pd.prefill.eval("[a.tobytes() for a in kv]")


def test_reregistered_cache_is_seen_by_later_pulls(pd):
    """A puller may cache the peer's blocks-cache layout (direct memory access); when the peer
    replaces the cache under the same model_id, later pulls must read the new memory."""
    setup_blocks(pd)
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0])")
    pd.prefill.exec("cm.unregister_cache(cache.cache_id)\n"
                    "kv2 = tensors(4, (8, 64), seed=9)\n"
                    "cache2 = cm.register_blocks_cache(CacheDesc(4, [8, 64], DataType.DT_FLOAT16), addrs(kv2), "
                    "BlocksCacheKey(1, 0))\n"
                    "for a in kv: a[:] = 0")  # the old memory no longer holds the data
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0, 1], [0, 1])")
    src, dst = pd.prefill.eval("kv2"), pd.decode.eval("kv")
    assert all(d[:2].tobytes() == s[:2].tobytes() for s, d in zip(src, dst))
    pd.prefill.exec("cm.unregister_cache(cache2.cache_id)")
    with pytest.raises(LLMException) as e:
        pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0])")
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_push_into_a_cache_that_is_not_remote_accessible_is_refused(pd):
    setup_blocks(pd, decoder_key="BlocksCacheKey(2, 0)")
    pd.decode.exec("host = zeros(1, (4, 16), host=True)\n"
                   "hc = cm.register_blocks_cache(CacheDesc(1, [4, 16], DataType.DT_FLOAT16, Placement.HOST), "
                   "addrs(host), BlocksCacheKey(2, 1))")  # HOST: not remote accessible by default
    pd.prefill.exec("src1 = tensors(1, (4, 16), seed=3)\n"
                    "s1 = cm.register_blocks_cache(CacheDesc(1, [4, 16], DataType.DT_FLOAT16), addrs(src1))")
    with pytest.raises(LLMException) as e:
        pd.prefill.exec("cm.push_blocks(BlocksCacheKey(2, 1), s1, [0], [0], tensor_num_per_layer=1)")
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "not remote accessible" in str(e.value)  # (on ascend: before the DEVICE/HOST placement check)
    assert not pd.decode.eval("host[0].any()")

"""Error paths of the public API (spec 3, 6, 8, 10), cross-process wherever a peer is involved.

Every failure is checked by exception *type*, and ``LLMException`` by ``status_code``. After
errors on a link, a correct transfer is run to show that the link is still usable.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager

import pytest

from pdlink import LLMDataDist, LLMException, LLMRole, LLMStatusCode
from poll import hang_guard, wait_until

S = LLMStatusCode


@contextmanager
def llm_error(code, op=None):
    """Expect an ``LLMException`` with ``status_code == code`` (and, for native failures, a
    message that starts with ``"<op> failed, error code is <code>"``)."""
    with pytest.raises(LLMException) as info:
        yield info
    assert info.value.status_code == code, f"{info.value.status_code}: {info.value}"
    if op is not None:
        assert str(info.value).startswith(f"{op} failed, error code is {code}"), str(info.value)


def engine(peers, name, role="PROMPT", cluster_id=1, **opts):
    """A peer holding an initialised ``dd`` / ``cm`` (options(...) keyword arguments in ``opts``)."""
    p = peers(name)
    args = ", ".join(f"{k}={v!r}" for k, v in opts.items())
    p.exec(f"dd = LLMDataDist(LLMRole.{role}, {cluster_id}); dd.init(options({args})); cm = dd.cache_manager")
    return p


def unused_port():
    """A port bound (so nobody else gets it) but not listening: connecting is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


BLOCKS = """
kv = tensors(4, (8, 64), seed={seed})
blk = cm.register_blocks_cache(CacheDesc(4, [8, 64], DataType.DT_FLOAT16), addrs(kv), {key})
"""
CONTIG = """
ct = tensors(2, ({batch}, 32), seed={seed})
c = cm.register_cache(CacheDesc(2, [{batch}, 32], DataType.DT_FLOAT16), addrs(ct))
"""


def setup_both(pd, link=True):
    """Prompt: blocks cache id 1 (model 0) + contiguous cache id 2 (batch 2).
    Decoder: blocks cache id 1 (model 0) + contiguous cache id 2 (batch 3)."""
    pd.prefill.exec(BLOCKS.format(seed=1, key="BlocksCacheKey(1, 0)") + CONTIG.format(batch=2, seed=3))
    pd.decode.exec(BLOCKS.format(seed=2, key="BlocksCacheKey(2, 0)") + CONTIG.format(batch=3, seed=4))
    assert pd.prefill.eval("(blk.cache_id, c.cache_id)") == (1, 2)
    if link:
        pd.link()


def assert_good_pull(pd):
    """A correct pull over the link moves exact bytes (the link is still usable)."""
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), blk, [6], [7])")
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    assert all(d[7].tobytes() == s[6].tobytes() for s, d in zip(src, dst))


# ---------------------------------------------------------------------------- before init / lifecycle


def test_calls_before_init_raise_plain_runtime_error():
    dd = LLMDataDist(LLMRole.PROMPT, 1)  # never initialised: no engine in this process
    calls = [
        lambda: dd.cache_manager,
        lambda: dd.listen_port,
        lambda: dd.links(),
        lambda: dd.link_clusters([], 1000),
        lambda: dd.unlink_clusters([], 1000),
        lambda: dd.switch_role(LLMRole.DECODER),
        lambda: dd.kv_cache_manager,
    ]
    for call in calls:
        with pytest.raises(RuntimeError) as e:
            call()
        assert type(e.value) is RuntimeError, type(e.value)  # not an LLMException
        assert str(e.value) == "llm datadist is not initialized"
    dd.finalize()  # a no-op when not initialised
    dd.finalize()
    assert LLMDataDist.llm_engine_instance is None


def test_constructor_type_and_range_errors():
    with pytest.raises(TypeError):
        LLMDataDist(LLMRole.PROMPT, "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LLMDataDist(1, 1)  # type: ignore[arg-type]  # a plain int is not an LLMRole
    with pytest.raises(TypeError):
        LLMDataDist(LLMRole.PROMPT, True)
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, -1)
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, 2**64)
    assert LLMDataDist(LLMRole.DECODER, 2**64 - 1).cluster_id == 2**64 - 1


def test_init_lifecycle_single_instance_per_process(peers):
    p = engine(peers, "life", listen="127.0.0.1:0", pool=1 << 20)
    port = p.eval("dd.listen_port")
    assert port > 0
    # init again on the same object: a no-op (same listener, same cache manager)
    p.exec("cm0 = cm; dd.init(options(listen='127.0.0.1:0', pool=1 << 20))")
    assert p.eval("dd.listen_port") == port and p.eval("dd.cache_manager is cm0")
    # a second engine in the same process is refused, whatever its options
    p.exec("dd2 = LLMDataDist(LLMRole.DECODER, 2)")
    with llm_error(S.LLM_FAILED):
        p.exec("dd2.init(options(pool=1 << 20))")
    with pytest.raises(RuntimeError, match="not initialized"):
        p.eval("dd2.cache_manager")
    assert p.eval("LLMDataDist.llm_engine_instance is dd")
    # finalize twice is a no-op; afterwards every call raises RuntimeError, and the old manager
    # LLM_ENGINE_FINALIZED (test_lifecycle.py has every operation)
    p.exec("dd.finalize(); dd.finalize()")
    assert p.eval("LLMDataDist.llm_engine_instance is None")
    for expr in ("dd.listen_port", "dd.cache_manager"):
        with pytest.raises(RuntimeError) as e:
            p.eval(expr)
        assert type(e.value) is RuntimeError and str(e.value) == "llm datadist is not initialized"
    with llm_error(S.LLM_ENGINE_FINALIZED):
        p.eval("cm0.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_INT8))")
    # now the second instance may start, and the first one's listener is gone
    p.exec("dd2.init(options(pool=1 << 20)); cm2 = dd2.cache_manager")
    ret = p.eval(f"dd2.link_clusters([cluster(1, {port})], 500)")
    assert ret == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert p.eval("cm2.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_INT8)).cache_id") == 1


def test_bad_init_options(peers):
    p = peers("opts")
    p.exec("dd = LLMDataDist(LLMRole.PROMPT, 1)\n"
           "def opts(**kw):\n"
           "    o = options(pool=1 << 20)\n"
           "    o.update(kw)\n"
           "    return o\n")
    invalid = [
        {"llm.EnableCacheManager": "true"},
        {"llm.EnableRemoteCacheAccessible": "yes"},
        {"llm.EnableSwitchRole": "2"},
        {"llm.SyncKvCacheWaitTime": "0"},
        {"llm.SyncKvCacheWaitTime": "-5"},
        {"llm.SyncKvCacheWaitTime": "1.5"},
        {"llm.SyncKvCacheWaitTime": "abc"},
        {"llm.SyncKvCacheWaitTime": str(2**31)},
        {"llm.listenIpInfo": "127.0.0.1"},
        {"llm.listenIpInfo": "127.0.0.1:"},
        {"llm.listenIpInfo": "localhost:80"},
        {"llm.listenIpInfo": "256.0.0.1:80"},
        {"llm.listenIpInfo": "127.0.0.1:65536"},
        {"llm.listenIpInfo": "127.0.0.1:-1"},
        {"llm.MemPoolConfig": "{"},
        {"llm.MemPoolConfig": "[4096]"},
        {"llm.MemPoolConfig": '{"memory_size": 0}'},
        {"llm.MemPoolConfig": '{"memory_size": "4096"}'},
        {"llm.MemPoolConfig": '{"page_shift": 12}'},
        {"llm.MemPoolConfig": '{"memory_size": 4096, "page_shift": 5}'},
        {"llm.HostMemPoolConfig": "not json"},
        {"llm.HostMemPoolConfig": '{"memory_size": %d}' % (21 * 1024**3)},
        {"ge.flowGraphMemMaxSize": "12MB"},
    ]
    for bad in invalid:
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(f"dd.init(opts(**{bad!r}))")
        assert p.eval("LLMDataDist.llm_engine_instance is None"), bad
    # KvCacheManager (v1) mode: a PROMPT needs llm.listenIpInfo, one per device, and a device id
    v1_invalid = [
        {"llm.EnableCacheManager": "0"},
        {"llm.EnableCacheManager": "0", "llm.listenIpInfo": "127.0.0.1:0;127.0.0.1:0"},
        {"llm.EnableCacheManager": "0", "llm.listenIpInfo": "127.0.0.1:0", "ge.exec.deviceId": "x"},
        {"llm.EnableCacheManager": "0", "llm.listenIpInfo": "127.0.0.1:0", "ge.exec.deviceId": ""},
        {"llm.EnableCacheManager": "0", "llm.listenIpInfo": "127.0.0.1:0", "ge.flowGraphMemMaxSize": "0"},
    ]
    for bad in v1_invalid:
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(f"dd.init(opts(**{bad!r}))")
        assert p.eval("LLMDataDist.llm_engine_instance is None"), bad
    with pytest.raises(TypeError):
        p.exec("dd.init([('llm.EnableCacheManager', '1')])")
    with pytest.raises(TypeError):
        p.exec("dd.init(opts(**{'llm.SyncKvCacheWaitTime': 1000}))")  # values must be str
    with pytest.raises(TypeError):
        p.exec("dd.init({1: '1'})")
    with pytest.raises(RuntimeError, match="not initialized"):
        p.eval("dd.cache_manager")
    # none of the failures left a half-initialised engine behind: a correct init works
    p.exec("dd.init(opts(**{'llm.SyncKvCacheWaitTime': '250', 'llm.listenIpInfo': '127.0.0.1:0'}))")
    assert p.eval("dd.listen_port") > 0


# ---------------------------------------------------------------------------- argument checking


def test_wrong_types_and_ranges_raise_type_and_value_errors(pd):
    setup_both(pd, link=False)
    d = pd.decode
    type_errors = [
        "cm.register_cache('desc', addrs(ct))",
        "cm.register_cache(CacheDesc(2, [3, 32], DataType.DT_FLOAT16), [str(a) for a in addrs(ct)])",
        "cm.register_cache(CacheDesc(2, [3, 32], DataType.DT_FLOAT16), addrs(ct)[0])",
        "cm.register_cache(CacheDesc(2, [3, 32], DataType.DT_FLOAT16), addrs(ct), [5])",
        "cm.register_cache(CacheDesc(2, [3, 32], DataType.DT_FLOAT16), addrs(ct), remote_accessible=1)",
        "cm.register_blocks_cache(CacheDesc(4, [8, 64], DataType.DT_FLOAT16), addrs(kv), CacheKey(1, 0))",
        "cm.allocate_cache(None)",
        "cm.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_INT8), [CacheKeyByIdAndIndex(1, 1)])",
        "cm.allocate_blocks_cache(CacheDesc(1, [1, 16], DataType.DT_INT8), CacheKey(1, 0))",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, ['0'], [1])",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1.0])",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [True], [1])",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, 0, 1)",
        "cm.pull_blocks(BlocksCacheKey(1, 0), 'blk', [0], [1])",
        "cm.pull_blocks((1, 0), blk, [0], [1])",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], src_layer_range=[0, 1])",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], tensor_num_per_layer='2')",
        "cm.pull_cache(CacheKey(1, 0), c, 0)",  # remote-accessible mode takes CacheKeyByIdAndIndex only
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, '0')",
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 0, size=1.0)",
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), None, 0)",
        "cm.push_blocks(CacheKeyByIdAndIndex(1, 1, 0), blk, [0], [0])",
        "cm.push_cache(BlocksCacheKey(1, 0), c, 0)",
        "cm.push_cache(CacheKeyByIdAndIndex(1, 2, 0), c, None)",
        "cm.copy_blocks(blk, {0: 1})",
        "cm.copy_blocks(blk, {'0': [1]})",
        "cm.copy_cache(c, c, '1')",
        "cm.remove_cache_key(BlocksCacheKey(1, 0))",
        "cm.deallocate_cache(1)",
        "cm.unregister_cache('1')",
        "CacheKeyByIdAndIndex('1', 1, 0)",
        "CacheKey(1, '7')",
        "BlocksCacheKey(1, '0')",
        "dd.link_clusters(cluster(1, 1), 1000)",
        "dd.link_clusters([LLMClusterInfo()], 1000)",  # remote_cluster_id is None
        "dd.link_clusters([cluster(1, 1)], '1000')",
        "dd.link_clusters([cluster(1, 1), 'x'], 1000)",
        "dd.unlink_clusters([cluster(1, 1)], 1000, force='yes')",
        "dd.unlink_clusters([LLMClusterInfo()], 1000, force=True)",
    ]
    for code in type_errors:
        with pytest.raises(TypeError):
            d.exec(code)
    value_errors = [
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 2**32)",
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, -1)",
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 0, size=2**63)",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], tensor_num_per_layer=-1)",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], tensor_num_per_layer=2**32)",
        "cm.push_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 2**32)",
        "cm.copy_cache(c, c, 0, 2**32)",
        "cm.unregister_cache(2**63)",
        "cm.register_cache(CacheDesc(2, [3, 32], DataType.DT_FLOAT16), [-1, 1])",
        "CacheKeyByIdAndIndex(1, 1, 2**32)",
        "CacheKeyByIdAndIndex(-1, 1, 0)",
        "CacheKey(1, 2**64)",
        "CacheDesc(-1, [1], DataType.DT_INT8)",
        "dd.link_clusters([cluster(1, 1)], 2**31)",
    ]
    for code in value_errors:
        with pytest.raises(ValueError):
            d.exec(code)
    with pytest.raises(ValueError):  # the cluster id setter range-checks too
        d.exec("LLMClusterInfo().remote_cluster_id = -1")
    with pytest.raises(TypeError):
        d.exec("LLMClusterInfo().remote_cluster_id = '1'")
    # none of this touched the local caches
    assert [a.tobytes() for a in d.eval("kv")] == [a.tobytes() for a in d.eval("tensors(4, (8, 64), seed=2)")]


def test_semantic_errors_raise_param_invalid_and_leave_the_link_usable(pd):
    setup_both(pd)
    d = pd.decode
    before = d.eval("[a.copy() for a in kv]"), d.eval("[a.copy() for a in ct]")
    python_checks = [
        # layer ranges
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], src_layer_range=range(0, 2, 2))",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], dst_layer_range=range(1, 1))",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], src_layer_range=range(2, 1))",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], src_layer_range=range(0, 2), "
        "dst_layer_range=range(0, 1))",
        "cm.push_blocks(BlocksCacheKey(1, 0), blk, [0], [1], src_layer_range=range(0, 3, 2))",
        "cm.push_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 0, src_layer_range=range(-1, 1))",
        # tensor_num_per_layer
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], tensor_num_per_layer=0)",
        "cm.push_blocks(BlocksCacheKey(1, 0), blk, [0], [1], tensor_num_per_layer=0)",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1], src_layer_range=range(0, 1), "
        "dst_layer_range=range(0, 1), tensor_num_per_layer=3)",
        "cm.push_blocks(BlocksCacheKey(1, 0), blk, [0], [1], range(0, 1), range(0, 1), tensor_num_per_layer=3)",
        # block lists
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [], [])",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [])",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0, 1], [2])",
        "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [], [2])",  # a BlocksCacheKey source needs src_blocks
        "cm.pull_blocks(CacheKeyByIdAndIndex(1, 2, 0), blk, [0], [1])",  # contiguous source: src_blocks empty
        "cm.push_blocks(BlocksCacheKey(1, 0), blk, [0], [])",
        "cm.push_blocks(BlocksCacheKey(1, 0), blk, [0, 1], [1])",
        # cache kinds
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), blk, 0)",
        "cm.pull_blocks(BlocksCacheKey(1, 0), c, [0], [1])",
        "cm.push_cache(CacheKeyByIdAndIndex(1, 2, 0), blk, 0)",
        "cm.push_blocks(BlocksCacheKey(1, 0), c, [0], [1])",
        # addresses
        "cm.register_cache(CacheDesc(2, [3, 32], DataType.DT_FLOAT16), addrs(ct)[:1])",
        "cm.register_cache(CacheDesc(2, [3, 32], DataType.DT_FLOAT16), [addrs(ct)[0], 0])",
        "cm.register_blocks_cache(CacheDesc(4, [8, 64], DataType.DT_FLOAT16), [])",
        # sizes and keywords
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 0, size=0)",
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 0, size=-2)",
        "cm.push_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 0, size=16)",
        "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 0, layer_range=range(0, 1))",
        "dd.link_clusters([cluster(1, 1)], 0)",
        "dd.unlink_clusters([cluster(1, 1)], -5)",
    ]
    for code in python_checks:
        with llm_error(S.LLM_PARAM_INVALID):
            d.exec(code)
    native_checks = [
        ("pull_cache", "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 3)"),  # local batch size is 3
        ("pull_cache", "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 2**32 - 1)"),
        ("pull_cache", "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 0, size=32 * 2 + 1)"),  # > stride
        ("pull_blocks", "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [8])"),  # local block out of range
        ("pull_blocks", "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0, 1], [1, 2**40])"),
        ("push_blocks", "cm.push_blocks(BlocksCacheKey(1, 0), blk, [8], [0])"),
        ("push_cache", "cm.push_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 3)"),
    ]
    for op, code in native_checks:
        with llm_error(S.LLM_PARAM_INVALID, op):
            d.exec(code)
    after = d.eval("kv"), d.eval("ct")
    for b, a in zip(before, after):
        assert [x.tobytes() for x in a] == [x.tobytes() for x in b]
    assert pd.prefill.eval("[a.tobytes() for a in kv] == [a.tobytes() for a in tensors(4, (8, 64), seed=1)]")
    assert_good_pull(pd)


def test_non_remote_mode_key_rules_and_push_refused(make_pd):
    pd = make_pd(remote=False)
    pd.prefill.exec("src = cm.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_INT8), "
                    "[CacheKey(1, 5), CacheKey(1, 2**64 - 1, 0, 9)])\nwrite_cache(src, 2)")
    pd.decode.exec("dst = cm.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_INT8))\n"
                   "kv = tensors(2, (4, 64), seed=1, dtype=np.int8)\n"
                   "blk = cm.register_blocks_cache(CacheDesc(2, [4, 64], DataType.DT_INT8), addrs(kv), "
                   "BlocksCacheKey(2, 0))")
    pd.link()
    d = pd.decode
    for code in [
        "cm.pull_cache(CacheKey(1, 5, 0, 9), dst, 0)",  # both req_id and prefix_id valid
        "cm.pull_cache(CacheKey(1, 2**64 - 1), dst, 0)",  # neither
        "cm.pull_blocks(CacheKey(1, 5, 0, 9), blk, [], [0])",
        "cm.pull_blocks(CacheKey(1, 2**64 - 1), blk, [], [0])",
        # push needs enable_remote_cache_accessible
        "cm.push_blocks(BlocksCacheKey(1, 0), blk, [0], [0])",
        "cm.push_cache(CacheKeyByIdAndIndex(1, 1, 0), dst, 0)",
    ]:
        with llm_error(S.LLM_PARAM_INVALID):
            d.exec(code)
    with pytest.raises(TypeError):  # request keys are CacheKey / CacheKeyByIdAndIndex only
        d.exec("cm.pull_cache(BlocksCacheKey(1, 0), dst, 0)")
    # an unknown request key, then the real one: the errors consumed nothing
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST, "pull_cache"):
        d.exec("cm.pull_cache(CacheKey(1, 6), dst, 0)")
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST, "pull_cache"):
        d.exec("cm.pull_cache(CacheKey(1, 5, model_id=1), dst, 0)")  # model_id is part of the key
    d.exec("cm.pull_cache(CacheKey(1, 5), dst, 1)\ncm.pull_cache(CacheKey(1, 2**64 - 1, 0, 9), dst, 0)")
    src, dst = pd.prefill.eval("read_cache(src)"), d.eval("read_cache(dst)")
    assert dst[0][64:].tobytes() == src[0][:64].tobytes() and dst[0][:64].tobytes() == src[0][64:].tobytes()


def test_duplicate_cache_keys_are_rejected(peers):
    p = engine(peers, "dup", pool=1 << 20)
    desc = "CacheDesc(1, [2, 64], DataType.DT_INT8)"
    p.exec(f"a = cm.allocate_cache({desc}, [CacheKey(1, 5)])\n"
           "buf = zeros(1, (2, 64), np.int8)\nbuf2 = zeros(1, (4, 64), np.int8)\n"
           f"r = cm.register_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8), addrs(buf2), BlocksCacheKey(1, 3))")
    for code in [
        f"cm.allocate_cache({desc}, [CacheKey(1, 7), CacheKey(1, 7)])",  # duplicated in the call
        f"cm.allocate_cache({desc}, [CacheKey(1, 5)])",  # already bound to cache a
        f"cm.allocate_cache({desc}, [CacheKey(9, 5)])",  # cluster_id is not part of the key
        f"cm.allocate_cache({desc}, [CacheKey(1, 8), CacheKey(1, 9), CacheKey(1, 10)])",  # more keys than slots
        f"cm.allocate_cache({desc}, [CacheKey(1, 2**64 - 1, 0, 4), CacheKey(1, 11, 0, 4)])",  # same prefix
        f"cm.register_cache({desc}, addrs(buf), [CacheKey(1, 5)])",
        f"cm.register_cache({desc}, addrs(buf), [CacheKey(1, 12), CacheKey(1, 12)])",
        "cm.register_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8), addrs(buf2), BlocksCacheKey(1, 3))",
        "cm.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8), BlocksCacheKey(7, 3))",
    ]:
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(code)
    # the rejected keys were not half-registered: they can be used now
    p.exec(f"b = cm.allocate_cache({desc}, [CacheKey(1, 7), CacheKey(1, 8)])\n"
           f"g = cm.register_cache({desc}, addrs(buf), [CacheKey(1, 12)])")
    # a different model_id is a different key
    p.exec(f"m = cm.allocate_cache({desc}, [CacheKey(1, 5, 1)])\n"
           "m2 = cm.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8), BlocksCacheKey(1, 4))")
    # after removing a key it can be bound again
    p.exec(f"cm.remove_cache_key(CacheKey(1, 5))\nc = cm.allocate_cache({desc}, [CacheKey(1, 5)])")


# ---------------------------------------------------------------------------- remote lookups


def test_unknown_remote_keys_give_kv_cache_not_exist(pd):
    setup_both(pd)
    d, p = pd.decode, pd.prefill
    before_d, before_p = d.eval("kv"), p.eval("kv")
    for op, code in [
        ("pull_blocks", "cm.pull_blocks(BlocksCacheKey(1, 9), blk, [0], [1])"),
        ("pull_blocks", "cm.pull_blocks(CacheKeyByIdAndIndex(1, 99, 0), blk, [], [1])"),
        ("pull_cache", "cm.pull_cache(CacheKeyByIdAndIndex(1, 99, 0), c, 0)"),
        ("pull_cache", "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 2), c, 0)"),  # remote batch is 2
        ("pull_cache", "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 2**32 - 1), c, 0)"),
        ("push_blocks", "cm.push_blocks(BlocksCacheKey(1, 9), blk, [0], [1])"),
        ("push_cache", "cm.push_cache(CacheKeyByIdAndIndex(1, 99, 0), c, 0)"),
        ("push_cache", "cm.push_cache(CacheKeyByIdAndIndex(1, 2, 2), c, 0)"),
    ]:
        with llm_error(S.LLM_KV_CACHE_NOT_EXIST, op):
            d.exec(code)
    # the message names the op and the code, as llm_datadist formats it
    with pytest.raises(LLMException) as e:
        d.exec("cm.pull_blocks(BlocksCacheKey(1, 9), blk, [0], [1])")
    assert str(e.value).startswith("pull_blocks failed, error code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST")
    assert d.eval("[a.tobytes() for a in kv]") == [a.tobytes() for a in before_d]
    assert p.eval("[a.tobytes() for a in kv]") == [a.tobytes() for a in before_p]
    # the link survived: the correct calls work, in both directions
    assert_good_pull(pd)
    d.exec("cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 1), c, 2)")
    assert all(x[2].tobytes() == y[1].tobytes() for x, y in zip(d.eval("ct"), p.eval("ct")))
    p.exec("cm.push_blocks(BlocksCacheKey(2, 0), blk, [3], [0])")
    assert all(x[0].tobytes() == y[3].tobytes() for x, y in zip(d.eval("kv"), p.eval("kv")))


def test_remote_out_of_range_accesses_are_refused(pd):
    setup_both(pd)
    d, p = pd.decode, pd.prefill
    # the decoder also gets a contiguous cache whose slot (128 B) is larger than the prompt's (64 B)
    d.exec("wide = zeros(2, (2, 64))\n"
           "cw = cm.register_cache(CacheDesc(2, [2, 64], DataType.DT_FLOAT16), addrs(wide))")
    before_d, before_p = d.eval("kv"), p.eval("kv")
    for op, code in [
        ("pull_blocks", "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [10_000], [1])"),
        ("pull_blocks", "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [8], [1])"),
        ("pull_blocks", "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [-1], [1])"),
        ("pull_blocks", "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [2, 10_000], [1, 3])"),
        ("push_blocks", "cm.push_blocks(BlocksCacheKey(1, 0), blk, [1], [10_000])"),
        ("push_blocks", "cm.push_blocks(BlocksCacheKey(1, 0), blk, [1, 2], [3, -1])"),
        # the remote slot is smaller than what is asked for
        ("pull_cache", "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 1), cw, 0)"),
        ("pull_cache", "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 1), cw, 1, size=65)"),
        ("push_cache", "cm.push_cache(CacheKeyByIdAndIndex(1, 2, 0), cw, 0)"),
        # a remote slot of 64 B cannot fill one 128 B block
        ("pull_blocks", "cm.pull_blocks(CacheKeyByIdAndIndex(1, 2, 0), blk, [], [0], src_layer_range=range(0, 1))"),
        ("pull_blocks", "cm.pull_blocks(CacheKeyByIdAndIndex(1, 2, 0), blk, [], [0])"),  # 4 tensors here, 2 there
    ]:
        with llm_error(S.LLM_PARAM_INVALID, op):
            d.exec(code)
    assert d.eval("[a.tobytes() for a in kv]") == [a.tobytes() for a in before_d]  # nothing written locally
    assert not d.eval("any(a.any() for a in wide)")
    assert p.eval("[a.tobytes() for a in kv]") == [a.tobytes() for a in before_p]  # nor remotely
    assert p.eval("[a.tobytes() for a in ct] == [a.tobytes() for a in tensors(2, (2, 32), seed=3)]")
    assert_good_pull(pd)
    d.exec("cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 1), cw, 1, size=64)")  # exactly the remote slot
    src, dst = p.eval("ct"), d.eval("wide")
    assert all(w[1, :32].tobytes() == s[1].tobytes() and not w[1, 32:].any() for s, w in zip(src, dst))


# ---------------------------------------------------------------------------- links


def test_transfers_need_a_link(pd):
    setup_both(pd, link=False)
    d, p = pd.decode, pd.prefill
    for who, op, code in [
        (d, "pull_blocks", "cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1])"),
        (d, "pull_cache", "cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), c, 0)"),
        (d, "push_blocks", "cm.push_blocks(BlocksCacheKey(1, 0), blk, [0], [1])"),
        (p, "push_cache", "cm.push_cache(CacheKeyByIdAndIndex(2, 2, 0), c, 0)"),
    ]:
        with llm_error(S.LLM_NOT_YET_LINK, op):
            who.exec(code)
    pd.link()
    with llm_error(S.LLM_NOT_YET_LINK, "pull_blocks"):  # linked, but to cluster 1 only
        d.exec("cm.pull_blocks(BlocksCacheKey(3, 0), blk, [0], [1])")
    assert_good_pull(pd)
    assert d.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], 2000)") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    with llm_error(S.LLM_NOT_YET_LINK, "pull_blocks"):
        d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1])")
    with llm_error(S.LLM_NOT_YET_LINK, "push_blocks"):  # the non-forced unlink removed the far end too
        p.exec("cm.push_blocks(BlocksCacheKey(2, 0), blk, [0], [1])")
    pd.link()  # and a fresh link works again
    assert_good_pull(pd)


def test_link_clusters_failure_codes(pd):
    d, p = pd.decode, pd.prefill
    sock, dead = unused_port()
    try:
        ret = d.eval(f"dd.link_clusters([cluster(1, {dead})], 1000)", timeout=hang_guard(1000))
        assert ret == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    finally:
        sock.close()
    # a listener that accepts but never answers the handshake: bounded by the call's timeout
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(4)
    try:
        ret = d.eval(f"dd.link_clusters([cluster(1, {mute.getsockname()[1]})], 300)", timeout=hang_guard(300))
        assert ret == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    finally:
        mute.close()
    # the listener is cluster 1: asking it for cluster 5 fails, and leaves no link on either side
    assert d.eval(f"dd.link_clusters([cluster(5, {pd.port})], 2000)") == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert d.eval("dd.links()") == [] and p.eval("dd.links()") == []
    d.exec("b = cm.allocate_blocks_cache(CacheDesc(1, [1, 64], DataType.DT_INT8))")
    for cid in (5, 1):
        with llm_error(S.LLM_NOT_YET_LINK, "pull_blocks"):
            d.exec(f"cm.pull_blocks(BlocksCacheKey({cid}, 0), b, [0], [0])")
    pd.link()
    assert [lk["peer_cluster_id"] for lk in d.eval("dd.links()")] == [1]
    assert [lk["peer_cluster_id"] for lk in p.eval("dd.links()")] == [2]
    # re-linking an existing peer: a per-cluster code, not an exception
    assert d.eval(f"dd.link_clusters([cluster(1, {pd.port})], 2000)") == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
    # mixed results: overall is the last failing cluster's code
    sock, dead = unused_port()
    try:
        ret = d.eval(f"dd.link_clusters([cluster(1, {pd.port}), cluster(7, {dead})], 1000)")
    finally:
        sock.close()
    assert ret == (S.LLM_LINK_FAILED, [S.LLM_ALREADY_LINK, S.LLM_LINK_FAILED])
    # more than 16 clusters in one call
    ret = d.eval(f"dd.link_clusters([cluster(100 + i, {pd.port}) for i in range(17)], 1000)")
    assert ret == (S.LLM_CLUSTER_NUM_EXCEED_LIMIT, [])
    ret = d.eval(f"dd.unlink_clusters([cluster(100 + i, {pd.port}) for i in range(17)], 1000)")
    assert ret == (S.LLM_CLUSTER_NUM_EXCEED_LIMIT, [])
    # a remote ip is required (exactly one) for a link (raised) and a non-forced unlink (the
    # cluster's status, as upstream's engine answers it)
    with llm_error(S.LLM_PARAM_INVALID):
        d.exec("c = LLMClusterInfo(); c.remote_cluster_id = 1; c.append_local_ip_info('127.0.0.1', 0)\n"
               "dd.link_clusters([c], 1000)")
    d.exec(f"c = cluster(1, {pd.port}); c.append_remote_ip_info('127.0.0.1', {pd.port})")
    assert d.eval("dd.unlink_clusters([c], 1000)") == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
    assert [lk["peer_cluster_id"] for lk in d.eval("dd.links()")] == [1]  # the link is untouched


def test_unlink_clusters(pd):
    setup_both(pd, link=False)
    d, p = pd.decode, pd.prefill
    assert d.eval(f"dd.unlink_clusters([cluster(7, {pd.port})], 1000)") == (S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
    pd.link()
    links = d.eval("dd.links()")
    assert len(links) == 1 and links[0]["peer_cluster_id"] == 1 and links[0]["initiator"] is True
    links = p.eval("dd.links()")
    assert len(links) == 1 and links[0]["peer_cluster_id"] == 2 and links[0]["initiator"] is False
    # non-forced: both ends go
    ret = d.eval(f"dd.unlink_clusters([cluster(1, {pd.port}), cluster(7, {pd.port})], 2000)")
    assert ret == (S.LLM_NOT_YET_LINK, [S.LLM_SUCCESS, S.LLM_NOT_YET_LINK])
    assert d.eval("dd.links()") == []
    assert p.eval("dd.links()") == []  # the peer dropped its end before acknowledging
    assert d.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], 1000)") == (S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
    # forced: only the local end goes; a forced unlink needs no remote ip
    pd.link()
    d.exec("c = LLMClusterInfo(); c.remote_cluster_id = 1")
    ret = d.eval("dd.unlink_clusters([c], 1000, force=True)")
    assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert d.eval("dd.links()") == []
    # the peer was not told: its end sees the channels close and stays, broken, until replaced
    wait_until(lambda: [(lk["peer_cluster_id"], lk["broken"]) for lk in p.eval("dd.links()")] == [(2, True)], 20,
               "the prompt's end broken, still listed")
    with llm_error(S.LLM_NOT_YET_LINK, "pull_blocks"):
        d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), blk, [0], [1])")
    # the client re-links: the server replaces its stale end, and transfers work again
    pd.link()
    assert [lk["peer_cluster_id"] for lk in p.eval("dd.links()")] == [2]
    assert_good_pull(pd)
    p.exec("cm.push_blocks(BlocksCacheKey(2, 0), blk, [5], [6])")
    assert all(x[6].tobytes() == y[5].tobytes() for x, y in zip(d.eval("kv"), p.eval("kv")))
    # the server side may unlink too (non-forced): both ends go
    p.exec("c = LLMClusterInfo(); c.remote_cluster_id = 2; c.append_local_ip_info('127.0.0.1', 0); "
           "c.append_remote_ip_info('127.0.0.1', 1)")
    assert p.eval("dd.unlink_clusters([c], 2000)") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert p.eval("dd.links()") == []
    assert d.eval("dd.links()") == []


# ---------------------------------------------------------------------------- switch_role


def test_switch_role(pd):
    setup_both(pd)
    d, p = pd.decode, pd.prefill
    for who, role in ((d, "PROMPT"), (p, "DECODER")):
        with llm_error(S.LLM_EXIST_LINK, "switch_role"):
            who.exec(f"dd.switch_role(LLMRole.{role}, {{'llm.listenIpInfo': '127.0.0.1:0'}})")
        with llm_error(S.LLM_EXIST_LINK, "switch_role"):
            who.exec(f"dd.switch_role(LLMRole.{role})")
    assert d.eval("dd.role") == LLMRole.DECODER and p.eval("dd.role") == LLMRole.PROMPT
    assert p.eval("dd.listen_port") == pd.port and d.eval("dd.listen_port") == 0
    assert_good_pull(pd)  # the refused switches did not disturb the link
    assert d.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], 2000)") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert p.eval("dd.links()") == []
    # argument errors
    with pytest.raises(TypeError):
        d.exec("dd.switch_role(0)")
    with pytest.raises(TypeError):
        d.exec("dd.switch_role('PROMPT')")
    with pytest.raises(TypeError):
        d.exec("dd.switch_role(LLMRole.PROMPT, {'llm.listenIpInfo': 1})")
    with pytest.raises(TypeError):
        d.exec("dd.switch_role(LLMRole.PROMPT, [('llm.listenIpInfo', '127.0.0.1:0')])")
    for bad in ("127.0.0.1", "127.0.0.1:99999", "host:80"):
        with llm_error(S.LLM_PARAM_INVALID):
            d.exec(f"dd.switch_role(LLMRole.PROMPT, {{'llm.listenIpInfo': {bad!r}}})")
    assert d.eval("dd.role") == LLMRole.DECODER and d.eval("dd.listen_port") == 0
    # swap roles: the decoder starts a listener, the prompt stops its own
    d.exec("dd.switch_role(LLMRole.PROMPT, {'llm.listenIpInfo': '127.0.0.1:0'})")
    p.exec("dd.switch_role(LLMRole.DECODER)")
    new_port = d.eval("dd.listen_port")
    assert new_port > 0 and d.eval("dd.role") == LLMRole.PROMPT
    assert p.eval("dd.listen_port") == 0 and p.eval("dd.role") == LLMRole.DECODER
    # nobody listens on the old port any more; the new listener accepts
    assert d.eval(f"dd.link_clusters([cluster(1, {pd.port})], 1000)") == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert p.eval(f"dd.link_clusters([cluster(2, {new_port})], 2000)") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    p.exec("cm.pull_blocks(BlocksCacheKey(2, 0), blk, [4], [2])")  # the caches survived the switch
    assert all(x[2].tobytes() == y[4].tobytes() for x, y in zip(p.eval("kv"), d.eval("kv")))


def test_dead_peer_breaks_the_link_until_unlinked(pd, peers):
    setup_both(pd)
    p = pd.prefill
    pd.decode.kill()
    wait_until(lambda: all(lk["broken"] for lk in p.eval("dd.links()")), 20, "the prompt saw the link break")
    links = p.eval("dd.links()")
    assert len(links) == 1 and links[0]["peer_cluster_id"] == 2 and links[0]["broken"] is True
    # a known-broken link fails at once (LINK_FAILED, never the TIMEOUT a wait for the dead peer
    # would end in), under a hang guard
    with llm_error(S.LLM_LINK_FAILED, "push_blocks"):
        p.exec("cm.push_blocks(BlocksCacheKey(2, 0), blk, [0], [0])", timeout=hang_guard(1000))
    # the survivor unlinks (the peer is gone, the local end is freed anyway), then a new decoder links
    assert p.eval("dd.unlink_clusters([cluster(2, 1)], 1000)") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert p.eval("dd.links()") == []
    q = peers("decode2", env=pd.env)
    q.exec("dd = LLMDataDist(LLMRole.DECODER, 2); dd.init(options(pool=1 << 20)); cm = dd.cache_manager\n"
           "kv = zeros(4, (8, 64))\n"
           "blk = cm.register_blocks_cache(CacheDesc(4, [8, 64], DataType.DT_FLOAT16), addrs(kv))")
    assert q.eval(f"dd.link_clusters([cluster(1, {pd.port})], 2000)") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    q.exec("cm.pull_blocks(BlocksCacheKey(1, 0), blk, [3], [3])")
    assert all(x[3].tobytes() == y[3].tobytes() for x, y in zip(q.eval("kv"), p.eval("kv")))


def test_failed_switch_role_keeps_the_old_listener(pd):
    p = pd.prefill
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        with pytest.raises(LLMException) as e:
            p.exec(f"dd.switch_role(LLMRole.DECODER, {{'llm.listenIpInfo': '127.0.0.1:{busy.getsockname()[1]}'}})")
    finally:
        busy.close()
    assert e.value.status_code != S.LLM_SUCCESS and str(e.value).startswith("switch_role failed"), str(e.value)
    assert p.eval("dd.role") == LLMRole.PROMPT  # the failed call changed nothing ...
    assert p.eval("dd.listen_port") == pd.port  # ... so the old listener is still there
    pd.link()

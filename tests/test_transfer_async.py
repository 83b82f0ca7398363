"""Layer-wise ``transfer_cache_async`` (spec 7.8-7.11, 8.5, 10.5) across two real processes.

Every transfer kind (keyed or raw addresses; cache->cache, blocks->blocks, cache->blocks), the
layer loop's stop rules, ``CacheTask`` timeouts and every validation rule; data is checked byte
for byte. The prefill pushes into the decoder (the decoder dials, links are symmetric).
"""

from __future__ import annotations

import threading

import pytest

from internals import transfer_cache_async
from pdlink import Cache, CacheDesc, DataType, LayerSynchronizer, LLMException, LLMStatusCode, TransferConfig

S = LLMStatusCode

SYNC = """
import threading, time
class Sync(LayerSynchronizer):
    # records each call; waits for `gate` (if any) first; returns False at layer `fail_at`
    def __init__(self, fail_at=None, gate=None):
        self.calls, self.fail_at, self.gate = [], fail_at, gate
    def synchronize_layer(self, layer_index, timeout_in_millis):
        self.calls.append((layer_index, timeout_in_millis))
        if self.gate is not None and not self.gate.wait(20):
            return False
        return layer_index != self.fail_at
"""


def blocks(name, n, num_blocks=8, width=64, key="None", seed=None):
    """Peer code: `name` = n arrays (num_blocks, width) fp16 (patterned with `seed`, else zeros),
    registered as blocks cache `c_<name>`."""
    fill = f"tensors({n}, ({num_blocks}, {width}), seed={seed})" if seed else f"zeros({n}, ({num_blocks}, {width}))"
    return (f"{name} = {fill}\nc_{name} = cm.register_blocks_cache(CacheDesc({n}, [{num_blocks}, {width}], "
            f"DataType.DT_FLOAT16), addrs({name}), {key})\n")


def contig(name, n, batch, width=64, seed=None):
    """Peer code: `name` = n arrays (batch, width) fp16, registered as contiguous cache `c_<name>`."""
    fill = f"tensors({n}, ({batch}, {width}), seed={seed})" if seed else f"zeros({n}, ({batch}, {width}))"
    return (f"{name} = {fill}\nc_{name} = cm.register_cache(CacheDesc({n}, [{batch}, {width}], "
            f"DataType.DT_FLOAT16), addrs({name}))\n")


def setup(pd, prefill_code, decode_code):
    pd.prefill.exec(SYNC + prefill_code)
    pd.decode.exec(decode_code)
    pd.link()


def run(pd, call, sync="Sync()"):
    """Start `cm.transfer_cache_async(...)` on the prefill (`call` = its argument list after the
    synchronizer); return (synchronize(), get_results(), synchronizer calls)."""
    pd.prefill.exec(f"sync = {sync}\ntask = cm.transfer_cache_async({call.format(sync='sync')})")
    return pd.prefill.eval("(task.synchronize(), task.get_results(), sync.calls)", timeout=60)


def bytes_of(arrays):
    return [a.tobytes() for a in arrays]


# ---------------------------------------------------------------------------- keyed (remote accessible)


def test_official_sample_blocks_cache_key(pd):
    """transfer_cache_async_sample.py: a blocks cache pushed with
    TransferWithCacheKeyConfig(BlocksCacheKey(D_ID, 0), range(0, 1), range(0, 1)), then get_results()."""
    setup(pd, blocks("kv", 4, key="BlocksCacheKey(1, 0)", seed=1), blocks("kv", 4, key="BlocksCacheKey(2, 0)"))
    pd.prefill.exec("task = cm.transfer_cache_async(c_kv, Sync(), "
                    "[TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 1), range(0, 1))])")
    assert pd.prefill.eval("task.get_results()") == [S.LLM_SUCCESS]
    assert pd.prefill.eval("task.synchronize()") == S.LLM_SUCCESS
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    # Without block indices a source pushes one slot; a blocks source's slot is block 0.
    for t in (0, 1):
        assert dst[t][0].tobytes() == src[t][0].tobytes()
        assert not dst[t][1:].any()
    assert not dst[2].any() and not dst[3].any()  # layer 1 was not asked for


def test_two_configs_to_two_layers_of_one_destination_and_layer_order(pd):
    setup(pd, blocks("kv", 6, key="BlocksCacheKey(1, 0)", seed=2), blocks("kv", 6, key="BlocksCacheKey(2, 0)"))
    # source layer 0 -> destination layer 2, source layer 2 -> destination layer 0; nobody wants layer 1
    ret, results, calls = run(pd, "c_kv, {sync}, ["
                                  "TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 1), range(2, 3)), "
                                  "TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(2, 3), range(0, 1))], "
                                  "[0, 1, 5], [3, 4, 0], 128")  # 128 = the block size: accepted
    assert (ret, results) == (S.LLM_SUCCESS, [S.LLM_SUCCESS, S.LLM_SUCCESS])
    assert calls == [(0, None), (2, None)]
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    for s, d in ((0, 4), (1, 5), (4, 0), (5, 1)):
        for sb, db in ((0, 3), (1, 4), (5, 0)):
            assert dst[d][db].tobytes() == src[s][sb].tobytes()
        assert not dst[d][[1, 2, 5, 6, 7]].any()
    assert not dst[2].any() and not dst[3].any()


def test_cache_to_cache_by_id_and_index_and_cache_to_blocks(pd):
    setup(pd, contig("ct", 4, 2, seed=3) + contig("one", 2, 1, width=256, seed=4),
          contig("ct", 4, 3) + blocks("kv", 2, key="BlocksCacheKey(2, 0)"))
    # whole slot 1 of both layers -> slot 2 of the decoder's cache id 1
    ret, results, _ = run(pd, "c_ct, {sync}, [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, 1, 2), "
                              "range(0, 2), range(0, 2), 1)]")
    assert (ret, results) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    src, dst = pd.prefill.eval("ct"), pd.decode.eval("ct")
    for s, d in zip(src, dst):
        assert d[2].tobytes() == s[1].tobytes() and not d[:2].any()
    # a 512-byte slot cut into 128-byte blocks, into blocks 6, 7, 0, 1 of the decoder's blocks cache
    ret, results, _ = run(pd, "c_one, {sync}, [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), "
                              "range(0, 1), range(0, 1))], None, [6, 7, 0, 1], 128")
    assert (ret, results) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    src, dst = pd.prefill.eval("one"), pd.decode.eval("kv")
    for s, d in zip(src, dst):
        chunks = s[0].reshape(4, 64)
        assert [d[b].tobytes() for b in (6, 7, 0, 1)] == bytes_of(chunks)
        assert not d[2:6].any()


def test_synchronizer_false_stops_the_transfer(pd):
    setup(pd, blocks("kv", 6, key="BlocksCacheKey(1, 0)", seed=5), blocks("kv", 6, key="BlocksCacheKey(2, 0)"))
    ret, results, calls = run(pd, "c_kv, {sync}, ["
                                  "TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 3), range(0, 3)), "
                                  "TransferWithCacheKeyConfig(BlocksCacheKey(9, 0), range(2, 3), range(2, 3))], "
                                  "[1], [1]", sync="Sync(fail_at=1)")
    # the config holding layer 1 is marked PARAM_INVALID; cluster 9's config never transferred
    assert (ret, results) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID, None])
    assert calls == [(0, None), (1, None)]
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    assert dst[0][1].tobytes() == src[0][1].tobytes() and dst[1][1].tobytes() == src[1][1].tobytes()
    assert not any(d.any() for d in dst[2:])


def test_blocking_synchronizer_times_out_then_completes(pd):
    setup(pd, blocks("kv", 4, key="BlocksCacheKey(1, 0)", seed=6), blocks("kv", 4, key="BlocksCacheKey(2, 0)"))
    pd.prefill.exec("gate = threading.Event()\nsync = Sync(gate=gate)\n"
                    "task = cm.transfer_cache_async(c_kv, sync, [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), "
                    "range(0, 2), range(0, 2))], [2, 3], [2, 3])\n"
                    "first = task.synchronize(300)")
    assert pd.prefill.eval("first") == S.LLM_TIMEOUT  # the gate is shut: only the timeout can end it
    assert pd.prefill.eval("task.get_results(0)") == [S.LLM_TIMEOUT]
    assert pd.prefill.eval("task.synchronize(0)") == S.LLM_TIMEOUT
    assert not any(d.any() for d in pd.decode.eval("kv"))  # nothing moved while layer 0 is pending
    pd.prefill.exec("gate.set()")
    assert pd.prefill.eval("(task.synchronize(), task.get_results(), sync.calls)") == (
        S.LLM_SUCCESS, [S.LLM_SUCCESS], [(0, None), (1, None)])
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    for s, d in zip(src, dst):
        assert d[2:4].tobytes() == s[2:4].tobytes() and not d[:2].any() and not d[4:].any()
    for bad, exc in (("'1'", TypeError), ("-1", ValueError), ("2**32", ValueError), ("1.5", TypeError)):
        for method in ("synchronize", "get_results"):
            with pytest.raises(exc):
                pd.prefill.eval(f"task.{method}({bad})")


def test_failure_mid_way_records_the_code_and_stops(pd):
    setup(pd, blocks("kv", 6, key="BlocksCacheKey(1, 0)", seed=7), blocks("kv", 6, key="BlocksCacheKey(2, 0)"))
    ret, results, calls = run(pd, "c_kv, {sync}, ["
                                  "TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 3), range(0, 3)), "
                                  "TransferWithCacheKeyConfig(BlocksCacheKey(2, 7), range(1, 2), range(1, 2))], "
                                  "[2], [2]")
    # model 7 does not exist on cluster 2: its code lands in cluster 2's (shared) slot
    assert (ret, results) == (S.LLM_KV_CACHE_NOT_EXIST, [S.LLM_KV_CACHE_NOT_EXIST] * 2)
    assert calls == [(0, None), (1, None)]
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    for t in range(4):  # layers 0 and 1 went before the failure
        assert dst[t][2].tobytes() == src[t][2].tobytes()
    assert not dst[4].any() and not dst[5].any()  # layer 2 was never transferred
    # the link is still fine
    ret, results, _ = run(pd, "c_kv, {sync}, [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(2, 3), "
                              "range(2, 3))], [2], [2]")
    assert (ret, results) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert pd.decode.eval("kv[4][2].tobytes()") == src[4][2].tobytes()


# ---------------------------------------------------------------------------- raw addresses (TransferConfig)


def test_transfer_config_into_raw_addresses(make_pd):
    pd = make_pd(remote=False)
    setup(pd, contig("ct", 4, 2, seed=8), contig("ct", 4, 3))
    slot = 64 * 2  # bytes per slot of the decoder's cache
    # every layer of slot 1 -> slot 2 (addresses pre-offset, as llm_datadist requires); layer 1 of
    # slot 0 -> slot 0: two configs to one cluster share its result slot
    addrs = pd.decode.eval("addrs(ct)")
    all_layers = [a + 2 * slot for a in addrs]
    ret, results, calls = run(pd, f"c_ct, {{sync}}, [TransferConfig(2, {all_layers}, None, 1), "
                                  f"TransferConfig(2, {addrs[2:]}, range(1, 2))]")
    assert (ret, results) == (S.LLM_SUCCESS, [S.LLM_SUCCESS, S.LLM_SUCCESS])
    assert calls == [(0, None), (1, None)]
    src, dst = pd.prefill.eval("ct"), pd.decode.eval("ct")
    for t, (s, d) in enumerate(zip(src, dst)):
        assert d[2].tobytes() == s[1].tobytes() and not d[1].any()
        if t < 2:
            assert not d[0].any()
        else:
            assert d[0].tobytes() == s[0].tobytes()


def test_transfer_config_with_block_indices(make_pd):
    pd = make_pd(remote=False)
    setup(pd, blocks("kv", 4, seed=9) + contig("one", 2, 1, width=256, seed=10),
          blocks("kv", 4) + blocks("pg", 2, width=80))
    kv_addrs, pg_addrs = pd.decode.eval("(addrs(kv), addrs(pg))")
    # blocks -> blocks, both layers; dst_block_memory_size omitted (= the source block size)
    ret, results, _ = run(pd, f"c_kv, {{sync}}, [TransferConfig(2, {kv_addrs})], [0, 1, 5], [3, 4, 0]")
    assert (ret, results) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    # layer 1 only, with dst_block_memory_size = the block size (128 bytes)
    ret, results, _ = run(pd, f"c_kv, {{sync}}, [TransferConfig(2, {kv_addrs[2:]}, range(1, 2))], [7], [7], 128")
    assert (ret, results) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    for t, (s, d) in enumerate(zip(src, dst)):
        for sb, db in ((0, 3), (1, 4), (5, 0)):
            assert d[db].tobytes() == s[sb].tobytes()
        assert (d[7].tobytes() == s[7].tobytes()) == (t >= 2)
        assert not d[[1, 2, 5, 6]].any()
    # cache -> blocks: a 512-byte slot in 160-byte blocks (the last chunk is 32 bytes)
    ret, results, _ = run(pd, f"c_one, {{sync}}, [TransferConfig(2, {pg_addrs})], None, [5, 6, 0, 2], 160")
    assert (ret, results) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    src, dst = pd.prefill.eval("one"), pd.decode.eval("pg")
    for s, d in zip(src, dst):
        s = s[0]
        assert d[5].tobytes() == s[0:80].tobytes() and d[6].tobytes() == s[80:160].tobytes()
        assert d[0].tobytes() == s[160:240].tobytes()
        assert d[2][:16].tobytes() == s[240:256].tobytes() and not d[2][16:].any()
        assert not d[[1, 3, 4, 7]].any()


def test_raw_addresses_outside_registered_memory(make_pd):
    pd = make_pd(remote=False)
    setup(pd, contig("ct", 2, 1, seed=11), contig("ct", 2, 1) + "other = tensors(2, (1, 64), seed=12)\n")
    before = pd.decode.eval("(ct, other)")
    reg, other = pd.decode.eval("(addrs(ct), addrs(other))")
    size = 128
    cases = [other,                                # memory the decoder never registered
             [reg[0] + size - 64, reg[1]],         # a run crossing the end of a registered tensor
             [reg[0], other[1]]]                   # K fits, V does not
    for dst in cases:
        ret, results, _ = run(pd, f"c_ct, {{sync}}, [TransferConfig(2, {dst})]")
        assert (ret, results) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID]), dst
    after = pd.decode.eval("(ct, other)")
    assert bytes_of(after[1]) == bytes_of(before[1])
    ct = after[0]
    assert ct[0].tobytes() == pd.prefill.eval("ct[0].tobytes()")  # the third case's K landed
    assert not ct[1].any()
    # an unlinked cluster, then a correct push over the same link
    ret, results, _ = run(pd, f"c_ct, {{sync}}, [TransferConfig(9, {reg})]")
    assert (ret, results) == (S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
    ret, results, _ = run(pd, f"c_ct, {{sync}}, [TransferConfig(2, {reg})]")
    assert (ret, results) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert bytes_of(pd.decode.eval("ct")) == bytes_of(pd.prefill.eval("ct"))


# ---------------------------------------------------------------------------- validation


VALIDATION_SETUP = SYNC + blocks("kv", 4, seed=1) + contig("ct", 4, 2, seed=2) + contig("odd", 3, 2, seed=3) + """
kh = tensors(2, (2, 64), seed=4, host=True)
host = cm.register_cache(CacheDesc(2, [2, 64], DataType.DT_FLOAT16, Placement.HOST), addrs(kh))
s = Sync()
K = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 1), range(0, 1))
R = TransferConfig(2, [4096, 8192])
"""


def _expect(p, call, exc, code=S.LLM_PARAM_INVALID):
    with pytest.raises(exc) as info:
        p.exec(f"cm.transfer_cache_async({call})")
    if exc is LLMException:
        assert info.value.status_code == code, (call, info.value)
    else:
        assert type(info.value) is exc, (call, info.value)
    return info.value


def test_validation_remote_accessible_mode(peers):
    p = peers("v")
    p.exec("dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(options()); cm = dd.cache_manager\n" + VALIDATION_SETUP)
    threads = p.eval("threading.active_count()")
    cases = [
        # spec 8.5: the source
        ("None, s, [K]", TypeError), ("kv, s, [K]", TypeError), ("host, s, [K]", LLMException),
        # block index lists and dst_block_memory_size: types, then ranges
        ("c_kv, s, [K], None, '0'", TypeError), ("c_kv, s, [K], None, [0, '1']", TypeError),
        ("c_kv, s, [K], [0.5], [0]", TypeError), ("c_kv, s, [K], [True], [0]", TypeError),
        ("c_kv, s, [K], None, [-1], 128", ValueError), ("c_kv, s, [K], [2**64], [0]", ValueError),
        ("c_kv, s, [K], [0], [0], '128'", TypeError), ("c_kv, s, [K], [0], [0], -1", ValueError),
        # rule 4: src_block_indices need dst_block_indices of the same length
        ("c_kv, s, [K], [0]", LLMException), ("c_kv, s, [K], [0, 1], [0]", LLMException),
        # rule 5: a contiguous source into blocks needs dst_block_memory_size
        ("c_ct, s, [K], None, [0]", LLMException),
        # the synchronizer and the configs
        ("c_kv, None, [K]", TypeError), ("c_kv, object(), [K]", TypeError),
        ("c_kv, s, None", TypeError), ("c_kv, s, K", TypeError), ("c_kv, s, [K, None]", TypeError),
        ("c_kv, s, [R]", TypeError), ("c_kv, s, [K, R]", TypeError),
        # rule 6: dst_block_memory_size without dst blocks
        ("c_kv, s, [K], None, None, 128", LLMException), ("c_kv, s, [K], [], [], 1", LLMException),
        # rule 1: two tensors per layer
        ("c_odd, s, [K]", LLMException),
        # rule 2: the layer range within the source's layers
        ("c_kv, s, [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(1, 3), range(0, 2))]", LLMException),
        # rule 4: src_batch_index 0 with src blocks
        ("c_kv, s, [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, 1), range(0, 1), range(0, 1), 1)], [0], [0]",
         LLMException),
    ]
    for call, exc in cases:
        _expect(p, call, exc)
    msg = str(_expect(p, "c_kv, s, [R]", TypeError))
    assert msg.startswith("While enable_remote_cache_accessible is True, transfer_configs"), msg
    # 7.9: ranges of unequal length set one at a time are caught here
    p.exec("K2 = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 1), range(0, 1))\n"
           "K2.src_layer_range = range(0, 2)")
    _expect(p, "c_kv, s, [K2]", LLMException)
    # nothing started, the synchronizer was never asked
    assert p.eval("(threading.active_count(), s.calls)") == (threads, [])
    # valid calls: bms 0 means "not given"; an empty config list succeeds at once; an unlinked peer
    # is a result, not an exception
    assert p.eval("cm.transfer_cache_async(c_kv, s, [], None, None, 0).get_results()") == []
    assert p.eval("cm.transfer_cache_async(c_kv, s, ()).synchronize()") == S.LLM_SUCCESS
    assert p.eval("cm.transfer_cache_async(c_kv, s, [K], None, None, 0).get_results()") == [S.LLM_NOT_YET_LINK]
    assert p.eval("cm.transfer_cache_async(c_ct, s, [K], None, [0], 64).get_results()") == [S.LLM_NOT_YET_LINK]
    p.exec("dd.finalize()")
    _expect(p, "c_kv, s, [K]", LLMException, S.LLM_ENGINE_FINALIZED)  # a finalized engine's manager


def test_validation_raw_address_mode(peers):
    p = peers("w")
    p.exec("dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(options(remote=False)); cm = dd.cache_manager\n"
           + VALIDATION_SETUP)
    cases = [
        ("c_kv, s, [K]", TypeError), ("c_kv, s, [R, K]", TypeError),
        # 7.8 / rule 3: two dst_addrs per transferred layer (default range: every layer)
        ("c_kv, s, [R]", LLMException), ("c_kv, s, [TransferConfig(2, [1, 2, 3], range(0, 2))]", LLMException),
        ("c_kv, s, [TransferConfig(2, [1, 2, 3, 4], range(0, 1))]", LLMException),
        # rule 2
        ("c_kv, s, [TransferConfig(2, [1, 2, 3, 4], range(1, 3))]", LLMException),
        # rule 4: src_batch_index 0 with src blocks
        ("c_kv, s, [TransferConfig(2, [1, 2], range(0, 1), 1)], [0], [0]", LLMException),
    ]
    for call, exc in cases:
        _expect(p, call, exc)
    assert p.eval("s.calls") == []
    assert p.eval("cm.transfer_cache_async(c_kv, s, [TransferConfig(2, [1, 2, 3, 4])]).get_results()") == [
        S.LLM_NOT_YET_LINK]


# ---------------------------------------------------------------------------- the algorithm alone


class _Sync(LayerSynchronizer):
    def __init__(self, action=None):
        self.calls = []
        self.action = action

    def synchronize_layer(self, layer_index, timeout_in_millis):
        self.calls.append(layer_index)
        if self.action is not None:
            return self.action(layer_index)
        return True


def _cache(num_tensors=4, shape=(2, 64), blocks=False):
    addrs = [4096 * (i + 1) for i in range(num_tensors)]
    return Cache(1, CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16), addrs, is_blocks_cache=blocks)


def test_timeout_code_is_a_parameter_and_exceptions_read_as_timeouts():
    """The v1 KvCacheManager passes LLM_WAIT_PROCESS_TIMEOUT; a synchronizer that raises ends the
    thread and every answer is the timeout code (as upstream)."""
    calls = []
    gate = threading.Event()

    def blocked(layer):
        gate.wait(10)
        return True

    task = transfer_cache_async(lambda *a, **k: calls.append(k), _cache(), False, _Sync(blocked),
                                [TransferConfig(2, [1, 2, 3, 4])], remote_cache_accessible=False,
                                timeout_code=S.LLM_WAIT_PROCESS_TIMEOUT)
    assert task.synchronize(10) == S.LLM_WAIT_PROCESS_TIMEOUT
    assert task.get_results(0) == [S.LLM_WAIT_PROCESS_TIMEOUT]
    gate.set()
    assert task.get_results() == [S.LLM_SUCCESS] and len(calls) == 4

    def boom(layer):
        raise ZeroDivisionError("layer not ready")

    task = transfer_cache_async(lambda *a, **k: None, _cache(), False, _Sync(boom),
                                [TransferConfig(2, [1, 2, 3, 4]), TransferConfig(3, [1, 2, 3, 4])],
                                remote_cache_accessible=False)
    assert task.synchronize() == S.LLM_TIMEOUT
    assert task.get_results() == [S.LLM_TIMEOUT, S.LLM_TIMEOUT]


def test_runs_sent_to_the_engine():
    """Raw cache -> blocks: one native call per tensor, consecutive chunks coalesced, absolute remote
    addresses; a config the engine would refuse fails at its first layer with PARAM_INVALID."""
    sent = []

    def fn(op, is_push, key, cache, mode, **kw):
        sent.append((op, is_push, key, mode, kw))

    cache = _cache(shape=(1, 32))  # 64-byte slots
    task = transfer_cache_async(fn, cache, False, _Sync(), [TransferConfig(7, [1000, 2000], range(1, 2))],
                                None, [3, 4, 9], 24, remote_cache_accessible=False)
    assert task.get_results() == [S.LLM_SUCCESS]
    assert sent == [
        ("transfer_cache_async", True, None, 3,
         {"peer": 7, "local_tensors": [2 + k], "remote_tensors": [0], "local_runs": [(0, 48), (48, 16)],
          "remote_runs": [(base + 72, 48), (base + 216, 16)]})
        for k, base in enumerate((1000, 2000))]
    # more dst blocks than the slot has chunks: PARAM_INVALID at layer 0, nothing sent
    sent.clear()
    sync = _Sync()
    task = transfer_cache_async(fn, cache, False, sync, [TransferConfig(7, [1, 2, 3, 4])], None, [0, 1, 2, 3], 24,
                                remote_cache_accessible=False)
    assert task.get_results() == [S.LLM_PARAM_INVALID] and sent == [] and sync.calls == [0]
    # src_block_indices with a contiguous source
    task = transfer_cache_async(fn, cache, False, _Sync(), [TransferConfig(7, [1, 2, 3, 4])], [0], [0],
                                remote_cache_accessible=False)
    assert task.get_results() == [S.LLM_PARAM_INVALID] and sent == []


def test_configs_are_not_mutated():
    cfg = TransferConfig(2, [1, 2, 3, 4])
    task = transfer_cache_async(lambda *a, **k: None, _cache(), False, _Sync(), [cfg], remote_cache_accessible=False)
    assert task.get_results() == [S.LLM_SUCCESS]
    assert cfg.src_layer_range is None


def test_cache_task_is_exported():
    import llm_datadist
    import pdlink
    from pdlink import CacheTask

    assert pdlink.CacheTask is CacheTask and llm_datadist.CacheTask is CacheTask
    assert "CacheTask" in llm_datadist.__all__

"""Ascend-only end-to-end cases: placement rules, device memory exhaustion and HCCL failures.

A PROMPT and a DECODER process on the Ascend backend over the fake vendor libraries
(tests/fake_ascend): caches in (fake) NPU memory that the host cannot touch, bytes moved by the
fake HCCL between the processes. Faults are injected in one process with FAKE_ASCEND_INJECT
("fn:rc:after_n:times", counted in that process; the hccl.* pseudo-names count the items that
process sends; their rc must be non-zero: 9 = HCCL_E_TIMEOUT, 21 = HCCL_E_REMOTE for the
sender). Every test checks the error code, that nothing hangs (bounded times), what was
left intact, and that the link (or the engine) recovers with byte-exact data.

The rest of the end-to-end suite runs on this backend too, as the ``[ascend]`` parameter of the
``transport`` fixture (conftest.py).
"""

from __future__ import annotations

import time

import pytest

from backend_env import peer_env
from pdlink import LLMException
from pdlink import LLMStatusCode as S
from peer import wait_for

PROMPT_ID, DECODER_ID = 1, 2  # as conftest's PD

# The fakes' test-only control API (tests/fake_ascend/fake_control.h), reached through ctypes: the
# library pdlink loaded is the one ctypes opens (same path), so the counters are shared.
FAKE = """
import ctypes
fake = ctypes.CDLL(os.path.join(os.environ["PDLINK_ASCEND_LIB_DIR"], "libascendcl.so"))
fake.fake_acl_bytes_in_use.restype = ctypes.c_ulonglong
fake.fake_ascend_calls.restype = ctypes.c_long
"""

BLOCKS = """
kv = {fill}(2, (16, 4096){seed})
cache = cm.register_blocks_cache(CacheDesc(2, [16, 4096], DataType.DT_FLOAT16), addrs(kv), {key})
"""


@pytest.fixture
def transport(fake_ascend_lib_dir):
    """Overrides conftest's: every PD of this module runs on the Ascend backend."""
    return "ascend"


def linked_blocks(pd):
    """Prompt: patterned device blocks cache under BlocksCacheKey(1, 0); decoder: zeroed device
    blocks cache; linked."""
    pd.prefill.exec(FAKE + BLOCKS.format(fill="tensors", seed=", seed=1", key="BlocksCacheKey(1, 0)"))
    pd.decode.exec(FAKE + BLOCKS.format(fill="zeros", seed="", key="None"))
    pd.link()


def failed(peer, code, timeout=30):
    """Runs `code` in `peer`, expecting an LLMException, and returns it. `timeout` (seconds) is the
    hang guard: far beyond the configured timeouts, so the assertion is on the status, never on how
    long the call took (tests/README.md)."""
    with pytest.raises(LLMException) as e:
        peer.exec(code, timeout=timeout)
    return e.value


SRC = [0, 2, 4, 6, 9, 11, 13, 15]  # eight runs per tensor (16 HCCL items): a fault lands mid-batch
DST = [1, 3, 5, 7, 8, 10, 12, 14]
PULL = f"cm.pull_blocks(BlocksCacheKey(1, 0), cache, {SRC}, {DST})"


def assert_pulled(pd):
    src, dst = pd.prefill.eval("kv"), pd.decode.eval("kv")
    for s, d in zip(src, dst):
        assert d[DST].tobytes() == s[SRC].tobytes()


# ---------------------------------------------------------------------------- (a) placement rules


def test_device_and_host_caches_never_mix_across_a_link(pd):
    """A DEVICE cache on one side and a HOST cache on the other: refused with LLM_PARAM_INVALID in
    every direction, nothing written anywhere; matching placements then move exact bytes (DEVICE
    over HCCL, HOST over the link's TCP connection)."""
    host = ("hk = tensors(2, (8, 64), seed={seed}, host=True)\n"
            "hc = cm.register_blocks_cache(CacheDesc(2, [8, 64], DataType.DT_FLOAT16, Placement.HOST), addrs(hk), "
            "{key}, remote_accessible=True)\n"
            "dk = tensors(2, (8, 64), seed={dseed})\n"
            "dc = cm.register_blocks_cache(CacheDesc(2, [8, 64], DataType.DT_FLOAT16), addrs(dk), {dkey})\n")
    pd.prefill.exec(host.format(seed=1, key="BlocksCacheKey(1, 1)", dseed=2, dkey="BlocksCacheKey(1, 0)"))
    pd.decode.exec(host.format(seed=3, key="BlocksCacheKey(2, 1)", dseed=4, dkey="BlocksCacheKey(2, 0)"))
    pd.link()
    assert pd.decode.eval("(type(dk[0]).__name__, type(hk[0]).__name__)") == ("DeviceArray", "ndarray")
    state = "[a.tobytes() for a in hk + dk]"
    before = pd.prefill.eval(state), pd.decode.eval(state)
    for who, code in [
        (pd.decode, "cm.pull_blocks(BlocksCacheKey(1, 0), hc, [0, 1], [2, 3])"),  # remote DEVICE -> local HOST
        (pd.decode, "cm.pull_blocks(BlocksCacheKey(1, 1), dc, [0, 1], [2, 3])"),  # remote HOST -> local DEVICE
        (pd.prefill, "cm.push_blocks(BlocksCacheKey(2, 1), dc, [0], [5])"),  # local DEVICE -> remote HOST
        (pd.prefill, "cm.push_blocks(BlocksCacheKey(2, 0), hc, [0], [5])"),  # local HOST -> remote DEVICE
    ]:
        err = failed(who, code)
        assert err.status_code == S.LLM_PARAM_INVALID, (code, err)
    assert (pd.prefill.eval(state), pd.decode.eval(state)) == before
    # the refusals did not hurt the link: DEVICE <-> DEVICE and HOST <-> HOST work
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), dc, [0, 1], [2, 3])\n"
                   "cm.pull_blocks(BlocksCacheKey(1, 1), hc, [4], [6])")
    pd.prefill.exec("cm.push_blocks(BlocksCacheKey(2, 0), dc, [7], [7])")
    for s, d in zip(pd.prefill.eval("dk"), pd.decode.eval("dk")):
        assert d[2:4].tobytes() == s[0:2].tobytes() and d[7].tobytes() == s[7].tobytes()
    for s, d in zip(pd.prefill.eval("hk"), pd.decode.eval("hk")):
        assert d[6].tobytes() == s[4].tobytes()


def test_a_cpu_peer_cannot_exchange_device_caches(peers, fake_ascend_lib_dir):
    """An Ascend engine and a CPU engine link (the control connection is the same), but DEVICE
    caches cannot move between them in either direction; nothing is written."""
    for prompt_kind, decode_kind in (("ascend", "tcp"), ("tcp", "ascend")):
        p, d = peers(f"prefill-{prompt_kind}", env=peer_env(prompt_kind)), peers(f"decode-{decode_kind}",
                                                                                env=peer_env(decode_kind))
        p.exec(f"dd = LLMDataDist(LLMRole.PROMPT, {PROMPT_ID}); dd.init(options(listen='127.0.0.1:0')); "
               "cm = dd.cache_manager\n" + BLOCKS.format(fill="tensors", seed=", seed=1", key="BlocksCacheKey(1, 0)"))
        d.exec(f"dd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); dd.init(options()); cm = dd.cache_manager\n"
               + BLOCKS.format(fill="zeros", seed="", key="BlocksCacheKey(2, 0)"))
        assert d.eval(f"dd.link_clusters([cluster({PROMPT_ID}, {p.eval('dd.listen_port')})], 5000)") == (
            S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert (p.eval("dd._engine.backend"), d.eval("dd._engine.backend")) == (
            "ascend" if prompt_kind == "ascend" else "cpu", "ascend" if decode_kind == "ascend" else "cpu")
        # an Ascend requester finds no device channel on a CPU peer (FEATURE_NOT_ENABLED); a CPU
        # requester is told by the Ascend peer that its cache is in device memory (PARAM_INVALID)
        for who, kind, code in [(d, decode_kind, "cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0])"),
                                (p, prompt_kind, "cm.push_blocks(BlocksCacheKey(2, 0), cache, [1], [1])")]:
            err = failed(who, code)
            want = S.LLM_FEATURE_NOT_ENABLED if kind == "ascend" else S.LLM_PARAM_INVALID
            assert err.status_code == want, (prompt_kind, code, err)
        assert not d.eval("any(a.any() for a in kv)")
        assert p.eval("[a.tobytes() for a in kv]") == p.eval("[a.tobytes() for a in tensors(2, (16, 4096), seed=1)]")


# ---------------------------------------------------------------------------- (b) device memory exhaustion


def test_failed_device_malloc_is_device_out_of_memory_and_leaves_nothing(peers, fake_ascend_lib_dir):
    """aclrtMalloc fails (ACL_ERROR_RT_MEMORY_ALLOCATION): LLM_DEVICE_OUT_OF_MEMORY naming the call,
    no device memory left allocated, no half-initialised engine; the next try works.

    pdlink takes a cache manager's DEVICE memory from the device as one pool when the engine
    initialises (llm.MemPoolConfig) and carves allocate_cache from it, so the device allocation that
    can fail is the pool's, in init; allocate_cache beyond the pool is LLM_OUT_OF_MEMORY (as on the
    CPU backend, test_local_ops) and allocates nothing either."""
    p = peers("oom", env=peer_env("ascend", FAKE_ASCEND_INJECT="aclrtMalloc:207001:0:1"))
    p.exec(FAKE + f"dd = LLMDataDist(LLMRole.PROMPT, {PROMPT_ID})")
    with pytest.raises(LLMException) as e:
        p.exec("dd.init(options(listen='127.0.0.1:0', pool=4 << 20))")
    assert e.value.status_code == S.LLM_DEVICE_OUT_OF_MEMORY, e.value
    assert "aclrtMalloc" in str(e.value)
    assert p.eval("(fake.fake_acl_bytes_in_use(0), fake.fake_ascend_calls(b'aclrtMalloc'))") == (0, 1)
    assert p.eval("LLMDataDist.llm_engine_instance is None")
    with pytest.raises(RuntimeError, match="not initialized"):
        p.eval("dd.cache_manager")
    # the injection was for one call: now the pool is allocated and allocate_cache carves it
    p.exec("dd.init(options(listen='127.0.0.1:0', pool=4 << 20)); cm = dd.cache_manager\n"
           "c = cm.allocate_cache(CacheDesc(2, [4, 1024], DataType.DT_INT8), [CacheKey(1, 1)])\nwrite_cache(c, 5)")
    assert p.eval("fake.fake_acl_bytes_in_use(0)") == 4 << 20
    with pytest.raises(LLMException) as e:  # more than the pool holds
        p.exec("cm.allocate_cache(CacheDesc(2, [1024, 4096], DataType.DT_INT8), [CacheKey(1, 2)])")
    assert e.value.status_code == S.LLM_OUT_OF_MEMORY, e.value
    assert p.eval("(dd._engine.cache_count, fake.fake_acl_bytes_in_use(0))") == (1, 4 << 20)
    # the failed call bound no key, and the cache that was there still holds its bytes
    p.exec("c2 = cm.allocate_cache(CacheDesc(1, [4, 1024], DataType.DT_INT8), [CacheKey(1, 2)])")
    want = [(i * 5 + 5 * 101 + 13 * k) % 251 for i in range(2) for k in range(4)]
    assert [x for t in p.eval("[r[:4].tolist() for r in read_cache(c)]") for x in t] == want
    p.exec("cm.deallocate_cache(c); cm.deallocate_cache(c2); cm.remove_cache_key(CacheKey(1, 1)); "
           "cm.remove_cache_key(CacheKey(1, 2)); dd.finalize()")
    assert p.eval("fake.fake_acl_bytes_in_use(0)") == 0  # finalize returned the pool


# ---------------------------------------------------------------------------- (c) remote error mid-batch


def test_remote_error_mid_batch_fails_the_pull_then_relink_succeeds(make_pd):
    pd = make_pd(timeout=3000, prefill_env={"FAKE_ASCEND_INJECT": "hccl.remote_error:21:5:1"})
    linked_blocks(pd)
    src = pd.prefill.eval("[a.tobytes() for a in kv]")
    err = failed(pd.decode, PULL)
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert "HCCL_E_REMOTE" in str(err), str(err)
    assert pd.prefill.eval("fake.fake_ascend_calls(b'hccl.remote_error')") == 6  # 5 items went, the 6th failed
    assert pd.prefill.eval("[a.tobytes() for a in kv]") == src  # the source is intact
    # the link is poisoned until rebuilt: fast failures, no hang
    err = failed(pd.decode, PULL)
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert pd.decode.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], 2000)")[0] == S.LLM_SUCCESS
    pd.link()
    pd.decode.exec(PULL)
    assert_pulled(pd)
    assert pd.prefill.eval("[a.tobytes() for a in kv]") == src


def test_remote_error_during_a_push_is_reported_by_the_pusher(make_pd):
    """The receiving side of a push fails the batch: the pushing prompt gets LLM_LINK_FAILED."""
    pd = make_pd(timeout=3000, decode_env={"FAKE_ASCEND_INJECT": "hccl.remote_error:21:0:1"})
    pd.prefill.exec(FAKE + BLOCKS.format(fill="tensors", seed=", seed=1", key="None"))
    pd.decode.exec(FAKE + BLOCKS.format(fill="zeros", seed="", key="BlocksCacheKey(2, 0)"))
    pd.link()
    # the decoder sends nothing in a push, so its injection stays unused: the push goes through
    pd.prefill.exec(f"cm.push_blocks(BlocksCacheKey(2, 0), cache, {SRC}, {DST})")
    for s, d in zip(pd.prefill.eval("kv"), pd.decode.eval("kv")):
        assert d[DST].tobytes() == s[SRC].tobytes()
    assert pd.decode.eval("fake.fake_ascend_calls(b'hccl.remote_error')") == 0
    # the prompt pulls from the decoder (links are symmetric): now the decoder sends, and fails
    err = failed(pd.prefill, "cm.pull_blocks(BlocksCacheKey(2, 0), cache, [1, 3], [0, 2])")
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert pd.decode.eval("fake.fake_ascend_calls(b'hccl.remote_error')") == 1


# ---------------------------------------------------------------------------- (d) stalled peer


def test_stalled_peer_times_out_within_sync_kv_timeout(make_pd):
    """The prompt's device stops sending (hccl.stall): the decoder's pull ends with LLM_TIMEOUT
    after sync_kv_timeout, the prompt's stalled transfer ends when the decoder hangs up (bounded by
    HCCL_EXEC_TIMEOUT), nobody hangs, and a new link moves the bytes."""
    pd = make_pd(timeout=500, prefill_env={"FAKE_ASCEND_INJECT": "hccl.stall:9:2:1", "HCCL_EXEC_TIMEOUT": "2"},
                 decode_env={"HCCL_EXEC_TIMEOUT": "2"})
    linked_blocks(pd)
    src = pd.prefill.eval("[a.tobytes() for a in kv]")
    err = failed(pd.decode, PULL)
    assert err.status_code == S.LLM_TIMEOUT, err
    # the prompt still answers (within its hang guard; its stalled transfer ended with the hang-up)
    assert pd.prefill.eval("[a.tobytes() for a in kv]", timeout=20) == src
    err = failed(pd.decode, PULL)
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert pd.decode.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], 2000, force=True)")[0] == S.LLM_SUCCESS
    pd.link()
    pd.decode.exec(PULL)
    assert_pulled(pd)


def test_stalled_push_times_out_on_the_pusher(make_pd):
    """The pushing prompt's own device stalls: its push ends with LLM_TIMEOUT after
    sync_kv_timeout; both ends of the link are then broken (fast LLM_LINK_FAILED, no hang) until the
    decoder links again, after which the push moves exact bytes."""
    pd = make_pd(timeout=500, prefill_env={"FAKE_ASCEND_INJECT": "hccl.stall:9:2:1", "HCCL_EXEC_TIMEOUT": "2"},
                 decode_env={"HCCL_EXEC_TIMEOUT": "2"})
    pd.prefill.exec(FAKE + BLOCKS.format(fill="tensors", seed=", seed=1", key="None"))
    pd.decode.exec(FAKE + BLOCKS.format(fill="zeros", seed="", key="BlocksCacheKey(2, 0)"))
    pd.link()
    push = f"cm.push_blocks(BlocksCacheKey(2, 0), cache, {SRC}, {DST})"
    err = failed(pd.prefill, push)
    assert err.status_code == S.LLM_TIMEOUT, err
    err = failed(pd.prefill, push)
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert wait_for(lambda: all(lk["broken"] for lk in pd.decode.eval("dd.links()")), timeout=5)
    assert pd.decode.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], 2000, force=True)")[0] == S.LLM_SUCCESS
    pd.link()
    pd.prefill.exec(push)
    assert_pulled(pd)


def test_timed_out_pull_never_writes_late(make_pd):
    """The prompt's device is slow (every stream task starts 1 s late): the decoder's pull times out
    after 300 ms, and its destination memory is not written afterwards either, when the prompt's
    transfer finally runs (the prompt waits up to 5 s for it): the caller may reuse the buffer as
    soon as the call returned."""
    pd = make_pd(timeout=300, prefill_timeout=5000, prefill_env={"FAKE_ASCEND_STREAM_DELAY_US": "1000000"})
    linked_blocks(pd)
    err = failed(pd.decode, PULL)
    assert err.status_code == S.LLM_TIMEOUT, err
    time.sleep(1.5)  # the prompt's delayed send has run (and failed) by now
    assert not pd.decode.eval("any(a.any() for a in kv)")
    assert pd.prefill.eval("fake.fake_ascend_calls(b'HcclBatchSendRecv')") == 1


# ---------------------------------------------------------------------------- (e) peer killed


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_peer_killed_after_device_transfers(make_pd, victim):
    """Both directions' device channels were in use when one peer dies: the survivor's next transfer
    fails with LLM_LINK_FAILED or LLM_TIMEOUT within sync_kv_timeout, and unlinking cleans up."""
    pd = make_pd(timeout=2000)
    linked_blocks(pd)
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0])")
    pd.prefill.exec("c2 = cm.register_blocks_cache(CacheDesc(2, [16, 4096], DataType.DT_FLOAT16), addrs(kv))")
    pd.decode.exec("c2 = cm.register_blocks_cache(CacheDesc(2, [16, 4096], DataType.DT_FLOAT16), addrs(kv), "
                   "BlocksCacheKey(2, 0))")
    pd.prefill.exec("cm.pull_blocks(BlocksCacheKey(2, 0), c2, [0], [1])")  # the prompt's direction too
    survivor, call, peer_id, port = (
        (pd.decode, PULL, 1, pd.port) if victim == "prefill"
        else (pd.prefill, "cm.pull_blocks(BlocksCacheKey(2, 0), c2, [2], [2])", 2, 1))
    getattr(pd, victim).kill()
    # the dead peer's sockets are closed by the kernel: the request or its answer meets the end of
    # the stream (never a wait), and the link is known broken
    err = failed(survivor, call)
    assert err.status_code == S.LLM_LINK_FAILED, err
    ret = survivor.eval(f"dd.unlink_clusters([cluster({peer_id}, {port})], 1000)")
    assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), ret  # a broken link unlinks locally
    assert survivor.eval("dd.links()") == []
    err = failed(survivor, call)
    assert err.status_code == S.LLM_NOT_YET_LINK


# ---------------------------------------------------------------------------- (f) request keys


@pytest.mark.parametrize("fault", ["hccl.remote_error:21:1:1", "hccl.stall:9:1:1"])
def test_pull_by_request_key_releases_the_key_only_after_success(make_pd, fault):
    """pull_cache by CacheKey from a pool cache in device memory: a pull that fails mid-way (remote
    error, or a stall that times out) keeps the key and the cache; after relinking the same pull
    succeeds byte-exact, consumes the key and frees the cache."""
    pd = make_pd(remote=False, timeout=500,
                 prefill_env={"FAKE_ASCEND_INJECT": fault, "HCCL_EXEC_TIMEOUT": "2"},
                 decode_env={"HCCL_EXEC_TIMEOUT": "2"})
    pd.prefill.exec(FAKE + "c_src = cm.allocate_cache(CacheDesc(3, [2, 4096], DataType.DT_INT8), [CacheKey(1, 5)])\n"
                    "write_cache(c_src, 6)\nexpected = [a.tobytes() for a in read_cache(c_src)]\n"
                    "cm.deallocate_cache(c_src)")  # only the request key holds it now
    pd.decode.exec("c_dst = cm.allocate_cache(CacheDesc(3, [2, 4096], DataType.DT_INT8))\nwrite_cache(c_dst, 1)")
    pd.link()
    before = pd.decode.eval("[a.tobytes() for a in read_cache(c_dst)]")
    err = failed(pd.decode, "cm.pull_cache(CacheKey(1, 5), c_dst, 1)")
    want = S.LLM_LINK_FAILED if "remote_error" in fault else S.LLM_TIMEOUT
    assert err.status_code == want, err
    time.sleep(0.2)  # a release would travel asynchronously: give it the chance to (wrongly) happen
    assert pd.prefill.eval("dd._engine.cache_count") == 1  # the key still holds the cache
    assert pd.decode.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], 2000, force=True)")[0] == S.LLM_SUCCESS
    pd.link()
    pd.decode.exec("cm.pull_cache(CacheKey(1, 5), c_dst, 1)")
    got = pd.decode.eval("read_cache(c_dst)")
    expected = pd.prefill.eval("expected")
    for g, b, e in zip(got, before, expected):
        assert g[4096:].tobytes() == e[:4096] and g[:4096].tobytes() == b[:4096]  # key slot 0 -> local slot 1
    assert wait_for(lambda: pd.prefill.eval("dd._engine.cache_count") == 0)  # consumed by the pull: freed
    err = failed(pd.decode, "cm.pull_cache(CacheKey(1, 5), c_dst, 0)")
    assert err.status_code == S.LLM_KV_CACHE_NOT_EXIST


# ---------------------------------------------------------------------------- resources


def test_link_unlink_cycles_with_device_transfers_leak_nothing(make_pd):
    """Every link builds HCCL communicators (one per direction in use) and every unlink must
    destroy them: after many link / pull / push / unlink cycles both processes hold the same file
    descriptors, threads and device memory as before."""
    pd = make_pd()
    linked_blocks(pd)
    pd.decode.exec("c2 = cm.register_blocks_cache(CacheDesc(2, [16, 4096], DataType.DT_FLOAT16), addrs(kv), "
                   "BlocksCacheKey(2, 0))")
    cycle = (f"assert dd.unlink_clusters([cluster(1, {pd.port})], 2000)[0] == 0\n"
             f"assert dd.link_clusters([cluster(1, {pd.port})], 5000)[0] == 0\n"
             "cm.pull_blocks(BlocksCacheKey(1, 0), cache, [{i}], [{i}])\n")
    push = "cm.push_blocks(BlocksCacheKey(2, 0), cache, [{i}], [{j}])"  # the prompt's direction too

    def run(cycles):
        for i in range(cycles):
            pd.decode.exec(cycle.format(i=i % 16))
            pd.prefill.exec(push.format(i=i % 16, j=(i + 1) % 16))

    def state():
        return [(side.eval("resources()"), side.eval("fake.fake_acl_bytes_in_use(0)"))
                for side in (pd.prefill, pd.decode)]

    run(3)  # warm-up: thread pools, the fakes' stream workers
    before = state()
    run(30)
    assert wait_for(lambda: state() == before), (before, state())
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, list(range(16)), list(range(16)))")
    assert pd.decode.eval("[a.tobytes() for a in kv]") == pd.prefill.eval("[a.tobytes() for a in kv]")


# ---------------------------------------------------------------------------- link-time device channel


def test_device_channel_setup_failure_fails_the_link_cleanly(make_pd):
    """link_clusters sets up the decoder's device channel (an HCCL communicator) before it returns.
    When the prompt cannot join it (HcclCommInitRootInfo fails there), the link fails within
    HCCL_CONNECT_TIMEOUT, the decoder keeps no link, the prompt's end is broken, and the next
    link_clusters works."""
    hccl = {"HCCL_CONNECT_TIMEOUT": "1"}
    pd = make_pd(prefill_env={"FAKE_ASCEND_INJECT": "HcclCommInitRootInfo:4:0:1", **hccl}, decode_env=hccl)
    pd.prefill.exec(FAKE + BLOCKS.format(fill="tensors", seed=", seed=1", key="BlocksCacheKey(1, 0)"))
    pd.decode.exec(FAKE + BLOCKS.format(fill="zeros", seed="", key="None"))
    ret = pd.decode.eval(f"dd.link_clusters([cluster(1, {pd.port})], 5000)", timeout=50)  # hang guard
    assert ret[0] != S.LLM_SUCCESS and ret[1] == [ret[0]], ret
    assert ret == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED]), ret  # every link failure is LINK_FAILED
    assert pd.prefill.eval("fake.fake_ascend_calls(b'HcclCommInitRootInfo')") == 1
    assert pd.decode.eval("dd.links()") == []
    # the prompt's end is marked broken (as after any peer failure) until replaced or unlinked
    assert wait_for(lambda: all(lk["broken"] for lk in pd.prefill.eval("dd.links()")))
    err = failed(pd.decode, PULL)
    assert err.status_code == S.LLM_NOT_YET_LINK
    pd.link()
    assert [(lk["peer_cluster_id"], lk["broken"]) for lk in pd.prefill.eval("dd.links()")] == [(2, False)]
    pd.decode.exec(PULL)
    assert_pulled(pd)


# ---------------------------------------------------------------------------- v1 tensors


def test_v1_get_cache_tensors_of_device_memory(peers, fake_ascend_lib_dir):
    """get_cache_tensors over a pool cache in device memory: numpy(copy=True) (and str()) must give
    the cache's values through a device-to-host copy; the process must not crash."""
    p = peers("v1-tensors", env=peer_env("ascend"))
    p.exec(f"cfg = LLMConfig(); cfg.device_id = 0\ndd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); "
           "dd.init(cfg.generate_options()); km = dd.kv_cache_manager\n"
           "c = km.allocate_cache(CacheDesc(2, [2, 4], DataType.DT_FLOAT16))\n"
           "from pdlink.device import open_backend\n"
           "vals = np.arange(8, dtype=np.float16).reshape(2, 4)\n"
           "open_backend().copy(c.per_device_tensor_addrs[0][1], 1, vals.ctypes.data, 0, vals.nbytes)\n"
           "ts = km.get_cache_tensors(c, 1)")
    assert p.eval("ts[0].numpy(copy=True).tolist()", timeout=10) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "4." in p.eval("str(ts[0])", timeout=10)

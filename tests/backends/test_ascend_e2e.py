"""Ascend-only end-to-end cases: placement rules, device memory exhaustion and HCCL failures.

A PROMPT and a DECODER process on the Ascend backend over the fake vendor libraries
(tests/fake_ascend): caches in (fake) NPU memory that the host cannot touch, bytes moved by the
fake HCCL between the processes. Faults are injected in one process with FAKE_ASCEND_INJECT
("fn:rc:after_n:times", counted in that process; the hccl.* pseudo-names count the items that
process sends; their rc must be non-zero: 9 = HCCL_E_TIMEOUT, 21 = HCCL_E_REMOTE for the
sender). Every test checks the error code, that nothing hangs (hang guards, never durations), the
whole destination and its guards (and the source) after every transfer, failed ones included, and
that the link (or the engine) recovers with byte-exact data.

The fake HCCL makes a failed batch's partial result exact: a sender's item completes only once the
receiver has taken it, so when the fault hits item n + 1, exactly n items (whole rows) have landed.

The rest of the end-to-end suite runs on this backend too, as the ``ascend-fake`` variant
(conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from backend_env import Variant, peer_env
from conftest import DECODER_ID, PROMPT_ID, Pair, only, reader
from llm_datadist import BlocksCacheKey, CacheKey, DataType, Placement
from pdlink import LLMException
from pdlink import LLMStatusCode as S
from peer import Peer
from peers import ascend_e2e, fake_ascend, kv
from poll import hang_guard, wait_until
from verify import Copy, Snapshot, assert_same, check_transfer, nothing, rows

pytestmark = only("ascend-fake")

KEY = Pair.KEY  # BlocksCacheKey(1, 0): the prompt's blocks cache
DECODER_KEY = BlocksCacheKey(DECODER_ID, 0)
SHAPE = (16, 4096)  # 16 blocks of 8 KiB (float16) per tensor, 2 tensors
SRC = [0, 2, 4, 6, 9, 11, 13, 15]  # eight runs per tensor (16 HCCL items): a fault lands mid-batch
DST = [1, 3, 5, 7, 8, 10, 12, 14]
MOVES = list(zip(SRC, DST))


def blocks(pair: Pair, prompt_key: BlocksCacheKey | None = KEY, decoder_key: BlocksCacheKey | None = None,
           link: bool = True) -> None:
    """Prompt: patterned device blocks cache "kv" (seed 1); decoder: zeroed device blocks cache "kv";
    under the given keys; linked unless told otherwise."""
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=prompt_key)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=None, key=decoder_key)
    if link:
        pair.link()


def failed(peer: Peer, timeout_ms: int, fn: Callable[..., object], *args: object) -> LLMException:
    """``fn(*args)`` in ``peer``, expecting an LLMException, bounded by a hang guard over the
    configured timeout (the assertion is on the status, never on how long it took)."""
    with pytest.raises(LLMException) as e:
        peer.call_within(hang_guard(timeout_ms), fn, *args)
    return e.value


def assert_partly_moved(actual: Snapshot, dst0: Snapshot, src0: Snapshot, moves: list[tuple[int, int]],
                        landed: int, what: str) -> None:
    """After a batch that failed part-way: exactly ``landed`` of the requested (tensor, row) items
    hold the source row, each whole; every other requested row, every other byte and the guards
    hold what they held before."""
    items = [(t, s, d) for t in range(len(dst0.tensors)) for s, d in moves]
    rb = dst0.row_bytes
    new = [(t, s, d) for t, s, d in items
           if bytes(actual.tensor(t)[d * rb:(d + 1) * rb]) == bytes(src0.tensor(t)[s * rb:(s + 1) * rb])]
    assert len(new) == landed, f"{what}: {len(new)} of {len(items)} rows moved, {landed} expected: {new}"
    assert_same(actual, dst0.with_bytes(src0, [Copy(t, s * rb, t, d * rb, rb) for t, s, d in new]), what)


def pulled(pair: Pair) -> None:
    """The decoder pulls MOVES from the prompt: the whole destination and the source checked."""
    check_transfer(reader(pair.prefill), reader(pair.decode),
                   lambda: pair.decode.call(kv.pull_blocks, KEY, "kv", SRC, DST), rows(MOVES))


def unlink(pair: Pair, force: bool = False) -> S:
    return pair.decode.call(kv.unlink, PROMPT_ID, pair.port, force, 2000)


def prompt_served_its_last_frame(pair: Pair) -> bool:
    """The prompt's serving thread for the decoder's link has ended (the link is a tombstone there):
    every request and confirmation the decoder sent on it has been acted on, and nothing more will
    be. Before it ends it finishes the transfer it is serving (its device send has returned)."""
    return bool(pair.prefill.call(kv.stats)["tombstones"] == 1)


# ---------------------------------------------------------------------------- (a) placement rules


def test_device_and_host_caches_never_mix_across_a_link(pair: Pair) -> None:
    """A DEVICE cache on one side and a HOST cache on the other: refused with LLM_PARAM_INVALID in
    every direction, nothing written anywhere; matching placements then move exact bytes (DEVICE
    over HCCL, HOST over the link's TCP connection)."""
    for side, seed, cid in ((pair.prefill, 1, PROMPT_ID), (pair.decode, 3, DECODER_ID)):
        side.call(kv.register_blocks, "hk", 2, (8, 64), seed=seed, key=BlocksCacheKey(cid, 1),
                  placement=Placement.HOST, remote_accessible=True)
        side.call(kv.register_blocks, "dk", 2, (8, 64), seed=seed + 1, key=BlocksCacheKey(cid, 0))
    pair.link()
    for side in (pair.prefill, pair.decode):
        assert side.call(ascend_e2e.in_device_memory, "dk") == [True, True]
        assert side.call(ascend_e2e.in_device_memory, "hk") == [False, False]

    def state() -> list[Snapshot]:
        return [side.call(kv.snapshot, name) for side in (pair.prefill, pair.decode) for name in ("hk", "dk")]

    before = state()
    for who, fn, key, name, src, dst in [
        (pair.decode, kv.pull_blocks, BlocksCacheKey(1, 0), "hk", [0, 1], [2, 3]),  # remote DEVICE -> local HOST
        (pair.decode, kv.pull_blocks, BlocksCacheKey(1, 1), "dk", [0, 1], [2, 3]),  # remote HOST -> local DEVICE
        (pair.prefill, kv.push_blocks, BlocksCacheKey(2, 1), "dk", [0], [5]),  # local DEVICE -> remote HOST
        (pair.prefill, kv.push_blocks, BlocksCacheKey(2, 0), "hk", [0], [5]),  # local HOST -> remote DEVICE
    ]:
        err = failed(who, 5000, fn, key, name, src, dst)
        assert err.status_code == S.LLM_PARAM_INVALID, (fn.__name__, key, name, err)
    for got, want in zip(state(), before):
        assert_same(got, want, "after the refused transfers")
    # the refusals did not hurt the link: DEVICE <-> DEVICE and HOST <-> HOST work
    check_transfer(reader(pair.prefill, "dk"), reader(pair.decode, "dk"),
                   lambda: pair.decode.call(kv.pull_blocks, BlocksCacheKey(1, 0), "dk", [0, 1], [2, 3]),
                   rows([(0, 2), (1, 3)]))
    check_transfer(reader(pair.prefill, "hk"), reader(pair.decode, "hk"),
                   lambda: pair.decode.call(kv.pull_blocks, BlocksCacheKey(1, 1), "hk", [4], [6]), rows([(4, 6)]))
    check_transfer(reader(pair.prefill, "dk"), reader(pair.decode, "dk"),
                   lambda: pair.prefill.call(kv.push_blocks, BlocksCacheKey(2, 0), "dk", [7], [7]), rows([(7, 7)]))


def test_a_cpu_peer_cannot_exchange_device_caches(peers: Callable[..., Peer], variant: Variant) -> None:
    """An Ascend engine and a CPU engine link (the control connection is the same), but DEVICE
    caches cannot move between them in either direction; nothing is written."""
    for prompt_kind, decode_kind in (("ascend", "tcp"), ("tcp", "ascend")):
        p, d = peers(f"prefill-{prompt_kind}", env=peer_env(prompt_kind)), peers(f"decode-{decode_kind}",
                                                                                env=peer_env(decode_kind))
        port = p.call(kv.start, "prompt", PROMPT_ID, listen=True)
        d.call(kv.start, "decoder", DECODER_ID)
        p.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
        d.call(kv.register_blocks, "kv", 2, SHAPE, seed=None, key=DECODER_KEY)
        assert d.call(kv.link, PROMPT_ID, port) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert (p.call(kv.backend), d.call(kv.backend)) == (
            "ascend" if prompt_kind == "ascend" else "cpu", "ascend" if decode_kind == "ascend" else "cpu")
        # an Ascend requester finds no device channel on a CPU peer (FEATURE_NOT_ENABLED); a CPU
        # requester is told by the Ascend peer that its cache is in device memory (PARAM_INVALID)
        requests = [(d, decode_kind, kv.pull_blocks, KEY, [0], [0]),
                    (p, prompt_kind, kv.push_blocks, DECODER_KEY, [1], [1])]
        for who, kind, fn, key, src, dst in requests:
            before = p.call(kv.snapshot, "kv"), d.call(kv.snapshot, "kv")
            err = failed(who, 5000, fn, key, "kv", src, dst)
            want = S.LLM_FEATURE_NOT_ENABLED if kind == "ascend" else S.LLM_PARAM_INVALID
            assert err.status_code == want, (prompt_kind, fn.__name__, err)
            assert_same(p.call(kv.snapshot, "kv"), before[0], f"the prompt's cache ({prompt_kind})")
            assert_same(d.call(kv.snapshot, "kv"), before[1], f"the decoder's cache ({decode_kind})")


# ---------------------------------------------------------------------------- (b) device memory exhaustion


def test_failed_device_malloc_is_device_out_of_memory_and_leaves_nothing(peers: Callable[..., Peer],
                                                                        variant: Variant) -> None:
    """aclrtMalloc fails (ACL_ERROR_RT_MEMORY_ALLOCATION): LLM_DEVICE_OUT_OF_MEMORY naming the call,
    no device memory left allocated, no half-initialised engine; the next try works.

    pdlink takes a cache manager's DEVICE memory from the device as one pool when the engine
    initialises (llm.MemPoolConfig) and carves allocate_cache from it, so the device allocation that
    can fail is the pool's, in init; allocate_cache beyond the pool is LLM_OUT_OF_MEMORY (as on the
    CPU backend, test_local_ops) and allocates nothing either."""
    p = peers("oom", env=variant.env(FAKE_ASCEND_INJECT="aclrtMalloc:207001:0:1"))
    p.call(ascend_e2e.create, "prompt", PROMPT_ID)
    with pytest.raises(LLMException) as e:
        p.call(ascend_e2e.init_engine, 4 << 20)
    assert e.value.status_code == S.LLM_DEVICE_OUT_OF_MEMORY, e.value
    assert "aclrtMalloc" in str(e.value)
    assert (p.call(fake_ascend.bytes_in_use), p.call(fake_ascend.calls, "aclrtMalloc")) == (0, 1)
    assert p.call(ascend_e2e.no_engine_instance)
    with pytest.raises(RuntimeError, match="not initialized"):
        p.call(ascend_e2e.touch_cache_manager)
    # the injection was for one call: now the pool is allocated and allocate_cache carves it
    p.call(ascend_e2e.init_engine, 4 << 20)
    p.call(kv.allocate, "c", 2, (4, 1024), DataType.DT_INT8, seed=5, keys=[CacheKey(1, 1)])
    assert p.call(fake_ascend.bytes_in_use) == 4 << 20
    pool = p.call(kv.snapshot, "c")  # the whole pool, "c" in it
    with pytest.raises(LLMException) as e:  # more than the pool holds
        p.call(kv.allocate, "big", 2, (1024, 4096), DataType.DT_INT8, keys=[CacheKey(1, 2)])
    assert e.value.status_code == S.LLM_OUT_OF_MEMORY, e.value
    assert (p.call(kv.cache_count), p.call(fake_ascend.bytes_in_use)) == (1, 4 << 20)
    assert_same(p.call(kv.snapshot, "c"), pool, "the pool after the refused allocation")
    # the failed call bound no key, and the cache that was there still holds its bytes
    p.call(kv.allocate, "c2", 1, (4, 1024), DataType.DT_INT8, keys=[CacheKey(1, 2)])
    after = p.call(kv.snapshot, "c")
    for t in range(2):
        assert bytes(after.tensor(t)) == bytes(pool.tensor(t)), f"tensor {t} of the first cache changed"
    for name, key in (("c", CacheKey(1, 1)), ("c2", CacheKey(1, 2))):
        p.call(kv.deallocate, name)
        p.call(kv.remove_cache_key, key)
    p.call(kv.finalize)
    assert p.call(fake_ascend.bytes_in_use) == 0  # finalize returned the pool


# ---------------------------------------------------------------------------- (c) remote error mid-batch


def test_remote_error_mid_batch_fails_the_pull_then_relink_succeeds(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(timeout=3000, prefill_env={"FAKE_ASCEND_INJECT": "hccl.remote_error:21:5:1"})
    blocks(pair)
    src0, dst0 = pair.prefill.call(kv.snapshot, "kv"), pair.decode.call(kv.snapshot, "kv")
    err = failed(pair.decode, 3000, kv.pull_blocks, KEY, "kv", SRC, DST)
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert "HCCL_E_REMOTE" in str(err), str(err)
    assert pair.prefill.call(fake_ascend.calls, "hccl.remote_error") == 6  # 5 items went, the 6th failed
    dst1 = pair.decode.call(kv.snapshot, "kv")
    assert_partly_moved(dst1, dst0, src0, MOVES, 5, "destination of the failed pull")
    assert_same(pair.prefill.call(kv.snapshot, "kv"), src0, "source")
    # the link is poisoned until rebuilt: fast failures, no hang, nothing written
    err = failed(pair.decode, 3000, kv.pull_blocks, KEY, "kv", SRC, DST)
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert_same(pair.decode.call(kv.snapshot, "kv"), dst1, "destination of the pull over the poisoned link")
    assert unlink(pair) == S.LLM_SUCCESS
    pair.link()
    pulled(pair)


def test_remote_error_during_a_push_is_reported_by_the_pusher(make_pair: Callable[..., Pair]) -> None:
    """The receiving side of a push fails the batch: the pushing prompt gets LLM_LINK_FAILED."""
    pair = make_pair(timeout=3000, decode_env={"FAKE_ASCEND_INJECT": "hccl.remote_error:21:0:1"})
    blocks(pair, prompt_key=None, decoder_key=DECODER_KEY)
    # the decoder sends nothing in a push, so its injection stays unused: the push goes through
    check_transfer(reader(pair.prefill), reader(pair.decode),
                   lambda: pair.prefill.call(kv.push_blocks, DECODER_KEY, "kv", SRC, DST), rows(MOVES))
    assert pair.decode.call(fake_ascend.calls, "hccl.remote_error") == 0
    # the prompt pulls from the decoder (links are symmetric): now the decoder sends, and its
    # first item fails, so nothing lands
    src0, dst0 = pair.decode.call(kv.snapshot, "kv"), pair.prefill.call(kv.snapshot, "kv")
    err = failed(pair.prefill, 3000, kv.pull_blocks, DECODER_KEY, "kv", [1, 3], [0, 2])
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert pair.decode.call(fake_ascend.calls, "hccl.remote_error") == 1
    assert_same(pair.prefill.call(kv.snapshot, "kv"), nothing(dst0, src0), "destination of the failed pull")
    assert_same(pair.decode.call(kv.snapshot, "kv"), src0, "source of the failed pull")


# ---------------------------------------------------------------------------- (d) stalled peer

STALL = {"FAKE_ASCEND_INJECT": "hccl.stall:9:2:1", "HCCL_EXEC_TIMEOUT": "2"}  # items 1 and 2 go, 3 stalls


def test_stalled_peer_times_out_within_sync_kv_timeout(make_pair: Callable[..., Pair]) -> None:
    """The prompt's device stops sending (hccl.stall): the decoder's pull ends with LLM_TIMEOUT
    after sync_kv_timeout, the prompt's stalled transfer ends when the decoder hangs up (bounded by
    HCCL_EXEC_TIMEOUT), nobody hangs, and a new link moves the bytes."""
    pair = make_pair(timeout=500, prefill_env=STALL, decode_env={"HCCL_EXEC_TIMEOUT": "2"})
    blocks(pair)
    src0, dst0 = pair.prefill.call(kv.snapshot, "kv"), pair.decode.call(kv.snapshot, "kv")
    err = failed(pair.decode, 500, kv.pull_blocks, KEY, "kv", SRC, DST)
    assert err.status_code == S.LLM_TIMEOUT, err
    dst1 = pair.decode.call(kv.snapshot, "kv")
    assert_partly_moved(dst1, dst0, src0, MOVES, 2, "destination of the timed-out pull")
    # the prompt still answers (within its hang guard; its stalled transfer ended with the hang-up)
    assert_same(pair.prefill.call_within(20, kv.snapshot, "kv"), src0, "source")
    err = failed(pair.decode, 500, kv.pull_blocks, KEY, "kv", SRC, DST)
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert_same(pair.decode.call(kv.snapshot, "kv"), dst1, "destination of the pull over the poisoned link")
    assert unlink(pair, force=True) == S.LLM_SUCCESS
    pair.link()
    pulled(pair)


def test_stalled_push_times_out_on_the_pusher(make_pair: Callable[..., Pair]) -> None:
    """The pushing prompt's own device stalls: its push ends with LLM_TIMEOUT after
    sync_kv_timeout; both ends of the link are then broken (fast LLM_LINK_FAILED, no hang) until the
    decoder links again, after which the push moves exact bytes."""
    pair = make_pair(timeout=500, prefill_env=STALL, decode_env={"HCCL_EXEC_TIMEOUT": "2"})
    blocks(pair, prompt_key=None, decoder_key=DECODER_KEY)
    src0, dst0 = pair.prefill.call(kv.snapshot, "kv"), pair.decode.call(kv.snapshot, "kv")
    err = failed(pair.prefill, 500, kv.push_blocks, DECODER_KEY, "kv", SRC, DST)
    assert err.status_code == S.LLM_TIMEOUT, err
    err = failed(pair.prefill, 500, kv.push_blocks, DECODER_KEY, "kv", SRC, DST)
    assert err.status_code == S.LLM_LINK_FAILED, err
    wait_until(lambda: link_is_broken(pair.decode), 10, "the decoder's end of the link broken")
    # the decoder's end broke when its device receive failed: the two items before the stall landed
    assert_partly_moved(pair.decode.call(kv.snapshot, "kv"), dst0, src0, MOVES, 2, "destination of the stalled push")
    assert_same(pair.prefill.call(kv.snapshot, "kv"), src0, "source")
    assert unlink(pair, force=True) == S.LLM_SUCCESS
    pair.link()
    check_transfer(reader(pair.prefill), reader(pair.decode),
                   lambda: pair.prefill.call(kv.push_blocks, DECODER_KEY, "kv", SRC, DST), rows(MOVES))


def link_is_broken(peer: Peer) -> bool:
    """The peer has links, and every one is broken."""
    links = peer.call(kv.links)
    return bool(links) and all(link["broken"] for link in links)


def test_timed_out_pull_never_writes_late(make_pair: Callable[..., Pair]) -> None:
    """The prompt's device is slow (every stream task starts 1 s late): the decoder's pull times out
    after 300 ms, and its destination memory is not written afterwards either, when the prompt's
    transfer finally runs (the prompt waits up to 5 s for it): the caller may reuse the buffer as
    soon as the call returned."""
    pair = make_pair(timeout=300, prefill_timeout=5000, prefill_env={"FAKE_ASCEND_STREAM_DELAY_US": "1000000"})
    blocks(pair)
    dst0 = pair.decode.call(kv.snapshot, "kv")
    assert not prompt_served_its_last_frame(pair)
    err = failed(pair.decode, 300, kv.pull_blocks, KEY, "kv", SRC, DST)
    assert err.status_code == S.LLM_TIMEOUT, err
    assert_same(pair.decode.call(kv.snapshot, "kv"), dst0, "destination when the pull timed out")
    # the prompt's delayed send has run and failed (the stream reported it, so pdlink asked the
    # communicator why), and its serving thread is done: nothing can write the destination later
    wait_until(lambda: prompt_served_its_last_frame(pair), 20, "the prompt's serving thread ended")
    assert pair.prefill.call(fake_ascend.calls, "HcclBatchSendRecv") == 1
    assert pair.prefill.call(fake_ascend.calls, "HcclGetCommAsyncError") == 1
    assert_same(pair.decode.call(kv.snapshot, "kv"), dst0, "destination after the prompt's late send")


# ---------------------------------------------------------------------------- (e) peer killed


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_peer_killed_after_device_transfers(make_pair: Callable[..., Pair], victim: str) -> None:
    """Both directions' device channels were in use when one peer dies: the survivor's next transfer
    fails with LLM_LINK_FAILED (the dead peer's sockets are closed by the kernel, so it never waits
    for sync_kv_timeout), writes nothing, and unlinking cleans up."""
    pair = make_pair(timeout=2000)
    blocks(pair)
    check_transfer(reader(pair.prefill), reader(pair.decode),
                   lambda: pair.decode.call(kv.pull_blocks, KEY, "kv", [0], [0]), rows([(0, 0)]))
    pair.prefill.call(kv.register_blocks, "c2", 2, SHAPE, seed=None)
    pair.decode.call(kv.register_blocks, "c2", 2, SHAPE, seed=2, key=DECODER_KEY)
    check_transfer(reader(pair.decode, "c2"), reader(pair.prefill, "c2"),  # the prompt's direction too
                   lambda: pair.prefill.call(kv.pull_blocks, DECODER_KEY, "c2", [0], [1]), rows([(0, 1)]))
    if victim == "prefill":
        survivor, peer_id, port, dst = pair.decode, PROMPT_ID, pair.port, "kv"
        pull: tuple[BlocksCacheKey, str, list[int], list[int]] = (KEY, "kv", SRC, DST)
    else:
        survivor, peer_id, port, dst = pair.prefill, DECODER_ID, 1, "c2"
        pull = (DECODER_KEY, "c2", [2], [2])
    before = survivor.call(kv.snapshot, dst)
    getattr(pair, victim).kill()
    # the dead peer's sockets are closed by the kernel: the request or its answer meets the end of
    # the stream (never a wait), and the link is known broken
    err = failed(survivor, 2000, kv.pull_blocks, *pull)
    assert err.status_code == S.LLM_LINK_FAILED, err
    assert_same(survivor.call(kv.snapshot, dst), before, "destination of the transfer from the dead peer")
    ret = survivor.call(kv.unlink_clusters, [(peer_id, port, 0)], 1000)
    assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), ret  # a broken link unlinks locally
    assert survivor.call(kv.links) == []
    err = failed(survivor, 2000, kv.pull_blocks, *pull)
    assert err.status_code == S.LLM_NOT_YET_LINK, err
    assert_same(survivor.call(kv.snapshot, dst), before, "destination of the transfer without a link")


# ---------------------------------------------------------------------------- (f) request keys


@pytest.mark.parametrize("fault", ["hccl.remote_error:21:1:1", "hccl.stall:9:1:1"])
def test_pull_by_request_key_releases_the_key_only_after_success(make_pair: Callable[..., Pair], fault: str) -> None:
    """pull_cache by CacheKey from a pool cache in device memory: a pull that fails mid-way (remote
    error, or a stall that times out) keeps the key and the cache; after relinking the same pull
    succeeds byte-exact, consumes the key and frees the cache."""
    pair = make_pair(remote=False, timeout=500, prefill_env={"FAKE_ASCEND_INJECT": fault, "HCCL_EXEC_TIMEOUT": "2"},
                     decode_env={"HCCL_EXEC_TIMEOUT": "2"})
    pair.prefill.call(kv.allocate, "src", 3, (2, 4096), DataType.DT_INT8, seed=6, keys=[CacheKey(1, 5)])
    pair.prefill.call(kv.deallocate, "src")  # only the request key holds it now
    pair.decode.call(kv.allocate, "dst", 3, (2, 4096), DataType.DT_INT8, seed=1)
    pair.link()
    src0, dst0 = pair.prefill.call(kv.snapshot, "src"), pair.decode.call(kv.snapshot, "dst")
    assert not prompt_served_its_last_frame(pair)
    err = failed(pair.decode, 500, kv.pull_cache, CacheKey(1, 5), "dst", 1)
    want = S.LLM_LINK_FAILED if "remote_error" in fault else S.LLM_TIMEOUT
    assert err.status_code == want, err
    # a release would travel asynchronously, as a frame the prompt's serving thread acts on: once
    # that thread has ended, every frame the decoder sent has been acted on
    wait_until(lambda: prompt_served_its_last_frame(pair), 20, "the prompt's serving thread ended")
    assert pair.prefill.call(kv.cache_count) == 1  # the key still holds the cache
    # one item (key slot 0 of the first tensor) landed in local slot 1 before the fault
    dst1 = pair.decode.call(kv.snapshot, "dst")
    assert_partly_moved(dst1, dst0, src0, [(0, 1)], 1, "destination pool of the failed pull")
    assert_same(pair.prefill.call(kv.snapshot, "src"), src0, "source pool of the failed pull")
    assert unlink(pair, force=True) == S.LLM_SUCCESS
    pair.link()
    check_transfer(reader(pair.prefill, "src"), reader(pair.decode, "dst"),
                   lambda: pair.decode.call(kv.pull_cache, CacheKey(1, 5), "dst", 1), rows([(0, 1)]))
    wait_until(lambda: pair.prefill.call(kv.cache_count) == 0, 10, "the consumed cache freed")
    dst2 = pair.decode.call(kv.snapshot, "dst")
    err = failed(pair.decode, 500, kv.pull_cache, CacheKey(1, 5), "dst", 0)
    assert err.status_code == S.LLM_KV_CACHE_NOT_EXIST, err
    assert_same(pair.decode.call(kv.snapshot, "dst"), dst2, "destination pool of the pull of a consumed key")


# ---------------------------------------------------------------------------- resources


def test_link_unlink_cycles_with_device_transfers_leak_nothing(pair: Pair) -> None:
    """Every link builds HCCL communicators (one per direction in use) and every unlink must
    destroy them: after many link / pull / push / unlink cycles both processes hold the same file
    descriptors, threads and device memory as before; every transfer moved exactly its block."""
    blocks(pair)
    pair.decode.call(kv.register_blocks, "c2", 2, SHAPE, seed=2, key=DECODER_KEY)
    src = pair.prefill.call(kv.snapshot, "kv")
    want = {"kv": pair.decode.call(kv.snapshot, "kv"), "c2": pair.decode.call(kv.snapshot, "c2")}

    def run(cycles: range) -> None:
        for i in cycles:
            assert pair.unlink() == S.LLM_SUCCESS
            pair.link()
            pair.decode.call(kv.pull_blocks, KEY, "kv", [i % 16], [i % 16])
            pair.prefill.call(kv.push_blocks, DECODER_KEY, "kv", [i % 16], [(i + 1) % 16])  # the prompt's direction
            want["kv"] = want["kv"].with_rows(src, [(i % 16, i % 16)])
            want["c2"] = want["c2"].with_rows(src, [(i % 16, (i + 1) % 16)])

    def state() -> list[tuple[tuple[int, int], int]]:
        return [side.call(ascend_e2e.leak_state) for side in (pair.prefill, pair.decode)]

    run(range(3))  # warm-up: thread pools, the fakes' stream workers
    before = state()
    run(range(3, 33))
    wait_until(lambda: state() == before, 10, f"descriptors, threads and device memory back to {before}")
    for name in ("kv", "c2"):  # every pull and push of the cycles moved exactly its block
        assert_same(pair.decode.call(kv.snapshot, name), want[name], f"decoder's {name} after the cycles")
    assert_same(pair.prefill.call(kv.snapshot, "kv"), src, "the prompt's source")
    check_transfer(reader(pair.prefill), reader(pair.decode),
                   lambda: pair.decode.call(kv.pull_blocks, KEY, "kv", list(range(16)), list(range(16))),
                   rows([(b, b) for b in range(16)]))


# ---------------------------------------------------------------------------- link-time device channel


def test_device_channel_setup_failure_fails_the_link_cleanly(make_pair: Callable[..., Pair]) -> None:
    """link_clusters sets up the decoder's device channel (an HCCL communicator) before it returns.
    When the prompt cannot join it (HcclCommInitRootInfo fails there), the link fails within
    HCCL_CONNECT_TIMEOUT, the decoder keeps no link, the prompt's end is broken, and the next
    link_clusters works."""
    hccl = {"HCCL_CONNECT_TIMEOUT": "1"}
    pair = make_pair(prefill_env={"FAKE_ASCEND_INJECT": "HcclCommInitRootInfo:4:0:1", **hccl}, decode_env=hccl)
    blocks(pair, link=False)
    ret = pair.decode.call_within(hang_guard(5000), kv.link, PROMPT_ID, pair.port, 5000)
    assert ret == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED]), ret  # every link failure is LINK_FAILED
    assert pair.prefill.call(fake_ascend.calls, "HcclCommInitRootInfo") == 1
    assert pair.decode.call(kv.links) == []
    # the prompt's end is marked broken (as after any peer failure) until replaced or unlinked
    wait_until(lambda: link_is_broken(pair.prefill), 10, "the prompt's end of the failed link broken")
    before = pair.decode.call(kv.snapshot, "kv")
    err = failed(pair.decode, 5000, kv.pull_blocks, KEY, "kv", SRC, DST)
    assert err.status_code == S.LLM_NOT_YET_LINK, err
    assert_same(pair.decode.call(kv.snapshot, "kv"), before, "destination of the pull without a link")
    pair.link()
    assert [(lk["peer_cluster_id"], lk["broken"]) for lk in pair.prefill.call(kv.links)] == [(DECODER_ID, False)]
    pulled(pair)


# ---------------------------------------------------------------------------- v1 tensors


def test_v1_get_cache_tensors_of_device_memory(peers: Callable[..., Peer], variant: Variant) -> None:
    """get_cache_tensors over a pool cache in device memory: numpy(copy=True) (and str()) must give
    the cache's values through a device-to-host copy; the process must not crash."""
    p = peers("v1-tensors", env=variant.env())
    p.call(ascend_e2e.v1_allocate, DECODER_ID, 2, (2, 4))
    p.call(ascend_e2e.v1_poke_tensor, 1, list(range(8)))  # straight into the fake's device memory
    assert p.call_within(10, ascend_e2e.v1_tensor_values, 1) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "4." in p.call_within(10, ascend_e2e.v1_tensor_text, 1)

"""Dead, frozen, refusing and hostile peers: clear errors within the timeouts, never a hang.

No assertion here is on a duration: a call that could hang is bounded by a hang guard (a generous
multiple of its configured timeout, poll.hang_guard) and the assertion is on the status it returns.
Every transfer is checked on the whole destination, and a failed pull leaves the source intact.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import pytest

import rawwire
from backend_env import Variant
from conftest import DECODER_ID, PROMPT_ID, Pair, only
from pdlink import BlocksCacheKey, CacheKey, DataType, LLMException, LLMRole, LLMStatusCode
from peer import Peer
from peers import kv, workers
from poll import hang_guard, wait_until
from verify import assert_same, check_transfer, rows

KEY = Pair.KEY
SHAPE = (16, 4096)  # 16 blocks of 8 KiB per tensor


def linked(make_pair: Callable[..., Pair], timeout: int = 1000, remote: bool = True) -> Pair:
    pair = make_pair(timeout=timeout, remote=remote)
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    pair.link()
    return pair


def failed_pull(pair: Pair, timeout_ms: int, blocks: tuple[int, ...] = (0, 1)) -> LLMException:
    """A pull of ``blocks`` that must fail, bounded by a hang guard: its exception."""
    with pytest.raises(LLMException) as e:
        pair.decode.call_within(hang_guard(timeout_ms), kv.pull_blocks, KEY, "kv", list(blocks), list(blocks))
    return e.value


def pulled_exactly(pair: Pair, blocks: list[int]) -> None:
    check_transfer(lambda: pair.prefill.call(kv.snapshot, "kv"), lambda: pair.decode.call(kv.snapshot, "kv"),
                   lambda: pair.decode.call(kv.pull_blocks, KEY, "kv", blocks, blocks), rows([(b, b) for b in blocks]))


def link_is_broken(peer: Peer) -> bool:
    return all(link["broken"] for link in peer.call(kv.links))


def test_peer_killed_after_link_gives_link_failed(make_pair: Callable[..., Pair]) -> None:
    pair = linked(make_pair)
    before = pair.decode.call(kv.snapshot, "kv")
    pair.prefill.kill()
    assert failed_pull(pair, 1000).status_code == LLMStatusCode.LLM_LINK_FAILED
    assert_same(pair.decode.call(kv.snapshot, "kv"), before, "destination of a pull from a dead peer")
    # the dead link is still an entity: switch_role refuses, unlink cleans up, then it is gone
    with pytest.raises(LLMException) as e:
        pair.decode.call(kv.switch_role, "prompt", "127.0.0.1:0")
    assert e.value.status_code == LLMStatusCode.LLM_EXIST_LINK
    assert pair.unlink() == LLMStatusCode.LLM_SUCCESS
    assert pair.decode.call(kv.links) == []
    assert pair.decode.call(kv.switch_role, "prompt", "127.0.0.1:0")[0] == LLMRole.PROMPT


def test_frozen_peer_times_out_then_relink_works(make_pair: Callable[..., Pair]) -> None:
    pair = linked(make_pair, timeout=500)
    source = pair.prefill.call(kv.snapshot, "kv")
    pair.prefill.freeze()
    try:
        err = failed_pull(pair, 500)
        assert err.status_code == LLMStatusCode.LLM_TIMEOUT, err
        # the timed-out link is poisoned: the next transfer fails at once, without asking the
        # (still frozen) peer: a request to it would have timed out again
        err = failed_pull(pair, 500)
        assert err.status_code == LLMStatusCode.LLM_LINK_FAILED, err
        assert "unlink_clusters" in str(err)
    finally:
        pair.prefill.thaw()
    assert_same(pair.prefill.call(kv.snapshot, "kv"), source, "source after the failed pulls")
    assert pair.unlink(force=True) == LLMStatusCode.LLM_SUCCESS
    pair.link()
    pulled_exactly(pair, [3])


def test_link_to_silent_listener_times_out(peers: Callable[..., Peer]) -> None:
    # a socket that accepts but never answers the hello
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        d = peers("decode")
        d.call(kv.start, "decoder", DECODER_ID)
        ret = d.call_within(hang_guard(300), kv.link, PROMPT_ID, silent.getsockname()[1], 300)
    assert ret == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert d.call(kv.links) == []


def test_failed_pull_leaves_the_source_key_for_a_retry(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(timeout=300, remote=False)
    pair.prefill.call(kv.allocate, "src", 2, (1, 4096), DataType.DT_INT8, seed=6, keys=[CacheKey(1, 5)])
    pair.prefill.call(kv.deallocate, "src")  # only the request key holds it now
    source = pair.prefill.call(kv.snapshot, "src")
    pair.decode.call(kv.allocate, "dst", 2, (1, 4096), DataType.DT_INT8)
    pair.link()
    pair.prefill.freeze()
    try:
        with pytest.raises(LLMException) as e:
            pair.decode.call_within(hang_guard(300), kv.pull_cache, CacheKey(1, 5), "dst")
    finally:
        pair.prefill.thaw()
    assert e.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert pair.prefill.call(kv.cache_count) == 1  # the key still holds the cache
    assert_same(pair.prefill.call(kv.snapshot, "src"), source, "source pool after the failed pull")
    assert pair.unlink() == LLMStatusCode.LLM_SUCCESS
    pair.link()
    check_transfer(lambda: pair.prefill.call(kv.snapshot, "src"), lambda: pair.decode.call(kv.snapshot, "dst"),
                   lambda: pair.decode.call(kv.pull_cache, CacheKey(1, 5), "dst"), rows([(0, 0)]))
    wait_until(lambda: pair.prefill.call(kv.cache_count) == 0, 10, "the consumed cache freed")


def test_garbage_and_hostile_hellos_are_refused_and_the_engine_keeps_serving(pair: Pair) -> None:
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    # 1. random bytes: the connection is dropped
    with socket.create_connection(("127.0.0.1", pair.port)) as s:
        s.sendall(os.urandom(4096))
        s.settimeout(5)
        try:
            assert s.recv(100) == b""
        except ConnectionResetError:
            pass
    # 2. a truncated hello followed by silence: dropped after the handshake timeout, the
    #    listener meanwhile keeps accepting (checked by the real link below)
    stalled = socket.create_connection(("127.0.0.1", pair.port))
    stalled.sendall(rawwire.hello()[:10])
    # 3. a wrong protocol version and 4. a wrong expected cluster id: refused with a reason
    for hello, words in [(rawwire.hello(version=99), "version"), (rawwire.hello(expected=77), "not cluster 77")]:
        with socket.create_connection(("127.0.0.1", pair.port)) as s:
            s.sendall(hello)
            a = rawwire.read_ack(s)
            assert a.status == LLMStatusCode.LLM_LINK_FAILED and a.cluster == 1 and words in a.message, a
    # 5. a reverse channel without a forward one
    h = rawwire.handshake(pair.port, channel=1)
    h.sock.close()
    assert (h.stage, h.status) == ("auth", LLMStatusCode.LLM_LINK_FAILED), h.message
    pair.link()
    pulled_exactly(pair, [5])
    assert [link["peer_cluster_id"] for link in pair.prefill.call(kv.links)] == [DECODER_ID]
    stalled.close()


def test_hostile_frames_on_an_established_link_only_drop_that_link(pair: Pair) -> None:
    """A peer that passes the handshake and then sends out-of-range or malformed requests."""
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    h = rawwire.handshake(pair.port, cluster=9, nonce=77)
    if pair.variant.path == "cma":
        # an engine forced to direct memory access refuses a peer that is not (proven) on its host
        assert h.status == LLMStatusCode.LLM_LINK_FAILED and "cma" in h.message, h.message
        return
    assert h.status == 0, h.message
    fwd = h.sock
    h = rawwire.handshake(pair.port, channel=1, cluster=9, nonce=77)
    assert h.status == 0, h.message
    rev = h.sock
    fwd.settimeout(5)
    tensor_bytes = SHAPE[0] * SHAPE[1] * 2
    source = pair.prefill.call(kv.snapshot, "kv")
    # reads outside the registered region, of a missing tensor, of an unregistered model: refused
    for b, code in [(rawwire.blocks_body(runs=((tensor_bytes - 8, 64),)), LLMStatusCode.LLM_PARAM_INVALID),
                    (rawwire.blocks_body(runs=((2**64 - 8, 64),)), LLMStatusCode.LLM_PARAM_INVALID),
                    (rawwire.blocks_body(tensors=(2,)), LLMStatusCode.LLM_PARAM_INVALID),
                    (rawwire.blocks_body(model=5), LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
                    (rawwire.blocks_body(runs=((0, 0),)), LLMStatusCode.LLM_PARAM_INVALID),
                    (rawwire.blocks_body(kind=5, runs=((4096, 64),)), LLMStatusCode.LLM_PARAM_INVALID)]:
        fwd.sendall(rawwire.request(1, b))
        status, msg, data = rawwire.read_response(fwd)
        assert status == code and data == b"", msg
    # a legal read works and returns exactly the registered bytes
    fwd.sendall(rawwire.request(1, rawwire.blocks_body(runs=((128, 64),))))
    status, msg, data = rawwire.read_response(fwd)
    if pair.variant.device_memory:
        # device memory never leaves through the control connection, only through the device
        # channel (which this raw peer never set up): a stream read of it is refused
        assert status == LLMStatusCode.LLM_PARAM_INVALID and data == b"" and "device memory" in msg, msg
    else:
        assert status == 0 and data == source.tensor(0)[128:192].tobytes()
    # a write whose declared payload disagrees with its descriptor: the link is dropped
    fwd.sendall(rawwire.request(2, rawwire.blocks_body(), payload_len=10**12))
    assert fwd.recv(10) == b""
    assert_same(pair.prefill.call(kv.snapshot, "kv"), source, "the victim's cache")
    # and the engine still serves a real decoder
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    pair.link()
    pulled_exactly(pair, [1])
    fwd.close()
    rev.close()


BIG = (64, 256 * 1024)  # 64 blocks of 256 KiB per tensor: 2 x 16 MiB


def start_prefill(peers: Callable[..., Peer], variant: Variant) -> tuple[Peer, int]:
    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True)
    p.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    p.call(kv.register_blocks, "big", 2, BIG, DataType.DT_UINT8, seed=7, key=BlocksCacheKey(PROMPT_ID, 1))
    return p, port


def test_peer_killed_before_link(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.prefill.kill()
    ret = pair.decode.call_within(hang_guard(3000), kv.link, PROMPT_ID, pair.port, 3000)
    assert ret == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert pair.decode.call(kv.links) == []


# What a transfer loop interrupted by the peer's death ends with, per data path: a stream (or an
# HCCL transfer) broken by the death fails the transfer in flight; with direct memory access a copy
# already under way may complete, and the next request finds the peer gone, unless the loop had
# finished its remaining copies first.
KILLED_OUTCOMES: dict[str, tuple[object, ...]] = {
    "tcp": (LLMStatusCode.LLM_LINK_FAILED,),
    "hccl": (LLMStatusCode.LLM_LINK_FAILED,),
    "cma": ("ok", LLMStatusCode.LLM_LINK_FAILED),
}


@only("cpu-tcp", "cpu-cma", "ascend-fake", heavy=("cpu-cma", "ascend-fake"))  # seconds each: the default run keeps one
@pytest.mark.parametrize("op", ["pull", "push"])
def test_peer_killed_during_a_large_transfer_then_restarted(peers: Callable[..., Peer], variant: Variant,
                                                            op: str) -> None:
    """Kill the prefill while transfers run back to back: the decoder gets an error (or, with direct
    memory access, may finish a copy already under way), never a hang; its resources are released;
    a restarted prefill with the same cluster id links again and serves correct bytes."""
    p, port = start_prefill(peers, variant)
    d = peers("decode", env=variant.env())
    d.call(kv.start, "decoder", DECODER_ID, timeout_ms=10000)
    d.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    d.call(kv.register_blocks, "big", 2, BIG, DataType.DT_UINT8, seed=8)
    assert d.call(kv.link, PROMPT_ID, port)[0] == LLMStatusCode.LLM_SUCCESS
    baseline = d.call(kv.resources)
    d.call(workers.start_transfer_loop, op, BlocksCacheKey(PROMPT_ID, 1), "big", list(range(64)),
           list(range(63, -1, -1)), 50)
    # the loop is under way (its first transfer completed) when the peer dies
    wait_until(lambda: d.call(workers.transfers_done) >= 1, 30, "the first transfer of the loop done")
    p.kill()
    outcome = d.call_within(hang_guard(10000), workers.join_transfer_loop, hang_guard(10000) / 2)
    assert outcome in KILLED_OUTCOMES[variant.path], outcome
    # unlinking the dead peer succeeds (non-force: there is nobody left to tell), and the serving
    # thread and sockets of that link are gone
    wait_until(lambda: link_is_broken(d), 10, "the decoder saw the link break")
    assert d.call(kv.unlink, PROMPT_ID, port) == LLMStatusCode.LLM_SUCCESS
    wait_until(lambda: all(now <= before for now, before in zip(d.call(kv.resources), baseline)), 10,
               f"descriptors and threads back to {baseline}")
    # a restarted prefill (same cluster id, new process and port) serves correct bytes
    p2, port2 = start_prefill(peers, variant)
    assert d.call(kv.link, PROMPT_ID, port2)[0] == LLMStatusCode.LLM_SUCCESS
    check_transfer(lambda: p2.call(kv.snapshot, "big"), lambda: d.call(kv.snapshot, "big"),
                   lambda: d.call(kv.pull_blocks, BlocksCacheKey(PROMPT_ID, 1), "big", [0, 5], [0, 5]),
                   rows([(0, 0), (5, 5)]))


@pytest.mark.parametrize("force", [False, True])
def test_unlink_toward_a_dead_peer(make_pair: Callable[..., Pair], force: bool) -> None:
    pair = linked(make_pair)
    pair.prefill.kill()
    wait_until(lambda: link_is_broken(pair.decode), 10, "the decoder saw the link break")
    # the peer is gone and known to be: nothing to notify; the local end is released either way
    ret = pair.decode.call_within(hang_guard(2000), kv.unlink, PROMPT_ID, pair.port, force, 2000)
    assert ret == LLMStatusCode.LLM_SUCCESS
    assert pair.decode.call(kv.links) == []
    assert failed_pull(pair, 1000).status_code == LLMStatusCode.LLM_NOT_YET_LINK


def test_unlink_toward_a_frozen_peer_releases_the_local_end(make_pair: Callable[..., Pair]) -> None:
    """Non-force unlink of a peer that looks healthy but does not answer: the local end is removed
    and the caller is told the peer could not be notified."""
    pair = linked(make_pair)
    pair.prefill.freeze()
    try:
        ret = pair.decode.call_within(hang_guard(300), kv.unlink, PROMPT_ID, pair.port, False, 300)
    finally:
        pair.prefill.thaw()
    assert ret == LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED
    assert pair.decode.call(kv.links) == []
    assert failed_pull(pair, 1000).status_code == LLMStatusCode.LLM_NOT_YET_LINK

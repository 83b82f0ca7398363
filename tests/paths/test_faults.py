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
from llm_datadist import BlocksCacheKey, CacheKey, DataType, LLMRole
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import kv, workers
from poll import hang_guard, wait_until
from relay import DOWN, UP, Relay
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
    pair.pulled([3])


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
    pair.pulled([5])
    assert [link["peer_cluster_id"] for link in pair.prefill.call(kv.links)] == [DECODER_ID]
    stalled.close()


def test_hostile_frames_on_an_established_link_only_drop_that_link(pair: Pair) -> None:
    """A peer that passes the handshake and then sends out-of-range or malformed requests."""
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    h = rawwire.handshake(pair.port, cluster=9, nonce=77)
    if pair.variant.same_host:
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
    pair.pulled([1])
    fwd.close()
    rev.close()


BIG = (64, 256 * 1024)  # 64 blocks of 256 KiB per tensor: 2 x 16 MiB
BIG_KEY = BlocksCacheKey(PROMPT_ID, 1)


def start_prefill(peers: Callable[..., Peer], variant: Variant, timeout_ms: int | None = None) -> tuple[Peer, int]:
    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True, timeout_ms=timeout_ms)
    p.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    p.call(kv.register_blocks, "big", 2, BIG, DataType.DT_UINT8, seed=7, key=BIG_KEY)
    return p, port


def test_peer_killed_before_link(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair()
    pair.prefill.kill()
    ret = pair.decode.call_within(hang_guard(3000), kv.link, PROMPT_ID, pair.port, 3000)
    assert ret == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert pair.decode.call(kv.links) == []


# A transfer loop that the peer's death interrupts never ends "ok": it runs until a transfer fails
# (UNBOUNDED transfers would take hours). What fails, per data path: on tcp and HCCL the transfer
# in flight, whose stream the death breaks; with direct memory access (cma) a copy already under
# way may still complete (the kernel copies from the dead process's pages until they are gone),
# and the next transfer finds the peer gone. Either way the loop's outcome is LLM_LINK_FAILED.
UNBOUNDED = 1 << 30


# seconds each: heavy; the default run interrupts a tcp transfer with the relay tests below
@only("cpu-tcp", "cpu-cma", "ascend-fake", heavy=("cpu-tcp", "cpu-cma", "ascend-fake"))
@pytest.mark.parametrize("op", ["pull", "push"])
def test_peer_killed_during_a_large_transfer_then_restarted(peers: Callable[..., Peer], variant: Variant,
                                                            op: str) -> None:
    """Kill the prefill while 32 MiB transfers run back to back (once the first has completed): the
    decoder's loop ends with LLM_LINK_FAILED, never a hang; its resources are released; a restarted
    prefill with the same cluster id links again and serves correct bytes."""
    p, port = start_prefill(peers, variant)
    d = peers("decode", env=variant.env())
    d.call(kv.start, "decoder", DECODER_ID, timeout_ms=10000)
    d.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    d.call(kv.register_blocks, "big", 2, BIG, DataType.DT_UINT8, seed=8)
    assert d.call(kv.link, PROMPT_ID, port)[0] == LLMStatusCode.LLM_SUCCESS
    baseline = d.call(kv.resources)
    d.call(workers.start_transfer_loop, op, BIG_KEY, "big", list(range(64)), list(range(63, -1, -1)), UNBOUNDED)
    # the loop is under way (its first transfer completed) when the peer dies
    wait_until(lambda: d.call(workers.transfers_done) >= 1, 30, "the first transfer of the loop done")
    p.kill()
    outcome = d.call_within(hang_guard(10000), workers.join_transfer_loop, hang_guard(10000) / 2)
    assert outcome == LLMStatusCode.LLM_LINK_FAILED, outcome
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
                   lambda: d.call(kv.pull_blocks, BIG_KEY, "big", [0, 5], [0, 5]), rows([(0, 0), (5, 5)]))


# On tcp a fault can be made to land while a transfer's bytes are on the wire: the decoder links
# through a relay (tests/relay.py) that lets HELD_AFTER bytes of the transfer through and then holds
# the rest. Once the relay holds, the transfer is in flight and cannot have completed (MOVED bytes
# are far more than the relay, the kernel's socket buffers and the relay's chunk can hold between
# them: the test asserts that the relay forwarded fewer).
HELD_AFTER = 1 << 20
MOVED_BLOCKS = list(range(48))  # of "big": 2 tensors x 48 x 256 KiB = 24 MiB; blocks 48-63 untouched
MOVED_BYTES = 2 * len(MOVED_BLOCKS) * BIG[1]


def relayed_decoder(peers: Callable[..., Peer], variant: Variant, relay: Relay, timeout_ms: int) -> Peer:
    d = peers("decode", env=variant.env())
    d.call(kv.start, "decoder", DECODER_ID, timeout_ms=timeout_ms)
    d.call(kv.register_blocks, "big", 2, BIG, DataType.DT_UINT8, seed=8)
    assert d.call(kv.link, PROMPT_ID, relay.port)[0] == LLMStatusCode.LLM_SUCCESS
    assert {link["transport"] for link in d.call(kv.links)} == {"tcp"}
    return d


def start_held_transfer(d: Peer, relay: Relay, op: str) -> int:
    """Starts one pull (or push) of MOVED_BLOCKS in the decoder and returns once its bytes are seen
    flowing and held at the relay: the direction they flow in."""
    direction = DOWN if op == "pull" else UP
    relay.hold_after(direction, HELD_AFTER)
    d.call(workers.start_transfer_loop, op, BIG_KEY, "big", MOVED_BLOCKS, MOVED_BLOCKS, 1)
    assert relay.wait_held(direction) >= HELD_AFTER
    return direction


@only("cpu-tcp")
@pytest.mark.parametrize("op", ["pull", "push"])
def test_peer_killed_while_the_transfer_bytes_flow(peers: Callable[..., Peer], variant: Variant, op: str) -> None:
    """The prefill dies while 24 MiB of one pull (or push) are on the wire and held at the relay:
    that very transfer fails with LLM_LINK_FAILED (none completed); the pushing decoder's source is
    unchanged; a retry against a restarted prefill moves exactly the requested blocks (the pull's, all
    of them: every other byte and guard of the destination is as before the failed pull)."""
    p, port = start_prefill(peers, variant)
    with Relay(port) as relay:
        # a generous timeout: under ThreadSanitizer (.ci/sanitizers.sh) a pushed payload lands in the
        # serving thread at about 100 KB/s, every piece a (suppressed) race check
        d = relayed_decoder(peers, variant, relay, timeout_ms=30000)
        decoder0 = d.call(kv.snapshot, "big")
        direction = start_held_transfer(d, relay, op)
        assert relay.connections() == 5  # the link's two channels and its three lanes (pdlink.TcpStreams 4)
        p.kill()
        relay.release()  # what the prefill sent before it died goes on to the decoder, then the end
        outcome = d.call_within(hang_guard(30000), workers.join_transfer_loop, hang_guard(30000) / 2)
        assert outcome == LLMStatusCode.LLM_LINK_FAILED, outcome
        assert d.call(workers.transfers_done) == 0
        assert relay.forwarded[direction] < MOVED_BYTES, relay.forwarded
    assert d.call(kv.unlink, PROMPT_ID, relay.port) == LLMStatusCode.LLM_SUCCESS
    # the same seeds: the same source bytes; its timeout bounds how long one frame may take to arrive
    p2, port2 = start_prefill(peers, variant, timeout_ms=30000)
    assert d.call(kv.link, PROMPT_ID, port2)[0] == LLMStatusCode.LLM_SUCCESS
    moves = [(b, b) for b in MOVED_BLOCKS]
    if op == "pull":
        # the failed pull may have landed part of its blocks; the retry lands all of them, and what it
        # leaves is exactly the destination before the failed pull with those blocks replaced
        prompt0 = p2.call(kv.snapshot, "big")
        d.call(kv.pull_blocks, BIG_KEY, "big", MOVED_BLOCKS, MOVED_BLOCKS)
        assert_same(d.call(kv.snapshot, "big"), decoder0.with_rows(prompt0, moves), "destination after the retry")
        assert_same(p2.call(kv.snapshot, "big"), prompt0, "source of the retried pull")
    else:
        assert_same(d.call(kv.snapshot, "big"), decoder0, "source of the failed push")
        # the first and last of the blocks (1 MiB: a push of all 24 MiB takes minutes under TSan)
        ends = [MOVED_BLOCKS[0], MOVED_BLOCKS[-1]]
        check_transfer(lambda: d.call(kv.snapshot, "big"), lambda: p2.call(kv.snapshot, "big"),
                       lambda: d.call_within(hang_guard(30000), kv.push_blocks, BIG_KEY, "big", ends, ends),
                       rows([(b, b) for b in ends]))


@only("cpu-tcp")
def test_peer_frozen_while_the_pull_bytes_flow(peers: Callable[..., Peer], variant: Variant) -> None:
    """The prefill is frozen while a 24 MiB pull is on the wire (held at the relay, then let go):
    what was in the socket buffers arrives, the rest never does, and the pull ends with LLM_TIMEOUT
    within sync_kv_timeout; the prefill's cache is unchanged, and after a forced unlink and a new link
    the same pull moves exact bytes."""
    p, port = start_prefill(peers, variant)
    prompt0 = p.call(kv.snapshot, "big")
    with Relay(port) as relay:
        d = relayed_decoder(peers, variant, relay, timeout_ms=3000)
        decoder0 = d.call(kv.snapshot, "big")
        direction = start_held_transfer(d, relay, "pull")
        assert relay.connections() == 5  # the link's two channels and its three lanes (pdlink.TcpStreams 4)
        p.freeze()
        try:
            relay.release()
            outcome = d.call_within(hang_guard(3000), workers.join_transfer_loop, hang_guard(3000) / 2)
            assert outcome == LLMStatusCode.LLM_TIMEOUT, outcome
            assert relay.forwarded[direction] < MOVED_BYTES, relay.forwarded
        finally:
            p.thaw()
        assert d.call(kv.unlink, PROMPT_ID, relay.port, True) == LLMStatusCode.LLM_SUCCESS
    assert_same(p.call(kv.snapshot, "big"), prompt0, "source of the timed-out pull")
    assert d.call(kv.link, PROMPT_ID, port)[0] == LLMStatusCode.LLM_SUCCESS
    d.call(kv.pull_blocks, BIG_KEY, "big", MOVED_BLOCKS, MOVED_BLOCKS)
    assert_same(d.call(kv.snapshot, "big"), decoder0.with_rows(prompt0, [(b, b) for b in MOVED_BLOCKS]),
                "destination after the retry")


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


@only("cpu-cma")
def test_on_cma_a_frozen_peer_still_serves_a_cached_layout_read(make_pair: Callable[..., Pair]) -> None:
    """What the cma path promises with a frozen peer: once the decoder has the prompt's layout (its
    first pull), a pull of registered blocks is a kernel copy from the prompt's memory that needs
    nothing from the prompt's threads, so it succeeds byte-exact while every thread of the prompt is
    stopped; the peer's freeze is no error on this path."""
    pair = linked(make_pair, timeout=500)
    pair.pulled([0])  # the layout is now cached
    source, dst0 = pair.prefill.call(kv.snapshot, "kv"), pair.decode.call(kv.snapshot, "kv")
    pair.prefill.freeze()  # (the source is read before and after: a frozen peer answers no call)
    try:
        pair.decode.call(kv.pull_blocks, KEY, "kv", [1, 2, 3], [1, 2, 3])
        assert all(state in ("T", "t") for state in pair.prefill.thread_states())  # frozen throughout
    finally:
        pair.prefill.thaw()
    assert_same(pair.decode.call(kv.snapshot, "kv"), dst0.with_rows(source, [(1, 1), (2, 2), (3, 3)]), "destination")
    assert_same(pair.prefill.call(kv.snapshot, "kv"), source, "source")

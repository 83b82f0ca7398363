"""Bounded resources: every resource a peer can make an engine spend (links, handshakes, threads,
descriptors, lock time, pins, notifications) has a bound, an init option and a default; dead links are reaped;
nobody takes over another peer's cluster id. The attackers are plain socket programs on
127.0.0.2 (tests/peers/hostile.py); the victim is the prefill of a pair whose honest decoder must
keep pulling byte-exact within its timeout throughout. Resource counts are polled, never timed.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import socket
import struct
import time
from collections.abc import Callable

import pytest

import internals
import rawwire
from backend_env import Variant
from conftest import DECODER_ID, PROMPT_ID, Pair, only
from llm_datadist import BlocksCacheKey, CacheKey, DataType, LLMRole
from pdlink import LLMStatusCode
from peer import Peer
from peers import hostile, kv
from poll import hang_guard, wait_until
from review_kit import pinned_by_a_direct_read
from verify import check_transfer, rows

# The attackers are this test process, on no emulated host: the two-hosts cells are left out.
pytestmark = pytest.mark.one_host("the attacker is the test process")
KEY = Pair.KEY
SHAPE = (16, 1024)
S = LLMStatusCode


def become(peer: Peer, uid: int) -> None:
    """Runs `peer` as another local user from now on (the attacks of a user other than the victim's)."""
    if os.geteuid() != 0:
        pytest.skip("running a peer as another user needs root")
    peer.call(hostile.become, uid)


def linked(make_pair: Callable[..., Pair], options: dict[str, str] | None = None) -> Pair:
    pair = make_pair(prefill_options=options)
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    pair.link()
    pair.pulled([0])  # what a data path sets up once per process (the IPC exporter's thread) predates the counts
    return pair


def stat(peer: Peer, name: str) -> int:
    return peer.call(kv.stats)[name]


def unix_name(peers: Callable[..., Peer], pair: Pair) -> str | None:
    """How a raw attacker reaches a victim that only takes same-host links."""
    return peers("spy").call(hostile.redirect_name, pair.port) if pair.variant.same_host else None


def test_the_limits_and_their_defaults_come_from_the_engine() -> None:
    limits = internals.core.EngineLimits()
    assert (limits.max_links_per_source, limits.max_handshakes, limits.max_handshakes_per_source,
            limits.hello_timeout_ms, limits.pin_timeout_ms, limits.handshake_timeout_ms,
            limits.max_notifications_per_link, limits.max_notification_bytes,
            limits.max_notification_bytes_per_link,
            limits.max_notification_bytes_per_source, limits.tcp_streams, limits.max_tcp_lanes,
            limits.tcp_chunk_bytes) == (64, 64, 16, 1000, 0, 5000, 4096, 16 << 20, 1 << 20, 4 << 20, 4, 64, 1 << 20)


def _default_max_links(nofile: int) -> int:
    """EngineLimits().max_links in a process whose descriptor limit is `nofile`."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return int(internals.core.EngineLimits().max_links)


def test_the_default_link_cap_fits_the_descriptor_limit(peers: Callable[..., Peer]) -> None:
    """512 links (HIXL's pool) where the descriptors allow, else what RLIMIT_NOFILE leaves after a
    reserve of 128, at 4 descriptors a link: 1024 descriptors hold 224 links, not 512."""
    assert peers("roomy").call(_default_max_links, 4096) == 512
    assert peers("usual").call(_default_max_links, 1024) == 224
    assert peers("tight").call(_default_max_links, 64) == 1


@pytest.mark.parametrize("option", sorted(internals.LIMIT_OPTIONS))
def test_each_limit_reaches_the_engine_from_its_option_or_its_variable(monkeypatch: pytest.MonkeyPatch,
                                                                      option: str) -> None:
    env, field = internals.LIMIT_OPTIONS[option]
    monkeypatch.setenv(env, "7")
    assert internals.parse_engine_options({})["limits"] == {field: 7}  # the variable, when the option is absent
    assert internals.parse_engine_options({option: "9"})["limits"] == {field: 9}  # the option wins
    limits = internals.core.EngineLimits()
    setattr(limits, field, 9)  # and the engine has the field
    assert getattr(limits, field) == 9


@pytest.mark.parametrize("option, value", [("pdlink.MaxLinks", "0"), ("pdlink.MaxHandshakes", "-1"),
                                           ("pdlink.PinTimeoutMs", "soon"), ("pdlink.HandshakeTimeoutMs", "0")])
def test_a_bad_limit_option_is_refused(peers: Callable[..., Peer], option: str, value: str) -> None:
    p = peers("p")
    with pytest.raises(Exception) as e:
        p.call(kv.start, "prompt", 1, listen=True, extra={option: value})
    assert getattr(e.value, "status_code", None) == S.LLM_PARAM_INVALID and option in str(e.value)


def test_dead_links_leave_tombstones_not_threads_or_descriptors(peers: Callable[..., Peer],
                                                                make_pair: Callable[..., Pair]) -> None:
    """Raw links that die (the attacker closes them) are reaped: their threads end and their
    descriptors close; each leaves a tombstone, so llm_datadist callers still see the dead link
    (switch_role: LLM_EXIST_LINK) until they unlink it; tombstones are bounded by pdlink.MaxLinks."""
    pair = linked(make_pair, {"pdlink.MaxLinks": "20"})
    base_fds, base_threads = pair.prefill.call(kv.resources)
    a = peers("attacker")
    unix = unix_name(peers, pair)
    results = a.call(hostile.many_links, pair.port, 18, 100, unix)
    assert [r[0] for r in results] == [0] * 18, results
    wait_until(lambda: stat(pair.prefill, "live_links") == 19, 20, "19 live links (18 raw, 1 honest)")
    pair.pulled([1])
    a.call(hostile.close_all)
    wait_until(lambda: stat(pair.prefill, "live_links") == 1, 20, "only the honest link left alive")
    wait_until(lambda: (lambda r: r[0] <= base_fds and r[1] <= base_threads)(pair.prefill.call(kv.resources)), 20,
               f"descriptors and threads back to {base_fds}, {base_threads}")
    assert stat(pair.prefill, "tombstones") == 18
    dead = [link for link in pair.prefill.call(kv.links) if link["broken"]]
    assert sorted(link["peer_cluster_id"] for link in dead) == list(range(100, 118))
    pair.pulled([2])
    # more dead links than the bound: the oldest tombstones are forgotten
    results = a.call(hostile.many_links, pair.port, 10, 200, unix)
    assert [r[0] for r in results] == [0] * 10, results
    a.call(hostile.close_all)
    wait_until(lambda: stat(pair.prefill, "live_links") == 1, 20, "the second wave reaped")
    assert stat(pair.prefill, "tombstones") == 20
    # a tombstone is an entity until unlinked
    with pytest.raises(Exception) as e:
        pair.prefill.call(kv.switch_role, "decoder")
    assert getattr(e.value, "status_code", None) == S.LLM_EXIST_LINK
    assert pair.prefill.call(kv.unlink, 209, 0, True) == S.LLM_SUCCESS
    assert stat(pair.prefill, "tombstones") == 19


def test_links_that_never_finish_a_handshake_leave_nothing(peers: Callable[..., Peer],
                                                           make_pair: Callable[..., Pair]) -> None:
    pair = linked(make_pair, {"pdlink.MaxHandshakesPerSource": "64", "pdlink.HelloTimeoutMs": "60000"})
    base_fds, base_threads = pair.prefill.call(kv.resources)
    a = peers("attacker")
    assert a.call(hostile.silent_connections, pair.port, 40) == 40
    wait_until(lambda: stat(pair.prefill, "handshakes") == 40, 20, "40 handshakes waiting")
    pair.pulled([3])
    a.call(hostile.close_all)
    wait_until(lambda: stat(pair.prefill, "handshakes") == 0, 20, "no handshake left")
    wait_until(lambda: (lambda r: r[0] <= base_fds and r[1] <= base_threads)(pair.prefill.call(kv.resources)), 20,
               "descriptors and threads back")
    assert stat(pair.prefill, "tombstones") == 0 and stat(pair.prefill, "live_links") == 1


def test_a_handshake_that_stalls_is_dropped_at_the_handshake_timeout(make_pair: Callable[..., Pair]) -> None:
    """A connection that sends part of a hello and then nothing holds its handshake slot until
    pdlink.HandshakeTimeoutMs (300 ms here), then the victim closes it and the slot is free."""
    pair = linked(make_pair, {"pdlink.HandshakeTimeoutMs": "300"})
    with socket.create_connection(("127.0.0.1", pair.port)) as stalled:
        stalled.sendall(rawwire.hello()[:10])
        wait_until(lambda: stat(pair.prefill, "handshakes") == 1, 20, "the stalled handshake counted")
        stalled.settimeout(hang_guard(300))
        assert stalled.recv(100) == b""  # closed by the victim; a hang would raise socket.timeout
    wait_until(lambda: stat(pair.prefill, "handshakes") == 0, 20, "the slot freed")
    pair.pulled([2])


def test_a_handshake_flood_from_one_source_does_not_lock_others_out(peers: Callable[..., Peer],
                                                                    make_pair: Callable[..., Pair]) -> None:
    """One source (here a local user of another uid, from any loopback address) may hold
    pdlink.MaxHandshakesPerSource handshake slots (16 by default) with connections that said hello
    and then stall: past that its newcomers are dropped at once, and a decoder of another user links
    during the flood."""
    pair = make_pair()
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    a = peers("attacker")
    become(a, 65534)
    held = sum(a.call(hostile.stalled_handshakes, pair.port, 5, f"127.0.0.{2 + i}") for i in range(8))
    assert held == 16  # 40 tried from 8 addresses: one user, one share
    assert stat(pair.prefill, "handshakes") == 16 and stat(pair.prefill, "handshakes_refused") == 24
    pair.link()  # from root, during the flood
    pair.pulled([4])
    a.call(hostile.close_all)


def _evicted_at_least(pair: Pair, n: int) -> bool:
    return stat(pair.prefill, "handshakes_evicted") >= n


def test_silent_connections_make_room_for_one_that_speaks(peers: Callable[..., Peer],
                                                          make_pair: Callable[..., Pair]) -> None:
    """Connections that never send their hello cannot lock anyone out, even from many sources and
    with every slot taken: when the slots are full the oldest silent one is dropped for the
    newcomer, so a dialler that speaks at once always gets in."""
    pair = make_pair(prefill_options={"pdlink.MaxHandshakes": "8", "pdlink.HelloTimeoutMs": "60000",
                                      "pdlink.HandshakeTimeoutMs": "60000"})  # nothing ends by a deadline here
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    a, b = peers("attacker"), peers("attacker2")
    become(b, 65534)
    # Two users, four addresses each: every slot silent. Ten at a time, each ten evicted before the
    # next: a burst that outruns the ends of the evicted threads is refused by design (at most
    # kEvictingPerSlot x MaxHandshakes of them in flight), and a slow victim (a sanitizer) falls behind.
    # Under a sanitizer the victim is slower still: bursts of five (twice as many), the same totals.
    burst = 5 if os.environ.get("PDLINK_SANITIZER") else 10
    opened = 0
    for i in range(40 // burst):
        for attacker, address in ((a, 2 + i % 4), (b, 6 + i % 4)):
            assert attacker.call(hostile.silent_connections, pair.port, burst, f"127.0.0.{address}") == burst * (i + 1)
            opened += burst
            wait_until(functools.partial(_evicted_at_least, pair, opened - 8), 20,
                       f"the oldest silent ones dropped {pair.prefill.call(kv.stats)}")
    assert stat(pair.prefill, "handshakes_evicted") == 72 and stat(pair.prefill, "handshakes_refused") == 0
    assert stat(pair.prefill, "handshakes") <= 8
    pair.link()
    pair.pulled([4])
    assert a.call(hostile.closed_by_the_engine, 5) >= 36  # the first of them were the ones dropped
    a.call(hostile.close_all)
    b.call(hostile.close_all)


def test_a_silent_connection_is_dropped_at_the_hello_deadline(peers: Callable[..., Peer],
                                                              make_pair: Callable[..., Pair]) -> None:
    """pdlink.HelloTimeoutMs (300 ms here) bounds how long a connection may stay silent, whatever
    the handshake timeout (a minute here): the engine closes it and frees its slot."""
    pair = linked(make_pair, {"pdlink.HelloTimeoutMs": "300", "pdlink.HandshakeTimeoutMs": "60000"})
    a = peers("attacker")
    assert a.call(hostile.silent_connections, pair.port, 4) == 4
    assert a.call(hostile.closed_by_the_engine, hang_guard(300)) == 4
    wait_until(lambda: stat(pair.prefill, "handshakes") == 0, 20, "the slots freed")
    assert stat(pair.prefill, "handshakes_evicted") == 0  # the deadline did it, not a newcomer
    pair.pulled([2])


def test_the_total_handshake_cap_holds_across_sources(peers: Callable[..., Peer],
                                                      make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(prefill_options={"pdlink.MaxHandshakes": "6", "pdlink.MaxHandshakesPerSource": "4"})
    a, b = peers("attacker"), peers("attacker2")
    become(b, 65534)
    assert a.call(hostile.stalled_handshakes, pair.port, 4) == 4
    assert b.call(hostile.stalled_handshakes, pair.port, 4) == 2  # two more fit in all
    assert stat(pair.prefill, "handshakes") == 6 and stat(pair.prefill, "handshakes_refused") == 2
    a.call(hostile.close_all)
    b.call(hostile.close_all)
    wait_until(lambda: stat(pair.prefill, "handshakes") == 0, 20, "the slots given back")
    pair.link()


def test_max_links_refuses_newcomers_and_frees_with_them(peers: Callable[..., Peer],
                                                         make_pair: Callable[..., Pair]) -> None:
    pair = linked(make_pair, {"pdlink.MaxLinks": "4"})
    a = peers("attacker")
    unix = unix_name(peers, pair)
    results = a.call(hostile.many_links, pair.port, 3, 100, unix)
    assert [r[0] for r in results] == [0, 0, 0], results
    status, message = peers("attacker2").call(hostile.link_raw, pair.port, 120, b"", unix)
    assert status == S.LLM_LINK_FAILED and "the most it may have" in message, message
    pair.pulled([5])
    a.call(hostile.close_all)
    wait_until(lambda: stat(pair.prefill, "live_links") == 1, 20, "the attacker's links reaped")
    assert peers("attacker3").call(hostile.link_raw, pair.port, 121, b"", unix) == (0, "")


def test_notifications_a_peer_floods_are_bounded_per_link_and_in_bytes(peers: Callable[..., Peer],
                                                                     make_pair: Callable[..., Pair]) -> None:
    """pdlink.MaxNotificationsPerLink (3 here) unread notifications from one link, then LLM_LINK_BUSY
    for each further one, the link intact; a second link has its own count, and
    pdlink.MaxNotificationBytes (64 here) bounds them all. A notification that is oversized or
    malformed drops only its link. The honest decoder pulls byte-exact throughout."""
    pair = linked(make_pair, {"pdlink.MaxNotificationsPerLink": "3", "pdlink.MaxNotificationBytes": "64"})
    unix = unix_name(peers, pair)
    frame = rawwire.request(rawwire.OP_NOTIFY, rawwire.notify_body(b"n", b"0123456789"))  # 11 bytes
    a, b = peers("attacker"), peers("attacker2")
    assert a.call(hostile.link_raw, pair.port, 9, b"", unix) == (0, "")
    assert [a.call(hostile.exchange, frame)[0] for _ in range(5)] == [0, 0, 0, S.LLM_LINK_BUSY, S.LLM_LINK_BUSY]
    assert b.call(hostile.link_raw, pair.port, 10, b"", unix) == (0, "")
    assert [b.call(hostile.exchange, frame)[0] for _ in range(3)] == [0, 0, S.LLM_LINK_BUSY]  # 55, then 66 > 64
    assert (stat(pair.prefill, "notifications"), stat(pair.prefill, "notifications_refused")) == (5, 3)
    pair.pulled([1])
    limits = internals.core.LIMITS
    bad = {
        "a body announced past the bound": rawwire.request_header(
            rawwire.OP_NOTIFY, 4 + limits["max_notify_name_bytes"] + limits["max_notify_message_bytes"] + 1),
        "a message one past its limit": rawwire.request(
            rawwire.OP_NOTIFY, rawwire.notify_body(b"", b"m" * (limits["max_notify_message_bytes"] + 1))),
        "a name longer than the body": rawwire.request(rawwire.OP_NOTIFY, struct.pack("<I", 100) + b"x"),
        "a payload": rawwire.request(rawwire.OP_NOTIFY, rawwire.notify_body(b"n", b""), payload_len=8),
    }
    for i, (what, frame) in enumerate(bad.items()):
        assert a.call(hostile.link_raw, pair.port, 20 + i, b"", unix) == (0, ""), what
        assert a.call(hostile.exchange, frame) == "closed", what
        a.call(hostile.close)
    assert stat(pair.prefill, "notifications") == 5  # nothing of them was queued
    pair.pulled([2])


def test_a_raw_read_of_many_runs_does_not_stall_an_honest_pull(peers: Callable[..., Peer],
                                                              make_pair: Callable[..., Pair]) -> None:
    """A raw-address read naming the most runs a request may (against 260 registered tensors): the
    registry resolves each run through an index, under a shared lock, so an honest pull running at
    the same time completes within its 1 s timeout, byte-exact, every time."""
    pair = make_pair(timeout=1000)
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    for i in range(129):  # 2 + 258 = 260 registered tensors
        pair.prefill.call(kv.register, f"c{i}", 2, (2, 64), seed=i)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    pair.link()
    base = pair.prefill.call(kv.tensor_addresses, "c128")[1]
    runs = internals.core.LIMITS["max_request_pieces"]
    body = rawwire.counted_body(1, runs, struct.pack("<I", 0), struct.pack("<QQ", base + 8, 1) * runs)
    body = bytes([rawwire.KIND_RAW]) + body[1:]
    flags = rawwire.FLAG_DIRECT if pair.variant.same_host else 0
    a = peers("attacker")
    assert a.call(hostile.link_raw, pair.port, 9, b"", unix_name(peers, pair)) == (0, "")
    a.call(hostile.start_request_loop, rawwire.request(rawwire.OP_READ, body, flags=flags))
    for block in range(16):
        pair.decode.call_within(hang_guard(1000), kv.pull_blocks, KEY, "kv", [block], [block])
    answers = a.call(hostile.stop_request_loop)
    # every run resolved; then the bytes (on the Ascend backend staged out of device memory), or,
    # for a direct read of device memory, the refusal that sends a requester to the stream path
    direct_to_device = pair.variant.device_memory and flags == rawwire.FLAG_DIRECT
    expected = S.LLM_FEATURE_NOT_ENABLED if direct_to_device else S.LLM_SUCCESS
    assert answers and all(s == expected for s in answers), answers[:5]
    check_transfer(lambda: pair.prefill.call(kv.snapshot, "kv"), lambda: pair.decode.call(kv.snapshot, "kv"),
                   lambda: None, lambda dst0, src0: dst0.with_rows(src0, [(b, b) for b in range(16)]))


@only("cpu-cma")
def test_a_pin_expires_and_frees_the_memory(peers: Callable[..., Peer], variant: Variant) -> None:
    """A same-host peer asks for one direct read of a pool cache and then stays silent. The owner
    deallocates the cache; once the pin bound passes (pdlink.PinTimeoutMs) the memory returns to the
    pool, and the owner's next allocation, which failed with LLM_OUT_OF_MEMORY meanwhile, succeeds."""
    p, _ = pinned_by_a_direct_read(peers, variant, PROMPT_ID)
    p.call(kv.deallocate, "big")
    p.call(kv.remove_cache_key, CacheKey(1, 7))  # no reference is left but the attacker's pin
    with pytest.raises(Exception) as e:
        p.call(kv.allocate, "again", 1, (1, 768 * 1024), DataType.DT_INT8)
    assert getattr(e.value, "status_code", None) == S.LLM_OUT_OF_MEMORY
    wait_until(lambda: stat(p, "pins_expired") == 1, hang_guard(500), "the pin expired")
    p.call(kv.allocate, "again", 1, (1, 768 * 1024), DataType.DT_INT8)


def _word(pid: int, addr: int) -> int:
    """One 8-byte word of process `pid`'s memory, read the way a same-host peer could."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(addr)
        return int.from_bytes(mem.read(8), "little")


@only("cpu-cma")
def test_one_peers_expired_pin_never_moves_another_peers_pin_epoch(peers: Callable[..., Peer],
                                                                  variant: Variant) -> None:
    """Each served link has its own pin epoch word (engine/pin_epochs.h): a direct answer names it.
    A peer whose pin expires moves only its own link's word, so another peer's copy that spans the
    expiry still checks out; the other peer is answered the same word and epoch afterwards."""
    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True, extra={"pdlink.PinTimeoutMs": "500"})
    p.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    name = peers("spy").call(hostile.redirect_name, port)
    silent, honest = peers("silent"), peers("honest")
    assert silent.call(hostile.link_raw, port, 9, b"", name) == (0, "")
    assert honest.call(hostile.link_raw, port, 10, b"", name) == (0, "")
    read = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(tensors=(0, 1), runs=((0, 64),)),
                           flags=rawwire.FLAG_DIRECT)

    def answered(peer: Peer) -> tuple[int, int]:
        answer = peer.call(hostile.exchange, read)
        assert isinstance(answer, tuple) and answer[0] == 0, answer
        epoch, addr = struct.unpack("<QQ", answer[2][:16])
        return epoch, addr

    honest_epoch, honest_word = answered(honest)
    honest.call(hostile.send, rawwire.request(rawwire.OP_RELEASE, rawwire.blocks_body()))  # done: unpinned
    silent_epoch, silent_word = answered(silent)
    assert silent_word != honest_word
    wait_until(lambda: stat(p, "pins_expired") == 1, hang_guard(500), "the silent peer's pin expired")
    assert _word(p.pid, silent_word) == silent_epoch + 1  # the expiry moved its own word
    assert _word(p.pid, honest_word) == honest_epoch  # and nobody else's
    assert answered(honest) == (honest_epoch, honest_word)


def test_a_healthy_link_cannot_be_taken_over_by_a_newcomer(peers: Callable[..., Peer],
                                                           make_pair: Callable[..., Pair]) -> None:
    """Without a secret, a raw peer that links as cluster 2 while the honest cluster 2's link is
    healthy is refused (a probe finds the old link alive); the honest link keeps working."""
    pair = linked(make_pair)
    status, message = peers("attacker").call(hostile.link_raw, pair.port, DECODER_ID, b"", unix_name(peers, pair))
    assert status == S.LLM_LINK_FAILED and "already has a healthy link" in message, message
    pair.pulled([6])
    assert [(link["peer_cluster_id"], link["broken"]) for link in pair.prefill.call(kv.links)] == [(DECODER_ID, False)]


def _engines(peers: Callable[..., Peer], variant: Variant) -> tuple[Peer, int, Peer, int]:
    """A decoder and a prefill, both listening: (decoder, its port, prefill, its port)."""
    d, p = peers("decode", env=variant.env()), peers("prefill", env=variant.env())
    dport = d.call(kv.start, "decoder", DECODER_ID, listen=True)
    d.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    pport = p.call(kv.start, "prompt", PROMPT_ID, listen=True)
    p.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    return d, dport, p, pport


def _linked_ids(peer: Peer) -> list[tuple[int, bool, bool]]:
    return sorted((link["peer_cluster_id"], link["initiator"], link["broken"]) for link in peer.call(kv.links))


def test_a_squatter_of_the_id_a_dialler_asks_for_is_dropped_and_the_real_peer_linked(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Without a secret a raw peer links to the decoder first, claiming to be the prefill's
    cluster. When the decoder then links to the prefill's address, the engine there does not
    confirm that claim (it never dialled that link): the squatter's link is dropped, the dialled one
    made, and the decoder pulls the prefill's bytes, not the squatter's."""
    d, dport, p, pport = _engines(peers, variant)
    name = peers("spy").call(hostile.redirect_name, dport) if variant.same_host else None
    squatter = peers("squatter")
    assert squatter.call(hostile.link_raw, dport, PROMPT_ID, b"", name) == (0, "")
    wait_until(lambda: _linked_ids(d) == [(PROMPT_ID, False, False)], 20, "the squatter linked")
    assert d.call(kv.link, PROMPT_ID, pport)[0] == S.LLM_SUCCESS
    assert _linked_ids(d) == [(PROMPT_ID, True, False)]
    assert squatter.call(hostile.exchange, rawwire.request(rawwire.OP_PING, b"")) == "closed"
    check_transfer(lambda: p.call(kv.snapshot, "kv"), lambda: d.call(kv.snapshot, "kv"),
                   lambda: d.call(kv.pull_blocks, KEY, "kv", [3], [3]), rows([(3, 3)]))


@only("cpu-tcp")
def test_a_nonce_learnt_from_a_dial_does_not_make_a_squatter_confirmed(peers: Callable[..., Peer],
                                                                      variant: Variant) -> None:
    """The relay of the hostile review: the prefill once dials an attacker's address as the
    decoder's id, so the attacker learns the prefill's hello nonce; a second attacker links to the
    decoder claiming the prefill's id with that very nonce. The prefill confirms only a link it
    dialled from the end the decoder saw, so the decoder drops the squatter, links the real
    prefill (LLM_SUCCESS) and pulls the prefill's bytes."""
    d, dport, p, pport = _engines(peers, variant)
    relay = peers("relay")
    relay_port = relay.call(hostile.serve, "read_exact")  # answers whoever dials as the id it expects
    assert p.call(kv.link, DECODER_ID, relay_port, 3000, hostile.ATTACKER_IP)[0] == S.LLM_SUCCESS
    nonces = [o["nonce"] for o in relay.call(hostile.observed) if o["event"] == "hello" and o["channel"] == 0]
    assert nonces, "the prefill dialled the relay"
    name = peers("spy").call(hostile.redirect_name, dport) if variant.same_host else None
    squatter = peers("squatter")
    assert squatter.call(hostile.link_raw, dport, PROMPT_ID, b"", name, rawwire.ANY, nonces[-1]) == (0, "")
    wait_until(lambda: _linked_ids(d) == [(PROMPT_ID, False, False)], 20, "the squatter linked")
    assert d.call(kv.link, PROMPT_ID, pport)[0] == S.LLM_SUCCESS
    assert _linked_ids(d) == [(PROMPT_ID, True, False)]
    check_transfer(lambda: p.call(kv.snapshot, "kv"), lambda: d.call(kv.snapshot, "kv"),
                   lambda: d.call(kv.pull_blocks, KEY, "kv", [2], [2]), rows([(2, 2)]))


def test_a_peer_that_linked_first_is_confirmed_and_the_dialler_answers_already_link(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """llm_datadist's cross-linking answer holds: the prefill links to the decoder first; the
    decoder's own link to the prefill is confirmed by the prefill (it dialled that link), so the
    decoder answers LLM_ALREADY_LINK and neither side keeps a second link; the decoder pulls over
    the prefill's link. The link stays confirmed: a second link call does not dial again."""
    d, dport, p, pport = _engines(peers, variant)
    assert p.call(kv.link, DECODER_ID, dport)[0] == S.LLM_SUCCESS
    assert [link["confirmed"] for link in d.call(kv.links)] == [False]
    assert d.call(kv.link, PROMPT_ID, pport)[0] == S.LLM_ALREADY_LINK
    assert _linked_ids(d) == [(PROMPT_ID, False, False)]
    assert [link["confirmed"] for link in d.call(kv.links)] == [True]
    wait_until(lambda: _linked_ids(p) == [(DECODER_ID, True, False)], 20, "the spare link gone from the prefill")
    # Confirmed once, for the link's life: with the prefill frozen (a dial to it would hang until the
    # timeout, 5 s, and fail), another link call answers at once from the confirmed link.
    p.freeze()
    try:
        assert d.call(kv.link, PROMPT_ID, pport)[0] == S.LLM_ALREADY_LINK
    finally:
        p.thaw()
    check_transfer(lambda: p.call(kv.snapshot, "kv"), lambda: d.call(kv.snapshot, "kv"),
                   lambda: d.call(kv.pull_blocks, KEY, "kv", [5], [5]), rows([(5, 5)]))


def test_an_owner_that_pauses_keeps_its_link(peers: Callable[..., Peer], make_pair: Callable[..., Pair]) -> None:
    """A newcomer that claims a healthy link's cluster id while its owner is paused for 1.4 s (a
    long GC, a stop signal) is refused: the link is found dead only after pings over a window of
    3 s go unanswered, which the paused owner answers once it runs again."""
    pair = linked(make_pair)
    unix = unix_name(peers, pair)
    attacker = peers("attacker")
    pair.decode.freeze()
    paused = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        claim = pool.submit(attacker.call, hostile.link_raw, pair.port, DECODER_ID, b"", unix)
        # the owner's pause itself: 1.4 s, as in the attack it defeats
        wait_until(lambda: time.monotonic() - paused >= 1.4, 5, "the owner paused for 1.4 s")
        pair.decode.thaw()
        status, message = claim.result(timeout=30)
    assert status == S.LLM_LINK_FAILED and "already has a healthy link" in message, message
    pair.pulled([6])


def test_one_source_holds_at_most_its_share_of_links(peers: Callable[..., Peer],
                                                    make_pair: Callable[..., Pair]) -> None:
    """pdlink.MaxLinksPerSource (3 here): a local user of another uid links three times, then is
    refused; another user still links, and the honest decoder keeps pulling. Closing frees the share."""
    pair = linked(make_pair, {"pdlink.MaxLinksPerSource": "3"})
    unix = unix_name(peers, pair)
    a, b = peers("attacker"), peers("attacker2")
    become(a, 65534)
    become(b, 65533)
    results = a.call(hostile.many_links, pair.port, 4, 100, unix)
    assert [r[0] for r in results] == [0, 0, 0, S.LLM_LINK_FAILED], results
    assert "the most one source may have" in results[3][1], results[3]
    assert b.call(hostile.link_raw, pair.port, 120, b"", unix) == (0, "")
    pair.pulled([5])
    a.call(hostile.close_all)
    wait_until(lambda: stat(pair.prefill, "live_links") == 2, 20, "the first user's links reaped")
    assert a.call(hostile.link_raw, pair.port, 121, b"", unix) == (0, "")


def test_each_link_has_its_own_share_of_the_notification_bytes(peers: Callable[..., Peer],
                                                               make_pair: Callable[..., Pair]) -> None:
    """pdlink.MaxNotificationBytesPerLink (30 here): one peer's unread notifications stop at its own
    share (LLM_LINK_BUSY), the engine-wide budget (1000) is not drained, and another peer queues its
    own."""
    pair = linked(make_pair, {"pdlink.MaxNotificationBytesPerLink": "30", "pdlink.MaxNotificationBytes": "1000"})
    unix = unix_name(peers, pair)
    frame = rawwire.request(rawwire.OP_NOTIFY, rawwire.notify_body(b"n", b"0123456789"))  # 11 bytes
    a, b = peers("attacker"), peers("attacker2")
    assert a.call(hostile.link_raw, pair.port, 9, b"", unix) == (0, "")
    assert [a.call(hostile.exchange, frame)[0] for _ in range(4)] == [0, 0, S.LLM_LINK_BUSY, S.LLM_LINK_BUSY]
    assert b.call(hostile.link_raw, pair.port, 10, b"", unix) == (0, "")
    assert [b.call(hostile.exchange, frame)[0] for _ in range(3)] == [0, 0, S.LLM_LINK_BUSY]
    assert (stat(pair.prefill, "notifications"), stat(pair.prefill, "notifications_refused")) == (4, 3)
    pair.pulled([1])


def test_the_links_of_one_source_share_one_budget_of_notification_bytes(peers: Callable[..., Peer],
                                                                       make_pair: Callable[..., Pair]) -> None:
    """pdlink.MaxNotificationBytesPerSource (30 here): the links of one local user share it, so
    more links gain that user nothing; another user has its own."""
    pair = linked(make_pair, {"pdlink.MaxNotificationBytesPerSource": "30"})
    unix = unix_name(peers, pair)
    frame = rawwire.request(rawwire.OP_NOTIFY, rawwire.notify_body(b"n", b"0123456789"))  # 11 bytes
    a, b, c = peers("attacker"), peers("attacker2"), peers("other-user")
    become(a, 65534)
    become(b, 65534)
    become(c, 65533)
    assert a.call(hostile.link_raw, pair.port, 9, b"", unix) == (0, "")
    assert b.call(hostile.link_raw, pair.port, 10, b"", unix) == (0, "")
    assert [a.call(hostile.exchange, frame)[0] for _ in range(2)] == [0, 0]
    assert [b.call(hostile.exchange, frame)[0] for _ in range(2)] == [S.LLM_LINK_BUSY, S.LLM_LINK_BUSY]
    assert c.call(hostile.link_raw, pair.port, 11, b"", unix) == (0, "")
    assert [c.call(hostile.exchange, frame)[0] for _ in range(3)] == [0, 0, S.LLM_LINK_BUSY]
    assert (stat(pair.prefill, "notifications"), stat(pair.prefill, "notifications_refused")) == (4, 3)
    pair.pulled([1])


def test_a_peer_that_ignores_unlink_frames_loses_its_link_at_the_timeout(peers: Callable[..., Peer],
                                                                       make_pair: Callable[..., Pair]) -> None:
    """The victim unlinks a raw peer that never answers: the unlink reports that the peer could not
    be told, within its timeout, and the link is gone locally, so switch_role is not held hostage."""
    pair = linked(make_pair)
    a = peers("attacker")
    assert a.call(hostile.link_raw, pair.port, 9, b"", unix_name(peers, pair)) == (0, "")
    wait_until(lambda: 9 in [link["peer_cluster_id"] for link in pair.prefill.call(kv.links)], 20, "the peer linked")
    status = pair.prefill.call_within(hang_guard(1000), kv.unlink, 9, 0, False, 1000)
    assert status == S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
    assert [link["peer_cluster_id"] for link in pair.prefill.call(kv.links)] == [DECODER_ID]
    assert pair.prefill.call(kv.unlink, DECODER_ID, 0, True) == S.LLM_SUCCESS
    assert pair.prefill.call(kv.switch_role, "decoder")[0] == int(LLMRole.DECODER)


def test_a_restarted_peer_takes_its_cluster_id_back(peers: Callable[..., Peer], make_pair: Callable[..., Pair],
                                                    variant: Variant) -> None:
    """A decoder that died and restarts with the same cluster id links again: the old link is dead
    (found so by the probe, if the death was not noticed yet)."""
    pair = linked(make_pair)
    pair.decode.kill()
    d2 = peers("decode2", env=variant.env())
    d2.call(kv.start, "decoder", DECODER_ID)
    d2.call(kv.register_blocks, "kv", 2, SHAPE, seed=3)
    assert d2.call(kv.link, PROMPT_ID, pair.port)[0] == S.LLM_SUCCESS
    check_transfer(lambda: pair.prefill.call(kv.snapshot, "kv"), lambda: d2.call(kv.snapshot, "kv"),
                   lambda: d2.call(kv.pull_blocks, KEY, "kv", [7], [7]), rows([(7, 7)]))


@only("cpu-tcp")
def test_with_a_secret_a_prover_replaces_the_old_link(peers: Callable[..., Peer], variant: Variant) -> None:
    """With a link secret, a newcomer that proves it is cluster 2 replaces cluster 2's old link (the
    restart of a peer whose death went unnoticed); the old link is broken."""
    secret = {"pdlink.LinkSecret": "shared"}
    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True, extra=secret)
    p.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    d1, d2 = peers("d1", env=variant.env()), peers("d2", env=variant.env())
    for d in (d1, d2):
        d.call(kv.start, "decoder", DECODER_ID, extra=secret)
        d.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    assert d1.call(kv.link, PROMPT_ID, port)[0] == S.LLM_SUCCESS
    assert d2.call(kv.link, PROMPT_ID, port)[0] == S.LLM_SUCCESS
    wait_until(lambda: d1.call(kv.links)[0]["broken"], 10, "the replaced link broken on the old peer")
    check_transfer(lambda: p.call(kv.snapshot, "kv"), lambda: d2.call(kv.snapshot, "kv"),
                   lambda: d2.call(kv.pull_blocks, KEY, "kv", [8], [8]), rows([(8, 8)]))


def test_a_dialler_keeps_its_own_link_when_the_peer_dials_back(peers: Callable[..., Peer], variant: Variant) -> None:
    """Engine A dials B; then someone claiming to be B dials A. A keeps the link it dialled for its
    own requests (the newcomer gets the accepted slot, not A's link)."""
    a = peers("a", env=variant.env())
    b = peers("b", env=variant.env())
    a_port = a.call(kv.start, "prompt", 1, listen=True)
    b_port = b.call(kv.start, "prompt", 2, listen=True)
    b.call(kv.register_blocks, "kv", 2, SHAPE, seed=4, key=BlocksCacheKey(2, 0))
    a.call(kv.register_blocks, "kv", 2, SHAPE, seed=None)
    assert a.call(kv.link, 2, b_port)[0] == S.LLM_SUCCESS
    unix = peers("spy").call(hostile.redirect_name, a_port) if variant.same_host else None
    assert peers("attacker").call(hostile.link_raw, a_port, 2, b"", unix) == (0, "")
    links = a.call(kv.links)
    assert sorted((link["initiator"], link["broken"]) for link in links) == [(False, False), (True, False)]
    check_transfer(lambda: b.call(kv.snapshot, "kv"), lambda: a.call(kv.snapshot, "kv"),
                   lambda: a.call(kv.pull_blocks, BlocksCacheKey(2, 0), "kv", [9], [9]), rows([(9, 9)]))


@only("cpu-tcp")
@pytest.mark.skipif("undefined" in os.environ.get("PDLINK_SANITIZER", ""),
                    reason="UBSan's dynamic-type check probes memory through a pipe, which a process without "
                           "descriptors cannot open: it reports every stream object of the victim's log line as "
                           "an invalid vptr (the default and heavy runs have this test)")
def test_out_of_descriptors_the_listener_backs_off_and_recovers(peers: Callable[..., Peer],
                                                               make_pair: Callable[..., Pair]) -> None:
    """With its descriptors exhausted, the victim's listener cannot accept: it pauses and retries
    (counted, logged once) instead of spinning; once descriptors are free again, links are accepted."""
    pair = linked(make_pair)
    old = pair.prefill.call(kv.limit_descriptors, 4)
    a = peers("attacker")
    try:
        a.call(hostile.silent_connections, pair.port, 12)
        wait_until(lambda: stat(pair.prefill, "listener_backoffs") >= 1, 20, "the listener backed off")
        assert pair.prefill.call(kv.can_open_a_file) is False  # the process really is out of descriptors
        pair.pulled([10])  # established links keep working
    finally:
        a.call(hostile.close_all)
        pair.prefill.call(kv.restore_descriptors, old)
    assert peers("late").call(hostile.link_raw, pair.port, 50) == (0, "")  # cpu-tcp: no redirect needed


@only("cpu-tcp")
def test_lanes_attach_only_to_their_own_link_within_their_bounds(peers: Callable[..., Peer],
                                                                  make_pair: Callable[..., Pair]) -> None:
    """LANE channels (extra TCP streams of a tcp link): a raw peer may attach pdlink.TcpStreams - 1 of
    them (2 here) to its own link, by its link's nonce; a lane with another nonce, or claiming
    another cluster, is refused; one more than the share is refused; past pdlink.MaxTcpLanes (3
    here, over all links) too. Silent lanes hold only what the bounds allow; a frame other than a
    plain read or write on a lane drops the link; the honest decoder keeps pulling throughout, and
    once the attacker is gone its threads and descriptors are back."""
    pair = linked(make_pair, {"pdlink.TcpStreams": "3", "pdlink.MaxTcpLanes": "3"})
    base_fds, base_threads = pair.prefill.call(kv.resources)
    a = peers("attacker")
    nonce, other = (int.from_bytes(os.urandom(16), "little") for _ in range(2))
    assert a.call(hostile.link_raw, pair.port, 9, b"", None, rawwire.ANY, nonce) == (0, "")
    refused = a.call(hostile.open_lanes, pair.port, 9, other, 1) + a.call(hostile.open_lanes, pair.port, 10, nonce, 1)
    assert [status for status, _ in refused] == [rawwire.LINK_FAILED] * 2, refused
    assert all("no link of cluster" in message for _, message in refused), refused
    lanes = a.call(hostile.open_lanes, pair.port, 9, nonce, 3)
    assert [status for status, _ in lanes] == [0, 0, rawwire.LINK_FAILED], lanes
    assert "the most it may have (pdlink.TcpStreams)" in lanes[2][1]
    (raw,) = [link for link in pair.prefill.call(kv.links) if link["peer_cluster_id"] == 9]
    assert list(raw["lanes"]) == ["served x3"]
    # a second raw link gets one lane: the engine's three are taken then
    b = peers("attacker2")
    nonce_b = int.from_bytes(os.urandom(16), "little")
    assert b.call(hostile.link_raw, pair.port, 11, b"", None, rawwire.ANY, nonce_b) == (0, "")
    lanes_b = b.call(hostile.open_lanes, pair.port, 11, nonce_b, 2)
    assert [status for status, _ in lanes_b] == [0, rawwire.LINK_FAILED], lanes_b
    assert "the most lanes it may have (pdlink.MaxTcpLanes)" in lanes_b[1][1]
    pair.pulled([1])
    # a ping on a lane: the victim drops that link (its lanes and channels)
    assert b.call(hostile.lane_exchange, 0, rawwire.request(5, b"")) == "closed"
    wait_until(lambda: all(link["broken"] for link in pair.prefill.call(kv.links) if link["peer_cluster_id"] == 11),
               20, "the link whose lane broke the protocol is broken")
    pair.pulled([2])
    for attacker in (a, b):
        attacker.call(hostile.close_lanes)
        attacker.call(hostile.close)
    wait_until(lambda: (lambda r: r[0] <= base_fds and r[1] <= base_threads)(pair.prefill.call(kv.resources)), 20,
               f"descriptors and threads back to {base_fds}, {base_threads}")
    pair.pulled([3])

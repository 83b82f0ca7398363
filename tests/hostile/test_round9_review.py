"""Round 9 hostile review: KV handoffs attacked by a raw peer that knows only docs/security.md
("KV handoffs") and the public docs it points to. Each test is one attack; a hole is marked
``xfail(strict=True, reason="round 9: ...")``, a claim that held is a plain test. Raw peers run
tests/peers/round9.py (several raw links in one attacker process) and tests/peers/hostile.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import rawwire
from backend_env import Variant
from conftest import only
from pdlink import LLMStatusCode
from peer import Peer
from peers import handoff, hostile, native, round9
from poll import wait_until
from review_kit import PING, claim_lands, listening_victim
from verify import assert_same

S = LLMStatusCode
ROWS, ROW, KEY = 8, 256, 7

pytestmark = pytest.mark.one_host("raw attacker processes talk to the victim")


def _read(ticket: object, runs=((ROW, ROW),), flags: int = 0) -> bytes:
    body = rawwire.offer_body(KEY, ticket.offer_id, ticket.generation, runs=runs,  # type: ignore[attr-defined]
                              block_size=ROW)
    return rawwire.request(rawwire.OP_READ, body, flags=flags)


def _commit(ticket: object) -> bytes:
    return rawwire.request(rawwire.OP_COMMIT, rawwire.offer_body(KEY, ticket.offer_id,  # type: ignore[attr-defined]
                                                                 ticket.generation))  # type: ignore[attr-defined]


def _abort(rid: bytes, reason: bytes = b"") -> bytes:
    return rawwire.request(rawwire.OP_HANDOFF, rawwire.abort_body(rid, reason))


def _hold(ticket: object) -> bytes:
    return rawwire.request(rawwire.OP_HANDOFF, rawwire.hold_body([(ticket.offer_id,  # type: ignore[attr-defined]
                                                                   ticket.generation)]))  # type: ignore[attr-defined]


def _attacker(peers: Callable[..., Peer], variant: Variant, port: int, clusters: list[int],
              name: str = "attacker") -> Peer:
    """One raw attacker process holding a link to the victim per cluster id (link i is clusters[i])."""
    a = peers(name)
    for c in clusters:
        unix = a.call(hostile.redirect_name, port, c) if variant.same_host else None
        a.call(round9.link, port, c, unix)
    return a


@only("cpu-tcp")
def test_a_commit_with_no_read_before_it_releases_nothing(peers: Callable[..., Peer], variant: Variant) -> None:
    """A commit naming an unbound offer (its ticket known, never read) from a link that never read
    it: no link is bound, so nothing is released; the offer is still claimable by its decoder."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    a = _attacker(peers, variant, port, [9, 10])
    a.call(round9.send, 0, _commit(ticket))
    assert a.call(round9.exchange, 0, PING) == (0, "", b"")
    assert victim.call(handoff.state, "o") == (False, None)
    before = victim.call(native.snapshot, "big")
    assert a.call(round9.exchange, 1, _read(ticket)) == (0, "", bytes(before.tensor(0)[ROW:2 * ROW]))
    assert victim.call(handoff.state, "o") == (False, None)


@only("cpu-tcp")
def test_an_abort_from_another_link_leaves_a_bound_offer_and_its_reads(peers: Callable[..., Peer],
                                                                      variant: Variant) -> None:
    """Link 0 reads (binds) the offer; link 1 (another cluster id) aborts its request id: the offer
    stays live and link 0 still reads it; the abort is queued as link 1's event."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    before = victim.call(native.snapshot, "big")
    a = _attacker(peers, variant, port, [9, 10])
    row = bytes(before.tensor(0)[ROW:2 * ROW])
    assert a.call(round9.exchange, 0, _read(ticket)) == (0, "", row)
    assert a.call(round9.exchange, 1, _abort(b"req", b"mine")) == (0, "", b"")
    assert victim.call(handoff.state, "o") == (False, None)
    assert a.call(round9.exchange, 0, _read(ticket)) == (0, "", row)
    assert victim.call(round9.handoff_events) == [("aborted", 10, "req", "mine")]


@only("cpu-tcp")
def test_any_linked_peer_aborts_an_unbound_offer_by_its_request_id_alone(peers: Callable[..., Peer],
                                                                         variant: Variant) -> None:
    """As documented (security.md: "the receiver's live offers of that id are released unless bound
    to another link"): a peer without the ticket, knowing or guessing only the request id, releases
    an offer no decoder has read or held yet ("peer_aborted"). Recorded so a change is seen: a
    request id is no secret, so an offer is safe from this only once its decoder bound it."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    victim.call(handoff.offer, "o", "big", [1], "req-17")
    a = _attacker(peers, variant, port, [9])
    assert a.call(round9.exchange, 0, _abort(b"req-17")) == (0, "", b"")
    wait_until(lambda: victim.call(handoff.state, "o")[0], 10, "the offer released by the stranger's abort")
    assert victim.call(handoff.state, "o") == (True, "peer_aborted")


@only("cpu-tcp")
def test_request_ids_and_reasons_with_nuls_reach_python_and_invalid_utf8_drops_the_link(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Round 9 found that an abort whose request id was not UTF-8 made ``handoff_events()`` raise and
    lose the queue it had taken. A request id or reason holding a NUL is text and reaches the
    application as it is; one that is not UTF-8 (bytes never in UTF-8, a cut sequence) is a malformed
    body: the link drops and nothing is queued. ``handoff_events()`` returns every honest event,
    those before the bad frames and after them."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    a = _attacker(peers, variant, port, [9, 10, 11])
    for rid, why in ((b"ok-1", b""), (b"r\x00q", b"a\x00b")):
        assert a.call(round9.exchange, 0, _abort(rid, why)) == (0, "", b"")
    assert a.call(round9.exchange, 0, _abort(b"\xff\xfe", b"x")) == "closed"
    assert a.call(round9.exchange, 1, _abort(b"ok-2", b"\xc3")) == "closed"
    assert a.call(round9.exchange, 2, _abort(b"ok-3", "\u00e9t\u00e9".encode())) == (0, "", b"")
    assert victim.call(round9.handoff_events) == [("aborted", 9, "ok-1", ""), ("aborted", 9, "r\x00q", "a\x00b"),
                                                   ("aborted", 11, "ok-3", "\u00e9t\u00e9")]


def _honest_told(peers: Callable[..., Peer], variant: Variant, victim: Peer) -> None:
    """An honest engine (cluster 50) the victim dialled, so a source of its own (security.md: "a link
    this engine dialled its own"; every local raw attacker is one source, its uid), aborts "honest"
    with reason "why" to the victim: one event queued there."""
    honest = peers("honest", env=variant.env())
    hport = honest.call(native.start, 50, listen=True)
    victim.call(native.connect, hport, 50)
    honest.call(handoff.abort, "honest", 1, "why")  # returns once the victim answered: queued


@only("cpu-tcp")
def test_an_abort_flood_from_many_cluster_ids_does_not_evict_an_earlier_peers_event(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """security.md: what a peer's frames queue is at most ``max_handoff_events``, one peer at most a
    quarter and the links of one source at most a quarter (round 9 found the share was per cluster
    id only, which a peer picks). An attacker process dials five links under five cluster ids and
    floods aborts: its source keeps its newest quarter (16), the rest counted dropped, and the honest
    peer's one event, queued first from another source, stays."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True, limits={"max_handoff_events": 64})
    _honest_told(peers, variant, victim)
    a = _attacker(peers, variant, port, [100, 101, 102, 103, 104])
    for i in range(5):
        assert a.call(round9.flood, i, [_abort(b"flood-%d-%d" % (i, k)) for k in range(64)]) == [0] * 64
    assert victim.call(handoff.stats)["handoff_events_dropped"] == 5 * 64 - 16
    events = victim.call(round9.handoff_events)
    assert events == [("aborted", 50, "honest", "why")] + [("aborted", 104, "flood-4-%d" % k, "")
                                                             for k in range(48, 64)]


@only("cpu-tcp")
def test_holds_from_another_link_do_not_keep_a_bound_offer_past_its_lease(peers: Callable[..., Peer],
                                                                         variant: Variant) -> None:
    """Link 0 binds the offer (lease 1 s) by a read and goes quiet; link 1 holds it again and
    again: its holds extend nothing, the offer expires."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    a = _attacker(peers, variant, port, [9, 10])
    ticket = victim.call(handoff.offer, "o", "big", [1], "req", 1000)
    assert a.call(round9.exchange, 0, _read(ticket))[0] == 0

    def expired_while_held() -> bool:
        assert a.call(round9.exchange, 1, _hold(ticket)) == (0, "", b"")
        return bool(victim.call(handoff.state, "o")[0])

    wait_until(expired_while_held, 20, "the offer expired while another link held it")
    assert victim.call(handoff.state, "o") == (True, "expired")


@only("cpu-tcp")
def test_a_bound_links_death_releases_its_offers_and_gives_back_what_it_held(peers: Callable[..., Peer],
                                                                            variant: Variant) -> None:
    """A raw decoder binds two offers (a read, a hold), then its sockets close: both are released
    "link_down" at once (not at the 1 h lease), and the victim's threads, descriptors and live
    offers are back where they were; an unbound offer stays."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    t1 = victim.call(handoff.offer, "a", "big", [1], "r1", 3_600_000)
    t2 = victim.call(handoff.offer, "b", "big", [2], "r2", 3_600_000)
    victim.call(handoff.offer, "c", "big", [3], "r3", 3_600_000)
    base = victim.call(round9.resources)  # the lease thread started with the first offer
    a = _attacker(peers, variant, port, [9])
    assert a.call(round9.exchange, 0, _read(t1))[0] == 0
    assert a.call(round9.exchange, 0, _hold(t2)) == (0, "", b"")
    a.call(round9.close, 0)
    wait_until(lambda: victim.call(handoff.state, "a")[0] and victim.call(handoff.state, "b")[0], 10,
               "the bound offers released when their link died")
    assert victim.call(handoff.state, "a") == (True, "link_down")
    assert victim.call(handoff.state, "b") == (True, "link_down")
    assert victim.call(handoff.state, "c") == (False, None)
    assert victim.call(round9.live_offers) == 1
    wait_until(lambda: victim.call(round9.resources) == base, 10, f"threads and descriptors back to {base}")


@only("cpu-cma")
def test_a_release_waits_for_a_pinned_direct_read_of_the_offer(peers: Callable[..., Peer],
                                                              variant: Variant) -> None:
    """The fence on cma: a same-host raw peer reads the offer directly (answered addresses, the
    cache pinned until its next frame) and then stalls. The application releases the offer: it is
    not reported released while the pin is held; the peer's next frame (a read of the offer) is
    refused, ends the pin, and the release is then reported."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    a = _attacker(peers, variant, port, [9])
    answer = a.call(round9.exchange, 0, _read(ticket, flags=rawwire.FLAG_DIRECT))
    assert isinstance(answer, tuple) and answer[0] == 0, answer
    victim.call(handoff.release, "o")
    assert victim.call(round9.wait, "o", 0.5) is False
    answer = a.call(round9.exchange, 0, _read(ticket, flags=rawwire.FLAG_DIRECT))
    assert isinstance(answer, tuple) and answer[0] == S.LLM_OFFER_RELEASED and answer[2] == b"", answer
    wait_until(lambda: victim.call(handoff.state, "o")[0], 10, "the release reported once the pin ended")
    assert victim.call(handoff.state, "o") == (True, "released")


@only("cpu-tcp")
def test_holds_cannot_carry_an_offer_across_a_role_switch(peers: Callable[..., Peer], variant: Variant) -> None:
    """A raw decoder holds a live offer while the prefill switches roles: the switch must not commit
    with the offer live (it rolls back at its drain timeout, the offer still live), and once the
    application releases the offer the switch commits."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    a = _attacker(peers, variant, port, [9])
    assert a.call(round9.exchange, 0, _hold(ticket)) == (0, "", b"")
    with pytest.raises(Exception) as e:
        victim.call(native.switch_role, "PROMPT", drain_timeout_ms=500)
    assert getattr(e.value, "status_code", None) == S.LLM_TIMEOUT or "TIMEOUT" in str(e.value), e.value
    assert victim.call(handoff.state, "o") == (False, None)
    assert a.call(round9.exchange, 0, _hold(ticket)) == (0, "", b"")
    victim.call(handoff.release, "o")
    victim.call(native.switch_role, "PROMPT", drain_timeout_ms=5000)
    assert victim.call(round9.live_offers) == 0


@only("cpu-tcp")
@pytest.mark.parametrize("mode", ["read_wrong_length", "read_huge_payload", "resp_payload_on_error",
                                  "resp_text_on_success"])
def test_a_hostile_servers_answer_to_a_claim_lands_nothing(peers: Callable[..., Peer], variant: Variant,
                                                           mode: str) -> None:
    """The decoder claims a ticket whose address is a hostile server: a claim answered with the wrong
    length, an oversized payload, a payload announced on an error or text on a success fails, the
    decoder's region unchanged, and no commit (release) is sent for it."""
    from pdlink import Ticket

    attacker = peers("attacker")
    port = attacker.call(hostile.serve, mode)
    decoder = peers("decoder", env=variant.env())
    decoder.call(native.start, 2)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    before = decoder.call(native.snapshot, "dst")
    ticket = Ticket(cluster_id=1, address=f"{hostile.ATTACKER_IP}:{port}", key=KEY, tensors=1, block_size=ROW,
                    length=ROWS * ROW, blocks=(1, 2), offer_id=5, generation=0x1234, request_id="req", lease_ms=60000)
    with pytest.raises(Exception) as e:
        decoder.call(handoff.claim, ticket, "dst", [3, 4], 2000)
    assert getattr(e.value, "status_code", None) is not None, e.value
    assert_same(decoder.call(native.snapshot, "dst"), before, "the decoder's region after the failed claim")
    seen = attacker.call(hostile.observed)
    assert any(o.get("op") == rawwire.OP_READ and o.get("kind") == rawwire.KIND_OFFER for o in seen), seen
    assert not any(o.get("op") == rawwire.OP_COMMIT for o in seen), seen


@only("cpu-tcp")
def test_an_abort_under_the_prefills_cluster_id_from_a_stranger_does_not_fail_the_decoders_claim(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """A stranger links to the decoder calling itself the prefill's cluster id (1) and aborts the
    request id the decoder is about to claim from the real prefill (round 9 found aborts remembered
    by cluster id): the remembered abort is the stranger's link's, and the claim, finding no link to
    cluster 1 it dialled, dials the ticket's address (the stranger's accepted link is dropped for
    it: security.md "Identities"), so the decoder's claim from the real prefill lands."""
    prefill, _ = listening_victim(peers, variant, ROWS, ROW)
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    decoder = peers("decoder", env=variant.env())
    dport = decoder.call(native.start, 2, listen=True)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    a = peers("attacker")
    a.call(round9.link, dport, 1, None)
    assert a.call(round9.exchange, 0, _abort(b"req", b"spoofed")) == (0, "", b"")
    claim_lands(prefill, decoder, ticket)


@only("cpu-tcp")
def test_an_abort_flood_under_one_cluster_id_keeps_to_its_quarter(peers: Callable[..., Peer],
                                                                  variant: Variant) -> None:
    """The per-peer share holds for one cluster id: a peer flooding 4 x the queue's worth of aborts
    keeps only its newest quarter queued (the rest counted dropped), and the honest peer's event
    queued before it (from another source) stays."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True, limits={"max_handoff_events": 64})
    _honest_told(peers, variant, victim)
    a = _attacker(peers, variant, port, [100])
    assert a.call(round9.flood, 0, [_abort(b"flood-%d" % k) for k in range(256)]) == [0] * 256
    assert victim.call(handoff.stats)["handoff_events_dropped"] == 256 - 16
    events = victim.call(round9.handoff_events)
    assert events == [("aborted", 50, "honest", "why")] + [("aborted", 100, "flood-%d" % k, "")
                                                             for k in range(240, 256)]


@only("cpu-tcp")
def test_a_hold_then_a_commit_releases_an_offer_claimed_with_no_byte_read(peers: Callable[..., Peer],
                                                                          variant: Variant) -> None:
    """Recorded, not a hole: the ticket's holder binds the offer by a hold and commits without
    reading: the offer is released "claimed" though no block was read (native_api's "claimed: a
    claim landed every block" is what an honest decoder does; the prefill cannot tell). Only the
    bound link can do it: the same commit from another link changed nothing before."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    a = _attacker(peers, variant, port, [9, 10])
    assert a.call(round9.exchange, 0, _hold(ticket)) == (0, "", b"")
    a.call(round9.send, 1, _commit(ticket))
    assert a.call(round9.exchange, 1, PING) == (0, "", b"")
    assert victim.call(handoff.state, "o") == (False, None)
    a.call(round9.send, 0, _commit(ticket))
    assert a.call(round9.exchange, 0, PING) == (0, "", b"")
    wait_until(lambda: victim.call(handoff.state, "o")[0], 10, "the offer released by the holder's commit")
    assert victim.call(handoff.state, "o") == (True, "claimed")


@only("cpu-tcp")
def test_a_commit_from_the_bound_link_with_another_key_releases_nothing(peers: Callable[..., Peer],
                                                                        variant: Variant) -> None:
    """A commit is checked like a read: from the bound link, naming the offer's id and generation
    under another key (model id), it releases nothing; with the offer's key it releases it
    "claimed"."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    a = _attacker(peers, variant, port, [9])
    assert a.call(round9.exchange, 0, _read(ticket))[0] == 0
    a.call(round9.send, 0, rawwire.request(rawwire.OP_COMMIT, rawwire.offer_body(KEY + 1, ticket.offer_id,
                                                                                 ticket.generation)))
    assert a.call(round9.exchange, 0, PING) == (0, "", b"")
    assert victim.call(handoff.state, "o") == (False, None)
    a.call(round9.send, 0, _commit(ticket))
    assert a.call(round9.exchange, 0, PING) == (0, "", b"")
    wait_until(lambda: victim.call(handoff.state, "o")[0], 10, "the offer released by the commit with its key")
    assert victim.call(handoff.state, "o") == (True, "claimed")


@only("cpu-tcp")
def test_reads_of_an_offer_on_a_tcp_lane_are_checked_like_the_links_own(peers: Callable[..., Peer],
                                                                       variant: Variant) -> None:
    """A raw peer with a lane of its link: a lane read of the offer with a wrong generation or
    outside its blocks is refused with nothing answered; one inside is served and binds the offer to
    the lane's link (another link is refused); the link's commit releases it, and a lane read after
    that is refused."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    src = victim.call(native.snapshot, "big")
    ticket = victim.call(handoff.offer, "o", "big", [1, 2], "req")
    a = peers("attacker9")
    nonce = 0x5EED_0000_0000_0000_0000_0000_0000_0009
    assert a.call(hostile.link_raw, port, 9, b"", None, rawwire.ANY, nonce) == (0, "")
    assert [s for s, _ in a.call(hostile.open_lanes, port, 9, nonce, 1)] == [0]
    wrong = rawwire.request(rawwire.OP_READ, rawwire.offer_body(KEY, ticket.offer_id, ticket.generation ^ 1,
                                                                runs=((ROW, ROW),), block_size=ROW))
    for frame in (wrong, _read(ticket, runs=((0, 2 * ROW),)), _read(ticket, runs=((3 * ROW, ROW),))):
        answer = a.call(hostile.lane_exchange, 0, frame)
        assert isinstance(answer, tuple) and answer[0] == S.LLM_OFFER_RELEASED and answer[2] == b"", answer
    assert a.call(hostile.lane_exchange, 0, _read(ticket, runs=((ROW, 2 * ROW),))) == (
        0, "", bytes(src.tensor(0)[ROW:3 * ROW]))
    b = _attacker(peers, variant, port, [10])
    answer = b.call(round9.exchange, 0, _read(ticket))
    assert isinstance(answer, tuple) and answer[0] == S.LLM_OFFER_RELEASED and "another link" in answer[1], answer
    a.call(hostile.send, _commit(ticket))
    assert a.call(hostile.exchange, PING) == (0, "", b"")
    wait_until(lambda: victim.call(handoff.state, "o")[0], 10, "the offer released by the link's commit")
    assert victim.call(handoff.state, "o") == (True, "claimed")
    answer = a.call(hostile.lane_exchange, 0, _read(ticket))
    assert isinstance(answer, tuple) and answer[0] == S.LLM_OFFER_RELEASED and answer[2] == b"", answer


@only("cpu-tcp")
def test_a_peer_that_stops_reading_an_offers_answer_holds_its_release_only_until_the_send_deadline(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """The bound decoder reads 12 MiB of an offer and never reads the answer: the read is being
    served, so the application's release is not reported at once (the fence); the serving side's
    request deadline (max(2 x the engine's timeout, 5 s): 5 s here) ends the answer, and the release
    is then reported ("released"), the offer no longer live."""
    big = 4 << 20
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True, timeout_ms=1000)
    victim.call(native.register, "big", 4, big, seed=None, key=KEY)
    a = _attacker(peers, variant, port, [9])
    ticket = victim.call(handoff.offer, "o", "big", [1, 2, 3], "req")
    a.call(round9.send, 0, rawwire.request(rawwire.OP_READ, rawwire.offer_body(
        KEY, ticket.offer_id, ticket.generation, runs=((big, 3 * big),), block_size=big)))
    wait_until(lambda: victim.call(native.role_state)["served_in_flight"] == 1, 10, "the read being served")
    victim.call(handoff.release, "o")
    assert victim.call(handoff.state, "o") == (False, None)
    wait_until(lambda: victim.call(handoff.state, "o")[0], 20, "the release reported after the send deadline")
    assert victim.call(handoff.state, "o") == (True, "released")
    assert victim.call(round9.live_offers) == 0


OTHER_OPS = {
    "release": (rawwire.OP_RELEASE, 0),
    "split end": (rawwire.OP_RELEASE, rawwire.MARK_SPLIT),
    "describe": (rawwire.OP_DESCRIBE, 0),
    "split chunk": (rawwire.OP_READ, rawwire.MARK_SPLIT),
}


@only("cpu-tcp", "cpu-cma")
@pytest.mark.parametrize("what", sorted(OTHER_OPS))
def test_other_ops_naming_an_offer_from_a_stranger_link_neither_release_nor_read_it(
        peers: Callable[..., Peer], variant: Variant, what: str) -> None:
    """Link 0 binds the offer; link 1 names it (its ticket known) in a release, a split pull's end
    frame, a describe or a split pull's chunk: whatever the answer, no byte of the cache comes back,
    the offer stays live and link 0 still reads it."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    a = _attacker(peers, variant, port, [9, 10])
    flags = rawwire.FLAG_DIRECT if variant.same_host else 0
    assert a.call(round9.exchange, 0, _read(ticket, flags=flags))[0] == 0
    op, mark = OTHER_OPS[what]
    frame = rawwire.request(op, rawwire.offer_body(KEY, ticket.offer_id, ticket.generation, runs=((ROW, ROW),),
                                                   block_size=ROW), flags=mark)
    if op == rawwire.OP_RELEASE:
        a.call(round9.send, 1, frame)
    else:
        answer = a.call(round9.exchange, 1, frame)
        assert answer == "closed" or (isinstance(answer, tuple) and answer[0] != 0 and answer[2] == b""), answer
    answer = a.call(round9.exchange, 1, PING)
    assert answer == "closed" or answer == (0, "", b""), answer
    assert victim.call(handoff.state, "o") == (False, None)
    assert a.call(round9.exchange, 0, _read(ticket, flags=flags))[0] == 0
    assert victim.call(handoff.state, "o") == (False, None)


@only("cpu-cma")
def test_a_direct_write_to_an_offer_is_refused_and_answers_no_address(peers: Callable[..., Peer],
                                                                      variant: Variant) -> None:
    """On a same-host link a direct write (answered with addresses the peer would write into) names
    the offer: refused, no address answered, the cache unchanged."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    before = victim.call(native.snapshot, "big")
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    a = _attacker(peers, variant, port, [9])
    frame = rawwire.request(rawwire.OP_WRITE, rawwire.offer_body(KEY, ticket.offer_id, ticket.generation,
                                                                 runs=((ROW, ROW),), block_size=ROW),
                            flags=rawwire.FLAG_DIRECT)
    answer = a.call(round9.exchange, 0, frame)
    assert isinstance(answer, tuple) and answer[0] != 0 and answer[2] == b"", answer
    assert_same(victim.call(native.snapshot, "big"), before, "the cache after a direct write to the offer")
    assert victim.call(handoff.state, "o") == (False, None)



@only("cpu-tcp", "cpu-cma")
def test_a_stranger_linking_as_the_bound_decoders_cluster_id_releases_its_offer_without_a_secret(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Recorded, the documented identity model (round 9 filed it as a hole; security.md "KV
    handoffs" and "Identities"): without a link secret a cluster id is a claim. The decoder (a raw
    link as cluster 9, which answers no ping) binds the offer (on cma by a direct read); a stranger,
    another process, links in claiming cluster 9: the decoder's link is found dead and replaced, its
    offer released "link_down" (at once, not at its lease), and the stranger reads nothing of it."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req", 3_600_000)
    decoder = _attacker(peers, variant, port, [9], name="decoder")
    flags = rawwire.FLAG_DIRECT if variant.same_host else 0
    assert decoder.call(round9.exchange, 0, _read(ticket, flags=flags))[0] == 0
    stranger = _attacker(peers, variant, port, [9], name="stranger")
    wait_until(lambda: victim.call(handoff.state, "o")[0], 10, "the offer released when its link was replaced")
    assert victim.call(handoff.state, "o") == (True, "link_down")
    answer = stranger.call(round9.exchange, 0, _read(ticket, flags=flags))
    assert isinstance(answer, tuple) and answer[0] == S.LLM_OFFER_RELEASED and answer[2] == b"", answer


@only("cpu-tcp")
def test_with_a_link_secret_a_stranger_cannot_link_as_the_bound_decoder(peers: Callable[..., Peer],
                                                                        variant: Variant) -> None:
    """What security.md says to do where peers are not trusted: with a link secret, the decoder (an
    engine with the secret, cluster 9) links and binds the offer by a hold; a stranger linking as
    cluster 9 without the secret, or with a wrong one, is refused at the handshake; the offer stays
    live, and the decoder's claim over its link then lands and releases it "claimed"."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True, secret="round9-secret")
    victim.call(native.register, "big", ROWS, ROW, seed=1, key=KEY)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req", 3_600_000)
    decoder = peers("decoder", env=variant.env())
    decoder.call(native.start, 9, secret="round9-secret")
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    decoder.call(native.connect, port, 1)
    decoder.call(handoff.hold, [ticket])
    stranger = peers("stranger")
    for secret in (b"", b"a-guess"):
        status, message = stranger.call(hostile.link_raw, port, 9, secret, None)
        assert status != 0, (secret, message)
    assert victim.call(handoff.state, "o") == (False, None)
    claim_lands(victim, decoder, ticket)


@only("cpu-tcp")
def test_a_guess_learns_nothing_from_the_refusals_text(peers: Callable[..., Peer], variant: Variant) -> None:
    """security.md: "one answer for every unknown offer so a guess learns nothing". A read naming a
    live offer's id with a wrong generation, a released offer's id with a wrong generation, a never
    used id, and another key with the right ticket, are refused with the same status and text (but
    the id it named, echoed back)."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    live = victim.call(handoff.offer, "live", "big", [1], "req")
    gone = victim.call(handoff.offer, "gone", "big", [2], "req2")
    victim.call(handoff.release, "gone")
    a = _attacker(peers, variant, port, [9])

    def refused(key: int, offer_id: int, generation: int) -> tuple[int, str, bytes] | str:
        """The answer, the offer id it names (echoed back) written as N."""
        answer = a.call(round9.exchange, 0, rawwire.request(rawwire.OP_READ, rawwire.offer_body(
            key, offer_id, generation, runs=((ROW, ROW),), block_size=ROW)))
        if isinstance(answer, tuple):
            return answer[0], answer[1].replace(f"offer {offer_id} ", "offer N "), answer[2]
        return answer

    answers = {
        "live id, wrong generation": refused(KEY, live.offer_id, live.generation ^ 1),
        "released id, wrong generation": refused(KEY, gone.offer_id, gone.generation ^ 1),
        "unused id": refused(KEY, live.offer_id + 1000, live.generation),
        "live offer, wrong key": refused(KEY + 1, live.offer_id, live.generation),
    }
    assert len(set(answers.values())) == 1, answers
    (answer,) = set(answers.values())
    assert isinstance(answer, tuple) and answer[0] == S.LLM_OFFER_RELEASED and answer[2] == b"", answer

"""Round 9b hostile review: the round 9 fixes to KV handoffs attacked by a raw peer that knows only
docs/security.md ("KV handoffs") and the docs it points to: the UTF-8 check on kHandoff strings,
the per-peer and per-source shares of the event queue, aborts remembered by link and the claim's
dial, checked commits, wire v9. Each test is one attack; a hole is marked
``xfail(strict=True, reason="round 9b: ...")``, a claim that held is a plain test. Raw peers run
tests/peers/round9b.py (links from chosen loopback sources) and tests/peers/round9.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import rawwire
from backend_env import Variant
from conftest import only
from pdlink import LLMStatusCode
from peer import Peer
from peers import handoff, hostile, native, round9, round9b
from poll import wait_until
from review_kit import PING, claim_lands, listening_victim
from verify import assert_same

ROWS, ROW, KEY = 8, 256, 7

pytestmark = pytest.mark.one_host("raw attacker processes talk to the victim")


def _read(ticket: object, runs=((ROW, ROW),)) -> bytes:
    body = rawwire.offer_body(KEY, ticket.offer_id, ticket.generation, runs=runs,  # type: ignore[attr-defined]
                              block_size=ROW)
    return rawwire.request(rawwire.OP_READ, body)


def _commit(ticket: object, key: int = KEY, generation_xor: int = 0) -> bytes:
    return rawwire.request(rawwire.OP_COMMIT, rawwire.offer_body(
        key, ticket.offer_id, ticket.generation ^ generation_xor))  # type: ignore[attr-defined]


def _abort(rid: bytes, reason: bytes = b"") -> bytes:
    return rawwire.request(rawwire.OP_HANDOFF, rawwire.abort_body(rid, reason))


# Not well-formed UTF-8 (RFC 3629): each must drop the link and queue nothing.
MALFORMED = {
    "overlong NUL": (b"\xc0\x80", b""),
    "C1 lead": (b"\xc1\xbf", b""),
    "overlong 3-byte": (b"\xe0\x80\xaf", b""),
    "overlong 4-byte": (b"\xf0\x80\x80\xaf", b""),
    "surrogate D800": (b"\xed\xa0\x80", b""),
    "surrogate DFFF": (b"\xed\xbf\xbf", b""),
    "surrogate pair (CESU-8)": (b"\xed\xa0\xbd\xed\xb8\x80", b""),
    "past U+10FFFF": (b"\xf4\x90\x80\x80", b""),
    "F7 lead": (b"\xf7\xbf\xbf\xbf", b""),
    "5-byte form": (b"\xf8\x88\x80\x80\x80", b""),
    "F5": (b"a\xf5", b""),
    "FF": (b"\xff", b""),
    "lone continuation": (b"a\x80b", b""),
    "cut 3-byte at the end": (b"ok\xe2\x82", b""),
    "cut 4-byte at the end": (b"ok\xf0\x9f\x98", b""),
    "cut at the 256-byte limit": (b"\xf0\x9f\x98\x80" * 63 + b"abc\xf0", b""),
    "surrogate in the reason": (b"ok", b"\xed\xa0\x80"),
    "overlong in the reason": (b"ok", b"\xc0\xaf"),
}

# Well-formed edges: each is kept and reaches the application exactly.
WELL_FORMED = [
    (b"\xf4\x8f\xbf\xbf", b"\xef\xbf\xbf"),  # U+10FFFF, U+FFFF
    (b"\xef\xbb\xbfbom", b"\x00"),  # a BOM, a NUL alone
    (b"\xf0\x9f\x98\x80" * 64, "\u00e9".encode() * 128),  # exactly 256 bytes each
    (b"\xed\x9f\xbf", b"\xee\x80\x80"),  # U+D7FF and U+E000, the surrogates' neighbours
]


@only("cpu-tcp")
def test_every_utf8_edge_in_an_abort_drops_the_link_and_handoff_events_keeps_every_honest_record(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Fix 1 of round 9 against every UTF-8 edge: a request id or reason that is overlong, a
    surrogate, past U+10FFFF, a byte never in UTF-8, a lone continuation or a sequence cut at the
    field's end (also at the 256-byte limit) drops its link (one link per case) and queues nothing;
    well-formed edges (U+10FFFF, U+FFFF, a BOM, a NUL, 256 bytes of 4-byte characters, U+D7FF and
    U+E000) are kept and reach ``handoff_events()`` exactly, which never raises."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    a = peers("attacker")
    good = a.call(round9b.link_from, port, 9, hostile.ATTACKER_IP)
    for rid, why in WELL_FORMED:
        assert a.call(round9.exchange, good, _abort(rid, why)) == (0, "", b""), (rid, why)
    dropped = {}
    for n, (name, (rid, why)) in enumerate(sorted(MALFORMED.items())):
        i = a.call(round9b.link_from, port, 100 + n, hostile.ATTACKER_IP)
        dropped[name] = a.call(round9.exchange, i, _abort(rid, why))
    assert dropped == {name: "closed" for name in MALFORMED}
    assert a.call(round9.exchange, good, _abort(b"after", b"")) == (0, "", b"")
    expected = [("aborted", 9, rid.decode(), why.decode()) for rid, why in WELL_FORMED]
    assert victim.call(round9.handoff_events) == expected + [("aborted", 9, "after", "")]
    assert victim.call(handoff.stats)["handoff_events_dropped"] == 0


@only("cpu-tcp")
def test_request_ids_from_the_application_cannot_make_released_or_handoff_events_raise(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Request ids that reach the event queues by other routes than a peer's abort frame: an
    offer's own request id (released by the application, by its lease, by its bound link's death)
    and a local abort. A str holding a lone surrogate (no UTF-8 form) is refused by ``offer`` with
    nothing made; well-formed ones with a NUL and U+10FFFF come back from
    ``released()`` exactly, and neither ``released()`` nor ``handoff_events()`` raises."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    assert victim.call(round9b.offer_raw, "bad", "big", [1], "r\ud800").startswith("raised ")
    assert victim.call(round9.live_offers) == 0
    odd = ["a\x00b", "\U0010ffff", "\ufeff" + "\U0001f600" * 63]
    tickets = [victim.call(handoff.offer, f"o{k}", "big", [k + 1], rid, 1000 if k == 1 else None)
               for k, rid in enumerate(odd)]
    a = peers("attacker")
    i = a.call(round9b.link_from, port, 9, hostile.ATTACKER_IP)
    assert a.call(round9.exchange, i, _read(tickets[2], runs=((3 * ROW, ROW),)))[0] == 0
    victim.call(handoff.release, "o0")
    a.call(round9.close, i)
    wait_until(lambda: all(victim.call(handoff.state, f"o{k}")[0] for k in range(3)), 10,
               "the offers released (application, lease, link death)")
    assert victim.call(round9b.abort_raw, "\U0010ffff\x00") == "ok"
    by_id = sorted(victim.call(round9b.released_records), key=lambda r: r[1])
    assert by_id == sorted([(None, odd[0], "released"), (None, odd[1], "expired"), (9, odd[2], "link_down")],
                           key=lambda r: r[1])
    assert victim.call(round9.handoff_events) == []


@only("cpu-tcp")
def test_a_request_id_with_no_utf8_form_raises_invalid_argument(peers: Callable[..., Peer],
                                                                variant: Variant) -> None:
    """native_api.md: "A request id and a reason are UTF-8 text (...; ``abort`` raises
    ``InvalidArgument`` for other bytes)". A Python str holding a lone surrogate has no UTF-8 form:
    ``abort`` (either field) and ``offer`` must raise ``InvalidArgument`` (a ``ValueError``), the
    error the application is told to expect, and make nothing."""
    victim, _ = listening_victim(peers, variant, ROWS, ROW)
    got = [victim.call(round9b.abort_raw, "r\udfff"), victim.call(round9b.abort_raw, "r", "\ud800"),
           victim.call(round9b.offer_raw, "bad", "big", [1], "r\ud800")]
    assert victim.call(round9.live_offers) == 0
    assert got == ["raised InvalidArgument"] * 3, got


def _honest_told(peers: Callable[..., Peer], variant: Variant, victim: Peer) -> None:
    """An honest engine (cluster 50) the victim dialled (a source of its own) aborts "honest"."""
    honest = peers("honest", env=variant.env())
    hport = honest.call(native.start, 50, listen=True)
    victim.call(native.connect, hport, 50)
    honest.call(handoff.abort, "honest", 1, "why")


@only("cpu-tcp")
def test_one_process_linking_from_several_loopback_addresses_keeps_to_a_quarter_of_the_events(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Fix 2 of round 9: a source is a remote peer's IP address. One attacker process links from
    five loopback addresses (127.0.0.2 .. 127.0.0.6, all this host's), each under its own cluster
    id, and fills each link's quarter (16 of 64): security.md says one process fills no more than
    a quarter and other peers' events stay. Held: every loopback address is the attacker's uid (one
    source), so it keeps its newest 16, the rest counted dropped, and the honest event stays."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True, limits={"max_handoff_events": 64})
    _honest_told(peers, variant, victim)
    a = peers("attacker")
    for n in range(5):
        i = a.call(round9b.link_from, port, 100 + n, f"127.0.0.{2 + n}")
        assert a.call(round9.flood, i, [_abort(b"f-%d-%d" % (n, k)) for k in range(16)]) == [0] * 16
    assert victim.call(handoff.stats)["handoff_events_dropped"] == 5 * 16 - 16
    assert victim.call(round9.handoff_events) == [("aborted", 50, "honest", "why")] + [
        ("aborted", 104, "f-4-%d" % k, "") for k in range(16)]


@only("cpu-tcp")
def test_a_claim_of_a_ticket_naming_the_real_prefills_address_under_another_cluster_id_fails_cleanly(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Fix 3: a hostile ticket whose address is the real prefill but whose cluster id is another (3).
    The decoder dials the address expecting cluster 3, finds cluster 1, and the claim fails; the
    offer stays live and unbound (the honest ticket's claim then lands), and the decoder keeps no
    link of cluster 3."""
    prefill, _ = listening_victim(peers, variant, ROWS, ROW)
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    decoder = peers("decoder", env=variant.env())
    decoder.call(native.start, 2)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    forged = decoder.call(round9b.forge, ticket, 3, None)
    with pytest.raises(Exception) as e:
        decoder.call(handoff.claim, forged, "dst", [3], 3000)
    assert getattr(e.value, "status_code", None) is not None, e.value
    assert prefill.call(handoff.state, "o") == (False, None)
    assert all(c != 3 for c, _ in decoder.call(round9b.link_clusters))
    decoder.call(handoff.claim, ticket, "dst", [3])
    wait_until(lambda: prefill.call(handoff.state, "o")[0], 10, "the offer released by the honest claim")
    assert prefill.call(handoff.state, "o") == (True, "claimed")


@only("cpu-tcp")
def test_a_stranger_squatting_the_prefills_id_before_the_prefill_dials_neither_fails_nor_serves_the_claim(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Fix 3: a stranger links to the decoder as the prefill's cluster id (1) first and aborts the
    request id; then the real prefill dials the decoder (no secret) and the decoder claims. The
    claim lands the offer's bytes from the real prefill and releases it "claimed"; the stranger's
    abort fails nothing, and the stranger's link is no longer one of the decoder's."""
    prefill, _ = listening_victim(peers, variant, ROWS, ROW)
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    decoder = peers("decoder", env=variant.env())
    dport = decoder.call(native.start, 2, listen=True)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    a = peers("attacker")
    i = a.call(round9b.link_from, dport, 1, hostile.ATTACKER_IP)
    assert a.call(round9.exchange, i, _abort(b"req", b"spoofed")) == (0, "", b"")
    prefill.call(native.connect, dport, 2)
    claim_lands(prefill, decoder, ticket)


@only("cpu-tcp")
def test_a_stream_of_hostile_tickets_to_a_silent_address_gives_back_every_thread_and_descriptor(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Fix 3's dial: 16 async claims of tickets naming 16 cluster ids at an address that accepts and
    never answers (after 4 that start the async pool's workers). Each dials (the silent listener
    accepted them) and fails LLM_LINK_FAILED at the dial's bound (``connect_timeout_ms``, 500 ms
    here: a claim's own ``timeout_ms`` does not bound its dial), and the decoder's threads, descriptors and links are
    back where they were."""
    attacker = peers("attacker")
    port = attacker.call(round9b.silent_listener)
    decoder = peers("decoder", env=variant.env())
    decoder.call(round9b.start_dialler, 2, 500)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    prefill, _ = listening_victim(peers, variant, ROWS, ROW)
    honest = prefill.call(handoff.offer, "o", "big", [1], "req")
    forged = [decoder.call(round9b.forge, honest, 1000 + n, f"{hostile.ATTACKER_IP}:{port}") for n in range(16)]

    def claim_all(tickets: list[object]) -> list[tuple[str, str | None]]:
        for n, t in enumerate(tickets):
            decoder.call(handoff.claim_async, f"c{n}", t, "dst", [n % ROWS])
        return [decoder.call(handoff.finish, f"c{n}", 60) for n in range(len(tickets))]

    claim_all(forged[:4])  # the async pool's workers, which stay, started
    base = decoder.call(round9.resources)
    outcomes = claim_all(forged)
    assert outcomes == [("FAILED", "LLM_LINK_FAILED")] * 16, outcomes
    assert attacker.call(round9b.accepted) >= 16
    wait_until(lambda: decoder.call(round9.resources) == base, 15, f"threads and descriptors back to {base}")
    assert decoder.call(round9b.link_clusters) == []


@only("cpu-tcp")
def test_commits_with_a_wrong_generation_or_repeated_release_once_and_keep_the_link(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Fix 4: from the bound link, a commit with a wrong generation releases nothing; the right one
    releases the offer "claimed"; the same commit twice more, and a commit naming an offer id never
    made, change nothing and keep the link; ``released()`` holds exactly one record."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    a = peers("attacker")
    i = a.call(round9b.link_from, port, 9, hostile.ATTACKER_IP)
    assert a.call(round9.exchange, i, _read(ticket))[0] == 0
    a.call(round9.send, i, _commit(ticket, generation_xor=1))
    assert a.call(round9.exchange, i, PING) == (0, "", b"")
    assert victim.call(handoff.state, "o") == (False, None)
    for _ in range(3):
        a.call(round9.send, i, _commit(ticket))
    a.call(round9.send, i, rawwire.request(rawwire.OP_COMMIT, rawwire.offer_body(KEY, 99999, 1)))
    assert a.call(round9.exchange, i, PING) == (0, "", b"")
    wait_until(lambda: victim.call(handoff.state, "o")[0], 10, "the offer released by the commit")
    assert victim.call(handoff.state, "o") == (True, "claimed")
    assert victim.call(round9b.released_records) == [(9, "req", "claimed")]
    assert victim.call(round9.live_offers) == 0


@only("cpu-tcp")
@pytest.mark.parametrize("version", [8, 9, rawwire.VERSION + 1])
def test_a_peer_of_another_wire_version_is_refused_with_both_versions_named(
        peers: Callable[..., Peer], variant: Variant, version: int) -> None:
    """Wire v10: a hello of v8, v9 (or v11) is refused at the handshake, the reason naming both the
    peer's version and this engine's; no link is made."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    a = peers("attacker")
    status, message = a.call(round9b.old_hello, port, version)
    assert status != 0, message
    assert f"this engine speaks pdlink protocol {rawwire.VERSION}, the dialler {version}" in message, message
    assert victim.call(round9b.link_clusters) == []


@only("cpu-tcp")
def test_handoff_frames_and_offer_reads_before_any_offer_exists(peers: Callable[..., Peer],
                                                                variant: Variant) -> None:
    """Wire v9: a peer sends op 13 (holds of guessed offers, an abort) and kOffer reads and commits to
    an engine that never made an offer: the reads are refused LLM_OFFER_RELEASED with nothing
    answered, the link kept, the abort queued; once the link closes the victim's threads and
    descriptors are back where they were and no offer is live."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    base = victim.call(round9.resources)
    a = peers("attacker")
    i = a.call(round9b.link_from, port, 9, hostile.ATTACKER_IP)
    hold = rawwire.request(rawwire.OP_HANDOFF, rawwire.hold_body([(1, 1), (0, 0), (2**64 - 1, 2**64 - 1)]))
    assert a.call(round9.exchange, i, hold) == (0, "", b"")
    read = rawwire.request(rawwire.OP_READ, rawwire.offer_body(KEY, 1, 0, runs=((0, ROW),), block_size=ROW))
    answer = a.call(round9.exchange, i, read)
    assert isinstance(answer, tuple) and answer[0] == LLMStatusCode.LLM_OFFER_RELEASED, answer
    assert answer[2] == b"", answer
    a.call(round9.send, i, rawwire.request(rawwire.OP_COMMIT, rawwire.offer_body(KEY, 1, 0)))
    assert a.call(round9.exchange, i, _abort(b"early")) == (0, "", b"")
    assert a.call(round9.exchange, i, PING) == (0, "", b"")
    assert victim.call(round9.handoff_events) == [("aborted", 9, "early", "")]
    a.call(round9.close, i)
    wait_until(lambda: victim.call(round9.resources) == base, 10, f"threads and descriptors back to {base}")
    assert victim.call(round9.live_offers) == 0


@only("cpu-tcp")
def test_a_process_that_exits_right_after_an_offer_is_released_exits_cleanly(variant: Variant) -> None:
    """An application that made an offer and exits without ``engine.close()`` just after the offer
    is released (here by its own abort; a peer's abort, a commit or a link's death wake the handoff
    thread the same way) must exit with status 0. Twelve runs, each its own interpreter."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    codes = []
    for _ in range(12):
        run = subprocess.run([sys.executable, "-m", "peers.round9b"], cwd=here, capture_output=True, text=True,
                             timeout=60)
        codes.append((run.returncode, run.stderr.strip()[-80:]))
    assert codes == [(0, "")] * 12, codes


@only("cpu-tcp")
@pytest.mark.parametrize("noise", [0, 64])
def test_an_abort_flood_from_a_stranger_does_not_make_the_decoder_forget_the_prefills_abort(
        peers: Callable[..., Peer], variant: Variant, noise: int) -> None:
    """native_api.md: an abort "fails its claims of that request id over the link the abort arrived
    on ... when the abort arrived before the claim returned (a decoder may abort a ticket it has
    not claimed yet)". The decoder (max_handoff_events 64) dials the prefill; the prefill aborts
    "req" to it, then offers "req" again (a retry). A stranger linked to the decoder sends
    ``noise`` aborts of other request ids (within its own event share: 16 queued). The decoder's
    claim of the ticket must fail LLM_OFFER_RELEASED, landing nothing (with no noise it does)."""
    prefill, pport = listening_victim(peers, variant, ROWS, ROW)
    decoder = peers("decoder", env=variant.env())
    dport = decoder.call(native.start, 2, listen=True, limits={"max_handoff_events": 64})
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    before = decoder.call(native.snapshot, "dst")
    decoder.call(native.connect, pport, 1)
    prefill.call(handoff.abort, "req", 2, "gone")
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    a = peers("attacker")
    i = a.call(round9b.link_from, dport, 9, hostile.ATTACKER_IP)
    assert a.call(round9.flood, i, [_abort(b"noise-%d" % k) for k in range(noise)]) == [0] * noise
    assert decoder.call(handoff.stats)["handoff_events_dropped"] == max(0, noise - 16)
    with pytest.raises(Exception) as e:
        decoder.call(handoff.claim, ticket, "dst", [3])
    assert getattr(e.value, "status_code", None) == LLMStatusCode.LLM_OFFER_RELEASED, e.value
    assert_same(decoder.call(native.snapshot, "dst"), before, "the decoder's region after the failed claim")


@only("cpu-tcp")
def test_a_hostile_tickets_dial_does_not_capture_the_real_prefills_later_claims(peers: Callable[..., Peer],
                                                                             variant: Variant) -> None:
    """Fix 3's dial, as a router that passes one forged ticket would: the ticket names the prefill's
    cluster id (1) and the attacker's address (a server that answers a hello as whatever cluster it
    is dialled as, and reads with 0x5a bytes). The decoder claims it (it lands the attacker's bytes:
    the ticket was the attacker's). Then the decoder claims the real prefill's ticket (cluster 1,
    the prefill's address): it must land the prefill's bytes and release the offer "claimed", and
    the attacker must see no read of it."""
    prefill, _ = listening_victim(peers, variant, ROWS, ROW)
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    attacker = peers("attacker")
    aport = attacker.call(hostile.serve, "read_exact")
    decoder = peers("decoder", env=variant.env())
    decoder.call(native.start, 2)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    forged = decoder.call(round9b.forge, ticket, None, f"{hostile.ATTACKER_IP}:{aport}")
    decoder.call(handoff.claim, forged, "dst", [2])
    reads_before = sum(o.get("op") == rawwire.OP_READ for o in attacker.call(hostile.observed))
    assert reads_before >= 1
    decoder.call(handoff.claim, ticket, "dst", [3])
    reads_after = sum(o.get("op") == rawwire.OP_READ for o in attacker.call(hostile.observed))
    src, dst = prefill.call(native.snapshot, "big"), decoder.call(native.snapshot, "dst")
    assert (reads_after - reads_before, bytes(dst.tensor(0)[3 * ROW:4 * ROW]) == bytes(src.tensor(0)[ROW:2 * ROW])) \
        == (0, True)
    # the commit is one-way: the prefill releases the offer when it reads it
    wait_until(lambda: prefill.call(handoff.state, "o")[0], 10, "the offer released by the honest claim")
    assert prefill.call(handoff.state, "o") == (True, "claimed")


SECRET = "round-9b-secret"
UNTRUSTED_TICKETS = ("round 9b, documented (docs/security.md, \"KV handoffs\"): a ticket is the application's data; "
                     "without a link secret the decoder believes the cluster id a ticket's address answers as")


@only("cpu-tcp")
@pytest.mark.parametrize("secret", [pytest.param(None, marks=pytest.mark.xfail(strict=True, reason=UNTRUSTED_TICKETS)),
                                    SECRET], ids=["no secret", "secret"])
def test_a_stream_of_hostile_tickets_cannot_fill_the_decoders_link_table(peers: Callable[..., Peer],
                                                                        variant: Variant, secret: str | None) -> None:
    """Fix 3's dial, bounded? The decoder (MaxLinks 4) claims four tickets naming four cluster ids
    at the attacker's address (a server that answers as whatever cluster it is dialled as). Then the
    decoder claims the real prefill's ticket: it must land the prefill's bytes (the hostile tickets'
    links must not keep the decoder from linking to an honest prefill). Without a link secret each
    forged claim dials and keeps a link (documented: tickets are trusted); with one every forged
    dial fails at the handshake (the attacker cannot prove the secret), leaving no link."""
    prefill = peers("victim", env=variant.env())
    prefill.call(native.start, 1, listen=True, secret=secret)
    prefill.call(native.register, "big", ROWS, ROW, seed=1, key=7)
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    attacker = peers("attacker")
    aport = attacker.call(hostile.serve, "read_exact")
    decoder = peers("decoder", env=variant.env())
    decoder.call(native.start, 2, limits={"max_links": 4}, secret=secret)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    outcomes = [decoder.call(round9b.claim_outcome, decoder.call(round9b.forge, ticket, 1000 + n,
                                                                  f"{hostile.ATTACKER_IP}:{aport}"), "dst", [n], 3000)
                for n in range(4)]
    assert outcomes == ["LinkError LLM_LINK_FAILED"] * 4 and decoder.call(round9b.link_clusters) == [], outcomes
    decoder.call(handoff.claim, ticket, "dst", [5])
    src, dst = prefill.call(native.snapshot, "big"), decoder.call(native.snapshot, "dst")
    assert bytes(dst.tensor(0)[5 * ROW:6 * ROW]) == bytes(src.tensor(0)[ROW:2 * ROW])
    wait_until(lambda: prefill.call(handoff.state, "o")[0], 10, "the offer released by the honest claim")
    assert prefill.call(handoff.state, "o") == (True, "claimed")


@only("cpu-tcp")
def test_with_the_decoder_dialled_by_the_prefill_a_stranger_cannot_squat_and_the_prefills_abort_holds(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Fix 3 as the brief puts it: the real prefill dials the decoder (no secret), so the decoder's
    only link to cluster 1 is an accepted one. A stranger linking to the decoder as cluster 1 is
    refused (that link is healthy). The prefill aborts "req" to the decoder over its link and offers
    "req" again: the decoder's claim (which must dial the ticket's address, the accepted link being
    only a claim) still fails LLM_OFFER_RELEASED, landing nothing; a claim of another request id
    over the same route lands and releases its offer "claimed"."""
    prefill, _ = listening_victim(peers, variant, ROWS, ROW)
    decoder = peers("decoder", env=variant.env())
    dport = decoder.call(native.start, 2, listen=True)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    before = decoder.call(native.snapshot, "dst")
    prefill.call(native.connect, dport, 2)
    stranger = peers("stranger")
    status, message = stranger.call(hostile.link_raw, dport, 1)
    assert status != 0, message
    prefill.call(handoff.abort, "req", 2, "gone")
    aborted = prefill.call(handoff.offer, "o", "big", [1], "req")
    with pytest.raises(Exception) as e:
        decoder.call(handoff.claim, aborted, "dst", [3])
    assert getattr(e.value, "status_code", None) == LLMStatusCode.LLM_OFFER_RELEASED, e.value
    assert_same(decoder.call(native.snapshot, "dst"), before, "the decoder's region after the failed claim")
    other = prefill.call(handoff.offer, "p", "big", [2], "req-2")
    decoder.call(handoff.claim, other, "dst", [4])
    wait_until(lambda: prefill.call(handoff.state, "p")[0], 10, "the other offer released by its claim")
    assert prefill.call(handoff.state, "p") == (True, "claimed")


@only("cpu-tcp")
def test_links_that_abort_and_die_give_back_their_descriptors_and_threads(peers: Callable[..., Peer],
                                                                         variant: Variant) -> None:
    """Remembered aborts are kept by link (fix 3): does a dead link stay alive through them? Twenty
    raw links, one after the other (cluster ids 200..219), each send one abort and close. Every abort
    was answered and queued (the source's newest quarter: 16 of 64 kept); once they are gone the
    victim's threads and descriptors are back where they were."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True, limits={"max_handoff_events": 64})
    base = victim.call(round9.resources)
    a = peers("attacker")
    for n in range(20):
        i = a.call(round9b.link_from, port, 200 + n, hostile.ATTACKER_IP)
        assert a.call(round9.exchange, i, _abort(b"churn-%d" % n)) == (0, "", b"")
        a.call(round9.close, i)
    wait_until(lambda: victim.call(round9.resources) == base, 15, f"threads and descriptors back to {base}")
    assert victim.call(handoff.stats)["handoff_events_dropped"] == 4
    assert victim.call(round9.handoff_events) == [("aborted", 200 + n, "churn-%d" % n, "") for n in range(4, 20)]


BAD_ADDRESSES = ["", "127.0.0.1", "127.0.0.1:99999", "127.0.0.1:-1", "[::1]:1", "a" * 4096 + ":1",
                 "127.0.0.1:1:2", "256.1.1.1:80", "127.0.0.1:0", "\x00:1"]


@only("cpu-tcp")
def test_tickets_naming_odd_addresses_or_the_decoder_itself_fail_and_leave_the_decoder_serving(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Fix 3's dial with hostile addresses: tickets of an unknown cluster id (7) whose address is
    empty, has no port, a port out of range, IPv6, 4 KiB of name, extra colons, a bad IPv4 or a NUL,
    and tickets naming the decoder's own address (as cluster 7, and as its own cluster id 2). Each
    claim raises an LLMException or a ValueError with nothing landed; afterwards the decoder
    holds no link but its prefill's (none), and a claim of the honest ticket lands."""
    prefill, _ = listening_victim(peers, variant, ROWS, ROW)
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    decoder = peers("decoder", env=variant.env())
    dport = decoder.call(native.start, 2, listen=True)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    before = decoder.call(native.snapshot, "dst")
    cases = [(7, address) for address in BAD_ADDRESSES] + [(7, f"127.0.0.1:{dport}"), (2, f"127.0.0.1:{dport}")]
    outcomes = {}
    for cluster, address in cases:
        forged = decoder.call(round9b.forge, ticket, cluster, address)
        outcomes[(cluster, address[:20])] = decoder.call(round9b.claim_outcome, forged, "dst", [3], 2000)
    assert all(o != "ok" and (o.startswith(("LinkError", "LLMException", "OfferReleased", "InvalidArgument"))
                              or o == "ValueError") for o in outcomes.values()), outcomes
    assert_same(decoder.call(native.snapshot, "dst"), before, "the decoder's region after the failed claims")
    assert decoder.call(round9b.link_clusters) == []
    decoder.call(handoff.claim, ticket, "dst", [3])
    wait_until(lambda: prefill.call(handoff.state, "o")[0], 10, "the offer released by the honest claim")
    assert prefill.call(handoff.state, "o") == (True, "claimed")


@only("cpu-cma")
def test_one_user_from_several_processes_over_af_unix_is_one_source(peers: Callable[..., Peer],
                                                                    variant: Variant) -> None:
    """Fix 2 on a same-host cell (where the victim takes only same-host links): two attacker
    processes of one user link over the victim's AF_UNIX name, five links in all (cluster ids
    100..104), each filling its quarter (16 of 64). All five are one uid, one source: it keeps its
    newest 16, the rest counted dropped, and the honest peer's event (a link the victim dialled)
    stays."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True, limits={"max_handoff_events": 64})
    _honest_told(peers, variant, victim)
    procs = [peers("attacker-a"), peers("attacker-b")]
    links = []
    for n in range(5):
        p = procs[n % 2]
        unix = p.call(hostile.redirect_name, port, 100 + n)
        assert unix, "no same-host redirect"
        links.append((p, p.call(round9.link, port, 100 + n, unix)))
    for n, (p, i) in enumerate(links):
        assert p.call(round9.flood, i, [_abort(b"f-%d-%d" % (n, k)) for k in range(16)]) == [0] * 16
    assert victim.call(handoff.stats)["handoff_events_dropped"] == 5 * 16 - 16
    assert victim.call(round9.handoff_events) == [("aborted", 50, "honest", "why")] + [
        ("aborted", 104, "f-4-%d" % k, "") for k in range(16)]


@only("cpu-tcp")
def test_a_claim_that_dials_a_v8_engine_fails_naming_both_versions(peers: Callable[..., Peer],
                                                                   variant: Variant) -> None:
    """Wire v9 from the dialling side: the ticket's address is an engine that acks in wire v8. The
    claim fails (its message names both versions), nothing lands, and the decoder holds no link."""
    prefill, _ = listening_victim(peers, variant, ROWS, ROW)
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    attacker = peers("attacker")
    aport = attacker.call(hostile.serve, "ack_other_version", version=8)
    decoder = peers("decoder", env=variant.env())
    decoder.call(native.start, 2)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    before = decoder.call(native.snapshot, "dst")
    forged = decoder.call(round9b.forge, ticket, 5, f"{hostile.ATTACKER_IP}:{aport}")
    message = decoder.call(round9b.claim_message, forged, "dst", [3], 3000)
    assert f"the peer speaks pdlink protocol 8, this engine {rawwire.VERSION}" in message, message
    assert_same(decoder.call(native.snapshot, "dst"), before, "the decoder's region after the failed claim")
    assert decoder.call(round9b.link_clusters) == []


@only("cpu-tcp")
def test_a_peer_linked_as_cluster_zero_is_told_apart_from_no_bound_link(peers: Callable[..., Peer],
                                                                        variant: Variant) -> None:
    """native_api.md: a released record's ``peer`` is the cluster id of the bound link, ``None`` for
    an offer never bound. A raw peer links as cluster 0 (an id llm_datadist programs use) and claims
    an offer (a read, then its commit): its record says 0; an offer released unbound says None, so
    the application can tell the two apart (round 9b found both were 0)."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req")
    victim.call(handoff.offer, "u", "big", [2], "unbound")
    a = peers("attacker")
    i = a.call(round9b.try_link_from, port, 0, hostile.ATTACKER_IP)
    assert isinstance(i, int), i
    assert a.call(round9.exchange, i, _read(ticket))[0] == 0
    a.call(round9.send, i, _commit(ticket))
    assert a.call(round9.exchange, i, PING) == (0, "", b"")
    wait_until(lambda: victim.call(handoff.state, "o")[0], 10, "the offer released by the commit")
    victim.call(handoff.release, "u")
    wait_until(lambda: victim.call(handoff.state, "u")[0], 10, "the unbound offer released")
    assert victim.call(round9b.released_records) == [(0, "req", "claimed"), (None, "unbound", "released")]


@only("cpu-tcp")
def test_a_hostile_tickets_dial_does_not_drop_the_genuine_prefills_link(peers: Callable[..., Peer],
                                                                       variant: Variant) -> None:
    """The real prefill (cluster 1) dialled the decoder: the decoder's only link to cluster 1 is
    that accepted one. A forged ticket (the real offer, cluster 1, the attacker's address: a server
    that answers as whatever cluster it is dialled as) is claimed: the decoder dials the attacker,
    which cannot confirm the accepted link (kConfirm), and the decoder lets the attacker's link go.
    Held: the genuine link survives (the decoder still holds its accepted link to cluster 1, the
    prefill's is not broken), the claim reads the real offer over it, landing the prefill's bytes
    and releasing the offer "claimed", and the attacker served no read."""
    prefill, _ = listening_victim(peers, variant, ROWS, ROW)
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    attacker = peers("attacker")
    aport = attacker.call(hostile.serve, "read_exact")
    decoder = peers("decoder", env=variant.env())
    dport = decoder.call(native.start, 2, listen=True)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    prefill.call(native.connect, dport, 2)
    assert decoder.call(round9b.link_clusters) == [(1, False)]
    forged = decoder.call(round9b.forge, ticket, None, f"{hostile.ATTACKER_IP}:{aport}")
    assert decoder.call(round9b.claim_outcome, forged, "dst", [2], 3000) == "ok"
    seen = attacker.call(hostile.observed)
    assert any(o.get("event") == "hello" for o in seen), seen
    assert not any(o.get("op") == rawwire.OP_READ for o in seen), seen
    assert decoder.call(round9b.link_clusters) == [(1, False)]
    assert prefill.call(round9b.link_clusters) == [(2, True)]
    src, dst = prefill.call(native.snapshot, "big"), decoder.call(native.snapshot, "dst")
    assert bytes(dst.tensor(0)[2 * ROW:3 * ROW]) == bytes(src.tensor(0)[ROW:2 * ROW])
    wait_until(lambda: prefill.call(handoff.state, "o")[0], 10, "the offer released by the claim")
    assert prefill.call(handoff.state, "o") == (True, "claimed")


@only("cpu-tcp")
@pytest.mark.parametrize("secret", [None, SECRET], ids=["no secret", "secret"])
def test_a_hostile_ticket_whose_server_denies_the_genuine_link_does_not_keep_the_prefills_claims(
        peers: Callable[..., Peer], variant: Variant, secret: str | None) -> None:
    """The genuine prefill dialled the decoder; a forged ticket (its offer, the attacker's address: a
    server that refuses every request, the kConfirm that asks whether the decoder's accepted link of
    cluster 1 is its own included) is claimed first. Without a link secret the decoder believes the
    engine at the ticket's address (documented: tickets are trusted): it drops the accepted link as
    an impostor's and keeps the attacker's; but a claim reads from the engine at the address its
    ticket names, so the prefill's honest ticket that follows drops that link, dials the prefill and
    lands its bytes, releasing its offer "claimed". With a link secret the accepted link proves the
    prefill's identity: the forged ticket dials nobody (it reads the real offer over the genuine
    link), the link stays, and the honest claim lands over it."""
    prefill = peers("victim", env=variant.env())
    prefill.call(native.start, 1, listen=True, secret=secret)
    prefill.call(native.register, "big", ROWS, ROW, seed=1, key=7)
    ticket = prefill.call(handoff.offer, "o", "big", [1], "req")
    other = prefill.call(handoff.offer, "p", "big", [2], "req-2")
    attacker = peers("attacker")
    aport = attacker.call(hostile.serve, "refuse_everything")
    decoder = peers("decoder", env=variant.env())
    dport = decoder.call(native.start, 2, listen=True, secret=secret)
    decoder.call(native.register, "dst", ROWS, ROW, seed=2)
    prefill.call(native.connect, dport, 2)
    forged = decoder.call(round9b.forge, ticket, None, f"{hostile.ATTACKER_IP}:{aport}")
    forged_outcome = decoder.call(round9b.claim_outcome, forged, "dst", [2], 3000)
    seen = attacker.call(hostile.observed)
    if secret is None:
        assert any(o.get("op") == rawwire.OP_CONFIRM for o in seen), seen
        assert decoder.call(round9b.link_clusters) == [(1, True)]  # the attacker's
    else:
        assert (forged_outcome, seen, decoder.call(round9b.link_clusters)) == ("ok", [], [(1, False)])
    reads = sum(o.get("op") == rawwire.OP_READ for o in attacker.call(hostile.observed))
    outcome = decoder.call(round9b.claim_outcome, other, "dst", [4], 3000)
    assert outcome == "ok"
    assert decoder.call(round9b.link_clusters) == ([(1, True)] if secret is None else [(1, False)])
    assert sum(o.get("op") == rawwire.OP_READ for o in attacker.call(hostile.observed)) == reads  # none of it
    src, dst = prefill.call(native.snapshot, "big"), decoder.call(native.snapshot, "dst")
    assert bytes(dst.tensor(0)[4 * ROW:5 * ROW]) == bytes(src.tensor(0)[2 * ROW:3 * ROW])
    wait_until(lambda: prefill.call(handoff.state, "p")[0], 10, "the other offer released by its claim")
    assert prefill.call(handoff.state, "p") == (True, "claimed")

"""KV handoffs from a raw peer on the wire (wire v9's kOffer target and kHandoff frame; docs/security.md,
"Handoffs"): a read of an offer with a wrong generation, an unknown id, runs outside its blocks, a
tensor it does not have, or from another link than the one it is bound to, is refused (the link
kept, nothing moved); a write to an offer is refused with its payload consumed; a malformed kHandoff
body drops the link, a hold naming 2**32 - 1 offers or more than the bound included, before anything
is allocated for it; a well-formed hold or abort of offers that are not there changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import rawwire
from backend_env import Variant
from conftest import only
from pdlink import LLMStatusCode
from peer import Peer
from peers import handoff, hostile, native
from poll import wait_until
from review_kit import PING, listening_victim, raw_linked, refused_kept
from verify import assert_same

S = LLMStatusCode
ROWS, ROW, KEY = 8, 256, 7
MAX_HOLD_OFFERS = 1 << 16  # limits::kMaxHoldOffers

pytestmark = pytest.mark.one_host("a raw attacker process talks to the victim")


def _read(ticket: object, runs=((ROW, ROW),), tensors=(0,), generation: int | None = None,
          offer_id: int | None = None) -> bytes:
    body = rawwire.offer_body(KEY, ticket.offer_id if offer_id is None else offer_id,  # type: ignore[attr-defined]
                              ticket.generation if generation is None else generation,  # type: ignore[attr-defined]
                              runs=runs, tensors=tensors, block_size=ROW)
    return rawwire.request(rawwire.OP_READ, body)


@only("cpu-tcp", "cpu-cma")
def test_reads_of_an_offer_are_checked_and_refusals_keep_the_link(peers: Callable[..., Peer],
                                                                  variant: Variant) -> None:
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1, 2], "req")
    before = victim.call(native.snapshot, "big")
    a = raw_linked(peers, variant, port, 9)
    refused_kept(a, _read(ticket, generation=ticket.generation ^ 1), S.LLM_OFFER_RELEASED)
    refused_kept(a, _read(ticket, offer_id=ticket.offer_id + 1), S.LLM_OFFER_RELEASED)
    for runs in (((0, ROW),), ((ROW, 3 * ROW),), ((2 * ROW + 8, ROW),), ((3 * ROW, 1),)):
        text = refused_kept(a, _read(ticket, runs=runs), S.LLM_OFFER_RELEASED)
        assert "outside offer" in text, text
    refused_kept(a, _read(ticket, tensors=(1,)), S.LLM_PARAM_INVALID)
    refused_kept(a, _read(ticket, runs=((ROWS * ROW, ROW),)), S.LLM_PARAM_INVALID)
    write = rawwire.offer_body(KEY, ticket.offer_id, ticket.generation, runs=((ROW, 16),), block_size=ROW)
    text = refused_kept(a, rawwire.request(rawwire.OP_WRITE, write, 16) + b"\xa5" * 16, S.LLM_PARAM_INVALID)
    assert "read only" in text, text
    assert victim.call(handoff.state, "o") == (False, None)
    # a read inside the offer is served (on a same-host link as a direct read: addresses, not bytes),
    # and binds the offer to this link: another link's read is refused, nothing moved
    if not variant.same_host:
        assert a.call(hostile.exchange, _read(ticket, runs=((ROW, 2 * ROW),))) == (
            0, "", bytes(before.tensor(0)[ROW:3 * ROW]))
    else:
        a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, rawwire.offer_body(
            KEY, ticket.offer_id, ticket.generation, runs=((ROW, ROW),), block_size=ROW), flags=rawwire.FLAG_DIRECT))
    assert a.call(hostile.exchange, PING) == (0, "", b"")
    b = raw_linked(peers, variant, port, 10)
    text = refused_kept(b, _read(ticket), S.LLM_OFFER_RELEASED)
    assert "another link" in text, text
    # a commit from the other link does not release it; the bound link's does
    b.call(hostile.send, rawwire.request(rawwire.OP_COMMIT, rawwire.offer_body(KEY, ticket.offer_id,
                                                                                 ticket.generation)))
    assert b.call(hostile.exchange, PING) == (0, "", b"")
    assert victim.call(handoff.state, "o") == (False, None)
    a.call(hostile.send, rawwire.request(rawwire.OP_COMMIT, rawwire.offer_body(KEY, ticket.offer_id,
                                                                                 ticket.generation)))
    assert a.call(hostile.exchange, PING) == (0, "", b"")
    wait_until(lambda: victim.call(handoff.state, "o")[0], 10, "the offer released by its bound link's commit")
    assert victim.call(handoff.state, "o") == (True, "claimed")
    assert_same(victim.call(native.snapshot, "big"), before, "the victim's region after the attacks")


MALFORMED = {
    "empty": b"",
    "unknown kind": b"\x03",
    "kind 0": b"\x00\x00\x00",
    "abort cut short": rawwire.abort_body(b"req")[:4],
    "abort with trailing bytes": rawwire.abort_body(b"req", b"why") + b"\x00",
    "abort id past its bound": rawwire.abort_body(b"r" * 257),
    "abort reason past its bound": rawwire.abort_body(b"req", b"w" * 257),
    "abort id longer than the body": b"\x01\xff\x00abc",
    "hold count past its entries": rawwire.hold_body([(1, 2)], count=2),
    "hold count short of its entries": rawwire.hold_body([(1, 2), (3, 4)], count=1),
    "hold of 2**32 - 1 offers": rawwire.hold_body([], count=2**32 - 1),
    "hold past the bound": rawwire.hold_body([], count=MAX_HOLD_OFFERS + 1),
    "hold cut inside an entry": rawwire.hold_body([(1, 2)])[:-3],
}


@only("cpu-tcp", "cpu-cma")
@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_malformed_handoff_frame_drops_the_link(peers: Callable[..., Peer], variant: Variant, what: str) -> None:
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    victim.call(handoff.offer, "o", "big", [1], "req")
    a = raw_linked(peers, variant, port, 9)
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_HANDOFF, MALFORMED[what])) == "closed"
    assert victim.call(handoff.state, "o") == (False, None)
    assert victim.call(handoff.handoff_events) == []


@only("cpu-tcp", "cpu-cma")
def test_an_oversized_handoff_frame_is_dropped_before_its_body_is_read(peers: Callable[..., Peer],
                                                                       variant: Variant) -> None:
    """A header announcing a hold of 2**16 + 1 entries (past the frame's bound): the link is
    dropped on the header, nothing of the body read or allocated."""
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    a = raw_linked(peers, variant, port, 9)
    assert a.call(hostile.exchange, rawwire.request_header(rawwire.OP_HANDOFF, 5 + 16 * (MAX_HOLD_OFFERS + 1))) == \
        "closed"


@only("cpu-tcp", "cpu-cma")
def test_holds_and_aborts_of_offers_that_are_not_there_change_nothing(peers: Callable[..., Peer],
                                                                      variant: Variant) -> None:
    victim, port = listening_victim(peers, variant, ROWS, ROW)
    ticket = victim.call(handoff.offer, "o", "big", [1], "req", 400)
    a = raw_linked(peers, variant, port, 9)
    guesses = [(ticket.offer_id, ticket.generation ^ (1 << k)) for k in range(64)]
    guesses += [(ticket.offer_id + k, ticket.generation) for k in range(1, 64)]
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_HANDOFF, rawwire.hold_body(guesses))) == (0, "", b"")
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_HANDOFF, rawwire.abort_body(b"other"))) == (0, "", b"")
    # none of the guesses held it: it expires at its lease
    wait_until(lambda: victim.call(handoff.state, "o")[0], 20, "the offer expired")
    assert victim.call(handoff.state, "o") == (True, "expired")
    (event,) = victim.call(handoff.handoff_events)
    assert (event.kind, event.peer, event.request_id) == ("aborted", 9, "other")

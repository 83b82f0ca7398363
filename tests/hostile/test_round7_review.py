"""Hostile review, round 7: role epochs, the drain and the wire's epoch fence (issue 34), attacked
from docs/security.md ("Role epochs") and docs/architecture.md ("Roles") alone.

A victim ``pdlink.Engine`` (links survive its switches) is held in its drain by one raw peer that
asked for 8 MiB and reads none of it (the request stays in flight, ``served_in_flight`` 1); other
raw peers then probe what the drain admits, what it refuses, and whether they can hold the switch.
A raw peer sends a request whose reserved u16 is not zero. Claims and verdicts:

* while a switch drains, a linked peer's reads, writes (payload consumed), describes and path
  connects are refused
  with ``LLM_ROLE_SWITCHING``, the link kept; pings and notifications are still served; new links
  are refused; none of it is counted in the drain (held);
* a peer that keeps linking and requesting cannot hold a switch beyond ``drain_timeout_ms``, and
  the rolled-back switch changes nothing (held);
* a write whose payload is held half sent holds a switch only until its drain timeout (held);
* a request whose reserved u16 (wire v8) is not zero drops the link as malformed, nothing served
  (held);
* a request fenced by an old epoch stays refused after 65535 more switches (v7's u16 tag wrapped
  there and served it again; the u32 tag of v8 repeats only after 2^32 - 1) (held).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import rawwire
from backend_env import Variant
from conftest import only
from pdlink import LLMStatusCode
from peer import Peer
from peers import hostile, native, round7
from poll import wait_until
from review_kit import DEVICE, PING, ROOT_INFO, channel_body, listening_victim, raw_linked, refused_kept, setup
from verify import assert_same

S = LLMStatusCode
ROWS, ROW = 64, 128 * 1024  # the victim's region: 8 MiB, keyed 7
HOLD = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((0, ROWS * ROW),)))


_tag = rawwire.epoch_tag_of


def _victim(peers: Callable[..., Peer], variant: Variant) -> tuple[Peer, int]:
    return listening_victim(peers, variant, ROWS, ROW)


_linked = raw_linked


def _hold_a_drain(peers: Callable[..., Peer], variant: Variant, victim: Peer, port: int,
                  drain_timeout_ms: int) -> Peer:
    """A raw peer whose 8 MiB read stays in flight, then a switch to PROMPT started on the victim;
    returns the holder once the victim drains."""
    holder = _linked(peers, variant, port, 9)
    holder.call(hostile.send, HOLD)
    wait_until(lambda: victim.call(native.role_state)["served_in_flight"] == 1, 20, "the held read being served")
    victim.call(native.switch_role_async, "PROMPT", drain_timeout_ms=drain_timeout_ms)
    wait_until(lambda: victim.call(native.role_state)["phase"] == "draining", 20, "the victim draining")
    return holder


@only("cpu-tcp", "cpu-cma")
def test_a_drain_refuses_new_requests_keeps_the_link_and_serves_pings_and_notifications(
        peers: Callable[..., Peer], variant: Variant) -> None:
    victim, port = _victim(peers, variant)
    src = victim.call(native.snapshot, "big")
    a = _linked(peers, variant, port, 10)
    holder = _hold_a_drain(peers, variant, victim, port, drain_timeout_ms=30000)
    read = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((0, 64),)))
    assert "switch" in refused_kept(a, read, S.LLM_ROLE_SWITCHING)
    # a write's payload is a frame of an unknown op: were it not consumed with the refusal, the
    # victim would read it as the next frame and drop the link
    bogus = rawwire.request(0x55, b"")
    write = rawwire.request(rawwire.OP_WRITE, rawwire.blocks_body(model=7, runs=((64, len(bogus)),)), len(bogus))
    refused_kept(a, write + bogus, S.LLM_ROLE_SWITCHING)
    refused_kept(a, rawwire.request(rawwire.OP_DESCRIBE, read[rawwire.REQUEST_HEADER_BYTES:]), S.LLM_ROLE_SWITCHING)
    # a fenced read with a stale tag, and the server's own tag: the drain refuses both alike
    refused_kept(a, rawwire.request(rawwire.OP_READ, read[rawwire.REQUEST_HEADER_BYTES:], epoch_tag=_tag(0)),
                 S.LLM_ROLE_SWITCHING)
    # a path connect (a device channel's setup, which a CPU engine otherwise turns down) is gated too
    refused_kept(a, setup(DEVICE, channel_body(ROOT_INFO + 1)), S.LLM_ROLE_SWITCHING)
    assert a.call(hostile.exchange_header, PING) == (0, _tag(0))
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_NOTIFY, rawwire.notify_body(b"n", b"drain"))) == (
        0, "", b"")
    wait_until(lambda: any(n.message == b"drain" for n in victim.call(native.notifications)), 20,
               "the notification sent while draining")
    # a new link is refused while the victim drains
    status, message = peers("newcomer").call(hostile.link_raw, port, 11)
    assert status != 0, message
    state = victim.call(native.role_state)
    assert (state["phase"], state["served_in_flight"], state["pins"]) == ("draining", 1, 0), state
    holder.call(hostile.close)  # the only request admitted before the drain ends
    outcome, code, message, state = victim.call(native.switch_result)
    assert (outcome, state["role"], state["epoch"], state["phase"]) == ("ok", "PROMPT", 1, "ready"), message
    fresh = rawwire.request(rawwire.OP_READ, read[rawwire.REQUEST_HEADER_BYTES:], epoch_tag=_tag(1))
    assert a.call(hostile.exchange, fresh) == (0, "", bytes(src.tensor(0)[:64]))
    assert_same(victim.call(native.snapshot, "big"), src, "the victim's region after refused writes")


@only("cpu-tcp", "cpu-cma")
def test_a_peer_that_keeps_linking_and_requesting_holds_a_switch_only_until_its_drain_timeout(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """One peer asks for 64 bytes again and again, another dials new links again and again, while a
    third holds the drain: the switch rolls back at its 1.5 s drain timeout naming only the held
    request; role, epoch and phase as before; the loops saw refusals, never a dropped link; once the
    holder is gone nothing is left counted and the next switch commits."""
    victim, port = _victim(peers, variant)
    src = victim.call(native.snapshot, "big")
    requester = _linked(peers, variant, port, 10)
    read = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((128, 64),)))
    holder = _hold_a_drain(peers, variant, victim, port, drain_timeout_ms=1500)
    dialler = peers("dialler")
    requester.call(hostile.start_request_loop, read)
    dialler.call(round7.start_link_loop, port)
    outcome, code, message, state = victim.call(native.switch_result)
    assert (outcome, code) == ("TransferTimeout", S.LLM_TIMEOUT), message
    assert "1 served requests" in message and "rolled back" in message, message
    assert (state["role"], state["epoch"], state["phase"]) == ("MIX", 0, "ready")
    requests = requester.call(hostile.stop_request_loop)
    links = dialler.call(round7.stop_link_loop)
    assert int(S.LLM_ROLE_SWITCHING) in requests, requests
    assert set(requests) <= {0, int(S.LLM_ROLE_SWITCHING)}, requests
    assert any(status != 0 for status in links), links
    holder.call(hostile.close)
    wait_until(lambda: victim.call(native.role_state)["served_in_flight"] == 0, 20, "the held read over")
    state = victim.call(native.role_state)
    assert (state["transfers_in_flight"], state["pins"]) == (0, 0), state
    assert victim.call(native.switch_role, "PROMPT", True, 0, 5000)["epoch"] == 1
    assert requester.call(hostile.exchange, read) == (0, "", bytes(src.tensor(0)[128:192]))
    assert_same(victim.call(native.snapshot, "big"), src, "the victim's region")


@only("cpu-tcp", "cpu-cma")
def test_a_write_held_half_sent_holds_a_switch_only_until_its_drain_timeout(peers: Callable[..., Peer],
                                                                           variant: Variant) -> None:
    """A raw peer announces a 64 KiB write and sends 16 bytes of it: the switch rolls back at its
    300 ms drain timeout (role, epoch, phase unchanged); once the peer is gone it commits."""
    victim, port = _victim(peers, variant)
    a = _linked(peers, variant, port, 9)
    n = 64 * 1024
    a.call(hostile.send, rawwire.request(rawwire.OP_WRITE, rawwire.blocks_body(model=7, runs=((0, n),)), n)
           + b"\xa5" * 16)
    wait_until(lambda: victim.call(native.role_state)["served_in_flight"] == 1, 20, "the write being served")
    victim.call(native.switch_role_async, "PROMPT", drain_timeout_ms=300)
    outcome, code, message, state = victim.call(native.switch_result)
    assert (outcome, code) == ("TransferTimeout", S.LLM_TIMEOUT), message
    assert (state["role"], state["epoch"], state["phase"]) == ("MIX", 0, "ready")
    a.call(hostile.close)
    wait_until(lambda: victim.call(native.role_state)["served_in_flight"] == 0, 20, "the held write over")
    assert victim.call(native.switch_role, "PROMPT", True, 0)["epoch"] == 1


@only("cpu-tcp", "cpu-cma")
@pytest.mark.parametrize("reserved", [1, 0x100, 0xFFFF])
def test_a_request_with_a_non_zero_reserved_u16_drops_the_link(peers: Callable[..., Peer], variant: Variant,
                                                               reserved: int) -> None:
    """A raw peer's read (with the victim's own tag, which alone would be served) whose reserved u16
    at offset 6 is not zero: the victim drops the link as malformed without answering, and serves a
    fresh link the same read."""
    victim, port = _victim(peers, variant)
    src = victim.call(native.snapshot, "big")
    body = rawwire.blocks_body(model=7, runs=((0, 64),))
    a = _linked(peers, variant, port, 9)
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body, epoch_tag=_tag(0), reserved=reserved)) == (
        "closed")
    b = _linked(peers, variant, port, 10)
    assert b.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body, epoch_tag=_tag(0))) == (
        0, "", bytes(src.tensor(0)[:64]))
    assert_same(victim.call(native.snapshot, "big"), src, "the victim's region")


@only("cpu-tcp")
def test_a_request_fenced_by_an_old_epoch_stays_refused_after_the_tag_wraps(peers: Callable[..., Peer],
                                                                           variant: Variant) -> None:
    """A raw peer fences a read with epoch 0's tag; the victim commits 65535 switches (links survive
    them, the listener given up). The docs: a request made against an old epoch is refused after a
    switch with LLM_STALE_EPOCH. With v7's tag (1 + epoch % 65535) epoch 65535's tag was epoch 0's
    again and the read was served; v8's tag is 65536 there."""
    victim, port = _victim(peers, variant)
    a = _linked(peers, variant, port, 9)
    read = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((0, 64),)), epoch_tag=_tag(0))
    assert victim.call(round7.switch_many, 1)["epoch"] == 1
    refused_kept(a, read, S.LLM_STALE_EPOCH)  # one epoch on: refused
    assert victim.call(round7.switch_many, 65534)["epoch"] == 65535
    assert a.call(hostile.exchange_header, PING) == (0, 65536)  # v7's tag was 1 (epoch 0's) here
    refused_kept(a, read, S.LLM_STALE_EPOCH)


DIRECT = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((0, 4096),)), flags=rawwire.FLAG_DIRECT)


def _pinned(peers: Callable[..., Peer], variant: Variant) -> tuple[Peer, Peer]:
    """A victim (PinTimeoutMs 2000) and a same-host raw peer whose direct read pinned its region."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True, limits={"pin_timeout_ms": 2000})
    victim.call(native.register, "big", ROWS, ROW, seed=1, key=7)
    a = _linked(peers, variant, port, 9)
    answer = a.call(hostile.exchange, DIRECT)
    assert isinstance(answer, tuple) and answer[0] == 0, answer
    wait_until(lambda: victim.call(native.role_state)["pins"] == 1, 5, "the direct read's pin counted")
    return victim, a


@only("cpu-cma")
def test_a_silent_pin_holds_a_switch_only_until_the_pin_timeout(peers: Callable[..., Peer],
                                                                variant: Variant) -> None:
    """A peer pins the victim's region with a direct read and goes silent: the switch (drain timeout
    20 s) drains while the pin is held, and commits once the 2 s pin timeout freed it, not at its
    drain timeout."""
    victim, a = _pinned(peers, variant)
    victim.call(native.switch_role_async, "PROMPT", drain_timeout_ms=20000)
    wait_until(lambda: victim.call(native.role_state)["phase"] == "draining", 20, "the victim draining")
    assert victim.call(native.role_state)["pins"] == 1  # the pin is what the drain waits for
    outcome, code, message, state = victim.call(native.switch_result)
    assert (outcome, state["epoch"], state["pins"]) == ("ok", 1, 0), message


@only("cpu-cma")
def test_a_peer_that_pins_again_while_draining_is_refused_and_its_pin_ends(peers: Callable[..., Peer],
                                                                          variant: Variant) -> None:
    """While the victim drains (its pin timeout 2 s, held by another peer's unread 8 MiB read),
    the pinning peer's next direct read is refused with LLM_ROLE_SWITCHING and ends its pin; once
    the holder is gone the switch commits."""
    victim, a = _pinned(peers, variant)
    holder = peers("holder")
    port = victim.call(native.listen_port)
    unix = holder.call(hostile.redirect_name, port, 10)
    assert holder.call(hostile.link_raw, port, 10, b"", unix) == (0, "")
    holder.call(hostile.send, HOLD)
    wait_until(lambda: victim.call(native.role_state)["served_in_flight"] == 1, 20, "the held read being served")
    victim.call(native.switch_role_async, "PROMPT", drain_timeout_ms=20000)
    wait_until(lambda: victim.call(native.role_state)["phase"] == "draining", 20, "the victim draining")
    refused_kept(a, DIRECT, S.LLM_ROLE_SWITCHING)
    assert victim.call(native.role_state)["pins"] == 0
    holder.call(hostile.close)
    outcome, code, message, state = victim.call(native.switch_result)
    assert (outcome, state["epoch"], state["pins"], state["served_in_flight"]) == ("ok", 1, 0, 0), message


@only("cpu-tcp")
def test_a_switch_that_fails_after_giving_up_the_listener_changes_neither_role_nor_epoch(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """A switch to the listener's port on an address this host does not have (TEST-NET-1) gives up
    the old listener and cannot bind the new one: phase ``failed``, role and epoch unchanged, the
    linked raw peer still served under epoch 0's tag (its fenced read, the responses' tag), no new
    link; the next switch resolves it (epoch 1, a new listener that links)."""
    victim, port = _victim(peers, variant)
    src = victim.call(native.snapshot, "big")
    a = _linked(peers, variant, port, 9)
    code, message, state = victim.call(round7.switch_to, "PROMPT", f"192.0.2.1:{port}")
    assert code != 0, message
    assert (state["role"], state["epoch"], state["phase"]) == ("MIX", 0, "failed"), (state, message)
    read = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((64, 64),)), epoch_tag=_tag(0))
    assert a.call(hostile.exchange, read) == (0, "", bytes(src.tensor(0)[64:128]))
    assert a.call(hostile.exchange_header, PING) == (0, _tag(0))
    assert victim.call(native.listen_port) == 0
    code, message, state = victim.call(round7.switch_to, "PROMPT", "127.0.0.1:0")
    assert (code, state["role"], state["epoch"], state["phase"]) == (0, "PROMPT", 1, "ready"), message
    refused_kept(a, read, S.LLM_STALE_EPOCH)
    newcomer = peers("newcomer")
    assert newcomer.call(hostile.link_raw, victim.call(native.listen_port), 11) == (0, "")

"""Round 10 of the hostile review (docs/security.md, docs/reliability.md): the review of wire v10's
rows found no break in the rows, and one in deregistration, older than them. ``Engine.deregister``
returned at once while a peer's read or write of the region was still being served: the rest of
the answer carried whatever the application wrote there next, and the rest of a write landed in
memory the application had taken back (an array the engine alone held was freed under it: the
process died of SIGSEGV). Now a deregistration returns once nothing uses the memory: a read being
served sends the region's bytes to its end, a write lands in the region before it is let go, and a
live offer of it is released (``"released"``).
"""

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

pytestmark = pytest.mark.one_host("the attacker is the test process")
UNIT = 64 * 1024  # the region: one block of 64 KiB
ANSWER_UNITS = 4000  # a read of it 4000 times (262 MB): far more than the sockets hold
WRITE_UNITS = 1600


def victim_and_attacker(peers: Callable[..., Peer], variant: Variant) -> tuple[Peer, Peer]:
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True)
    attacker = peers("attacker")
    unix = attacker.call(hostile.redirect_name, port) if variant.same_host else None
    assert attacker.call(hostile.link_raw, port, 9, b"", unix) == (0, "")
    return victim, attacker


@only("cpu-tcp", "cpu-cma")
def test_a_deregistration_waits_for_the_read_being_served_and_the_answer_keeps_the_regions_bytes(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """A row reading the region 4000 times; 1 MiB of the answer read, the application deregisters
    the region and writes 0x22 over it as soon as that returns. The deregistration is still under
    way after 4 MiB more (the rest is not sent yet), and every byte of the answer is the region's."""
    victim, attacker = victim_and_attacker(peers, variant)
    victim.call(native.register, "src", 1, UNIT, seed=3, key=5)
    unit = victim.call(native.snapshot, "src").tensor(0).tobytes()
    body = rawwire.rows_body([(0, UNIT, 0, ANSWER_UNITS)], model=5)
    assert attacker.call(hostile.start_answer, rawwire.request(rawwire.OP_READ, body)) == (0, "", ANSWER_UNITS * UNIT)
    assert attacker.call(hostile.read_answer, 16 * UNIT, unit)
    victim.call(native.withdraw_and_reuse_after, "src", 0x22, 0)
    wait_until(lambda: victim.call(native.regions) == 0, 10, "the deregistration to begin")
    assert attacker.call(hostile.read_answer, 64 * UNIT, unit)
    assert victim.call(native.withdrawing), "deregister returned while the answer was being sent"
    assert attacker.call(hostile.read_answer, 0, unit), "the answer carried bytes written after deregister"
    wait_until(lambda: not victim.call(native.withdrawing), 10, "deregister to return once the answer was sent")
    assert attacker.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body)) == \
        (LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "no cache is published here under blocks cache (model_id=5)", b"")


@only("cpu-tcp", "cpu-cma")
def test_a_deregistration_waits_for_the_write_being_served_into_an_array_the_engine_alone_holds(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """A row writing 1600 times into a region registered from an array nothing else references;
    1 MiB of the payload sent, the application deregisters it. Before the fix the array was freed
    while the write went on, and the victim died (SIGSEGV). Now the deregistration waits until the
    write is answered, then the array is freed, and the victim serves on."""
    victim, attacker = victim_and_attacker(peers, variant)
    victim.call(native.register_owned, "owned", 1, UNIT, seed=9, key=6)
    body = rawwire.rows_body([(0, UNIT, 0, WRITE_UNITS)], model=6)
    total = WRITE_UNITS * UNIT
    attacker.call(hostile.send, rawwire.request(rawwire.OP_WRITE, body, payload_len=total))
    attacker.call(hostile.send_zeros, 16 * UNIT)
    victim.call(native.deregister_owned_in_background, "owned")
    wait_until(lambda: victim.call(native.regions) == 0, 10, "the deregistration to begin")
    assert victim.call(native.withdrawing) and not victim.call(native.owned_released, "owned")
    attacker.call(hostile.send_zeros, total - 16 * UNIT)
    assert attacker.call(hostile.read_response) == (0, "", b"")
    wait_until(lambda: not victim.call(native.withdrawing), 10, "deregister to return once the write was answered")
    assert victim.call(native.owned_released, "owned")
    assert attacker.call(hostile.exchange, rawwire.request(rawwire.OP_PING, b"")) == (0, "", b"")
    assert victim.call(native.stats)["live_links"] == 1  # alive, and serving


@only("cpu-tcp", "cpu-cma")
def test_a_deregistration_releases_the_regions_live_offers(peers: Callable[..., Peer], variant: Variant) -> None:
    """An offer retains blocks of the region; deregistering the region releases it (reason
    "released") instead of waiting for its lease, and a read of it is then refused."""
    victim, attacker = victim_and_attacker(peers, variant)
    victim.call(native.register, "offered", 4, UNIT, seed=4, key=7)
    ticket = victim.call(handoff.offer, "o", "offered", [1, 2], "req-10", 600_000)
    victim.call(native.deregister, "offered")
    wait_until(lambda: victim.call(handoff.state, "o") == (True, "released"), 10, "the offer released")
    body = rawwire.offer_body(7, ticket.offer_id, ticket.generation, runs=((UNIT, UNIT),))
    answer = attacker.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body))
    assert isinstance(answer, tuple) and answer[0] == LLMStatusCode.LLM_OFFER_RELEASED and answer[2] == b"", answer

"""The wire's epoch fence (v7; a u32 tag since v8) against a raw peer (docs/security.md, "Role
epochs"): any epoch tag on a read, write or describe gets at most a refusal (``LLM_STALE_EPOCH``,
nothing moved, a write's payload consumed, the link kept); the server's responses carry its own tag
(1 + epoch % 0xFFFFFFFF),
which moves with each committed switch; a tag on other frames is not read. The victim's
unregistered secret stays unchanged and its honest decoder is served byte-exact afterwards."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import rawwire
from backend_env import Variant
from conftest import Pair, only
from pdlink import LLMStatusCode
from peer import Peer
from peers import hostile, kv, native
from poll import wait_until
from review_kit import PING, after, attacker_links, make_victim, refused_kept
from verify import assert_same

S = LLMStatusCode
READ = rawwire.blocks_body(model=0, tensors=(0,), runs=((0, 64),))
WRITE = rawwire.blocks_body(model=0, tensors=(1,), runs=((8, 16),))


@pytest.fixture
def victim(pair: Pair) -> Pair:
    return make_victim(pair)


_tag = rawwire.epoch_tag_of


@only("cpu-tcp", "cpu-cma")
def test_any_epoch_tag_gets_a_refusal_at_most_and_the_link_is_kept(peers: Callable[..., Peer], victim: Pair) -> None:
    secret = victim.prefill.call(kv.secrets)
    a = attacker_links(peers, victim)
    before = victim.prefill.call(kv.snapshot, "kv")
    # the server's own tag (epoch 0) is served; a tag of 0 is unfenced
    for tag in (0, _tag(0)):
        assert a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, READ, epoch_tag=tag)) == (
            0, "", bytes(before.tensor(0)[:64]))
    # 0x10001 and 0xFFFF0001: the server's tag in the low 16 bits (all 32 are compared, v8)
    for tag in (2, 0x7FFF, 0xFFFF, 0x10001, 0xFFFF0001, 0xFFFFFFFF):
        text = refused_kept(a, rawwire.request(rawwire.OP_READ, READ, epoch_tag=tag), S.LLM_STALE_EPOCH)
        assert "prepare it again" in text, text
        # a write's payload is consumed with its refusal: the stream stays in step
        refused_kept(a, rawwire.request(rawwire.OP_WRITE, WRITE, 16, epoch_tag=tag) + b"\xa5" * 16,
                     S.LLM_STALE_EPOCH)
        refused_kept(a, rawwire.request(rawwire.OP_DESCRIBE, READ, epoch_tag=tag), S.LLM_STALE_EPOCH)
        # frames that are not fenced do not read the tag
        assert a.call(hostile.exchange, rawwire.request(rawwire.OP_PING, b"", epoch_tag=tag)) == (0, "", b"")
    assert_same(victim.prefill.call(kv.snapshot, "kv"), before, "the victim's cache after refused tags")
    after(victim, secret)


@only("cpu-tcp", "cpu-cma")
def test_responses_carry_the_servers_tag_which_moves_with_a_switch(peers: Callable[..., Peer],
                                                                   variant: Variant) -> None:
    """A pdlink.Engine victim (links survive its switches): the same raw link sees the tag move from
    1 to 2 with the commit, and its reads fenced by the old tag are refused."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True)
    victim.call(native.register, "src", 4, 256, seed=1, key=7)
    a = peers("attacker")
    unix = a.call(hostile.redirect_name, port, 9) if variant.same_host else None
    assert a.call(hostile.link_raw, port, 9, b"", unix) == (0, "")
    assert a.call(hostile.exchange_header, PING) == (0, _tag(0))
    read = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((256, 64),)), epoch_tag=_tag(0))
    src = victim.call(native.snapshot, "src")
    assert a.call(hostile.exchange, read) == (0, "", bytes(src.tensor(0)[256:320]))
    assert victim.call(native.switch_role, "PROMPT")["epoch"] == 1
    assert a.call(hostile.exchange_header, PING) == (0, _tag(1))  # the same link, the new tag
    refused_kept(a, read, S.LLM_STALE_EPOCH)
    fresh = rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((256, 64),)), epoch_tag=_tag(1))
    assert a.call(hostile.exchange, fresh) == (0, "", bytes(src.tensor(0)[256:320]))
    assert_same(victim.call(native.snapshot, "src"), src, "the victim's region")


@only("cpu-tcp", "cpu-cma")
def test_a_peer_that_stops_reading_holds_a_switch_only_until_its_drain_timeout(peers: Callable[..., Peer],
                                                                              variant: Variant) -> None:
    """A raw peer asks for 8 MiB and reads none of it: its request stays in flight at the victim
    (the serving thread blocked in its send), so a switch rolls back at its 300 ms drain timeout,
    naming the served request; role and epoch unchanged. Once the peer is gone, the switch commits."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True)
    rows, row = 64, 128 * 1024
    victim.call(native.register, "big", rows, row, seed=1, key=7)
    a = peers("attacker")
    unix = a.call(hostile.redirect_name, port, 9) if variant.same_host else None
    assert a.call(hostile.link_raw, port, 9, b"", unix) == (0, "")
    a.call(hostile.send, rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((0, rows * row),))))
    wait_until(lambda: victim.call(native.role_state)["served_in_flight"] == 1, 20, "the read being served")
    victim.call(native.switch_role_async, "PROMPT", drain_timeout_ms=300)
    outcome, code, message, state = victim.call(native.switch_result)
    assert (outcome, code) == ("TransferTimeout", S.LLM_TIMEOUT), message
    assert "1 served requests" in message and "rolled back" in message, message
    assert (state["role"], state["epoch"], state["phase"]) == ("MIX", 0, "ready")
    a.call(hostile.close)
    wait_until(lambda: victim.call(native.role_state)["served_in_flight"] == 0, 20, "the held read over")
    assert victim.call(native.switch_role, "PROMPT", True, 0)["epoch"] == 1


SPLIT = rawwire.MARK_SPLIT


@only("cpu-tcp", "cpu-cma")
def test_a_split_pull_holds_a_switch_until_its_end_frame_or_the_drain_timeout(peers: Callable[..., Peer],
                                                                             variant: Variant) -> None:
    """A raw peer's read with the split mark opens a split pull on its link, counted in
    served_in_flight though nothing is being served: a draining switch admits the pull's next
    chunk (a continuation) and refuses an unmarked read, and commits once the peer's end frame
    (a release with the mark) closed the pull. Opened again and never ended, it holds a switch
    only until the drain timeout (rolled back, role and epoch unchanged), which ends it: no longer
    counted (the next switch commits while the peer stays silent), its next chunk refused with
    LLM_ROLE_SWITCHING until its end frame; the link's end closes an open pull.
    The mark on any other frame drops the link."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True)
    row = 4096
    victim.call(native.register, "src", 4, row, seed=1, key=7)
    a = peers("attacker")
    unix = a.call(hostile.redirect_name, port, 9) if variant.same_host else None
    assert a.call(hostile.link_raw, port, 9, b"", unix) == (0, "")
    body = rawwire.blocks_body(model=7, runs=((0, row),))
    chunk = rawwire.request(rawwire.OP_READ, body, flags=SPLIT)
    end = rawwire.request(rawwire.OP_RELEASE, body, flags=SPLIT)
    served = lambda: victim.call(native.role_state)["served_in_flight"]  # noqa: E731
    assert a.call(hostile.exchange_header, chunk) == (0, _tag(0))
    wait_until(lambda: served() == 1, 20, "the chunk served, the pull still open")  # nothing is being served
    victim.call(native.switch_role_async, "PROMPT", drain_timeout_ms=30000)
    wait_until(lambda: victim.call(native.role_state)["phase"] == "draining", 20, "the switch draining")
    assert a.call(hostile.exchange_header, chunk) == (0, _tag(0))  # the open pull's chunk: admitted
    assert a.call(hostile.exchange_header, rawwire.request(rawwire.OP_READ, body)) == (
        S.LLM_ROLE_SWITCHING, _tag(0))  # any other read: refused
    a.call(hostile.send, end)
    outcome, _, message, state = victim.call(native.switch_result)
    assert (outcome, state["role"], state["epoch"], state["phase"]) == ("ok", "PROMPT", 1, "ready"), message
    wait_until(lambda: served() == 0, 20, "the pull closed")
    # opened again and never ended: held until the drain timeout, no longer
    assert a.call(hostile.exchange_header, chunk) == (0, _tag(1))
    victim.call(native.switch_role_async, "DECODER", drain_timeout_ms=300)
    outcome, code, message, state = victim.call(native.switch_result)
    assert (outcome, code) == ("TransferTimeout", S.LLM_TIMEOUT), message
    assert "1 served requests" in message and "rolled back" in message, message
    assert (state["role"], state["epoch"], state["phase"]) == ("PROMPT", 1, "ready")
    # the rollback ended the open pull: no longer counted (it holds no later switch), and its next
    # chunk is refused, not admitted as a continuation
    assert served() == 0
    assert a.call(hostile.exchange_header, chunk) == (S.LLM_ROLE_SWITCHING, _tag(1))
    assert served() == 0
    # the peer still silent, its link alive: the next switch commits
    assert victim.call(native.switch_role, "DECODER", True, 1)["epoch"] == 2
    # the end frame closes the ended pull; a new one opens, counted, and the mark on a ping drops
    # the link, which closes it
    a.call(hostile.send, end)
    assert a.call(hostile.exchange_header, chunk) == (0, _tag(2))
    wait_until(lambda: served() == 1, 20, "a new pull open")
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_PING, b"", flags=SPLIT)) == "closed"
    wait_until(lambda: served() == 0, 20, "the open pull closed with its link")


@only("cpu-cma")
def test_a_pin_held_by_a_direct_reader_holds_a_switch_until_its_next_frame_or_the_drain_timeout(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """A same-host raw peer's direct read (kFlagDirect) is answered with the addresses and pins
    them until the peer's next frame; the peer then stops. The drain counts the pin (``pins``): a
    switch with a 300 ms drain timeout rolls back naming it, role and epoch unchanged, the pin left to its bound (the
    rollback waits only for this side's own transfers, of which there are none here).
    The peer's next frame unpins, and the switch commits."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True)
    victim.call(native.register, "src", 4, 4096, seed=1, key=7)
    a = peers("attacker")
    assert a.call(hostile.link_raw, port, 9, b"", a.call(hostile.redirect_name, port, 9)) == (0, "")
    answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, rawwire.blocks_body(model=7, runs=((0, 64),)),
                                                      flags=rawwire.FLAG_DIRECT))
    assert isinstance(answer, tuple) and answer[0] == 0, answer
    wait_until(lambda: victim.call(native.role_state)["pins"] == 1, 20, "the direct read's pin held")
    victim.call(native.switch_role_async, "PROMPT", drain_timeout_ms=300)
    outcome, code, message, state = victim.call(native.switch_result)
    assert (outcome, code) == ("TransferTimeout", S.LLM_TIMEOUT), message
    assert "1 pins" in message and "rolled back" in message, message
    assert (state["role"], state["epoch"], state["phase"], state["pins"]) == ("MIX", 0, "ready", 1)
    assert a.call(hostile.exchange_header, PING) == (0, _tag(0))  # the next frame: unpinned
    wait_until(lambda: victim.call(native.role_state)["pins"] == 0, 20, "the pin released")
    assert victim.call(native.switch_role, "PROMPT", True, 0)["epoch"] == 1

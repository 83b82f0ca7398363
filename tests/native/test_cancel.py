"""``Pending.cancel()`` on ``pdlink.Engine``'s async transfers (docs/native_api.md, "Cancel"), on
every backend and data path: a large pull and a large push cancelled while their bytes are held at
a relay (tests/relay.py) end CANCELLED, leave each block of the destination with its old or its new
bytes (everything else, guards included, unchanged) and the source unchanged, release the serving
side's pins, and the same link then moves bytes exactly; a cancel after completion returns False and
the result stands."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

from backend_env import Variant
from conftest import only
from pdlink import LLMStatusCode
from peer import Peer
from peers import cancel, native
from poll import wait_until
from relay import DOWN, UP, Relay
from verify import Copy, Snapshot, assert_same

TARGET, INITIATOR = 1, 2
BLOCKS, BLOCK = 24, 1 << 20  # 24 MiB regions of 1 MiB blocks: three cancel slices of 8 MiB
NBYTES = BLOCKS * BLOCK
# The drain-timeout tests' sync pulls are one request split into 1 MiB chunks over the link's 4
# streams, each keeping up to 8 requested: 64 chunks leave some not yet asked for when the relay
# holds the answers, so the pull still has a cancel point (or a chunk to refuse) at the rollback.
SPLIT_BLOCKS = 64
# A cancel after completion needs a completed transfer, not a large one: 4 blocks of 1 MiB.
DONE_BLOCKS = 4
KINDS = ["descriptors", "batch", "prepared"]


def block_is(after: Snapshot, ref: Snapshot, block: int) -> bool:
    lo, hi = block * BLOCK, (block + 1) * BLOCK
    return bool(np.array_equal(after.tensor(0)[lo:hi], ref.tensor(0)[lo:hi]))


def check_old_or_new(before: Snapshot, after: Snapshot, src: Snapshot, blocks: int = BLOCKS) -> list[int]:
    """Asserts each of the `blocks` blocks of `after` holds its old (`before`) or its new (`src`)
    bytes and nothing else changed (guards included); returns the new blocks."""
    new = [b for b in range(blocks) if block_is(after, src, b) and not block_is(after, before, b)]
    assert_same(after, before.with_rows(src, [(b, b) for b in new]), "destination of the cancelled transfer")
    return new


class Setup:
    """A listening target with "src" (filled, key 9) and "sink" (filled with another pattern), and an
    initiator with "dst", linked directly or through a relay (`relay_port`: the port to dial for
    the target's), with prepared transfers "read" (src -> dst) and "write" (dst -> sink); each region
    `blocks` blocks of BLOCK bytes."""

    def __init__(self, peers: Callable[..., Peer], variant: Variant, relay_port: Callable[[int], int] | None = None,
                 blocks: int = BLOCKS):
        self.blocks, self.nbytes = blocks, blocks * BLOCK
        self.target = peers("target", env=variant.env())
        self.initiator = peers("initiator", env=variant.env())
        port = self.target.call(native.start, TARGET, listen=True, timeout_ms=60000)
        self.src = self.target.call(native.register, "src", blocks, BLOCK, seed=1, key=9)
        self.sink = self.target.call(native.register, "sink", blocks, BLOCK, seed=3, key=10)
        self.initiator.call(native.start, INITIATOR, timeout_ms=60000)
        self.initiator.call(native.register, "dst", blocks, BLOCK, seed=2)
        if relay_port is None:  # linked directly
            assert self.initiator.call(native.connect, port, TARGET) == TARGET
        else:
            assert self.initiator.call(native.connect, relay_port(port), TARGET, "127.0.0.1") == TARGET
        (link,) = self.initiator.call(native.links)
        assert link.transport == variant.link_transport
        for tag, name in (("read", "src"), ("write", "sink")):
            remote = self.target.call(native.remote, name)
            self.initiator.call(native.prepare, tag, TARGET, "dst", remote)

    def snap(self, side: Peer, name: str) -> Snapshot:
        return side.call(native.snapshot, name)

    def pins_released(self) -> None:
        wait_until(lambda: self.target.call(native.role_state)["pins"] == 0, 30, "the target's pins released")


# Held at a relay on tcp only: cma's reads copy the peer's memory through a cached layout and the
# device paths move bytes and answers over their own channels, so no byte of theirs waits at a relay
# on the link's socket (test_cancel_right_after_the_start covers them).
@only("cpu-tcp")
@pytest.mark.one_host("the test process relays the link")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["read", "write"])
def test_cancel_mid_flight(peers: Callable[..., Peer], variant: Variant, op: str, kind: str) -> None:
    with Relay(0) as relay:
        def relay_port(port: int) -> int:
            relay.target_port = port
            return relay.port

        s = Setup(peers, variant, relay_port)
        dest_side, dest, source_side, source = ((s.initiator, "dst", s.target, "src") if op == "read"
                                                else (s.target, "sink", s.initiator, "dst"))
        remote = s.src if op == "read" else s.sink
        dest0, source0 = s.snap(dest_side, dest), s.snap(source_side, source)
        # The transfer's bytes held at the relay after 1 MiB: it is in flight, not done.
        direction, budget = (DOWN if op == "read" else UP), 1 << 20
        relay.hold_after(direction, budget)
        s.initiator.call(cancel.start, "t", kind, op, TARGET, "dst", remote, NBYTES, op)
        relay.wait_held(direction)
        won, status = s.initiator.call(cancel.cancel, "t")
        # cancel returned while the relay still holds the transfer's bytes, and it is CANCELLED
        assert relay.wait_held(direction) >= budget
        assert (won, status) == (True, "CANCELLED")
        relay.release()
        assert s.initiator.call(cancel.finish, "t") == ("CANCELLED", "TransferCancelled", True)
        assert relay.forwarded[direction] < NBYTES
        new = check_old_or_new(dest0, s.snap(dest_side, dest), source0)
        assert len(new) < BLOCKS, "the cancel came after every block had moved"
        assert_same(s.snap(source_side, source), source0, "source of the cancelled transfer")
        s.pins_released()
        # the same link then moves bytes exactly: the whole transfer, synchronously
        assert len(s.initiator.call(native.links)) == 1
        s.initiator.call(native.post, op, list(range(BLOCKS)), list(range(BLOCKS)), op)
        assert_same(s.snap(dest_side, dest), dest0.with_rows(source0, [(b, b) for b in range(BLOCKS)]),
                    "destination after the cancelled transfer's retry")
        assert_same(s.snap(source_side, source), source0, "source of the retry")
        s.pins_released()


@only("cpu-tcp")
@pytest.mark.one_host("the test process relays the link")
def test_a_cancelled_prepared_read_with_a_block_view_leaves_each_piece_old_or_new(peers: Callable[..., Peer],
                                                                                   variant: Variant) -> None:
    """A prepared read with block views (the second half of each 1 MiB source block into the first
    half of each destination block: 12 MiB in 24 pieces) cancelled while its bytes are held at the
    relay: CANCELLED, each destination piece holds its old or its new bytes, never a mix, some are
    old, the second halves, the rest and the source are unchanged; the link then reads them all."""
    half = BLOCK // 2
    with Relay(0) as relay:
        def relay_port(port: int) -> int:
            relay.target_port = port
            return relay.port

        s = Setup(peers, variant, relay_port)
        s.initiator.call(native.prepare, "view", TARGET, "dst", s.target.call(native.remote, "src"),
                         local_view=(0, half), remote_view=(half, half))
        dst0, src0 = s.snap(s.initiator, "dst"), s.snap(s.target, "src")
        relay.hold_after(DOWN, 1 << 20)
        s.initiator.call(cancel.start, "t", "prepared", "read", TARGET, "dst", s.src, NBYTES, "view")
        relay.wait_held(DOWN)
        assert s.initiator.call(cancel.cancel, "t") == (True, "CANCELLED")
        relay.release()
        assert s.initiator.call(cancel.finish, "t") == ("CANCELLED", "TransferCancelled", True)
        after = s.snap(s.initiator, "dst")

        def piece(snap: Snapshot, offset: int) -> np.ndarray:
            return snap.tensor(0)[offset:offset + half]

        new = [b for b in range(BLOCKS) if np.array_equal(piece(after, b * BLOCK), piece(src0, b * BLOCK + half))
               and not np.array_equal(piece(after, b * BLOCK), piece(dst0, b * BLOCK))]
        assert_same(after, dst0.with_bytes(src0, [Copy(0, b * BLOCK + half, 0, b * BLOCK, half) for b in new]),
                    "destination of the cancelled view read")
        assert len(new) < BLOCKS, "the cancel came after every piece had moved"
        assert_same(s.snap(s.target, "src"), src0, "source of the cancelled transfer")
        s.pins_released()
        s.initiator.call(native.post, "view", list(range(BLOCKS)), list(range(BLOCKS)), "read")
        assert_same(s.snap(s.initiator, "dst"),
                    dst0.with_bytes(src0, [Copy(0, b * BLOCK + half, 0, b * BLOCK, half) for b in range(BLOCKS)]),
                    "destination after the retry")


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_after_completion_returns_false(peers: Callable[..., Peer], variant: Variant, kind: str) -> None:
    """A read of DONE_BLOCKS blocks (a completed transfer is all this needs, not a large one) waited
    for until DONE: its cancel returns False, it stays DONE, and its whole destination is the read's."""
    s = Setup(peers, variant, blocks=DONE_BLOCKS)
    dst0, src0 = s.snap(s.initiator, "dst"), s.snap(s.target, "src")
    s.initiator.call(cancel.start, "t", kind, "read", TARGET, "dst", s.src, s.nbytes, "read")
    wait_until(lambda: s.initiator.call(cancel.status, "t") == "DONE", 60, "the transfer done")
    assert s.initiator.call(cancel.cancel, "t") == (False, "DONE")
    assert s.initiator.call(cancel.finish, "t") == ("DONE", None, False)
    assert_same(s.snap(s.initiator, "dst"), dst0.with_rows(src0, [(b, b) for b in range(s.blocks)]),
                "destination of the completed transfer")
    assert_same(s.snap(s.target, "src"), src0, "source")
    s.pins_released()


@pytest.mark.parametrize("op", ["read", "write"])
def test_cancel_right_after_the_start(peers: Callable[..., Peer], variant: Variant, op: str) -> None:
    """On every cell: a prepared 24 MiB transfer cancelled as soon as it was submitted either ends
    CANCELLED (each block of the destination old or new, the rest and the source unchanged) or, when
    it had already completed, the cancel returns False and its result stands; either way the pins are
    released and the same link then moves the whole transfer byte-exact."""
    s = Setup(peers, variant)
    dest_side, dest, source_side, source = ((s.initiator, "dst", s.target, "src") if op == "read"
                                            else (s.target, "sink", s.initiator, "dst"))
    remote = s.src if op == "read" else s.sink
    dest0, source0 = s.snap(dest_side, dest), s.snap(source_side, source)
    won, status = s.initiator.call(cancel.start_and_cancel, "t", "prepared", op, TARGET, "dst", remote, NBYTES, op)
    outcome = s.initiator.call(cancel.finish, "t")
    everything = dest0.with_rows(source0, [(b, b) for b in range(BLOCKS)])
    if won:
        assert status == "CANCELLED"
        assert outcome == ("CANCELLED", "TransferCancelled", True)
        check_old_or_new(dest0, s.snap(dest_side, dest), source0)
    else:
        assert outcome == ("DONE", None, False)
        assert_same(s.snap(dest_side, dest), everything, "destination of the completed transfer")
    assert_same(s.snap(source_side, source), source0, "source")
    s.pins_released()
    s.initiator.call(native.post, op, list(range(BLOCKS)), list(range(BLOCKS)), op)
    assert_same(s.snap(dest_side, dest), everything, "destination of the retry")
    assert_same(s.snap(source_side, source), source0, "source of the retry")


# ---------------------------------------------------------------- at a role switch's drain timeout

DRAIN_MS = 1000  # the switch's drain timeout; the rollback then waits up to min(1 s, it) more


def _relayed(peers: Callable[..., Peer], variant: Variant, relay: Relay) -> Setup:
    def relay_port(port: int) -> int:
        relay.target_port = port
        return relay.port

    s = Setup(peers, variant, relay_port, SPLIT_BLOCKS)
    # a whole-region read into another region first: it opens the link's lanes, so the reads held
    # below are split pulls (chunk requests over the channel and 3 lanes: Limits.tcp_streams 4)
    s.initiator.call(native.register, "warm", s.blocks, BLOCK, seed=4)
    s.initiator.call(cancel.start_sync, "warm", "read", TARGET, "warm", s.src, s.nbytes)
    assert s.initiator.call(cancel.finish_sync, "warm") == (None, None)
    assert relay.connections() == 5
    return s


def _counts(side: Peer) -> tuple[int, int, int]:
    s = side.call(native.role_state)
    return s["transfers_in_flight"], s["served_in_flight"], s["pins"]


def _counts_back_to_zero(*sides: Peer) -> None:
    wait_until(lambda: all(_counts(side) == (0, 0, 0) for side in sides), 30, "every count of both sides back to 0")


def _roll_back(side: Peer, relay: Relay) -> tuple[str, int | None, str, dict]:
    """Switches `side` to PROMPT with a DRAIN_MS drain that the transfer held at `relay` outlasts;
    once the drain timed out (phase rolling_back) lets the relay go; the switch's outcome."""
    side.call(native.switch_role_async, "PROMPT", drain_timeout_ms=DRAIN_MS)
    wait_until(lambda: side.call(native.role_state)["phase"] == "rolling_back", 30, "the switch rolling back")
    relay.release()
    return side.call(native.switch_result)


@only("cpu-tcp")
@pytest.mark.one_host("the test process relays the link")
@pytest.mark.parametrize("kind", ["prepared", "descriptors", "sync"])
def test_a_drain_timeout_cancels_this_sides_transfers(peers: Callable[..., Peer], variant: Variant,
                                                      kind: str) -> None:
    """The initiator's 64 MiB pull is held at a relay after 1 MiB when the initiator is switched with
    a drain timeout it outlasts: the switch raises LLM_TIMEOUT naming one transfer cancelled and none
    still ending, role and epoch unchanged and phase ready; the pull ends cancelled (async:
    CANCELLED / TransferCancelled as after Pending.cancel; sync: TransferCancelled), each block of
    its destination old or new and nothing else changed; every count is back to 0 and the same link
    then moves the whole region byte-exact."""
    with Relay(0) as relay:
        s = _relayed(peers, variant, relay)
        dst0, src0 = s.snap(s.initiator, "dst"), s.snap(s.target, "src")
        forwarded0 = relay.forwarded[DOWN]
        relay.hold_after(DOWN, 1 << 20)
        if kind == "sync":
            s.initiator.call(cancel.start_sync, "t", "read", TARGET, "dst", s.src, s.nbytes)
        else:
            s.initiator.call(cancel.start, "t", kind, "read", TARGET, "dst", s.src, s.nbytes, "read")
        relay.wait_held(DOWN)
        outcome, code, message, after = _roll_back(s.initiator, relay)
        assert (outcome, code) == ("TransferTimeout", LLMStatusCode.LLM_TIMEOUT), message
        assert "1 transfers cancelled (0 still ending" in message, message
        assert (after["role"], after["epoch"], after["phase"]) == ("MIX", 0, "ready")
        assert after["transfers_in_flight"] == 0
        if kind == "sync":
            assert s.initiator.call(cancel.finish_sync, "t") == ("TransferCancelled", None)
        else:
            assert s.initiator.call(cancel.finish, "t") == ("CANCELLED", "TransferCancelled", True)
        assert relay.forwarded[DOWN] - forwarded0 < s.nbytes
        new = check_old_or_new(dst0, s.snap(s.initiator, "dst"), src0, s.blocks)
        assert len(new) < s.blocks, "the cancel came after every block had moved"
        assert_same(s.snap(s.target, "src"), src0, "source of the cancelled transfer")
        _counts_back_to_zero(s.initiator, s.target)
        assert len(s.initiator.call(native.links)) == 1
        s.initiator.call(native.post, "read", list(range(s.blocks)), list(range(s.blocks)), "read")
        assert_same(s.snap(s.initiator, "dst"), dst0.with_rows(src0, [(b, b) for b in range(s.blocks)]),
                    "destination after the cancelled transfer's retry")
        assert s.initiator.call(native.switch_role, "PROMPT", True, 0)["epoch"] == 1  # the next switch commits


@only("cpu-tcp")
@pytest.mark.one_host("the test process relays the link")
def test_a_drain_timeout_ends_the_peers_split_pull(peers: Callable[..., Peer], variant: Variant) -> None:
    """The serving side: the initiator's 64 MiB pull (chunk requests of a split pull) is held at a
    relay after 1 MiB of answers when the target is switched with a drain timeout it outlasts. The
    switch raises LLM_TIMEOUT (served requests in flight, none of its own cancelled), role and epoch
    unchanged; the pull's later chunks are refused, so it fails with LLM_ROLE_SWITCHING, each block
    of its destination old or new and nothing else changed; the target's served count goes back to
    0 and the same link then moves the whole region byte-exact."""
    with Relay(0) as relay:
        s = _relayed(peers, variant, relay)
        dst0, src0 = s.snap(s.initiator, "dst"), s.snap(s.target, "src")
        forwarded0 = relay.forwarded[DOWN]
        relay.hold_after(DOWN, 1 << 20)
        s.initiator.call(cancel.start_sync, "t", "read", TARGET, "dst", s.src, s.nbytes)
        relay.wait_held(DOWN)
        # the open pull counts 1, and each chunk being served (blocked in its send) 1 more
        wait_until(lambda: _counts(s.target)[1] >= 1, 30, "the pull open on the target")
        # the target has no transfer of its own to wait for: the switch is over while the relay holds
        s.target.call(native.switch_role_async, "PROMPT", drain_timeout_ms=DRAIN_MS)
        outcome, code, message, after = s.target.call(native.switch_result)
        relay.release()
        assert (outcome, code) == ("TransferTimeout", LLMStatusCode.LLM_TIMEOUT), message
        served = re.search(r"(\d+) served requests", message)
        assert served is not None and int(served.group(1)) >= 1, message
        assert "0 transfers cancelled" in message, message
        assert (after["role"], after["epoch"], after["phase"]) == ("MIX", 0, "ready")
        raised, code = s.initiator.call(cancel.finish_sync, "t")
        assert code == LLMStatusCode.LLM_ROLE_SWITCHING, raised
        assert relay.forwarded[DOWN] - forwarded0 < s.nbytes
        new = check_old_or_new(dst0, s.snap(s.initiator, "dst"), src0, s.blocks)
        assert len(new) < s.blocks, "the pull completed"
        assert_same(s.snap(s.target, "src"), src0, "source of the ended pull")
        _counts_back_to_zero(s.initiator, s.target)
        assert len(s.initiator.call(native.links)) == 1
        s.initiator.call(native.post, "read", list(range(s.blocks)), list(range(s.blocks)), "read")
        assert_same(s.snap(s.initiator, "dst"), dst0.with_rows(src0, [(b, b) for b in range(s.blocks)]),
                    "destination after the ended pull's retry")

"""Faults on the emulated wire between hosts (pdlink.testing.hosts, docs/hosts.md): what a link
does when the network under it partitions, and what a relink does once it heals.

The peers run on two emulated hosts (tests/hostbed.py), so their link is TCP over a real network
interface and the emulated wire, never a same-host path. Every transfer is judged on the whole of
both regions, in the peers that own them (peers.across.digests: a digest per 1 MiB row and the
guard bytes), and the fault is proven to have happened (the destination host stopped receiving).
"""

from __future__ import annotations

from collections.abc import Callable

import hostbed
from pdlink import LLMStatusCode
from peer import Peer
from peers import across, native
from poll import hang_guard, wait_until

ROW = 1 << 20
ROWS = 256  # the pull: 256 MiB
PAD = 4  # rows of the destination on each side of the pulled range, which must never change
TIMEOUT_MS = 6000  # sync timeout of both engines: far above the pull's time on the rack wire
SLACK_S = 4.0  # what may pass beyond the timeout before the read returns (a loaded 2-core machine)


def test_a_partition_during_a_large_pull_times_out_and_a_relink_after_healing_moves_every_byte(
        peers: Callable[..., Peer]) -> None:
    with hostbed.bed(2, "rack") as hosts:
        src = hostbed.place(peers, hosts, 0, "prefill")
        dst = hostbed.place(peers, hosts, 1, "decode")
        port = src.call(native.start, 1, listen=True, timeout_ms=TIMEOUT_MS)
        src_addr = src.call(native.register, "src", ROWS, ROW, seed=None, host=True)
        src.call_within(60, across.fill, "src", ROWS * ROW, seed=1)
        dst.call(native.start, 2, timeout_ms=TIMEOUT_MS)
        dst.call(native.register, "dst", ROWS + 2 * PAD, ROW, seed=None, host=True)
        dst.call_within(60, across.fill, "dst", (ROWS + 2 * PAD) * ROW, seed=2)
        src0, src_guards = src.call_within(60, across.digests, "src")
        dst0, dst_guards = dst.call_within(60, across.digests, "dst")
        assert src_guards and dst_guards
        peer = dst.call(native.connect, port)
        assert [link.transport for link in dst.call(native.links)] == ["tcp"]

        before = dst.call(across.received_bytes)
        dst.call(across.start_read, peer, "dst", PAD * ROW, src_addr, ROWS * ROW)
        wait_until(lambda: dst.call(across.received_bytes) - before >= 32 * ROW, 60, "32 MiB of the pull received")
        hosts.partition(0, 1)
        cut = dst.call(across.received_bytes)
        code, seconds = dst.call_within(hang_guard(TIMEOUT_MS), across.finish_read, hang_guard(TIMEOUT_MS))
        # The fault happened: the pull had not ended when the wire was cut, and nothing crosses it.
        assert cut - before < ROWS * ROW
        assert not dst.call(across.reachable, hosts[0].ip, port)
        assert code == LLMStatusCode.LLM_TIMEOUT
        assert seconds <= TIMEOUT_MS / 1000 + SLACK_S, seconds

        after, guards = dst.call_within(60, across.digests, "dst")
        assert guards, "a guard byte of the destination changed"
        assert after[:PAD] == dst0[:PAD] and after[PAD + ROWS:] == dst0[PAD + ROWS:], "bytes outside the range moved"
        assert src.call_within(60, across.digests, "src") == (src0, True), "the source changed"

        hosts.heal()
        wait_until(lambda: dst.call(across.reachable, hosts[0].ip, port), 30, "the wire healed")
        dst.call(native.disconnect, peer)
        peer = dst.call(native.connect, port)
        dst.call(across.start_read, peer, "dst", PAD * ROW, src_addr, ROWS * ROW)
        assert dst.call_within(hang_guard(TIMEOUT_MS), across.finish_read, hang_guard(TIMEOUT_MS))[0] == \
            LLMStatusCode.LLM_SUCCESS
        assert dst.call_within(60, across.digests, "dst") == (dst0[:PAD] + src0 + dst0[PAD + ROWS:], True)
        assert src.call_within(60, across.digests, "src") == (src0, True), "the source changed"

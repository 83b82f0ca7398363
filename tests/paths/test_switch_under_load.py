"""Role switches under load (issue #34, item 3), on every data path of the matrix: a decoder pulls
continuously on several threads while its prefill peer is switched PROMPT -> DECODER -> PROMPT, the
drain-timeout rollback forced while a transfer is held in flight, and two controllers racing with
the same expected epoch. ``pdlink.Engine.switch_role``/``role_state``: docs/native_api.md.

* ``test_pulls_stay_exact_while_the_prefill_switches``: 4 pulling threads in the decoder (2 plain
  descriptor reads, 2 prepared transfers), every pull checked against the whole destination with
  its guard bytes (tests/peers/switch_load.py): each one byte-exact, or refused with
  LLM_ROLE_SWITCHING (any pull, while the prefill drains) or LLM_STALE_EPOCH (a prepared one,
  after the prefill's committed switch; it prepares again), having changed nothing outside the rows
  it named. After each commit every thread completes a pull that began after it, before the next
  switch. 10 round trips by default (20 switches); 100 with the heavy tests (``pytest -m heavy``),
  the benchmark-sized run. Afterwards: the epoch is 2N, the phase ready, no pins on either side,
  the link the same live link, descriptors and threads of both processes back to where they were,
  and a plain and a prepared pull byte-exact.
* ``test_every_commit_fences_every_prepared_transfer``: the same load, 10 switches: each commit
  reaches each prepared thread as LLM_STALE_EPOCH on its next post (on cpu-cma too: the cached-layout
  reads check the prefill's published role word).
* ``test_two_controllers_race_for_one_epoch``: two threads of the prefill call ``switch_role`` with
  the same expected epoch at once (pulls running): exactly one commits, the other is refused with
  LLM_STALE_EPOCH or LLM_ROLE_SWITCHING, the epoch goes up by exactly one, and a late retry with
  that epoch is stale.
* ``test_a_drain_past_its_timeout_rolls_back`` (cpu-tcp, through tests/relay.py): a 48 MiB read (or
  write) held at the relay is counted in flight on the side told to switch; a switch with a 300 ms
  drain timeout raises LLM_TIMEOUT and leaves role, epoch and phase as they were, the transfer
  still in flight (its requests sent are held). Released, the decoder's own read (the decoder
  switched) stops at its next cancel point, cancelled (each destination row old or new, nothing
  else changed); the write, one request the prefill admitted before its switch, completes
  byte-exact. A switch then commits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from backend_env import VARIANTS, Variant
from conftest import only
from native_pair import INITIATOR, ROW, ROWS, TARGET
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import native, switch_load
from poll import hang_guard, wait_until
from relay import DOWN, UP, Relay
from verify import Snapshot, assert_same, check_transfer, rows

SWITCHING = int(LLMStatusCode.LLM_ROLE_SWITCHING)
STALE = int(LLMStatusCode.LLM_STALE_EPOCH)
PULLERS = ("read", "read", "prepared", "prepared")
# what a pull of each kind may fail with while its peer switches (anything else fails the test)
ALLOWED = {"read": [SWITCHING], "prepared": [SWITCHING, STALE]}
SEED = 1  # the target's "src": pattern(ROWS * ROW, 0, SEED)
SWITCH_GUARD_S = 60.0  # a switch drains pulls of 2 KiB; reaching this bound means a hang


class Loaded:
    """native_pair.Two's setup with roles: a listening PROMPT target (cluster 1) with region "src"
    (filled, published under key 7), a DECODER initiator with "dst" (filled with another pattern),
    linked over the cell's host path (checked); and the decoder's pulling threads
    (tests/peers/switch_load.py) against "src"."""

    def __init__(self, peers: Callable[..., Peer], variant: Variant):
        self.variant = variant
        self.target = peers("target", env=variant.env())
        self.initiator = peers("initiator", env=variant.env())
        port = self.target.call(native.start, TARGET, listen=True, role="PROMPT")
        self.src = self.target.call(native.register, "src", ROWS, ROW, seed=SEED, key=7)
        self.initiator.call(native.start, INITIATOR, role="DECODER")
        self.initiator.call(native.register, "dst", ROWS, ROW, seed=2)
        assert self.initiator.call(native.connect, port, TARGET) == TARGET
        (link,) = self.initiator.call(native.links)
        assert (link.peer_cluster_id, link.transport, link.initiator) == (TARGET, variant.link_transport, True)
        self.remote = self.target.call(native.remote, "src")

    def read(self, name: str) -> Callable[[], Snapshot]:
        side = self.initiator if name == "dst" else self.target
        return lambda: side.call(native.snapshot, name)

    def start_pullers(self) -> None:
        self.initiator.call(switch_load.start_pullers, TARGET, self.remote, SEED, PULLERS, ALLOWED, ROWS, ROW)

    def pulled_since(self, before: list[int]) -> list[int]:
        """Waits until every puller completed an exact pull since its counts were ``before``; the counts."""
        def advanced() -> list[int] | None:
            now = self.initiator.call(switch_load.progress)
            assert min(now) >= 0, f"a puller stopped on an error: {self.stop_pullers()}"
            return now if all(n > b for n, b in zip(now, before)) else None

        return wait_until(advanced, 30, "every puller completed an exact pull")

    def pulled_after_now(self) -> None:
        """Waits until every puller completed two more exact pulls: the second began after this call."""
        self.pulled_since([n + 1 for n in self.initiator.call(switch_load.progress)])

    def stop_pullers(self) -> list[dict[str, Any]]:
        report = self.initiator.call_within(60, switch_load.stop_pullers, 30)
        assert [(r["error"], r["alive"]) for r in report] == [(None, False)] * len(PULLERS), report
        return report

    def switch(self, role: str, expected_epoch: int | None = None,
               drain_timeout_ms: int | None = None) -> dict[str, Any]:
        return self.target.call_within(SWITCH_GUARD_S, switch_load.switch, role, expected_epoch, drain_timeout_ms)

    def settled(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Both processes' (descriptors, threads), once neither engine has a transfer in flight."""
        def idle() -> bool:
            return all(s["transfers_in_flight"] == 0 and s["served_in_flight"] == 0
                       for s in (self.target.call(switch_load.role_state),
                                 self.initiator.call(switch_load.role_state)))

        wait_until(idle, 30, "both engines with nothing in flight")
        return self.target.call(switch_load.resources), self.initiator.call(switch_load.resources)

    def exact_pulls(self, tag: str) -> None:
        """A plain descriptor read and a post of a transfer prepared now, each checked whole."""
        check_transfer(self.read("src"), self.read("dst"), lambda: self.initiator.call(
            native.descriptors, TARGET, "dst", [(3 * ROW, ROW), (0, ROW)], [(self.src, ROW), (self.src + 5 * ROW, ROW)],
            "read"), rows([(0, 3), (5, 0)]))
        self.initiator.call(native.prepare, tag, TARGET, "dst", self.remote)
        check_transfer(self.read("src"), self.read("dst"), lambda: self.initiator.call(
            native.post, tag, [7, 1], [2, 6], "read"), rows([(2, 7), (6, 1)]))


@pytest.fixture
def loaded(peers: Callable[..., Peer], variant: Variant) -> Iterator[Loaded]:
    yield Loaded(peers, variant)


def link_record(side: Peer) -> list[tuple[Any, ...]]:
    """What must not change about a side's links across switches: which peer, over what, who
    dialled, and that it is live."""
    return [(li.peer_cluster_id, li.peer_address, li.transport, li.device_paths, li.initiator, li.broken)
            for li in side.call(native.links)]


def storm(t: Loaded, cycles: int) -> tuple[list[dict[str, Any]], dict[int, list[int]]]:
    """The pullers run while the target switches PROMPT -> DECODER -> PROMPT ``cycles`` times, each
    switch with its expected epoch; after each commit every puller completes a pull that began after
    it. The pullers' report (``switch_load.stop_pullers``), and for each prepared puller the commits
    (1-based) whose epoch its next post did not find stale."""
    t.start_pullers()
    t.pulled_since([0] * len(PULLERS))
    epoch = 0
    stale = [t.initiator.call(switch_load.stale_counts)]
    for _ in range(cycles):
        for role in ("DECODER", "PROMPT"):
            state = t.switch(role, expected_epoch=epoch)
            epoch += 1
            assert (state["role"], state["epoch"], state["phase"]) == (role, epoch, "ready"), state
            t.pulled_after_now()
            stale.append(t.initiator.call(switch_load.stale_counts))
    missed = {i: [k + 1 for k in range(2 * cycles) if stale[k + 1][i] == stale[k][i]]
              for i, kind in enumerate(PULLERS) if kind == "prepared"}
    return t.stop_pullers(), missed


@pytest.mark.parametrize("cycles", [10, pytest.param(100, marks=pytest.mark.heavy)])
def test_pulls_stay_exact_while_the_prefill_switches(loaded: Loaded, cycles: int) -> None:
    t = loaded
    t.exact_pulls("warm-up")  # the paths' lazy parts (lanes, cached layouts) exist before the baseline
    links0 = link_record(t.target), link_record(t.initiator)
    assert [r[-1] for r in links0[0] + links0[1]] == [False, False]
    resources0 = t.settled()
    state0 = t.target.call(switch_load.role_state)
    assert (state0["role"], state0["epoch"], state0["phase"]) == ("PROMPT", 0, "ready"), state0

    report, missed = storm(t, cycles)  # every pull exact or refused cleanly (stop_pullers checks)
    for r in report:
        if r["kind"] == "prepared":
            assert r["codes"].get(STALE, 0) >= 1, report  # a commit reached it
            # each stale post made the thread prepare again; no prepare was refused stale
            assert r["prepares"] == 1 + r["steps"].get(f"post {STALE}", 0), report
            assert f"prepare {STALE}" not in r["steps"], report
        else:
            assert STALE not in r["codes"], report  # plain reads are unfenced
    print(f"{t.variant.id}: {2 * cycles} switches under load; pullers {report}; commits missed {missed}")

    state = t.target.call(switch_load.role_state)
    assert (state["role"], state["epoch"], state["phase"]) == ("PROMPT", 2 * cycles, "ready"), state
    assert t.initiator.call(switch_load.role_state)["epoch"] == 0  # the decoder never switched
    wait_until(lambda: all(s.call(switch_load.role_state)["pins"] == 0 for s in (t.target, t.initiator)), 30,
               "no pins left on either side")
    assert (link_record(t.target), link_record(t.initiator)) == links0
    wait_until(lambda: all(now <= then for side, side0 in zip(t.settled(), resources0)
                           for now, then in zip(side, side0)), 30,
               f"descriptors and threads of (prefill, decoder) back to {resources0}")
    t.exact_pulls("after")


def _fence_cell(v: Variant) -> Any:
    return pytest.param(v, id=v.id, marks=[pytest.mark.heavy] if v.heavy else [])


@pytest.mark.parametrize("variant", [_fence_cell(v) for v in VARIANTS], indirect=True)
def test_every_commit_fences_every_prepared_transfer(loaded: Loaded) -> None:
    """The epoch fence under load: after each of 10 commits, each prepared thread's next post is
    refused LLM_STALE_EPOCH (nothing moved, stop_pullers checks) and it prepares again."""
    _, missed = storm(loaded, 5)
    assert missed == {i: [] for i in missed}, f"commits a prepared thread's next post did not see: {missed}"


def test_two_controllers_race_for_one_epoch(loaded: Loaded) -> None:
    t = loaded
    t.start_pullers()
    t.pulled_since([0] * len(PULLERS))
    for epoch, role in enumerate(("DECODER", "PROMPT")):
        outcomes = t.target.call_within(SWITCH_GUARD_S, switch_load.race, role, epoch)
        winners = [o for o in outcomes if o == "ok"]
        losers = [o for o in outcomes if o != "ok"]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        assert losers[0] in (STALE, SWITCHING), outcomes
        state = t.target.call(switch_load.role_state)
        assert (state["role"], state["epoch"], state["phase"]) == (role, epoch + 1, "ready"), state
        # the loser changed nothing: a late retry with the same epoch is stale
        assert t.target.call(switch_load.try_switch, role, epoch) == STALE
        assert t.target.call(switch_load.role_state)["epoch"] == epoch + 1
        t.pulled_after_now()
    t.stop_pullers()
    t.exact_pulls("after")


# The rollback: the decoder reads (or writes) BIG_ROWS x BIG_ROW through a relay that lets HELD_AFTER
# bytes through and then holds (tests/relay.py), so the transfer is in flight and cannot have completed
# (the relay forwarded less than it moves) when one side is told to switch. A held read is in flight on
# the decoder (the prefill may have handed all its bytes to the kernel's socket buffers, which hold more
# than this read across the link's four streams); a held write is in flight on the prefill, whose
# serving thread waits for the payload. Each case switches the side the transfer is in flight on.
# 48 MiB: 48 chunk requests of 1 MiB, more than the link's 4 streams keep in flight (at most 8 each,
# limits::kMaxTcpDepth), so a held read has chunks not yet asked for when its cancel comes.
BIG_ROWS, BIG_ROW = 192, 256 * 1024
HELD_AFTER = 1 << 20
DRAIN_TIMEOUT_MS = 300
TRANSFER_TIMEOUT_MS = 30000  # both engines': the held transfer must outlive the drain, by far


def _row_is(snap: Snapshot, ref: Snapshot, row: int) -> bool:
    lo, hi = row * BIG_ROW, (row + 1) * BIG_ROW
    return bool((snap.tensor(0)[lo:hi] == ref.tensor(0)[lo:hi]).all())


@only("cpu-tcp")
@pytest.mark.one_host("the decoder links through a relay in the test process")
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_drain_past_its_timeout_rolls_back(peers: Callable[..., Peer], variant: Variant, op: str) -> None:
    prefill, decoder = peers("prefill", env=variant.env()), peers("decoder", env=variant.env())
    port = prefill.call(native.start, TARGET, listen=True, timeout_ms=TRANSFER_TIMEOUT_MS, role="PROMPT")
    remote = prefill.call(native.register, "big", BIG_ROWS, BIG_ROW, seed=3, key=7)
    decoder.call(native.start, INITIATOR, timeout_ms=TRANSFER_TIMEOUT_MS, role="DECODER")
    decoder.call(native.register, "big", BIG_ROWS, BIG_ROW, seed=4)
    # the read moves the prefill's bytes into the decoder, the write the decoder's into the prefill
    (src, dst), direction = ((prefill, decoder), DOWN) if op == "read" else ((decoder, prefill), UP)
    switching, counter = (decoder, "transfers_in_flight") if op == "read" else (prefill, "served_in_flight")
    role = "PROMPT" if switching is decoder else "DECODER"
    src0, dst0 = src.call(native.snapshot, "big"), dst.call(native.snapshot, "big")
    with Relay(port) as relay:
        assert decoder.call(native.connect, relay.port, TARGET) == TARGET
        assert [li.transport for li in decoder.call(native.links)] == ["tcp"]  # no same-host path around it
        relay.hold_after(direction, HELD_AFTER)
        decoder.call(switch_load.start_transfer, op, TARGET, "big", remote)
        assert relay.wait_held(direction) >= HELD_AFTER
        wait_until(lambda: switching.call(switch_load.role_state)[counter] >= 1, 10,
                   f"the held {op} counted in flight ({counter}) on the side that switches")
        before = switching.call(switch_load.role_state)
        with pytest.raises(LLMException) as e:
            switching.call_within(hang_guard(DRAIN_TIMEOUT_MS), switch_load.switch, role, 0, DRAIN_TIMEOUT_MS)
        assert e.value.status_code == LLMStatusCode.LLM_TIMEOUT
        after = switching.call(switch_load.role_state)
        assert (after["role"], after["epoch"], after["phase"]) == (before["role"], 0, "ready"), (before, after)
        # rolled back with the transfer still in flight: the requests it sent are held at the relay
        # (the read is cancelled, but ends only once their answers are read)
        assert after[counter] >= 1
        assert relay.forwarded[direction] < BIG_ROWS * BIG_ROW, relay.forwarded  # it could not have completed
        assert decoder.call(switch_load.finish_transfer, 0) is None  # still running
        relay.release()
        outcome = decoder.call_within(hang_guard(TRANSFER_TIMEOUT_MS), switch_load.finish_transfer,
                                      hang_guard(TRANSFER_TIMEOUT_MS) / 2)
        if op == "read":  # the switching side's own transfer: cancelled at its next cancel point
            assert outcome == "cancelled"
            assert relay.forwarded[direction] < BIG_ROWS * BIG_ROW, relay.forwarded
        else:  # the peer's write, one request admitted before the switch: it completes
            assert outcome == "ok"
            assert relay.forwarded[direction] >= BIG_ROWS * BIG_ROW
    after_dst = dst.call(native.snapshot, "big")
    new = [b for b in range(BIG_ROWS) if _row_is(after_dst, src0, b) and not _row_is(after_dst, dst0, b)]
    assert_same(after_dst, dst0.with_rows(src0, [(b, b) for b in new]), f"the destination of the {op} held across "
                "the rollback (each row old or new)")
    assert len(new) == BIG_ROWS if op == "write" else len(new) < BIG_ROWS, len(new)
    assert_same(src.call(native.snapshot, "big"), src0, f"the source of the {op}")
    wait_until(lambda: switching.call(switch_load.role_state)["pins"] == 0, 30, "no pins left")
    # the rolled-back engine switches as usual
    state = switching.call_within(SWITCH_GUARD_S, switch_load.switch, role, 0)
    assert (state["role"], state["epoch"], state["phase"]) == (role, 1, "ready"), state


TORN_ROWS = 96  # 24 MiB: 1 MiB chunks (pdlink.TcpChunkBytes' default), several on each of the link's streams
HOLDER_ROWS = 32  # 8 MiB: more than the relay lets through before it holds


@only("cpu-tcp")
@pytest.mark.one_host("the decoders link through relays in the test process")
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_transfer_begun_before_the_drain_finishes(peers: Callable[..., Peer], variant: Variant, op: str) -> None:
    """Two decoders, each linked to the prefill through a relay of its own. The second holds the
    drain open: an 8 MiB write of it, held at its relay, is being served when the prefill is told to
    switch (30 s drain timeout). The first's 24 MiB read (or write) began before the switch and was
    held at its relay; with the switch seen draining, its relay lets it go: it completes, byte-exact
    (begun before the drain, it is drained, not refused). Then the second's write is let go and the
    switch commits. Both links' lanes are open first (a whole-region transfer each), as on any link
    that moved a large transfer."""
    prefill = peers("prefill", env=variant.env())
    port = prefill.call(native.start, TARGET, listen=True, timeout_ms=TRANSFER_TIMEOUT_MS, role="PROMPT")
    remote = prefill.call(native.register, "big", TORN_ROWS, BIG_ROW, seed=3, key=7)
    holder_remote = prefill.call(native.register, "sink", HOLDER_ROWS, BIG_ROW, seed=None, key=8)
    first, holder = peers("first", env=variant.env()), peers("holder", env=variant.env())
    first.call(native.start, INITIATOR, timeout_ms=TRANSFER_TIMEOUT_MS, role="DECODER")
    first.call(native.register, "big", TORN_ROWS, BIG_ROW, seed=4)
    holder.call(native.start, INITIATOR + 1, timeout_ms=TRANSFER_TIMEOUT_MS, role="DECODER")
    holder.call(native.register, "big", HOLDER_ROWS, BIG_ROW, seed=5)
    (src, dst), direction = ((prefill, first), DOWN) if op == "read" else ((first, prefill), UP)
    with Relay(port) as relay, Relay(port) as holder_relay:
        for side, r, name, target, how in ((first, relay, "big", remote, op),
                                           (holder, holder_relay, "big", holder_remote, "write")):
            assert side.call(native.connect, r.port, TARGET) == TARGET
            side.call(switch_load.start_transfer, how, TARGET, name, target)  # opens the lanes
            assert side.call_within(60, switch_load.finish_transfer, 30) == "ok"
            assert side.call(native.links)[0].lanes == ("tcp x4",)
        dst.call(switch_load.fill, "big", 0x5A)  # what the first transfer moved, replaced
        src0, dst0 = src.call(native.snapshot, "big"), dst.call(native.snapshot, "big")
        forwarded0 = relay.forwarded[direction]
        relay.hold_after(direction, HELD_AFTER)
        first.call(switch_load.start_transfer, op, TARGET, "big", remote)
        assert relay.wait_held(direction) >= forwarded0 + HELD_AFTER
        holder_relay.hold_after(UP, HELD_AFTER)
        holder.call(switch_load.start_transfer, "write", TARGET, "big", holder_remote)
        holder_relay.wait_held(UP)
        # The first transfer is served already (a held write, or a split pull left open), so the
        # holder's write makes two: with one, the drain could begin before the holder's write and
        # refuse it uncounted while the relay still held its payload.
        wait_until(lambda: prefill.call(switch_load.role_state)["served_in_flight"] >= 2, 10,
                   "the holder's write being served")
        prefill.call(switch_load.start_switch, "DECODER", 0, TRANSFER_TIMEOUT_MS)
        wait_until(lambda: prefill.call(switch_load.role_state)["phase"] == "draining", 10, "the switch draining")
        assert relay.forwarded[direction] - forwarded0 < TORN_ROWS * BIG_ROW  # it could not have completed
        relay.release()
        outcome = first.call_within(hang_guard(TRANSFER_TIMEOUT_MS), switch_load.finish_transfer,
                                    hang_guard(TRANSFER_TIMEOUT_MS) / 2)
        state = prefill.call(switch_load.role_state)  # the holder kept the drain open throughout
        assert state["phase"] == "draining", (outcome, state, holder.call(switch_load.finish_transfer, 0),
                                              holder_relay.forwarded)
        holder_relay.release()
        held = holder.call_within(hang_guard(TRANSFER_TIMEOUT_MS), switch_load.finish_transfer,
                                  hang_guard(TRANSFER_TIMEOUT_MS) / 2)
        switched = prefill.call_within(hang_guard(TRANSFER_TIMEOUT_MS), switch_load.switch_outcome,
                                       hang_guard(TRANSFER_TIMEOUT_MS) / 2)
    assert (outcome, held, switched) == ("ok", "ok", "ok"), (outcome, held, switched)
    assert_same(dst.call(native.snapshot, "big"), dst0.with_rows(src0, [(b, b) for b in range(TORN_ROWS)]),
                f"the destination of the {op} begun before the drain")
    state = prefill.call(switch_load.role_state)
    assert (state["role"], state["epoch"], state["phase"]) == ("DECODER", 1, "ready"), state

"""Peer-side functions for the KV handoff tests (native/test_handoff.py): offers, claims, aborts,
holds and the race of a release and reuse against a late claim, on the engine and regions of
tests/peers/native.py (start it and register regions there first)::

    ticket = prefill.call(handoff.offer, "o", "src", [1, 2], "req-1")
    decode.call(handoff.claim, ticket, "dst", [5, 6])
    prefill.call(handoff.state, "o")            # (True, "claimed") once released

Offers are kept by a tag; errors raise in the test (``Peer.call``) with their status code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import pdlink
from peers import native
from peers.memory import device_memory_is_remote, direct_read, direct_write
from verify import differences

_state: dict[str, Any] = {"offers": {}, "pending": {}, "holding": None, "before": {}, "starting": {}}


def _region(name: str) -> pdlink.Region:
    return native._state["regions"][name].region


def offer(tag: str, name: str, blocks: Sequence[int], request_id: str, lease_ms: int | None = None) -> pdlink.Ticket:
    """Offers ``blocks`` of region ``name`` for ``request_id``; its ticket."""
    made = native._engine().offer(_region(name), list(blocks), request_id=request_id, lease_ms=lease_ms,
                                  on_release=lambda o: _state.setdefault("callbacks", []).append(o.reason))
    _state["offers"][tag] = made
    return made.ticket


def state(tag: str) -> tuple[bool, str | None]:
    """(released, reason) of offer ``tag``."""
    made = _state["offers"][tag]
    return made.released, made.reason


def callbacks() -> list[str]:
    """The reasons the offers' ``on_release`` callbacks were called with, in order."""
    return list(_state.get("callbacks", []))


def release(tag: str) -> None:
    _state["offers"][tag].release()


def claim(ticket: pdlink.Ticket, name: str, blocks: Sequence[int], timeout_ms: int | None = None) -> None:
    native._engine().claim(ticket, _region(name), list(blocks), timeout_ms=timeout_ms)


def claim_async(tag: str, ticket: pdlink.Ticket, name: str, blocks: Sequence[int]) -> None:
    _state["pending"][tag] = native._engine().claim_async(ticket, _region(name), list(blocks))


def cancel(tag: str) -> bool:
    return _state["pending"][tag].cancel()


def finish(tag: str, timeout: float = 60) -> tuple[str, str | None]:
    """The async claim's status and, when it failed, its status code's name."""
    pending = _state["pending"].pop(tag)
    try:
        pending.wait(timeout)
    except pdlink.TransferCancelled:
        return "CANCELLED", None
    except pdlink.LLMException as e:
        return "FAILED", pdlink.LLMStatusCode(e.status_code).name
    return "DONE", None


def abort(request_id: str, peer: int | None = None, reason: str = "") -> None:
    native._engine().abort(request_id, peer=peer, reason=reason)


def hold(tickets: Sequence[pdlink.Ticket]) -> None:
    native._engine().hold(list(tickets))


def start_holding(tickets: Sequence[pdlink.Ticket], period_ms: int) -> None:
    """Holds ``tickets`` every ``period_ms`` on a thread of its own until ``stop_holding`` (or the
    process dies)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period_ms / 1000):
            try:
                native._engine().hold(list(tickets))
            except pdlink.LLMException:
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    _state["holding"] = (stop, thread)


def stop_holding() -> None:
    stop, thread = _state["holding"]
    stop.set()
    thread.join(10)


def released() -> list[pdlink.HandoffEvent]:
    return native._engine().released()


def handoff_events() -> list[pdlink.HandoffEvent]:
    return native._engine().handoff_events()


def stats() -> dict[str, Any]:
    return native._engine().stats().as_dict()


# ---------------------------------------------------------------- the race (release + reuse vs a late claim)

def _fill(name: str, block: int, value: int) -> None:
    region = _region(name)
    direct_write(region.address + block * region.block_size, np.full(region.block_size, value, np.uint8),
                 device_memory_is_remote())


def race_offer(tag: str, name: str, block: int, value: int, request_id: str) -> pdlink.Ticket:
    """Writes ``value`` over block ``block`` of region ``name``, then offers it."""
    _fill(name, block, value)
    return offer(tag, name, [block], request_id)


def race_release_and_reuse(tag: str, name: str, block: int, reuse: int, delay_s: float = 0.0) -> str:
    """``delay_s`` after the call arrives, releases offer ``tag`` (unless a claim already did), waits
    until it is released, then reuses its block at once: writes ``reuse`` over it. Its reason."""
    made = _state["offers"].pop(tag)
    time.sleep(delay_s)  # places the release within a claim's run (a schedule, not a wait for a condition)
    made.release()
    assert made.wait(30), "the offer was not released within 30 s"
    _fill(name, block, reuse)
    return str(made.reason)


def race_claim(tag: str, ticket: pdlink.Ticket, name: str, block: int, delay_s: float = 0.0) -> None:
    """Snapshots region ``name`` whole, then returns; ``delay_s`` later (a schedule, not a wait for
    a condition) a thread starts the claim of ``ticket`` into ``block`` (``race_verdict`` waits)."""
    _state["before"][tag] = native.snapshot(name)

    def start() -> None:
        time.sleep(delay_s)
        claim_async(tag, ticket, name, [block])

    _state["starting"][tag] = threading.Thread(target=start, name=f"race-claim-{tag}")
    _state["starting"][tag].start()


def race_verdict(tag: str, name: str, block: int, value: int) -> str:
    """What the claim ``tag`` did: "claimed" (the whole region is what it was but block ``block``,
    which holds ``value`` in every byte), "refused" (it failed with LLM_OFFER_RELEASED and the
    region is unchanged), "refused, landed" (it failed with LLM_OFFER_RELEASED and the region is as
    a claim leaves it: an abort that arrived after the last read was served), or what went wrong."""
    _state["starting"].pop(tag).join()
    status, code = finish(tag)
    before = _state["before"].pop(tag)
    after = native.snapshot(name)
    region = _region(name)
    expected = before.with_tensor_bytes(0, block * region.block_size, np.full(region.block_size, value, np.uint8))
    if status == "DONE":
        got = direct_read(region.address + block * region.block_size, region.block_size, device_memory_is_remote())
        wrong = differences(after, expected)
        if not np.all(got == value) or wrong:
            return f"claimed, but the destination is wrong: {wrong[:3]} (block values {np.unique(got)[:5]})"
        return "claimed"
    if code == "LLM_OFFER_RELEASED":
        # unchanged first: the block may hold this value already (an earlier claim of the same
        # block and value), and then nothing tells the two apart; "refused" is true either way
        if not differences(after, before):
            return "refused"
        if not differences(after, expected):
            return "refused, landed"
        return f"refused, but the destination changed: {differences(after, before)[:3]}"
    return f"{status} {code}"


def race_abort(tag: str, request_id: str, delay_s: float = 0.0) -> str:
    """``delay_s`` after the call arrives, aborts ``request_id`` (this engine's offer ``tag`` of it,
    and every linked peer is told), waits until the offer is released; its reason."""
    made = _state["offers"].pop(tag)
    time.sleep(delay_s)  # places the abort within a claim's run (a schedule, not a wait for a condition)
    abort(request_id)
    assert made.wait(30), "the offer was not released within 30 s"
    return str(made.reason)

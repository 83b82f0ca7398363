"""KV handoffs (``pdlink.Engine.offer`` / ``claim`` / ``abort`` / ``hold``, docs/native_api.md,
"Handoffs"), between real processes on every backend and data path (the ``variant`` fixture): an
offer claimed moves exact bytes (whole destination and guards checked) and is released "claimed";
a claim after a release, an expiry or an abort fails with exactly ``LLM_OFFER_RELEASED`` and lands
nothing; a lease expires, a hold keeps it alive past it, a killed decoder's link releases its
offers "link_down" long before the lease; aborts from either side reach the other; another
decoder cannot claim a bound offer; a cancelled claim leaves the offer claimable; and the race of
a release and reuse against a late claim never serves a stale byte (``RACE_ITERATIONS`` times,
``HEAVY_RACE_ITERATIONS`` with the heavy tests)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

import pytest

import internals
import pdlink
from backend_env import Variant, peer_env
from conftest import only
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import handoff, native
from poll import wait_until
from verify import Snapshot, check_transfer, nothing, rows

PREFILL, DECODER, OTHER = 1, 2, 3
ROWS, ROW = 8, 256
KEY = 7
RACE_ITERATIONS = 300  # the default run's race of release + reuse against a late claim
HEAVY_RACE_ITERATIONS = 10_000  # the number, with the heavy tests
REUSE = 0xEE  # what a reused block is overwritten with


class Two:
    """A listening prefill engine with region "src" (filled, published under KEY) and a decoder
    engine with region "dst" (filled with another pattern), not linked: a claim links by itself."""

    def __init__(self, peers: Callable[..., Peer], variant: Variant, prefill_limits: dict[str, int] | None = None):
        self.peers = peers
        self.variant = variant
        self.prefill = peers("prefill", env=variant.env())
        self.decode = peers("decode", env=variant.env())
        self.port = self.prefill.call(native.start, PREFILL, listen=True, limits=prefill_limits)
        self.prefill.call(native.register, "src", ROWS, ROW, seed=1, key=KEY)
        self.decode.call(native.start, DECODER)
        self.decode.call(native.register, "dst", ROWS, ROW, seed=2)

    def link(self) -> None:
        assert self.decode.call(native.connect, self.port, PREFILL) == PREFILL

    def src(self) -> Callable[[], Snapshot]:
        return lambda: self.prefill.call(native.snapshot, "src")

    def dst(self, side: Peer | None = None) -> Callable[[], Snapshot]:
        return lambda: (side or self.decode).call(native.snapshot, "dst")


@pytest.fixture
def two(peers: Callable[..., Peer], variant: Variant) -> Iterator[Two]:
    yield Two(peers, variant)


def _released(side: Peer, tag: str, reason: str, timeout: float = 20) -> None:
    def done() -> tuple[bool, str | None] | None:
        now = side.call(handoff.state, tag)
        return now if now[0] else None

    got = wait_until(done, timeout, f"offer {tag} released")
    assert got == (True, reason)


def _refused_claim(two: Two, ticket: pdlink.Ticket, blocks: list[int]) -> LLMException:
    """A claim that must fail with exactly LLM_OFFER_RELEASED and land nothing (check_transfer checks
    the whole destination and the source when the action raises)."""
    with pytest.raises(LLMException) as e:
        check_transfer(two.src(), two.dst(), lambda: two.decode.call(handoff.claim, ticket, "dst", blocks), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_OFFER_RELEASED, str(e.value)
    assert isinstance(e.value, pdlink.OfferReleased)
    return e.value


def test_an_offer_claimed_moves_exact_bytes_and_is_released_claimed(two: Two) -> None:
    ticket = two.prefill.call(handoff.offer, "o", "src", [4, 1, 2], "req-1")
    assert ticket.blocks == (1, 2, 4) and ticket.key == KEY and ticket.request_id == "req-1"
    assert two.prefill.call(handoff.stats)["offers_live"] == 1
    assert two.prefill.call(handoff.stats)["offer_bytes"] == 3 * ROW
    check_transfer(two.src(), two.dst(), lambda: two.decode.call(handoff.claim, ticket, "dst", [5, 6, 0]),
                   rows([(1, 5), (2, 6), (4, 0)]))
    _released(two.prefill, "o", "claimed")
    assert two.prefill.call(handoff.callbacks) == ["claimed"]
    assert two.prefill.call(handoff.released) == [
        pdlink.HandoffEvent("released", DECODER, "req-1", "claimed", ticket.offer_id)]
    stats = two.prefill.call(handoff.stats)
    assert (stats["offers_live"], stats["offers_released"], stats["offer_bytes"]) == (0, 1, 0)
    assert two.prefill.call(native.role_state)["offers"] == 0


@pytest.mark.parametrize("how", ["claimed", "released", "expired", "aborted"])
def test_a_claim_of_an_offer_that_is_over_is_refused_and_lands_nothing(two: Two, how: str) -> None:
    two.link()
    ticket = two.prefill.call(handoff.offer, "o", "src", [3], "req-2", 200 if how == "expired" else None)
    if how == "claimed":
        two.decode.call(handoff.claim, ticket, "dst", [3])
    elif how == "released":
        two.prefill.call(handoff.release, "o")
    elif how == "aborted":
        two.prefill.call(handoff.abort, "req-2")
    _released(two.prefill, "o", how)
    _refused_claim(two, ticket, [0])


def test_a_ticket_with_a_wrong_generation_or_blocks_outside_the_offer_is_refused(two: Two) -> None:
    import dataclasses

    ticket = two.prefill.call(handoff.offer, "o", "src", [2, 3], "req-3")
    _refused_claim(two, dataclasses.replace(ticket, generation=ticket.generation ^ 1), [0, 1])
    _refused_claim(two, dataclasses.replace(ticket, blocks=(2, 4)), [0, 1])
    _refused_claim(two, dataclasses.replace(ticket, offer_id=ticket.offer_id + 1), [0, 1])
    assert two.prefill.call(handoff.state, "o") == (False, None)  # the offer itself is untouched
    check_transfer(two.src(), two.dst(), lambda: two.decode.call(handoff.claim, ticket, "dst", [0, 1]),
                   rows([(2, 0), (3, 1)]))


def test_a_lease_expires_and_a_hold_keeps_the_offer_past_it(two: Two) -> None:
    lease_ms = 300
    two.link()
    ticket = two.prefill.call(handoff.offer, "held", "src", [1], "req-4", lease_ms)
    two.decode.call(handoff.start_holding, [ticket], 50)
    start = time.monotonic()
    # polled: the offer is still live three leases after it was made (each hold extended it)
    wait_until(lambda: two.prefill.call(handoff.state, "held")[0] or time.monotonic() - start > 3 * lease_ms / 1000,
               10, "three leases passed")
    assert two.prefill.call(handoff.state, "held") == (False, None)
    two.decode.call(handoff.stop_holding)
    _released(two.prefill, "held", "expired")
    assert two.prefill.call(handoff.stats)["offers_expired"] == 1
    _refused_claim(two, ticket, [1])


def test_a_killed_decoders_offers_are_released_link_down_long_before_the_lease(two: Two) -> None:
    two.link()
    ticket = two.prefill.call(handoff.offer, "o", "src", [1, 2], "req-5", 600_000)
    two.decode.call(handoff.hold, [ticket])  # binds the offer to the decoder's link
    two.decode.kill()
    _released(two.prefill, "o", "link_down", timeout=20)  # the lease is 600 s
    (event,) = two.prefill.call(handoff.released)
    assert (event.reason, event.peer, event.request_id) == ("link_down", DECODER, "req-5")


def test_an_abort_from_the_decoder_releases_the_offer_and_tells_the_prefill(two: Two) -> None:
    two.link()
    ticket = two.prefill.call(handoff.offer, "o", "src", [0], "req-6")
    two.decode.call(handoff.abort, "req-6", None, "client went away")
    _released(two.prefill, "o", "peer_aborted")
    assert two.prefill.call(handoff.handoff_events) == [
        pdlink.HandoffEvent("aborted", DECODER, "req-6", "client went away")]
    assert two.prefill.call(handoff.stats)["offers_aborted"] == 1
    _refused_claim(two, ticket, [0])


def test_an_abort_from_the_prefill_tells_the_decoder_and_its_later_claim_fails(two: Two) -> None:
    two.link()
    ticket = two.prefill.call(handoff.offer, "o", "src", [0], "req-7")
    two.prefill.call(handoff.abort, "req-7", DECODER, "preempted")
    _released(two.prefill, "o", "aborted")
    assert two.decode.call(handoff.handoff_events) == [pdlink.HandoffEvent("aborted", PREFILL, "req-7", "preempted")]
    e = _refused_claim(two, ticket, [0])
    assert "aborted" in str(e)


def test_another_decoder_cannot_claim_a_bound_offer(two: Two) -> None:
    other = two.peers("other", env=two.variant.env())
    other.call(native.start, OTHER)
    other.call(native.register, "dst", ROWS, ROW, seed=3)
    two.link()
    assert other.call(native.connect, two.port, PREFILL) == PREFILL
    ticket = two.prefill.call(handoff.offer, "o", "src", [5], "req-8")
    two.decode.call(handoff.hold, [ticket])  # bound to the decoder's link
    with pytest.raises(LLMException) as e:
        check_transfer(two.src(), two.dst(other), lambda: other.call(handoff.claim, ticket, "dst", [5]), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_OFFER_RELEASED
    assert "another link" in str(e.value)
    assert two.prefill.call(handoff.state, "o") == (False, None)
    check_transfer(two.src(), two.dst(), lambda: two.decode.call(handoff.claim, ticket, "dst", [5]), rows([(5, 5)]))
    _released(two.prefill, "o", "claimed")


def test_claims_over_the_prefills_own_link_confirm_it_once(peers: Callable[..., Peer], variant: Variant) -> None:
    """The prefill dialled the decoder (no link secret): an accepted link's cluster id is only a
    claim, so the decoder's first claim dials the ticket's address, where the prefill confirms the
    link (LLM_ALREADY_LINK, the spare link closed); from then on the link is ``confirmed`` and later
    claims pull over it (docs/security.md, "Identities": a confirmed link answers at once)."""
    prefill, decode = peers("prefill", env=variant.env()), peers("decode", env=variant.env())
    prefill.call(native.start, PREFILL, listen=True)
    prefill.call(native.register, "src", ROWS, ROW, seed=1, key=KEY)
    dport = decode.call(native.start, DECODER, listen=True)
    decode.call(native.register, "dst", ROWS, ROW, seed=2)
    assert prefill.call(native.connect, dport, DECODER) == DECODER
    assert [(link.initiator, link.confirmed) for link in decode.call(native.links)] == [(False, False)]
    src, dst = (lambda: prefill.call(native.snapshot, "src")), (lambda: decode.call(native.snapshot, "dst"))
    for n, (remote, local) in enumerate([(3, 6), (4, 1)]):
        ticket = prefill.call(handoff.offer, f"o{n}", "src", [remote], f"req-c{n}")
        claim = functools.partial(decode.call, handoff.claim, ticket, "dst", [local])
        check_transfer(src, dst, claim, rows([(remote, local)]))
        _released(prefill, f"o{n}", "claimed")
        assert [(link.initiator, link.confirmed) for link in decode.call(native.links)] == [(False, True)]
    wait_until(lambda: [link.initiator for link in prefill.call(native.links)] == [True], 20,
               "the spare link gone from the prefill")


def test_a_cancelled_claim_leaves_the_offer_claimable_again(peers: Callable[..., Peer], variant: Variant) -> None:
    """A claim of 32 MiB (four cancel slices: more than a cancel right after the start can miss) is
    cancelled: the offer stays live, and the same decoder's next claim moves exact bytes."""
    rows_, row = 32, 1 << 20
    prefill = peers("prefill", env=variant.env())
    decode = peers("decode", env=variant.env())
    port = prefill.call(native.start, PREFILL, listen=True, timeout_ms=30000)
    prefill.call(native.register, "src", rows_, row, seed=1, key=KEY)
    decode.call(native.start, DECODER, timeout_ms=30000)
    decode.call(native.register, "dst", rows_, row, seed=2)
    assert decode.call(native.connect, port, PREFILL) == PREFILL
    cancelled = 0
    for attempt in range(5):
        tag = f"o{attempt}"
        ticket = prefill.call(handoff.offer, tag, "src", list(range(rows_)), f"big-{attempt}")
        decode.call(handoff.claim_async, tag, ticket, "dst", list(range(rows_)))
        decode.call(handoff.cancel, tag)
        status, code = decode.call(handoff.finish, tag)
        if status == "DONE":  # the cancel came after the last request: claimed, as any claim
            _released(prefill, tag, "claimed")
            continue
        assert (status, code) == ("CANCELLED", None)
        cancelled += 1
        assert prefill.call(handoff.state, tag) == (False, None)  # still live
        check_transfer(lambda: prefill.call(native.snapshot, "src"), lambda: decode.call(native.snapshot, "dst"),
                       functools.partial(decode.call_within, 120, handoff.claim, ticket, "dst", list(range(rows_))),
                       rows([(b, b) for b in range(rows_)]))
        _released(prefill, tag, "claimed")
        break
    assert cancelled == 1, "no claim was cancelled before its last request in 5 attempts"


def _claim_seconds(two: Two, n: int = 5) -> float:
    """The median time a claim of one block takes on this (warm) link, as the test sees it (the
    call to the decoder included): the scale of the window a race's two sides are placed in."""
    took = []
    for k in range(n):
        ticket = two.prefill.call(handoff.offer, f"time{k}", "src", [k % ROWS], f"time-{k}")
        start = time.monotonic()
        two.decode.call(handoff.claim, ticket, "dst", [k % ROWS])
        took.append(time.monotonic() - start)
        _released(two.prefill, f"time{k}", "claimed")
    return sorted(took)[n // 2]


# How a race's two sides are placed: iteration i puts the prefill's side (a release, an abort) at
# an offset from the start of the decoder's claim that sweeps RACE_STEPS points from -RACE_SPREAD to
# +RACE_SPREAD claim times (delaying the claim for a negative offset, the other side for a positive
# one), so on a fast machine or a sanitized one some come well before the claim, some cross it and
# some come after it.
RACE_STEPS = 11
RACE_SPREAD = 2.0


def _race_delays(two: Two, iterations: int) -> Iterator[tuple[float, float]]:
    """(the claim's delay, the other side's delay) of each iteration, on a linked and warm pair."""
    window = _claim_seconds(two) * RACE_SPREAD
    for i in range(iterations):
        offset = window * (2 * (i % RACE_STEPS) / (RACE_STEPS - 1) - 1)
        yield max(0.0, -offset), max(0.0, offset)


def _race(two: Two, iterations: int) -> None:
    two.link()
    _warm(two)
    verdicts: dict[str, int] = {}
    for i, (claim_delay, release_delay) in enumerate(_race_delays(two, iterations)):
        block, value, tag = i % ROWS, i % 200 + 1, f"r{i}"
        ticket = two.prefill.call(handoff.race_offer, tag, "src", block, value, f"race-{i}")
        two.decode.call(handoff.race_claim, tag, ticket, "dst", block, claim_delay)
        two.prefill.call(handoff.race_release_and_reuse, tag, "src", block, REUSE, release_delay)
        verdict = two.decode.call(handoff.race_verdict, tag, "dst", block, value)
        assert verdict in ("claimed", "refused"), f"iteration {i}: {verdict} (so far {verdicts})"
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
    assert sum(verdicts.values()) == iterations
    # the race was run: some claims came before the release, some after it
    assert verdicts.get("claimed", 0) > 0 and verdicts.get("refused", 0) > 0, verdicts
    stats = two.prefill.call(handoff.stats)
    assert (stats["offers_live"], stats["offer_bytes"]) == (0, 0), stats


def test_release_and_reuse_racing_a_late_claim_never_serves_a_stale_byte(two: Two) -> None:
    _race(two, RACE_ITERATIONS)


@pytest.mark.heavy
def test_release_and_reuse_racing_a_late_claim_10000_times(two: Two) -> None:
    _race(two, HEAVY_RACE_ITERATIONS)


ABORT_RACE_ITERATIONS = 100
# What an abort from the prefill racing a claim may end in (docs/native_api.md, "Handoffs"): (the
# claim's verdict, the offer's reason). The claim ran first (claimed, claimed); the abort came first
# (refused: nothing landed, aborted); or the two crossed: the claim landed every byte and its commit
# came after the abort (claimed, aborted), or the abort reached the decoder before the claim
# returned (refused, landed: every byte landed and the claim still fails), its commit reaching the
# prefill after the abort or before it (aborted or claimed).
ABORT_RACE_OUTCOMES = {("claimed", "claimed"), ("refused", "aborted"), ("claimed", "aborted"),
                       ("refused, landed", "aborted"), ("refused, landed", "claimed")}


def test_an_abort_racing_a_claim_ends_in_one_of_the_documented_outcomes(two: Two) -> None:
    """The prefill aborts a request while the decoder's claim of it runs, ``ABORT_RACE_ITERATIONS``
    times, the aborts spread over a claim's run: each time the pair of outcomes is one of
    ``ABORT_RACE_OUTCOMES``; a claim that fails leaves the destination as it was or as a claim
    leaves it (the offer's bytes), never anything else; nothing stays live."""
    two.link()
    _warm(two)
    seen: dict[tuple[str, str], int] = {}
    for i, (claim_delay, abort_delay) in enumerate(_race_delays(two, ABORT_RACE_ITERATIONS)):
        block, value, tag = i % ROWS, i % 200 + 1, f"a{i}"
        ticket = two.prefill.call(handoff.race_offer, tag, "src", block, value, f"abort-race-{i}")
        two.decode.call(handoff.race_claim, tag, ticket, "dst", block, claim_delay)
        reason = two.prefill.call(handoff.race_abort, tag, f"abort-race-{i}", abort_delay)
        verdict = two.decode.call(handoff.race_verdict, tag, "dst", block, value)
        assert (verdict, reason) in ABORT_RACE_OUTCOMES, f"iteration {i}: {(verdict, reason)} (so far {seen})"
        seen[(verdict, reason)] = seen.get((verdict, reason), 0) + 1
    # the race was run: some claims ran before the abort, some after it
    assert any(v == "claimed" for v, _ in seen) and any(v.startswith("refused") for v, _ in seen), seen
    stats = two.prefill.call(handoff.stats)
    assert (stats["offers_live"], stats["offer_bytes"]) == (0, 0), stats


def _warm(two: Two) -> None:
    """A claim of an offer of block 7 into the decoder's block 7: the link's data path is set up
    (on ucx, its first transfer connects the path)."""
    warm = two.prefill.call(handoff.offer, "warm", "src", [7], "req-warm")
    check_transfer(two.src(), two.dst(), lambda: two.decode.call(handoff.claim, warm, "dst", [7]), rows([(7, 7)]))
    _released(two.prefill, "warm", "claimed")


def test_a_role_switch_drains_live_offers(two: Two) -> None:
    """A live offer holds a switch's drain: past its timeout the switch rolls back (LLM_TIMEOUT,
    nothing changed). While a switch drains, a new offer is refused with LLM_ROLE_SWITCHING, and a
    claim of a live offer is served (the drain waits for it): claimed, the switch commits. (The
    link has moved bytes before: see the next test for a ucx link that has not.)"""
    two.link()
    _warm(two)
    ticket = two.prefill.call(handoff.offer, "o", "src", [0], "req-9")
    with pytest.raises(LLMException) as e:
        two.prefill.call(native.switch_role, "PROMPT", True, None, 200)
    assert e.value.status_code == LLMStatusCode.LLM_TIMEOUT
    state = two.prefill.call(native.role_state)
    assert (state["role"], state["epoch"], state["phase"], state["offers"]) == ("MIX", 0, "ready", 1)
    two.prefill.call(native.switch_role_async, "PROMPT", drain_timeout_ms=60_000)
    wait_until(lambda: two.prefill.call(native.role_state)["phase"] == "draining", 10, "the switch draining")
    with pytest.raises(LLMException) as e:
        two.prefill.call(handoff.offer, "late", "src", [1], "req-10")
    assert e.value.status_code == LLMStatusCode.LLM_ROLE_SWITCHING
    check_transfer(two.src(), two.dst(), lambda: two.decode.call(handoff.claim, ticket, "dst", [3]), rows([(0, 3)]))
    outcome, _, _, after = two.prefill.call(native.switch_result, 60)
    assert (outcome, after["role"], after["epoch"], after["offers"]) == ("ok", "PROMPT", 1, 0)
    _released(two.prefill, "o", "claimed")


@only("cpu-ucx", "cpu-ucx-sm")
def test_on_ucx_a_claim_that_would_set_up_the_path_is_refused_while_draining(two: Two) -> None:
    """Documented (docs/native_api.md, "Handoffs"): a ucx link's first transfer connects its path (a
    path connect, which a draining engine refuses like any new setup), so a claim that is a fresh
    link's first transfer fails with LLM_ROLE_SWITCHING while the prefill drains, landing nothing;
    the offer stays live (the switch then rolls back at its timeout), and once the switch is over
    the same claim lands."""
    two.link()
    ticket = two.prefill.call(handoff.offer, "o", "src", [0], "req-11")
    two.prefill.call(native.switch_role_async, "PROMPT", drain_timeout_ms=1500)
    wait_until(lambda: two.prefill.call(native.role_state)["phase"] == "draining", 10, "the switch draining")
    with pytest.raises(LLMException) as e:
        check_transfer(two.src(), two.dst(), lambda: two.decode.call(handoff.claim, ticket, "dst", [3]), nothing)
    assert e.value.status_code == LLMStatusCode.LLM_ROLE_SWITCHING, str(e.value)
    outcome, code, _, after = two.prefill.call(native.switch_result, 60)
    assert (outcome, code, after["role"], after["offers"]) == ("TransferTimeout", LLMStatusCode.LLM_TIMEOUT, "MIX", 1)
    check_transfer(two.src(), two.dst(), lambda: two.decode.call(handoff.claim, ticket, "dst", [3]), rows([(0, 3)]))
    _released(two.prefill, "o", "claimed")


def test_the_handoff_bounds_and_their_defaults(peers: Callable[..., Peer]) -> None:
    """Defaults from the engine; past max_offers an offer is refused (LLM_OUT_OF_MEMORY, nothing
    retained) until one is released; a lease past max_lease_ms, blocks out of range and an offer of
    a region without a key are refused."""
    limits = internals.core.EngineLimits()
    assert (limits.max_offers, limits.max_lease_ms, limits.offer_lease_ms, limits.max_handoff_events) == (
        65536, 3_600_000, 60_000, 4096)
    side = peers("prefill", env=peer_env("cpu"))
    side.call(native.start, PREFILL, limits={"max_offers": 2, "max_lease_ms": 1000, "offer_lease_ms": 1000})
    side.call(native.register, "src", ROWS, ROW, seed=1, key=KEY)
    side.call(native.register, "plain", ROWS, ROW, seed=1)
    side.call(handoff.offer, "a", "src", [0], "r-a")
    side.call(handoff.offer, "b", "src", [1], "r-b")
    with pytest.raises(LLMException) as e:
        side.call(handoff.offer, "c", "src", [2], "r-c")
    assert e.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY and "max_offers" in str(e.value)
    assert side.call(handoff.stats)["offers_live"] == 2
    side.call(handoff.release, "a")
    _released(side, "a", "released")
    side.call(handoff.offer, "c", "src", [2], "r-c")
    for args in ((["src", [3], "r-d", 1001]), (["src", [ROWS], "r-d"]), (["src", [], "r-d"])):
        with pytest.raises(LLMException) as e:
            side.call(handoff.offer, "d", *args)
        assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, str(e.value)
    with pytest.raises(ValueError):
        side.call(handoff.offer, "d", "plain", [0], "r-d")

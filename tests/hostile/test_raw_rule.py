"""The raw-range rule (csrc/core/spans.h) under attack: one rule for the registry's resolution of a
peer's reads by address, the cma path's check of a peer's table, and ``MemoryMap.covers``. A victim
registers one guarded buffer as overlapping regions (tests/peers/overlaps.py); an attacker on a raw
link from 127.0.0.2 (tests/peers/hostile.py) reads by address (kRaw) with empty, wrapping, huge,
straddling and unsorted ranges; an honest engine asks ``remote_memory().covers`` and reads.

Held: nothing outside registered memory is served, the canaries and an unregistered secret are
unchanged, the victim keeps serving. Found (xfail, strict): the rule's candidate window
(``kRawCandidates`` = 16 ranges starting closest below an address) makes memory inside one
registered range "not covered" when 16 later-starting ranges shadow it, and ``_core.covers`` sorts
equal starts with an unstable sort, so it disagrees with the registry (a stable multimap) about the
same table.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import internals
import rawwire
from pdlink import LLMException
from pdlink import LLMStatusCode as S
from peer import Peer
from peers import hostile, kv, native, overlaps, spans
from verify import assert_same

TCP = {"PDLINK_TRANSPORT": "tcp"}
LIMITS = internals.core.LIMITS
VICTIM, HONEST = 1, 2
TOTAL = 4096
CANDIDATES = 16  # limits::kRawCandidates (not exposed in LIMITS)
U64 = 2**64


def setup(peers: Callable[..., Peer], layout: list[tuple[int, int]]) -> tuple[Peer, Peer, Peer, int]:
    victim = peers("victim", env=TCP)
    port = victim.call(native.start, VICTIM, listen=True)
    base = victim.call(overlaps.register_layout, TOTAL, layout, 5)
    honest = peers("honest", env=TCP)
    honest.call(native.start, HONEST)
    honest.call(native.register, "dst", 1, TOTAL, seed=2)
    assert honest.call(native.connect, port, VICTIM) == VICTIM
    attacker = peers("attacker")
    assert attacker.call(hostile.link_raw, port, 9) == (0, "")
    return victim, honest, attacker, base


def raw_read(runs: list[tuple[int, int]]) -> bytes:
    return spans.raw_read(runs)


def served(attacker: Peer, runs: list[tuple[int, int]]) -> bool:
    """Whether the victim serves a read of these absolute ranges (its registry's verdict); a drop of
    the link fails the test."""
    answer = attacker.call(spans.exchange, raw_read(runs))
    assert not isinstance(answer, str), runs  # "closed": the victim dropped the link
    status, message, plen, _digest = answer
    assert status in (0, S.LLM_PARAM_INVALID), answer
    assert (plen == sum(n for _, n in runs)) if status == 0 else plen == 0, answer
    return status == 0


def honest_reads(honest: Peer, runs: list[tuple[int, int]]) -> bool:
    try:
        honest.call(native.descriptors, VICTIM, "dst", [(0, n) for _, n in runs], runs, "read")
        return True
    except LLMException as e:
        assert e.status_code == S.LLM_PARAM_INVALID, e
        return False


def test_hostile_ranges_are_refused_and_nothing_outside_moves(peers: Callable[..., Peer]) -> None:
    """Overlapping and equal-start registrations; the attacker's ranges: empty, wrapping past 2^64,
    a length of 2^64-1, one byte before / after the buffer, the unregistered secret, a run across
    the whole buffer through its overlaps, unsorted and repeated runs. Everything outside is
    refused with nothing sent; everything inside is served byte-exact; the canaries hold."""
    layout = [(1024, 1024), (0, 2048), (0, 512), (2048, 2048), (2040, 16), (3000, 1)]
    victim, honest, attacker, base = setup(peers, layout)
    secret = victim.call(kv.plant_secret, 64)
    before = victim.call(overlaps.snapshot)
    end = base + TOTAL
    refused = [
        [(base, 0)], [(U64 - 8, 16)], [(base, U64 - base)], [(base + 1, U64 - 1)], [(base - 1, 2)],
        [(end - 1, 2)], [(end, 1)], [(secret[0], 64)], [(0, 1)], [(U64 - 1, 1)],
        [(base, 10), (base - 1, 1)], [(base + 100, 10)] * 1000 + [(end, 1)],
    ]
    for runs in refused:
        assert not served(attacker, runs), runs[:3]
    inside = [[(base, TOTAL)], [(end - 1, 1), (base, 1), (base + 1000, 2000)], [(base + 2040, 16)] * 64]
    for runs in inside:
        assert served(attacker, runs), runs[:3]
        if len(runs) == 1:  # byte-exact
            answer = attacker.call(spans.exchange, raw_read(runs))
            assert answer[3] == victim.call(overlaps.digest, runs[0][0] - base, runs[0][1])
    assert attacker.call(hostile.exchange, rawwire.request(rawwire.OP_PING, b"")) == (0, "", b"")
    assert honest_reads(honest, [(base, TOTAL)])
    assert_same(victim.call(overlaps.snapshot), before, "the victim's buffer and its guard bytes")
    assert victim.call(kv.secrets) == [secret[1]], "the victim's unregistered secret changed"


def _agreement(peers: Callable[..., Peer], layout: list[tuple[int, int]], query: list[tuple[int, int]]
               ) -> tuple[bool, bool, bool, bool]:
    victim, honest, attacker, base = setup(peers, layout)
    q = [(base + o, n) for o, n in query]
    return (victim.call(overlaps.local_covers, q), honest.call(overlaps.remote_covers, VICTIM, q),
            served(attacker, q), honest_reads(honest, q))


def test_covers_agrees_with_the_victim_when_the_big_range_is_registered_last(peers: Callable[..., Peer]) -> None:
    """16 one-block regions at the buffer's start, then the whole buffer at the same start: covers
    and the victim agree (served)."""
    layout = [(0, 64)] * CANDIDATES + [(0, TOTAL)]
    assert _agreement(peers, layout, [(0, 100)]) == (True, True, True, True)


@pytest.mark.xfail(strict=True, reason="finding: _core.covers std::sort()s equal starts unstably, the registry "
                                       "keeps them in registration order (multimap), and the rule looks at only "
                                       "16 candidates: covers says yes to a range the victim refuses")
def test_covers_agrees_with_the_victim_when_the_big_range_is_registered_first(peers: Callable[..., Peer]) -> None:
    """The whole buffer first, then 16 one-block regions at the same start: the victim refuses
    [start, +100) (the 16 candidates it looks at all end at 64); covers must say the same."""
    layout = [(0, TOTAL)] + [(0, 64)] * CANDIDATES
    local, remote, by_victim, honest = _agreement(peers, layout, [(0, 100)])
    assert local == remote == by_victim == honest, (local, remote, by_victim, honest)


@pytest.mark.xfail(strict=True, reason="finding: a range inside one registered range is refused when 16 "
                                       "later-starting registrations shadow it (kRawCandidates window), against "
                                       "the documented rule 'covered when it lies inside one registered range'")
def test_a_range_inside_one_registration_is_served_whatever_overlaps_it(peers: Callable[..., Peer]) -> None:
    """The whole buffer, then 16 small regions starting at 1..16 inside it: [200, +10) lies inside
    the first registration, so by the documented rule it is covered and served."""
    layout = [(0, TOTAL)] + [(1 + i, 8) for i in range(CANDIDATES)]
    assert _agreement(peers, layout, [(200, 10)]) == (True, True, True, True)


@pytest.mark.xfail(strict=True, reason="finding: _core.covers counts no steps (UINT64_MAX), the peer refuses a "
                                       "request past max_request_span_steps and Engine.read does not split by "
                                       "steps: covers says yes to a list the read is refused for")
def test_covers_of_a_list_past_the_request_step_bound_matches_the_read(peers: Callable[..., Peer]) -> None:
    """64 adjacent one-byte registrations; a descriptor list of ranges across all 64 and across 63
    of them in turn, past max_request_span_steps: ``MemoryMap.covers`` ("a list it accepts is one
    the peer accepts") and an honest ``Engine.read`` of that list must agree. (Lengths in turn: a
    list of one range repeated goes as one row of stride 0 (wire v10), which the peer checks once.)"""
    span = LIMITS["max_raw_span"]
    layout = [(i, 1) for i in range(span)]
    victim, honest, _attacker, base = setup(peers, layout)
    count = LIMITS["max_request_span_steps"] // (2 * span - 1) + 1
    q = [(base, span), (base, span - 1)] * count
    says = honest.call(overlaps.remote_covers, VICTIM, q)
    try:
        honest.call_within(120, native.descriptors, VICTIM, "dst", [(0, span), (0, span - 1)] * count, q, "read")
        read = True
    except LLMException as e:
        read = False
        assert e.status_code == S.LLM_PARAM_INVALID and "max_request_span_steps" in str(e), e
    assert says == read, (says, read)


def test_the_span_bound_is_exact_and_covers_agrees(peers: Callable[..., Peer]) -> None:
    """65 adjacent one-byte registrations, then an overlapping pair: a range across 64 of them is
    served, across 65 refused; a range across two overlapping registrations is served; covers
    (local and remote) agrees with the victim on each."""
    span = LIMITS["max_raw_span"]
    layout = [(i, 1) for i in range(span + 1)] + [(1000, 100), (1050, 100)]
    victim, honest, attacker, base = setup(peers, layout)
    for query, want in [([(0, span)], True), ([(1, span)], True), ([(0, span + 1)], False),
                        ([(1000, 150)], True), ([(1000, 151)], False), ([(999, 2)], False)]:
        q = [(base + o, n) for o, n in query]
        got = (victim.call(overlaps.local_covers, q), honest.call(overlaps.remote_covers, VICTIM, q),
               served(attacker, q), honest_reads(honest, q))
        assert got == (want,) * 4, (query, got)

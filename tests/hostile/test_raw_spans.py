"""Raw-span amplification (the hostile review's finding): a victim registers one buffer as 64 regions
that follow each other exactly, and attackers send reads of registered memory by address (kRaw)
whose every range runs across all 64, a quarter-million ranges per request (a 4 MiB body). Such a
request made the victim take one cache reference per step under the registry's shared lock (+1.1
GiB per four requests) and starve register() behind the readers. Now its steps are bounded per
request (max_request_span_steps): it is refused with the registry's exact answer, early; a request
at the bound is served; the victim's peak memory stays small, a register() in it completes while
the attacks run, an honest peer's reads across the same regions are byte-exact before, during and
after, and the canaries (the guard bytes around the buffer, an unregistered secret) are unchanged.

The victim and the honest peer are engines of pdlink's own API (tests/peers/native.py) over TCP;
the attackers are raw links from 127.0.0.2 (tests/peers/hostile.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import internals
from pdlink import LLMStatusCode as S
from peer import Peer
from peers import hostile, kv, native, spans
from poll import wait_until
from verify import Copy, Snapshot, assert_same

LIMITS = internals.core.LIMITS
SLICES = LIMITS["max_raw_span"]  # 64: a range may run across this many registrations
SLICE = 64  # bytes per registration: the whole buffer is 4 KiB
SPAN = SLICES * SLICE
PEAK_BOUND_KIB = 64 * 1024
# Resident memory means nothing under a sanitizer (ASan keeps freed memory in quarantine): the
# bounds on it are checked in plain runs only (.ci/sanitizers.sh sets PDLINK_SANITIZER).
MEMORY_BOUNDS = not os.environ.get("PDLINK_SANITIZER")
TCP = {"PDLINK_TRANSPORT": "tcp"}
VICTIM, HONEST = 1, 2


def honest_read(honest: Peer, base: int, victim_snapshot: Callable[[], Snapshot], label: str) -> None:
    """The honest peer reads three ranges across many of the victim's regions (by address, one
    descriptor list) and gets exactly their bytes; the rest of its buffer is unchanged."""
    descs = [(0, 0, SPAN), (SLICE - 3, SPAN + 5, 10 * SLICE + 7), (SPAN - 2 * SLICE - 1, 2 * SPAN - 300, 2 * SLICE)]
    src = victim_snapshot()
    dst0 = honest.call(native.snapshot, "dst")
    honest.call(native.descriptors, VICTIM, "dst", [(d, n) for _, d, n in descs], [(base + s, n) for s, _, n in descs],
                "read")
    expected = dst0.with_bytes(src, [Copy(0, s, 0, d, n) for s, d, n in descs])
    assert_same(honest.call(native.snapshot, "dst"), expected, f"the honest peer's buffer ({label})")


def test_a_request_of_ranges_across_64_registrations_is_bounded(peers: Callable[..., Peer]) -> None:
    victim = peers("victim", env=TCP)
    port = victim.call(native.start, VICTIM, listen=True)
    base = victim.call(spans.register_slices, SLICES, SLICE, 5)
    secret = victim.call(kv.plant_secret)
    before = victim.call(spans.snapshot)
    honest = peers("honest", env=TCP)
    honest.call(native.start, HONEST)
    honest.call(native.register, "dst", 8, SPAN // 4, seed=2)  # 8 KiB
    assert honest.call(native.connect, port, VICTIM) == VICTIM
    honest_read(honest, base, lambda: victim.call(spans.snapshot), "before")

    attackers = [peers(f"attacker{i}") for i in range(2)]
    for i, a in enumerate(attackers):
        assert a.call(hostile.link_raw, port, 9 + i) == (0, "")
    # The attack: every range [base, +4 KiB) runs across all 64 registrations; as many ranges as a
    # request may have (max_request_pieces, 4 MiB of body): 16.7 M steps, 16 times the bound.
    pieces = LIMITS["max_request_pieces"]
    attack = spans.raw_read(((base, SPAN), pieces))
    refusal = (f"the address ranges of this request run across more than {LIMITS['max_request_span_steps']} "
               "registrations in all (max_request_span_steps); split it into several requests")
    answer = attackers[0].call(spans.exchange, attack)
    assert answer[:3] == (S.LLM_PARAM_INVALID, refusal, 0), answer

    rss = victim.call(spans.reset_peak)
    for a in attackers:
        a.call(spans.start_attack, attack)
    wait_until(lambda: all(a.call(spans.attacks_answered) >= 2 for a in attackers), 120,
               "both attackers answered twice")
    # While they go on: registrations get the registry's lock, and honest reads are byte-exact.
    def registered(n: int) -> bool:
        return bool(victim.call(spans.registered, n))

    def attacked_since(answered: list[int]) -> bool:
        return all(a.call(spans.attacks_answered) > count for a, count in zip(attackers, answered))

    for _ in range(3):
        answered = [a.call(spans.attacks_answered) for a in attackers]
        n = victim.call(spans.start_register, 1 << 16)
        wait_until(functools.partial(registered, n), 10, "a register() in the victim during the attacks")
        honest_read(honest, base, lambda: victim.call(spans.snapshot), "during the attacks")
        wait_until(functools.partial(attacked_since, answered), 120, "the attacks still going on")
    results = [a.call_within(120, spans.stop_attack) for a in attackers]
    peak = victim.call(spans.peak_kib)
    assert peak - rss < PEAK_BOUND_KIB or not MEMORY_BOUNDS, f"the victim's peak memory grew by {peak - rss} KiB"
    for r in results:
        assert len(r) >= 4 and all(x[:3] == (S.LLM_PARAM_INVALID, refusal, 0) for x in r), r[:3]
    assert victim.call(spans.deregister_extra) == 3

    # A request at the bound is served, within the same memory bound: max_request_span_steps steps,
    # every range across all 64 registrations (64 MiB of answer).
    at_bound = LIMITS["max_request_span_steps"] // SLICES
    rss = victim.call(spans.reset_peak)
    served = attackers[1].call_within(120, spans.exchange, spans.raw_read(((base, SPAN), at_bound)))
    assert served == (0, "", at_bound * SPAN, victim.call(spans.digest, 0, SPAN, at_bound)), served[:3]
    assert victim.call(spans.peak_kib) - rss < PEAK_BOUND_KIB or not MEMORY_BOUNDS
    # one step more is refused
    over = spans.raw_read([(base, SPAN)] * at_bound + [(base, 1)])
    assert attackers[1].call(spans.exchange, over)[:3] == (S.LLM_PARAM_INVALID, refusal, 0)

    honest_read(honest, base, lambda: victim.call(spans.snapshot), "after")
    assert_same(victim.call(spans.snapshot), before, "the victim's buffer and its guard bytes")
    assert victim.call(kv.secrets) == [secret[1]], "the victim's unregistered secret changed"

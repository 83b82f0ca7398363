"""Strided rows on the wire (v10, docs/architecture.md "Wire protocol"): a TransferBody may carry its
runs as rows (offset, length, stride, count). A hostile peer (tests/peers/hostile.py) sends them to a
victim engine: a row is served exactly as the runs it holds, checked a row at a time; a row that
runs past what it addresses is refused with nothing moved, the link intact; a row that holds no run,
wraps, or holds more runs than a request may is a malformed frame and drops the link. After each,
an honest decoder linked to the victim pulls byte-exact.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import pytest

import internals
import rawwire
from conftest import Pair, only
from llm_datadist import LLMStatusCode
from peer import Peer
from peers import hostile, kv
from verify import assert_same

pytestmark = pytest.mark.one_host("the attacker is the test process")
SHAPE = (16, 4096)
TENSOR_BYTES = SHAPE[0] * SHAPE[1] * 2
S = LLMStatusCode
LIMITS = internals.core.LIMITS
U64 = 2**64
# (offset, length, stride, count): a plain row, the same bytes three times (stride 0), runs that
# overlap (stride < length), one run
READ_ROWS = [(100, 16, 40, 5), (4096, 8, 0, 3), (8192, 32, 16, 4), (TENSOR_BYTES - 64, 64, 64, 1)]


@pytest.fixture
def victim(pair: Pair) -> Pair:
    """The prefill (the victim) with a blocks cache and an honest decoder linked to it."""
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=Pair.KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    pair.link()
    pair.pulled([0])
    return pair


def attacker_links(peers: Callable[..., Peer], pair: Pair) -> Peer:
    a = peers("attacker")
    unix = a.call(hostile.redirect_name, pair.port) if pair.variant.same_host else None
    assert a.call(hostile.link_raw, pair.port, 9, b"", unix) == (0, "")
    return a


def runs_of(rows: list[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    return [(o + k * stride, n) for o, n, stride, count in rows for k in range(count)]


def pong(a: Peer) -> bool:
    return a.call(hostile.exchange, rawwire.request(rawwire.OP_PING, b"")) == (0, "", b"")


@only("cpu-tcp", "cpu-cma")
def test_a_read_by_rows_answers_exactly_the_runs_they_hold(peers: Callable[..., Peer], victim: Pair) -> None:
    """Tensor-major, run by run, as the same runs sent as pairs; the cache unchanged."""
    a = attacker_links(peers, victim)
    before = victim.prefill.call(kv.snapshot, "kv")
    body = rawwire.rows_body(READ_ROWS, tensors=(1, 0))
    answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body))
    assert isinstance(answer, tuple) and answer[:2] == (0, ""), answer
    want = b"".join(before.tensor(t)[o:o + n].tobytes() for t in (1, 0) for o, n in runs_of(READ_ROWS))
    assert answer[2] == want
    pairs = rawwire.blocks_body(tensors=(1, 0), runs=runs_of(READ_ROWS))
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, pairs)) == answer
    assert_same(victim.prefill.call(kv.snapshot, "kv"), before, "the victim's cache")
    victim.pulled([1])


@only("cpu-tcp", "cpu-cma")
def test_a_write_by_rows_lands_exactly_its_runs(peers: Callable[..., Peer], victim: Pair) -> None:
    a = attacker_links(peers, victim)
    before = victim.prefill.call(kv.snapshot, "kv")
    rows = [(200, 16, 48, 4), (9000, 8, 8, 6), (12000, 8, 0, 3)]  # the last: one place three times, the last stays
    runs = runs_of(rows)
    payload = np.random.default_rng(5).integers(0, 256, 2 * sum(n for _, n in runs), dtype=np.uint8)
    body = rawwire.rows_body(rows, tensors=(0, 1))
    answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_WRITE, body, payload_len=len(payload))
                    + payload.tobytes())
    assert answer == (0, "", b""), answer
    want, at = before, 0
    for t in (0, 1):
        for o, n in runs:
            want = want.with_tensor_bytes(t, o, payload[at:at + n])
            at += n
    assert_same(victim.prefill.call(kv.snapshot, "kv"), want, "the victim's cache after a write by rows")
    victim.pulled([1])


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_row_that_runs_past_the_cache_is_refused_and_moves_nothing(peers: Callable[..., Peer], victim: Pair,
                                                                     op: str) -> None:
    """Its first runs lie inside the tensor, its last one not: the whole request is refused with the
    span it names (one check for the row), nothing is read or written, and the link serves on."""
    a = attacker_links(peers, victim)
    before = victim.prefill.call(kv.snapshot, "kv")
    row = (TENSOR_BYTES - 200, 16, 64, 4)  # the runs end at TENSOR_BYTES + 8
    body = rawwire.rows_body([row], tensors=(0,))
    if op == "read":
        answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body))
    else:
        answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_WRITE, body, payload_len=64) + b"\xee" * 64)
    assert isinstance(answer, tuple) and answer[0] == S.LLM_PARAM_INVALID and answer[2] == b"", answer
    assert f"access [{TENSOR_BYTES - 200}, +{3 * 64 + 16}) is outside" in answer[1], answer[1]
    assert pong(a)
    assert_same(victim.prefill.call(kv.snapshot, "kv"), before, "the victim's cache")
    victim.pulled([2])


@only("cpu-tcp", "cpu-cma")
def test_a_raw_row_reaching_unregistered_memory_is_refused_and_one_over_a_gap_is_served(
        peers: Callable[..., Peer], victim: Pair) -> None:
    """kRaw rows (absolute addresses): a row whose second run is an unregistered secret is refused
    without a byte of it; a row whose two runs lie in the cache's two tensors, with whatever lies
    between them, is served run by run (its span is not all registered memory)."""
    secret, _ = victim.prefill.call(kv.plant_secret, 64)
    t0, t1 = victim.prefill.call(kv.tensor_addresses, "kv")
    a = attacker_links(peers, victim)
    first = t0 + 64
    row = (first, 32, secret - first, 2) if secret > first else (secret, 32, first - secret, 2)
    refused = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, rawwire.rows_body(
        [row], kind=rawwire.KIND_RAW)))
    assert isinstance(refused, tuple) and refused[0] == S.LLM_PARAM_INVALID and refused[2] == b"", refused
    lo, hi = sorted((t0, t1))
    gap = (lo + 64, 32, hi - lo, 2)
    served = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, rawwire.rows_body([gap], kind=rawwire.KIND_RAW)))
    snap = victim.prefill.call(kv.snapshot, "kv")
    first_t, second_t = (0, 1) if t0 < t1 else (1, 0)
    assert served == (0, "", snap.tensor(first_t)[64:96].tobytes() + snap.tensor(second_t)[64:96].tobytes()), served
    victim.pulled([3])


MALFORMED = {
    "a row of no run": ([(0, 64, 64, 0)], None),
    "a row that wraps": ([(U64 - 64, 16, 32, 3)], None),
    "a stride times count past 64 bits": ([(0, 16, 2**63, 3)], None),
    "no rows": ([], None),
    "more rows stated than sent": ([(0, 16, 16, 2)], 2),
    "more runs than a request may have": ([(0, 1, 1, LIMITS["max_request_pieces"] + 1)], None),
    "rows together past the limit": ([(0, 1, 1, LIMITS["max_request_pieces"] // 2)] * 2 + [(0, 1, 1, 1)], None),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_row_drops_the_link_and_nothing_else(peers: Callable[..., Peer], victim: Pair,
                                                         case: str) -> None:
    """Decoded before anything is allocated for the runs: the link is dropped as for any malformed
    frame, the victim's memory is what it was, and honest pulls go on."""
    rows, count = MALFORMED[case]
    a = attacker_links(peers, victim)
    before = victim.prefill.call(kv.snapshot, "kv")
    rss = victim.prefill.call(kv.rss_kib)
    body = rawwire.rows_body(rows, tensors=(0,), count=count)
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body)) == "closed"
    assert victim.prefill.call(kv.rss_kib) - rss < 64 * 1024
    assert_same(victim.prefill.call(kv.snapshot, "kv"), before, "the victim's cache")
    victim.pulled([4])


def test_rows_are_counted_against_the_piece_limit_with_their_tensors(peers: Callable[..., Peer],
                                                                    victim: Pair) -> None:
    """Two tensors of one row of max_request_pieces / 2 runs: at the limit, answered (refused as a
    device read on a device cell, else served); one run more: malformed, the link dropped."""
    half = LIMITS["max_request_pieces"] // 2
    a = attacker_links(peers, victim)
    at_limit = rawwire.rows_body([(0, 1, 0, half)], tensors=(0, 1))
    answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, at_limit))
    assert isinstance(answer, tuple), answer
    if victim.variant.device_memory:  # a stream read of device memory is refused as such
        assert answer[0] == S.LLM_PARAM_INVALID and answer[2] == b"", answer[:2]
    else:
        snap = victim.prefill.call(kv.snapshot, "kv")
        assert answer[:2] == (0, "") and answer[2] == (snap.tensor(0)[:1].tobytes() * half
                                                       + snap.tensor(1)[:1].tobytes() * half)
    past = rawwire.rows_body([(0, 1, 0, half + 1)], tensors=(0, 1))
    assert a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, past)) == "closed"
    victim.pulled([5])


def test_a_truncated_rows_body_is_malformed(peers: Callable[..., Peer], victim: Pair) -> None:
    """A rows body cut inside its last row (every truncation point of the last u64s)."""
    body = rawwire.rows_body([(0, 16, 16, 2), (64, 8, 8, 2)], tensors=(0,))
    for cut in (1, 8, 31):
        a = attacker_links(peers, victim)
        assert a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body[:-cut])) == "closed", cut
    assert struct.unpack_from("<I", body, len(rawwire.body_header()) + 8)[0] == 2 | rawwire.ROWS_MARK
    victim.pulled([6])

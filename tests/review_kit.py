"""What the hostile reviews (test_round4_review.py, test_round5_review.py) share: the victim pair
(each file's ``victim`` fixture is ``make_victim``), a raw attacker linked to it, path-connect frames, and
the checks made after an attack (the link kept; the honest decoder still served; the victim's
unregistered secret unchanged)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import rawwire
from conftest import Pair
from peer import Peer
from peers import handoff, hostile, kv, native
from poll import wait_until
from verify import check_transfer, rows

SHAPE = (16, 4096)
ROOT_INFO = 4108  # an HCCL root info
DEVICE = rawwire.PATH_DEVICE_CHANNEL  # the HCCL entry's id, which names the device channel's setup
UCX = rawwire.PATH_UCX
PING = rawwire.request(rawwire.OP_PING, b"")


def make_victim(pair: Pair) -> Pair:
    """``pair`` with a keyed blocks cache on the prefill (and a planted, unregistered secret), one on
    the decode, linked, and one honest pull done."""
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=Pair.KEY)
    pair.prefill.call(kv.plant_secret)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    pair.link()
    pair.pulled([0])
    return pair


def attacker_links(peers: Callable[..., Peer], pair: Pair, cluster: int = 9) -> Peer:
    """A raw peer linked to the pair's prefill as ``cluster`` (over its AF_UNIX name on a same-host cell)."""
    a = peers(f"attacker{cluster}")
    unix = a.call(hostile.redirect_name, pair.port, cluster) if pair.variant.same_host else None
    assert a.call(hostile.link_raw, pair.port, cluster, b"", unix) == (0, "")
    return a


def listening_victim(peers: Callable[..., Peer], variant: Any, rows: int, row: int) -> tuple[Peer, int]:
    """A victim engine (cluster 1, listening) with region "big" of ``rows`` x ``row`` bytes keyed 7;
    (the victim, its port)."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True)
    victim.call(native.register, "big", rows, row, seed=1, key=7)
    return victim, port


def raw_linked(peers: Callable[..., Peer], variant: Any, port: int, cluster: int) -> Peer:
    """A raw attacker process (tests/peers/hostile.py) linked to the victim at ``port`` as
    ``cluster`` (over its AF_UNIX redirect on same-host cells)."""
    a = peers(f"attacker{cluster}")
    unix = a.call(hostile.redirect_name, port, cluster) if variant.same_host else None
    assert a.call(hostile.link_raw, port, cluster, b"", unix) == (0, "")
    return a


def channel_body(n: int, options: int = 1) -> bytes:
    """A device channel's setup body of ``n`` bytes: a root info's worth of filler, then the options byte."""
    return b"\xa5" * (n - 1) + bytes([options]) if n else b""


def ucx_body(n: int) -> bytes:
    """A ucx connect body of ``n`` bytes: a token, a message size, then filler for the worker address."""
    return struct.pack("<QI", 7, 1 << 16) + b"\xa5" * max(0, n - 12)


def setup(path: int, body: bytes, flags: int = 0, payload_len: int = 0, body_len: int | None = None) -> bytes:
    """A kPathConnect frame naming ``path`` (``body_len``: the announced length, header included)."""
    return rawwire.path_connect(path, body, flags=flags, payload_len=payload_len, body_len=body_len)


def pinned_by_a_direct_read(peers: Callable[..., Peer], variant: Any, cluster: int = 1,
                            timeout_ms: int | None = None) -> tuple[Peer, Peer]:
    """A prompt ``cluster`` (PinTimeoutMs 500; a 768 KiB cache "big" keyed ``CacheKey(1, 7)`` in a 1 MiB
    pool) and a same-host raw peer linked to it as cluster 9 that has read 4 KiB of the cache directly,
    so the cache is pinned until the peer's next frame: (prompt, attacker)."""
    from llm_datadist import CacheKey, DataType

    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", cluster, listen=True, pool=1 << 20, remote=False, timeout_ms=timeout_ms,
                  extra={"pdlink.PinTimeoutMs": "500"})
    p.call(kv.allocate, "big", 1, (1, 768 * 1024), DataType.DT_INT8, seed=1, keys=[CacheKey(1, 7)])
    a = peers("attacker")
    name = peers("spy").call(hostile.redirect_name, port)
    assert a.call(hostile.link_raw, port, 9, b"", name) == (0, "")
    answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, rawwire.blocks_body(
        kind=rawwire.KIND_REQUEST_KEY, req=7, runs=((0, 4096),)), flags=rawwire.FLAG_DIRECT))
    assert isinstance(answer, tuple) and answer[0] == 0, answer
    return p, a


def refused_kept(a: Peer, frame: bytes, code: int) -> str:
    """``frame`` is answered ``code`` with no payload and the link kept (a ping after it answers); the
    refusal's text."""
    answer = a.call(hostile.exchange, frame)
    assert isinstance(answer, tuple) and answer[0] == code and answer[2] == b"", (answer, code)
    assert a.call(hostile.exchange, PING) == (0, "", b""), "the link was not kept"
    return answer[1]


def after(victim: Pair, secret: list[bytes], blocks: int = 3) -> None:
    """The victim still serves its honest decoder; its unregistered secret is unchanged."""
    victim.pulled([blocks])
    assert victim.prefill.call(kv.secrets) == secret


def claim_lands(prefill: Peer, decoder: Peer, ticket: Any, offer: str = "o") -> None:
    """The decoder claims ``ticket``, an offer of block 1 of the prefill's region "big", into block 3
    of its region "dst": the offer is released "claimed", block 3 holds the source's block and the
    rest of both regions is unchanged."""
    def claim() -> None:
        decoder.call(handoff.claim, ticket, "dst", [3])
        wait_until(lambda: prefill.call(handoff.state, offer)[0], 10, "the offer released by the claim")

    check_transfer(lambda: prefill.call(native.snapshot, "big"), lambda: decoder.call(native.snapshot, "dst"), claim,
                   rows([(1, 3)]))
    assert prefill.call(handoff.state, offer) == (True, "claimed")

"""Every value of a request's flag byte, on every op that takes a body or none, on every link kind
(tcp, cma same-host and forced ucx, each with and without a link secret): the serving dispatch
(transport/path_table: ``PathTable::serverFor``; engine/request_server.cc: ``admitHeader``,
``admitAccess``) must reach only a path this engine's table names and this link admitted.

A raw attacker from 127.0.0.2 (tests/peers/flagsweep.py: a fresh link per frame, sealed frames
under a secret) sends each (op, flags). Held when: a flag combination no path of a production
table names (kFlagTestPath among them) drops the link, except the split mark alone on a read or a
release (served as the stream path's); a named one a link did not prove is refused
with no payload and the link kept; a direct answer (absolute addresses) goes only to a same-host
link and lists only registered memory; the victim serves an honest engine byte-exact afterwards and
its canaries and secret are unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest

import rawwire
from conftest import UCX_WHY_NOT, require_for_ucx
from pdlink import LLMStatusCode as S
from peer import Peer
from peers import flagsweep, hostile, kv, native, overlaps
from verify import assert_same

VICTIM, HONEST = 1, 2
TOTAL = 4096
NAMED = {0, 1, 2, 3, 6, 8}  # stream, cma, hccl, ipc, one-sided, ucx: the production table's entries
ACCESS = {rawwire.OP_READ, rawwire.OP_WRITE}
SPLIT = rawwire.MARK_SPLIT


def frames(base: int, current: bytes) -> dict[int, bytes]:
    raw = rawwire.body_header(kind=rawwire.KIND_RAW) + struct.pack("<II", 1, 0)
    read = raw + struct.pack("<IQQ", 1, base, 64)
    write = raw + struct.pack("<IQQ", 1, base, len(current))
    return {
        rawwire.OP_READ: rawwire.request(rawwire.OP_READ, read),
        rawwire.OP_WRITE: rawwire.request(rawwire.OP_WRITE, write, payload_len=len(current)) + current,
        rawwire.OP_DESCRIBE: rawwire.request(rawwire.OP_DESCRIBE, read),
        rawwire.OP_COMMIT: rawwire.request(rawwire.OP_COMMIT, rawwire.blocks_body()),
        rawwire.OP_RELEASE: rawwire.request(rawwire.OP_RELEASE, rawwire.blocks_body()),
        rawwire.OP_PING: rawwire.request(rawwire.OP_PING, b""),
        rawwire.OP_NOTIFY: rawwire.request(rawwire.OP_NOTIFY, rawwire.notify_body(b"n", b"m")),
        rawwire.OP_PATH_CONNECT: rawwire.path_connect(rawwire.PATH_UCX, struct.pack("<QI", 7, 0) + b"\xa5" * 64),
        rawwire.OP_CONFIRM: rawwire.request(rawwire.OP_CONFIRM, bytes(16) + b"127.0.0.1:1"),
        rawwire.OP_UNLINK: rawwire.request(rawwire.OP_UNLINK, b""),
    }


UCX_ENV = {"PDLINK_TRANSPORT": "ucx", "UCX_TLS": "tcp", "PDLINK_UCX_TRUSTED_NETWORK": "1"}
# auto with the trusted-network statement: the engine has ucx workers, but a tcp link without RDMA
# is not a ucx link (ucx::isPathOf), so its kFlagUcx requests are refused (ucx::refused)
UCX_AUTO_ENV = {"UCX_TLS": "tcp", "PDLINK_UCX_TRUSTED_NETWORK": "1"}
ENVS = {"tcp": {"PDLINK_TRANSPORT": "tcp"}, "cma": {}, "ucx": UCX_ENV, "ucx-auto": UCX_AUTO_ENV}



@pytest.mark.parametrize("kind", sorted(ENVS))
@pytest.mark.parametrize("secret", ["", "s3cret"], ids=["open", "secret"])
def test_every_flag_byte_reaches_only_an_admitted_path(peers: Callable[..., Peer], kind: str,
                                                       secret: str) -> None:
    if kind.startswith("ucx"):
        require_for_ucx(UCX_WHY_NOT)  # a failure under PDLINK_REQUIRE_UCX=1 (.ci/ucx.sh)
    same_host = kind == "cma"
    env = ENVS[kind]
    victim = peers("victim", env=env)
    port = victim.call(native.start, VICTIM, listen=True, secret=secret or None)
    base = victim.call(overlaps.register_layout, TOTAL, [(0, TOTAL)], 5)
    plant = victim.call(kv.plant_secret, 64)
    before = victim.call(overlaps.snapshot)
    current = bytes(before.tensor(0)[:8])
    attacker = peers("attacker")
    unix = None
    if same_host:
        h = rawwire.handshake(port, cluster=8, expected=rawwire.ANY, flags=rawwire.HELLO_SAME_HOST,
                              hint=rawwire.host_hint(), secret=secret.encode(), source=hostile.ATTACKER_IP)
        h.sock.close()
        assert h.result is not None and h.result.redirect, h.message
        unix = h.result.redirect
    results: dict[tuple[int, int], Any] = attacker.call_within(
        600, flagsweep.sweep, port, frames(base, current), secret.encode(), unix)

    bad = []
    for (op, flags), got in sorted(results.items()):
        if op in ACCESS:
            want_closed = flags not in NAMED and not (op == rawwire.OP_READ and flags == SPLIT)
        elif op == rawwire.OP_DESCRIBE:
            want_closed = flags not in (0, 1)
        elif op == rawwire.OP_RELEASE:
            want_closed = flags not in (0, SPLIT)
        else:
            want_closed = flags != 0
        if want_closed != (got == "closed"):
            bad.append((op, flags, got if got == "closed" else got[:2]))
            continue
        if got == "closed":
            continue
        status, plen, payload = got
        if op == rawwire.OP_READ and flags in (0, SPLIT):
            ok = status == 0 and plen == 64
        elif flags == wire_direct() and op in ACCESS | {rawwire.OP_DESCRIBE}:
            ok = (status == 0) if same_host else (status == S.LLM_FEATURE_NOT_ENABLED and plen == 0)
            if ok and same_host and op in ACCESS and not secret:
                # a DirectAnswer: epoch, epoch address, then (address, length) per piece
                _e, _ea, *flat = struct.unpack(f"<QQ{len(payload) // 8 - 2}Q", payload)
                ok = all(base <= a and a + n <= base + TOTAL for a, n in zip(flat[::2], flat[1::2]))
        elif op in ACCESS and flags != 0:
            ok = status != 0 and plen == 0
        else:
            ok = True
        if not ok:
            bad.append((op, flags, got[:2]))
    assert not bad, bad[:20]

    honest = peers("honest", env=env)
    honest.call(native.start, HONEST, secret=secret or None)
    honest.call(native.register, "dst", 1, TOTAL, seed=2)
    assert honest.call(native.connect, port, VICTIM) == VICTIM
    honest.call(native.descriptors, VICTIM, "dst", [(0, TOTAL)], [(base, TOTAL)], "read")
    assert bytes(honest.call(native.snapshot, "dst").tensor(0)) == bytes(before.tensor(0))
    assert_same(victim.call(overlaps.snapshot), before, "the victim's buffer and its guard bytes")
    assert victim.call(kv.secrets) == [plant[1]], "the victim's unregistered secret changed"


def wire_direct() -> int:
    return rawwire.FLAG_DIRECT

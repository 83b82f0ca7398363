"""Authenticated sessions: with a link secret every frame after the handshake is sealed under a
session key, so a man in the middle (tests/mitm.py, a proxy between two honest engines that knows
no secret) can neither inject, replay, reorder nor cut short a frame, nor rewrite the handshake.

Each attack runs twice: without a secret it succeeds (the proof that the proxy really did it and
that it matters), with one it is detected: the victim drops the link with the logged reason, acts
on nothing the proxy made, and every byte of its memory is what it was. Payload bytes are covered
only with payload integrity; the tests show both sides of that option.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import rawwire
from backend_env import Variant
from conftest import DECODER_ID, PROMPT_ID, Pair, only
from llm_datadist import CacheKeyByIdAndIndex
from mitm import Channel, Proxy, Request, sealed_payload
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import hostile, kv
from poll import wait_until
from verify import Snapshot, assert_same, check_transfer, nothing, rows

KEY = Pair.KEY
SHAPE = (8, 256)  # 8 blocks of 512 bytes per tensor
ROW = SHAPE[1] * 2
HEAD = rawwire.RESPONSE_HEADER_BYTES  # a response header (wire v7), before its message and payload
SECRET = "mitm-test-secret"
AUTH_FAILURE = "failed its authentication"
S = LLMStatusCode
# Every attack without a secret (it works), with sealed frames, and with payload integrity too.
MODES = [(False, False), (True, False), (True, True)]
MODE_IDS = ["no-secret", "sealed", "payload-integrity"]
pytestmark = only("cpu-tcp")  # the proxy sits on a TCP link; same-host channels are AF_UNIX (kernel-proven)


class Mitm:
    """A prefill (the victim, cluster 1) and a decoder linked to it through the proxy."""

    def __init__(self, peers: Callable[..., Peer], variant: Variant, secret: bool, integrity: bool = False,
                 on_hello: Callable[[bytes], bytes] | None = None,
                 on_request: Callable[[Channel, Request], list[bytes]] | None = None, link: bool = True):
        env = {"PDLINK_LINK_SECRET": SECRET} if secret else {}
        if integrity:
            env["PDLINK_PAYLOAD_INTEGRITY"] = "1"
        self.pair = Pair(peers, variant, prefill_env=env, decode_env=env)
        self.prefill, self.decode = self.pair.prefill, self.pair.decode
        self.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
        self.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
        self.proxy = Proxy(self.pair.port, on_hello, on_request)
        if link:
            assert self.decode.call(kv.link, PROMPT_ID, self.proxy.port)[0] == S.LLM_SUCCESS

    def victim_link(self) -> dict:
        (link,) = self.prefill.call(kv.links)
        return link

    def dropped_for_authentication(self) -> None:
        """The victim dropped the link because a frame failed its check."""
        link = wait_until(lambda: (v := self.victim_link())["broken"] and v, 10, "the victim drops the link")
        assert AUTH_FAILURE in link["broken_reason"], link

    def src(self) -> Snapshot:
        return self.prefill.call(kv.snapshot, "kv")

    def dst(self) -> Snapshot:
        return self.decode.call(kv.snapshot, "kv")


@pytest.fixture
def mitm(peers: Callable[..., Peer], variant: Variant) -> Iterator[Callable[..., Mitm]]:
    made: list[Mitm] = []

    def make(**kw: object) -> Mitm:
        made.append(Mitm(peers, variant, **kw))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for m in made:
        m.proxy.close()


def block_read(block: int) -> bytes:
    return rawwire.request(rawwire.OP_READ, rawwire.blocks_body(tensors=(0,), runs=((block * ROW, ROW),)))


def block_write(block: int, data: bytes) -> bytes:
    return rawwire.request(rawwire.OP_WRITE, rawwire.blocks_body(tensors=(0,), runs=((block * ROW, len(data)),)),
                           payload_len=len(data)) + data


@pytest.mark.parametrize("secret, integrity", MODES, ids=MODE_IDS)
def test_an_injected_read_gets_no_answer(mitm: Callable[..., Mitm], secret: bool, integrity: bool) -> None:
    """The proxy asks the victim for block 3 of its cache. Without a secret the victim answers with
    it; with one, the frame fails its check and nothing comes back."""
    m = mitm(secret=secret, integrity=integrity)
    check_transfer(m.src, m.dst, lambda: m.decode.call(kv.pull_blocks, KEY, "kv", [0], [0]), rows([(0, 0)]))
    fwd = m.proxy.forward()
    assert (fwd.authenticated, fwd.integrity) == (secret, integrity)
    src = m.src()
    fwd.inject(block_read(3) + os.urandom(rawwire.TAG_BYTES))  # a tag the proxy can only guess
    if not secret:
        wait_until(lambda: len(fwd.captured) >= HEAD + ROW, 10, "the victim answers the injected read")
        status, mlen, plen = struct.unpack_from("<IIQ", fwd.captured, 4)
        assert (status, mlen, plen) == (0, 0, ROW)
        assert bytes(fwd.captured[HEAD:HEAD + ROW]) == src.tensor(0)[3 * ROW:4 * ROW].tobytes()  # the victim's block
        return
    wait_until(fwd.closed.is_set, 10, "the victim closes the channel")
    assert fwd.captured == b""  # not a byte of the victim's memory went out
    m.dropped_for_authentication()
    assert_same(m.src(), src, "victim")


@pytest.mark.parametrize("secret, integrity", MODES, ids=MODE_IDS)
def test_an_injected_write_does_not_land(mitm: Callable[..., Mitm], secret: bool, integrity: bool) -> None:
    m = mitm(secret=secret, integrity=integrity)
    fwd = m.proxy.forward()
    src = m.src()
    forged = b"\xee" * ROW
    fwd.inject(block_write(5, forged) + os.urandom(rawwire.TAG_BYTES))
    if not secret:
        wait_until(lambda: len(fwd.captured) >= HEAD, 10, "the victim answers the injected write")
        assert_same(m.src(), src.with_tensor_bytes(0, 5 * ROW, np.frombuffer(forged, dtype=np.uint8)), "victim")
        return
    m.dropped_for_authentication()
    assert fwd.captured == b""
    assert_same(m.src(), src, "victim")


@pytest.mark.parametrize("secret, integrity", MODES, ids=MODE_IDS)
def test_a_replayed_push_does_not_land_again(mitm: Callable[..., Mitm], secret: bool, integrity: bool) -> None:
    """The decoder pushes its block 1 into the victim's block 2; the victim's own data then
    changes; the proxy sends the recorded push again."""
    m = mitm(secret=secret, integrity=integrity)
    check_transfer(m.dst, m.src, lambda: m.decode.call(kv.push_blocks, KEY, "kv", [1], [2]), rows([(1, 2)]))
    fwd = m.proxy.forward()
    (push,) = [r for r in fwd.requests if r.op == rawwire.OP_WRITE]
    m.prefill.call(kv.overwrite, "kv", 3)
    src = m.src()
    fwd.inject(push.raw)
    if not secret:
        wait_until(lambda: len(fwd.captured) >= HEAD, 10, "the victim answers the replayed push")
        assert_same(m.src(), src.with_rows(m.dst(), [(1, 2)]), "victim")
        return
    m.dropped_for_authentication()
    assert fwd.captured == b""
    assert_same(m.src(), src, "victim")


def hold_commits(channel: Channel, req: Request) -> list[bytes]:
    """Holds a commit back until the next request has gone, then sends it: two frames swapped."""
    held: list[bytes] = channel.__dict__.setdefault("held", [])
    if req.op == rawwire.OP_COMMIT and not channel.__dict__.get("swapped"):
        held.append(req.raw)
        return []
    if held:
        channel.__dict__["swapped"] = True
        out = [req.raw, *held]
        held.clear()
        return out
    return [req.raw]


@pytest.mark.parametrize("secret, integrity", MODES, ids=MODE_IDS)
def test_reordered_frames_are_detected(mitm: Callable[..., Mitm], secret: bool, integrity: bool) -> None:
    """A pull by cache id and index ends with a commit (the victim may then release what it
    read); the proxy delivers the next pull before it."""
    m = mitm(secret=secret, integrity=integrity, on_request=hold_commits)
    cache_id = m.prefill.call(kv.register, "req", 1, (2, 256), seed=4)
    keys = [CacheKeyByIdAndIndex(PROMPT_ID, cache_id, 0), CacheKeyByIdAndIndex(PROMPT_ID, cache_id, 1)]
    m.decode.call(kv.register, "dst", 1, (2, 256), seed=None)

    def src() -> Snapshot:
        return m.prefill.call(kv.snapshot, "req")

    def dst() -> Snapshot:
        return m.decode.call(kv.snapshot, "dst")

    check_transfer(src, dst, lambda: m.decode.call(kv.pull_cache, keys[0], "dst", 0), rows([(0, 0)]))
    if not secret:  # the swap goes unnoticed
        check_transfer(src, dst, lambda: m.decode.call(kv.pull_cache, keys[1], "dst", 1), rows([(1, 1)]))
        assert m.proxy.forward().__dict__.get("swapped")
        return
    with pytest.raises(LLMException) as e:
        check_transfer(src, dst, lambda: m.decode.call(kv.pull_cache, keys[1], "dst", 1), nothing)
    assert e.value.status_code == S.LLM_LINK_FAILED
    assert m.proxy.forward().__dict__.get("swapped")
    m.dropped_for_authentication()


def drop_last_run(channel: Channel, req: Request) -> list[bytes]:
    """A push cut short: its last run (and that run's bytes) removed, the lengths made consistent."""
    if req.op != rawwire.OP_WRITE or channel.__dict__.get("cut"):
        return [req.raw]
    channel.__dict__["cut"] = True
    kind, tensors, runs = rawwire.parse_body(req.body)
    assert len(runs) == 2 and tensors == [0, 1], (tensors, runs)
    body = rawwire.blocks_body(tensors=tuple(tensors), runs=tuple(runs[:1]))
    data = req.payload_bytes(channel.integrity)
    # tensor-major: tensor 0's runs, then tensor 1's; keep each tensor's first run
    kept = data[:ROW] + data[2 * ROW:3 * ROW]
    tags = req.payload[len(data):] if channel.integrity else b""
    cut = Request(req.op, req.flags, body, len(kept), req.tag, sealed_payload(kept, tags, channel.integrity))
    return [cut.raw]


@pytest.mark.parametrize("secret, integrity", MODES, ids=MODE_IDS)
def test_a_push_cut_short_is_detected(mitm: Callable[..., Mitm], secret: bool, integrity: bool) -> None:
    m = mitm(secret=secret, integrity=integrity, on_request=drop_last_run)
    src0 = m.src()
    if not secret:  # the pusher is told both blocks landed; only the first did
        m.decode.call(kv.push_blocks, KEY, "kv", [0, 1], [1, 3])
        assert_same(m.src(), src0.with_rows(m.dst(), [(0, 1)]), "victim")
        return
    with pytest.raises(LLMException) as e:
        m.decode.call(kv.push_blocks, KEY, "kv", [0, 1], [1, 3])
    assert e.value.status_code == S.LLM_LINK_FAILED
    m.dropped_for_authentication()
    assert_same(m.src(), src0, "victim")


def flip_payload(channel: Channel, req: Request) -> list[bytes]:
    if req.op != rawwire.OP_WRITE:
        return [req.raw]
    payload = bytes([req.payload[0] ^ 0xFF]) + req.payload[1:]
    return [Request(req.op, req.flags, req.body, req.payload_len, req.tag, payload).raw]


@pytest.mark.parametrize("integrity", [False, True], ids=["frames-only", "payload-integrity"])
def test_payload_bytes_are_covered_only_with_payload_integrity(mitm: Callable[..., Mitm], integrity: bool) -> None:
    """Without payload integrity a sealed link covers a payload's length, not its bytes: a flipped
    byte lands. With it, the chunk fails its check before any of it lands."""
    m = mitm(secret=True, integrity=integrity, on_request=flip_payload)
    assert m.victim_link()["authenticated"] and m.victim_link()["payload_integrity"] == integrity
    src0, dst0 = m.src(), m.dst()
    if not integrity:
        m.decode.call(kv.push_blocks, KEY, "kv", [4], [6])
        expected = src0.with_rows(dst0, [(4, 6)])
        first = expected.tensor(0)[6 * ROW:6 * ROW + 1].copy() ^ 0xFF
        assert_same(m.src(), expected.with_tensor_bytes(0, 6 * ROW, first), "victim")
        return
    with pytest.raises(LLMException) as e:
        m.decode.call(kv.push_blocks, KEY, "kv", [4], [6])
    assert e.value.status_code == S.LLM_LINK_FAILED
    m.dropped_for_authentication()
    assert_same(m.src(), src0, "victim")


def test_pulls_and_pushes_with_payload_integrity_move_every_byte(mitm: Callable[..., Mitm]) -> None:
    """Sealed payloads of several chunks (the whole cache is 16 KiB here: one chunk per request;
    bigger transfers are in test_transfer's heavy cases) arrive byte-exact both ways."""
    m = mitm(secret=True, integrity=True)
    check_transfer(m.src, m.dst, lambda: m.decode.call(kv.pull_blocks, KEY, "kv", [0, 2, 3], [1, 4, 5]),
                   rows([(0, 1), (2, 4), (3, 5)]))
    check_transfer(m.dst, m.src, lambda: m.decode.call(kv.push_blocks, KEY, "kv", [7], [0]), rows([(7, 0)]))


def rewrite_cluster(hello: bytes) -> bytes:
    """The dialler's Hello, claiming cluster 7 instead of its own."""
    assert struct.unpack_from("<Q", hello, 8)[0] == DECODER_ID
    return hello[:8] + struct.pack("<Q", 7) + hello[16:]


@pytest.mark.parametrize("secret, integrity", MODES, ids=MODE_IDS)
def test_a_rewritten_identity_fails_the_handshake(mitm: Callable[..., Mitm], secret: bool, integrity: bool) -> None:
    m = mitm(secret=secret, integrity=integrity, on_hello=rewrite_cluster, link=False)
    status, log = m.decode.call(kv.link_logged, PROMPT_ID, m.proxy.port)
    if not secret:  # the victim believes cluster 7 linked
        assert status == S.LLM_SUCCESS
        assert [link["peer_cluster_id"] for link in m.prefill.call(kv.links)] == [7]
        return
    assert status == S.LLM_LINK_FAILED
    assert any("handshake was altered on the way" in line for line in log), log
    assert m.prefill.call(kv.links) == [] and m.decode.call(kv.links) == []


def clear_integrity(hello: bytes) -> bytes:
    """A downgrade: the dialler's request for payload integrity removed."""
    assert hello[7] & rawwire.HELLO_PAYLOAD_INTEGRITY
    return hello[:7] + bytes([hello[7] & ~rawwire.HELLO_PAYLOAD_INTEGRITY]) + hello[8:]


def test_payload_integrity_cannot_be_stripped_on_the_way(peers: Callable[..., Peer], variant: Variant) -> None:
    """The decoder asks for payload integrity, the prefill does not: the proxy removes the request
    from the Hello, and the handshake fails instead of downgrading."""
    pair = Pair(peers, variant, prefill_env={"PDLINK_LINK_SECRET": SECRET},
                decode_env={"PDLINK_LINK_SECRET": SECRET, "PDLINK_PAYLOAD_INTEGRITY": "1"})
    proxy = Proxy(pair.port, on_hello=clear_integrity)
    try:
        status, log = pair.decode.call(kv.link_logged, PROMPT_ID, proxy.port)
        assert status == S.LLM_LINK_FAILED and any("altered on the way" in line for line in log), log
        assert pair.prefill.call(kv.links) == []
    finally:
        proxy.close()
    # without the proxy, the same pair links with integrity on both sides (either side asking is enough)
    assert pair.decode.call(kv.link, PROMPT_ID, pair.port)[0] == S.LLM_SUCCESS
    for side in (pair.prefill, pair.decode):
        assert [(k["authenticated"], k["payload_integrity"]) for k in side.call(kv.links)] == [(True, True)]


# ---------------------------------------------------------------------------- distinct errors


@pytest.mark.parametrize("prefill, decode, says", [
    (SECRET, None, "the peer requires a link secret and this engine has none"),
    (None, SECRET, "the peer has no link secret and this engine has one"),
    (SECRET, "another-secret", "the peer's link secret differs from this engine's"),
], ids=["secret-on-the-acceptor-only", "secret-on-the-dialler-only", "different-secrets"])
def test_each_secret_mismatch_has_its_own_error(peers: Callable[..., Peer], variant: Variant, prefill: str | None,
                                                decode: str | None, says: str) -> None:
    pair = Pair(peers, variant, prefill_env={"PDLINK_LINK_SECRET": prefill} if prefill else {},
                decode_env={"PDLINK_LINK_SECRET": decode} if decode else {})
    status, log = pair.decode.call(kv.link_logged, PROMPT_ID, pair.port)
    assert status == S.LLM_LINK_FAILED
    assert any(says in line for line in log), log
    assert pair.prefill.call(kv.links) == [] and pair.decode.call(kv.links) == []


@pytest.mark.parametrize("sent, says", [
    (b"", "the peer has no link secret"),
    (b"guess", "the peer does not know this engine's link secret"),
], ids=["no-proof", "wrong-proof"])
def test_the_acceptor_says_which_proof_failed(peers: Callable[..., Peer], variant: Variant, sent: bytes,
                                              says: str) -> None:
    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True, extra={"pdlink.LinkSecret": SECRET})
    h = rawwire.handshake(port, send_proof=bytes(32) if not sent else os.urandom(32))
    h.sock.close()
    assert (h.stage, h.status) == ("auth", S.LLM_LINK_FAILED) and says in h.message, h


@pytest.mark.parametrize("other", [rawwire.VERSION + 1, 9, 8, 7, 4], ids=["newer", "v9", "v8", "v7", "v4"])
def test_a_peer_of_another_protocol_version_is_named_as_such(peers: Callable[..., Peer], variant: Variant,
                                                             other: int) -> None:
    """Both directions: an acceptor refuses a Hello of another version saying so; a dialler told
    another version by the endpoint it dials says so. v9 (its frames are v10's, without rows in
    transfer bodies), v8 (v9's, without the KV handoff's target kind and frame), v7 (a u16 epoch
    tag at offset 6 of a 20-byte request header) and v4 (before kPathConnect replaced its
    device-channel and ucx-connect frames) are such versions."""
    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(rawwire.hello(version=other))
        ack = rawwire.read_ack(s)
    assert ack.status == S.LLM_LINK_FAILED, ack
    assert ack.message == (f"protocol version mismatch: this engine speaks pdlink protocol {rawwire.VERSION}, the "
                           f"dialler {other}: run the same pdlink release on both sides"), ack
    a = peers("attacker")
    hostile_port = a.call(hostile.serve, "ack_other_version", version=other)
    victim = peers("decode", env=variant.env())
    victim.call(kv.start, "decoder", DECODER_ID)
    status, log = victim.call(kv.link_logged, PROMPT_ID, hostile_port, ip=hostile.ATTACKER_IP)
    assert status == S.LLM_LINK_FAILED
    assert any(f"the peer speaks pdlink protocol {other}" in line for line in log), log

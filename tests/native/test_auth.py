"""Authenticated links: a shared secret proved by challenge-response, never sent (issue: reliability
and security). Hostile handshakes are refused before they reach any memory."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable

import pytest

import rawwire
from backend_env import Variant, peer_env
from conftest import pulled
from internals import core as _core
from llm_datadist import BlocksCacheKey
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import kv
from poll import wait_until
from verify import assert_same


@pytest.mark.parametrize("key_len", [0, 1, 32, 64, 65, 200])
@pytest.mark.parametrize("msg_len", [0, 3, 55, 56, 63, 64, 65, 1000])
def test_hmac_matches_python(key_len, msg_len):
    key, msg = os.urandom(key_len), os.urandom(msg_len)
    assert _core._hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()


SHAPE = (8, 256)
KEY = BlocksCacheKey(1, 0)


def pair(peers: Callable[..., Peer], variant: Variant | None, p_secret: str | None,
         d_secret: str | None) -> tuple[Peer, Peer, int]:
    """A listening PROMPT (cluster 1, blocks cache "kv" under KEY) and a DECODER (cluster 2, "kv"),
    not linked, each with its secret (None: none); on ``variant``'s path (None: loopback TCP)."""
    def env(secret: str | None) -> dict[str, str]:
        extra = {"PDLINK_LINK_SECRET": secret} if secret else {}
        return variant.env(**extra) if variant else peer_env("tcp", **extra)

    p, d = peers("prefill", env=env(p_secret)), peers("decode", env=env(d_secret))
    port = p.call(kv.start, "prompt", 1, listen=True)
    p.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    d.call(kv.start, "decoder", 2)
    d.call(kv.register_blocks, "kv", 2, SHAPE, seed=2)
    return p, d, port


OK = (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
FAILED = (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])


def test_same_secret_links_and_moves_bytes(peers: Callable[..., Peer], variant: Variant) -> None:
    p, d, port = pair(peers, variant, "s3cret-A", "s3cret-A")
    assert d.call(kv.link, 1, port) == OK
    pulled(p, d, [1, 2])


def test_secret_as_an_init_option(peers: Callable[..., Peer]) -> None:
    p, d = peers("prefill"), peers("decode")
    port = p.call(kv.start, "prompt", 1, listen=True, extra={"pdlink.LinkSecret": "opt-secret"})
    d.call(kv.start, "decoder", 2, extra={"pdlink.LinkSecret": "opt-secret"})
    assert d.call(kv.link, 1, port) == OK
    assert [link["authenticated"] for link in d.call(kv.links)] == [True]


@pytest.mark.parametrize("p_secret, d_secret", [("server-only", None), (None, "client-only"), ("one", "two")])
def test_mismatched_secrets_are_refused_on_both_sides(peers: Callable[..., Peer], p_secret: str | None,
                                                      d_secret: str | None) -> None:
    p, d, port = pair(peers, None, p_secret, d_secret)
    assert d.call(kv.link, 1, port, 2000) == FAILED
    assert d.call(kv.links) == [] and p.call(kv.links) == []
    # and the refused peer cannot touch memory: a pull finds no link and moves nothing
    before = d.call(kv.snapshot, "kv")
    with pytest.raises(LLMException) as e:
        d.call(kv.pull_blocks, KEY, "kv", [0], [0])
    assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    assert_same(d.call(kv.snapshot, "kv"), before, "the refused decoder's cache")


def test_forged_or_replayed_proofs_are_refused_and_the_engine_keeps_serving(peers: Callable[..., Peer]) -> None:
    p, d, port = pair(peers, None, "the-secret", "the-secret")
    # no proof knowledge: zeros
    h = rawwire.handshake(port, secret=b"")
    h.sock.close()
    assert (h.stage, h.status) == ("auth", LLMStatusCode.LLM_LINK_FAILED) and "authentication failed" in h.message, h
    # a right-looking proof for another nonce (a replay from another link attempt)
    sock = socket.create_connection(("127.0.0.1", port))
    frame = rawwire.hello(nonce=1)
    sock.sendall(frame)
    a = rawwire.read_ack(sock)
    assert a.status == 0
    # the server proved itself correctly for this hello (the scheme is what the docs say)...
    transcript = rawwire.transcript_hello(frame, a.cluster, a.challenge)
    assert a.proof == rawwire.proof(b"the-secret", b"S", transcript)
    # ...and a client proof for the same hello with nonce 2 does not pass for nonce 1
    other = rawwire.transcript_hello(frame[:24] + struct.pack("<Q", 2) + frame[32:], a.cluster, a.challenge)
    sock.sendall(rawwire.client_auth(rawwire.proof(b"the-secret", b"C", other + rawwire.transcript_client())))
    assert rawwire.read_auth(sock).status == LLMStatusCode.LLM_LINK_FAILED
    sock.close()
    # a raw client that does know the secret gets in (the scheme is what the docs say)
    h = rawwire.handshake(port, secret=b"the-secret", nonce=3)
    assert h.status == 0, h.message
    h.sock.close()
    # a real decoder still links and pulls
    assert d.call(kv.link, 1, port) == OK
    pulled(p, d, [4])


def test_connection_flood_does_not_stop_existing_links(peers: Callable[..., Peer]) -> None:
    p, d, port = pair(peers, None, None, None)
    assert d.call(kv.link, 1, port) == OK
    flood = []
    try:
        for _ in range(200):  # silent connections: each holds a handshake slot until it times out
            flood.append(socket.create_connection(("127.0.0.1", port)))
        pulled(p, d, list(range(8)))  # the established link is served throughout
    finally:
        for s in flood:
            s.close()
    # once the flood is gone, new links are accepted again: as soon as the server's handshake
    # threads have seen their connections close (quick, but not instant on a loaded machine or
    # under a sanitizer), so the first attempts may still find every handshake slot taken
    assert d.call(kv.unlink, 1, port) == LLMStatusCode.LLM_SUCCESS
    wait_until(lambda: d.call(kv.link, 1, port, 2000) == OK, 15, "a new link accepted after the flood")


def test_sealed_frames_follow_the_documented_scheme(peers: Callable[..., Peer]) -> None:
    """A raw client that knows the secret makes a whole link (both channels) and speaks sealed frames
    computed from the documented scheme (tests/rawwire.py: transcript, session key, per-direction
    sequence numbers): its ping is answered with a response whose tag checks out; the same ping
    sent again (a replay) is not answered and drops the link."""
    p, _d, port = pair(peers, None, "the-secret", None)
    fwd = rawwire.handshake(port, channel=0, nonce=77, secret=b"the-secret")
    rev = rawwire.handshake(port, channel=1, nonce=77, secret=b"the-secret")
    assert (fwd.status, rev.status) == (0, 0) and fwd.key and rev.key and fwd.key != rev.key
    wait_until(lambda: [link["authenticated"] for link in p.call(kv.links)] == [True], 20, "the raw link installed")
    sealer = rawwire.Sealer(fwd.key, requester=True)
    ping = sealer.seal(rawwire.request(rawwire.OP_PING, b""))
    fwd.sock.sendall(ping)
    fwd.sock.settimeout(5)
    answer = rawwire.recv_exact(fwd.sock, rawwire.RESPONSE_HEADER_BYTES + rawwire.TAG_BYTES)
    assert struct.unpack_from("<IIQ", answer, 4) == (0, 0, 0)
    assert sealer.check(answer[:rawwire.RESPONSE_HEADER_BYTES], answer[rawwire.RESPONSE_HEADER_BYTES:])
    fwd.sock.sendall(ping)  # replayed: its tag was for frame 0, the acceptor expects frame 1
    assert fwd.sock.recv(64) == b""  # closed without an answer
    wait_until(lambda: "failed its authentication" in p.call(kv.links)[0]["broken_reason"], 20,
               "the link dropped for the replay")
    fwd.sock.close()
    rev.sock.close()


@pytest.mark.parametrize("options, env", [
    ({"pdlink.PayloadIntegrity": "yes", "pdlink.LinkSecret": "s"}, {}),  # not '0' or '1'
    ({"pdlink.PayloadIntegrity": "1"}, {}),  # no secret to seal with
    ({}, {"PDLINK_PAYLOAD_INTEGRITY": "1"}),
], ids=["bad-value", "option-without-secret", "env-without-secret"])
def test_payload_integrity_option_is_validated(monkeypatch, options, env):
    from internals import parse_engine_options

    monkeypatch.delenv("PDLINK_LINK_SECRET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(LLMException) as e:
        parse_engine_options(options)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_payload_integrity_option_reaches_the_engine():
    from internals import parse_engine_options

    cfg = parse_engine_options({"pdlink.PayloadIntegrity": "1", "pdlink.LinkSecret": "s"})
    assert cfg["payload_integrity"] is True and cfg["link_secret"] == "s"
    assert parse_engine_options({})["payload_integrity"] is False
    # the engine itself refuses integrity without a secret, whoever asks
    from internals import open_engine

    with pytest.raises(LLMException) as err:
        open_engine(backend="cpu", device_id=0, cluster_id=3, role="MIX", payload_integrity=True)
    assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_secret_without_libcrypto_fails_init_naming_what_is_missing(peers: Callable[..., Peer]) -> None:
    """libcrypto is loaded at run time: where it cannot be, an engine with a secret does not start
    (and says what to install); one without a secret does not need it."""
    p = peers("prefill", env=peer_env("tcp", PDLINK_LIBCRYPTO="/nonexistent/libcrypto.so.3"))
    with pytest.raises(LLMException) as e:
        p.call(kv.start, "prompt", 1, listen=True, extra={"pdlink.LinkSecret": "s"})
    assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert "/nonexistent/libcrypto.so.3" in str(e.value) and "libssl3" in str(e.value)
    q = peers("decode", env=peer_env("tcp", PDLINK_LIBCRYPTO="/nonexistent/libcrypto.so.3"))
    assert q.call(kv.start, "decoder", 2) == 0

"""Authenticated links: a shared secret proved by challenge-response, never sent (issue: reliability
and security). Hostile handshakes are refused before they reach any memory."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

import pytest

import rawwire
from backend_env import peer_env
from internals import core as _core
from pdlink import LLMException, LLMStatusCode
from peer import wait_for

SETUP = """
kv = tensors(2, (8, 256), seed={seed})
cache = cm.register_blocks_cache(CacheDesc(2, [8, 256], DataType.DT_FLOAT16), addrs(kv), {key})
"""


@pytest.mark.parametrize("key_len", [0, 1, 32, 64, 65, 200])
@pytest.mark.parametrize("msg_len", [0, 3, 55, 56, 63, 64, 65, 1000])
def test_hmac_matches_python(key_len, msg_len):
    key, msg = os.urandom(key_len), os.urandom(msg_len)
    assert _core._hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()


def pair(peers, transport, p_secret, d_secret):
    env_p = peer_env(transport, **({"PDLINK_LINK_SECRET": p_secret} if p_secret else {}))
    env_d = peer_env(transport, **({"PDLINK_LINK_SECRET": d_secret} if d_secret else {}))
    p, d = peers("prefill", env=env_p), peers("decode", env=env_d)
    p.exec("dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(options(listen='127.0.0.1:0')); cm = dd.cache_manager\n"
           + SETUP.format(seed=1, key="BlocksCacheKey(1, 0)"))
    d.exec("dd = LLMDataDist(LLMRole.DECODER, 2); dd.init(options()); cm = dd.cache_manager\n"
           + SETUP.format(seed=2, key="None"))
    return p, d, p.eval("dd.listen_port")


def test_same_secret_links_and_moves_bytes(peers, transport):
    p, d, port = pair(peers, transport, "s3cret-A", "s3cret-A")
    assert d.eval(f"dd.link_clusters([cluster(1, {port})])")[0] == LLMStatusCode.LLM_SUCCESS
    d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [1, 2], [1, 2])")
    assert d.eval("[a[1:3].tobytes() for a in kv]") == p.eval("[a[1:3].tobytes() for a in kv]")


def test_secret_as_an_init_option(peers):
    p, d = peers("prefill"), peers("decode")
    p.exec("o = options(listen='127.0.0.1:0'); o['pdlink.LinkSecret'] = 'opt-secret'\n"
           "dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(o)")
    d.exec("o = options(); o['pdlink.LinkSecret'] = 'opt-secret'\ndd = LLMDataDist(LLMRole.DECODER, 2); dd.init(o)")
    assert d.eval(f"dd.link_clusters([cluster(1, {p.eval('dd.listen_port')})])")[0] == LLMStatusCode.LLM_SUCCESS


@pytest.mark.parametrize("p_secret, d_secret", [("server-only", None), (None, "client-only"), ("one", "two")])
def test_mismatched_secrets_are_refused_on_both_sides(peers, p_secret, d_secret):
    p, d, port = pair(peers, "tcp", p_secret, d_secret)
    assert d.eval(f"dd.link_clusters([cluster(1, {port})], 2000)") == (
        LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert d.eval("dd.links()") == [] and p.eval("dd.links()") == []
    # and the refused peer never got to touch memory: nothing was pulled
    assert d.eval("kv[0].tobytes()") != p.eval("kv[0].tobytes()")


def test_forged_or_replayed_proofs_are_refused_and_the_engine_keeps_serving(peers):
    p, d, port = pair(peers, "tcp", "the-secret", "the-secret")
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
    assert d.eval(f"dd.link_clusters([cluster(1, {port})])")[0] == LLMStatusCode.LLM_SUCCESS
    d.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [4], [4])")
    assert d.eval("kv[1][4].tobytes()") == p.eval("kv[1][4].tobytes()")


def test_connection_flood_does_not_stop_existing_links(peers):
    p, d, port = pair(peers, "tcp", None, None)
    assert d.eval(f"dd.link_clusters([cluster(1, {port})])")[0] == LLMStatusCode.LLM_SUCCESS
    flood = []
    try:
        for _ in range(200):  # silent connections: each holds a handshake slot until it times out
            flood.append(socket.create_connection(("127.0.0.1", port)))
        for block in range(8):  # the established link is served throughout
            d.exec(f"cm.pull_blocks(BlocksCacheKey(1, 0), cache, [{block}], [{block}])")
        assert d.eval("[a.tobytes() for a in kv]") == p.eval("[a.tobytes() for a in kv]")
    finally:
        for s in flood:
            s.close()
    # once the flood is gone, new links are accepted again: as soon as the server's handshake
    # threads have seen their connections close (quick, but not instant on a loaded machine or
    # under a sanitizer), so the first attempts may still find every handshake slot taken
    d.exec(f"dd.unlink_clusters([cluster(1, {port})])")
    assert wait_for(lambda: d.eval(f"dd.link_clusters([cluster(1, {port})], 2000)")[0] == LLMStatusCode.LLM_SUCCESS,
                    timeout=15)


def test_sealed_frames_follow_the_documented_scheme(peers):
    """A raw client that knows the secret makes a whole link (both channels) and speaks sealed frames
    computed from the documented scheme (tests/rawwire.py: transcript, session key, per-direction
    sequence numbers): its ping is answered with a response whose tag checks out; the same ping
    sent again (a replay) is not answered and drops the link."""
    p, _d, port = pair(peers, "tcp", "the-secret", None)
    fwd = rawwire.handshake(port, channel=0, nonce=77, secret=b"the-secret")
    rev = rawwire.handshake(port, channel=1, nonce=77, secret=b"the-secret")
    assert (fwd.status, rev.status) == (0, 0) and fwd.key and rev.key and fwd.key != rev.key
    assert wait_for(lambda: [link["authenticated"] for link in p.eval("dd.links()")] == [True])
    sealer = rawwire.Sealer(fwd.key, requester=True)
    ping = sealer.seal(rawwire.request(rawwire.OP_PING, b""))
    fwd.sock.sendall(ping)
    fwd.sock.settimeout(5)
    answer = rawwire.recv_exact(fwd.sock, 20 + rawwire.TAG_BYTES)
    assert struct.unpack_from("<IIQ", answer, 4) == (0, 0, 0)
    assert sealer.check(answer[:20], answer[20:])
    fwd.sock.sendall(ping)  # replayed: its tag was for frame 0, the acceptor expects frame 1
    assert fwd.sock.recv(64) == b""  # closed without an answer
    assert wait_for(lambda: "failed its authentication" in p.eval("dd.links()")[0]["broken_reason"])
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
    e = _core.Engine("cpu")
    with pytest.raises(LLMException) as err:
        e.initialize(3, 0, "", 0, 1000, 0, 16, 0, 16, 1000, payload_integrity=True)
    assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_secret_without_libcrypto_fails_init_naming_what_is_missing(peers):
    """libcrypto is loaded at run time: where it cannot be, an engine with a secret does not start
    (and says what to install); one without a secret does not need it."""
    from peers import kv

    p = peers("prefill", env=peer_env("tcp", PDLINK_LIBCRYPTO="/nonexistent/libcrypto.so.3"))
    with pytest.raises(LLMException) as e:
        p.call(kv.start, "prompt", 1, listen=True, extra={"pdlink.LinkSecret": "s"})
    assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert "/nonexistent/libcrypto.so.3" in str(e.value) and "libssl3" in str(e.value)
    q = peers("decode", env=peer_env("tcp", PDLINK_LIBCRYPTO="/nonexistent/libcrypto.so.3"))
    assert q.call(kv.start, "decoder", 2) == 0

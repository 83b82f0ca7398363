"""Authenticated links: a shared secret proved by challenge-response, never sent (issue: reliability
and security). Hostile handshakes are refused before they reach any memory."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

import pytest

import rawwire
from backend_env import peer_env
from internals import core as _core
from pdlink import LLMStatusCode
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
    challenge = os.urandom(16)
    sock.sendall(rawwire.hello(nonce=1, challenge=challenge))
    a = rawwire.read_ack(sock)
    assert a.status == 0
    # the server proved itself correctly for this hello...
    assert a.proof == rawwire.proof(b"the-secret", b"S", challenge, a.challenge, 9, a.cluster, 1, 0)
    # ...and a client proof bound to nonce 2 does not pass for nonce 1
    sock.sendall(rawwire.client_auth(rawwire.proof(b"the-secret", b"C", challenge, a.challenge, 9, a.cluster, 2, 0)))
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

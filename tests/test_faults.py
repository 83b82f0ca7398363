"""Dead, frozen, refusing and hostile peers: clear errors within the timeouts, never a hang."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from pdlink.status import LLMException, LLMStatusCode
from backend_env import peer_env
from peer import wait_for

import rawwire

SETUP = """
kv = tensors(2, (16, 4096), seed={seed})
cache = cm.register_blocks_cache(CacheDesc(2, [16, 4096], DataType.DT_FLOAT16), addrs(kv), {key})
"""


def linked(make_pd, timeout=1000, remote=True):
    pd = make_pd(timeout=timeout, remote=remote)
    pd.prefill.exec(SETUP.format(seed=1, key="BlocksCacheKey(1, 0)"))
    pd.decode.exec(SETUP.format(seed=2, key="None"))
    pd.link()
    return pd


def timed_pull(pd, blocks="[0, 1]"):
    t0 = time.monotonic()
    with pytest.raises(LLMException) as e:
        pd.decode.exec(f"cm.pull_blocks(BlocksCacheKey(1, 0), cache, {blocks}, {blocks})", timeout=30)
    return e.value, time.monotonic() - t0


def test_peer_killed_after_link_gives_link_failed(make_pd):
    pd = linked(make_pd)
    pd.prefill.kill()
    err, took = timed_pull(pd)
    assert err.status_code in (LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_TIMEOUT)
    assert took < 5
    # the dead link is still an entity: switch_role refuses, unlink cleans up, then it is gone
    with pytest.raises(LLMException) as e:
        pd.decode.exec("dd.switch_role(LLMRole.PROMPT, {'llm.listenIpInfo': '127.0.0.1:0'})")
    assert e.value.status_code == LLMStatusCode.LLM_EXIST_LINK
    assert pd.decode.eval(f"dd.unlink_clusters([cluster(1, {pd.port})])[0]") == LLMStatusCode.LLM_SUCCESS
    assert pd.decode.eval("dd.links()") == []
    pd.decode.exec("dd.switch_role(LLMRole.PROMPT, {'llm.listenIpInfo': '127.0.0.1:0'})")


def test_frozen_peer_times_out_then_relink_works(make_pd):
    pd = linked(make_pd, timeout=500)
    pd.prefill.signal(signal.SIGSTOP)
    try:
        err, took = timed_pull(pd)
    finally:
        pd.prefill.signal(signal.SIGCONT)
    assert err.status_code == LLMStatusCode.LLM_TIMEOUT
    assert 0.4 < took < 3.0, took
    # the timed-out link is poisoned: further transfers fail fast until it is rebuilt
    err, took = timed_pull(pd)
    assert err.status_code == LLMStatusCode.LLM_LINK_FAILED and took < 1
    assert "unlink_clusters" in str(err)
    pd.decode.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], force=True)")
    pd.link()
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [3], [3])")
    assert pd.decode.eval("[a[3].tobytes() for a in kv]") == pd.prefill.eval("[a[3].tobytes() for a in kv]")


def test_link_to_silent_listener_times_out(peers):
    # a socket that accepts but never answers the hello
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    port = silent.getsockname()[1]
    d = peers("decode")
    d.exec("dd = LLMDataDist(LLMRole.DECODER, 2); dd.init(options())")
    t0 = time.monotonic()
    ret = d.eval(f"dd.link_clusters([cluster(1, {port})], 300)")
    took = time.monotonic() - t0
    silent.close()
    assert ret == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert took < 2.5, took
    assert d.eval("dd.links()") == []


def test_failed_pull_leaves_the_source_key_for_a_retry(make_pd):
    pd = make_pd(timeout=300, remote=False)
    pd.prefill.exec("c_src = cm.allocate_cache(CacheDesc(2, [1, 4096], DataType.DT_INT8), [CacheKey(1, 5)])\n"
                    "write_cache(c_src, 6)\nexpected = [a.tobytes() for a in read_cache(c_src)]\n"
                    "cm.deallocate_cache(c_src)")  # only the request key holds it now
    pd.decode.exec("c_dst = cm.allocate_cache(CacheDesc(2, [1, 4096], DataType.DT_INT8))")
    pd.link()
    pd.prefill.signal(signal.SIGSTOP)
    try:
        with pytest.raises(LLMException) as e:
            pd.decode.exec("cm.pull_cache(CacheKey(1, 5), c_dst)")
    finally:
        pd.prefill.signal(signal.SIGCONT)
    assert e.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert pd.prefill.eval("dd._engine.cache_count") == 1  # the key still holds the cache
    assert pd.decode.eval(f"dd.unlink_clusters([cluster(1, {pd.port})])[0]") == LLMStatusCode.LLM_SUCCESS
    pd.link()
    pd.decode.exec("cm.pull_cache(CacheKey(1, 5), c_dst)")
    assert pd.decode.eval("[a.tobytes() for a in read_cache(c_dst)]") == pd.prefill.eval("expected")
    assert wait_for(lambda: pd.prefill.eval("dd._engine.cache_count") == 0)  # consumed by the pull: freed


def test_garbage_and_hostile_hellos_are_refused_and_the_engine_keeps_serving(pd):
    pd.prefill.exec(SETUP.format(seed=1, key="BlocksCacheKey(1, 0)"))
    pd.decode.exec(SETUP.format(seed=2, key="None"))
    # 1. random bytes: the connection is dropped
    with socket.create_connection(("127.0.0.1", pd.port)) as s:
        s.sendall(os.urandom(4096))
        s.settimeout(5)
        try:
            assert s.recv(100) == b""
        except ConnectionResetError:
            pass
    # 2. a truncated hello followed by silence: dropped after the handshake timeout, the
    #    listener meanwhile keeps accepting (checked by the real link below)
    stalled = socket.create_connection(("127.0.0.1", pd.port))
    stalled.sendall(rawwire.hello()[:10])
    # 3. a wrong protocol version and 4. a wrong expected cluster id: refused with a reason
    for hello, words in [(rawwire.hello(version=99), "version"), (rawwire.hello(expected=77), "not cluster 77")]:
        with socket.create_connection(("127.0.0.1", pd.port)) as s:
            s.sendall(hello)
            status, cluster, msg, _, _ = rawwire.read_ack(s)
            assert status == LLMStatusCode.LLM_LINK_FAILED and cluster == 1 and words in msg, msg
    # 5. a reverse channel without a forward one
    s, stage, status, msg = rawwire.handshake(pd.port, channel=1)
    s.close()
    assert (stage, status) == ("auth", LLMStatusCode.LLM_LINK_FAILED), msg
    pd.link()
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [5], [5])")
    assert pd.decode.eval("[a[5].tobytes() for a in kv]") == pd.prefill.eval("[a[5].tobytes() for a in kv]")
    assert [link["peer_cluster_id"] for link in pd.prefill.eval("dd.links()")] == [2]
    stalled.close()


def test_hostile_frames_on_an_established_link_only_drop_that_link(pd):
    """A peer that passes the handshake and then sends out-of-range or malformed requests."""
    pd.prefill.exec(SETUP.format(seed=1, key="BlocksCacheKey(1, 0)"))
    fwd, stage, status, msg = rawwire.handshake(pd.port, cluster=9, nonce=77)
    assert status == 0, msg
    rev, stage, status, msg = rawwire.handshake(pd.port, channel=1, cluster=9, nonce=77)
    if pd.transport == "cma":
        # an engine forced to direct memory access refuses a peer that is not on its host
        assert status == LLMStatusCode.LLM_LINK_FAILED and "cma" in msg, msg
        return
    assert status == 0, msg
    fwd.settimeout(5)
    tensor_bytes = 16 * 4096 * 2
    # reads outside the registered region, of a missing tensor, of an unregistered model: refused
    for b, code in [(rawwire.blocks_body(runs=((tensor_bytes - 8, 64),)), LLMStatusCode.LLM_PARAM_INVALID),
                    (rawwire.blocks_body(runs=((2**64 - 8, 64),)), LLMStatusCode.LLM_PARAM_INVALID),
                    (rawwire.blocks_body(tensors=(2,)), LLMStatusCode.LLM_PARAM_INVALID),
                    (rawwire.blocks_body(model=5), LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
                    (rawwire.blocks_body(runs=((0, 0),)), LLMStatusCode.LLM_PARAM_INVALID),
                    (rawwire.blocks_body(kind=5, runs=((4096, 64),)), LLMStatusCode.LLM_PARAM_INVALID)]:
        fwd.sendall(rawwire.request(1, b))
        status, msg, data = rawwire.read_response(fwd)
        assert status == code and data == b"", msg
    # a legal read works and returns exactly the registered bytes
    fwd.sendall(rawwire.request(1, rawwire.blocks_body(runs=((128, 64),))))
    status, msg, data = rawwire.read_response(fwd)
    if pd.transport == "ascend":
        # device memory never leaves through the control connection, only through the device
        # channel (which this raw peer never set up): a stream read of it is refused
        assert status == LLMStatusCode.LLM_PARAM_INVALID and data == b"" and "device memory" in msg, msg
    else:
        assert status == 0 and data == pd.prefill.eval("kv[0].tobytes()[128:192]")
    # a write whose declared payload disagrees with its descriptor: the link is dropped
    fwd.sendall(rawwire.request(2, rawwire.blocks_body(), payload_len=10**12))
    assert fwd.recv(10) == b""
    # and the engine still serves a real decoder
    pd.decode.exec(SETUP.format(seed=2, key="None"))
    pd.link()
    pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [1], [1])")
    assert pd.decode.eval("kv[0][1].tobytes()") == pd.prefill.eval("kv[0][1].tobytes()")
    fwd.close()
    rev.close()


BIG = """
big = tensors(2, (64, 256 * 1024), seed={seed}, dtype=np.uint8)  # 2 x 16 MiB
bigc = cm.register_blocks_cache(CacheDesc(2, [64, 256 * 1024], DataType.DT_UINT8), addrs(big), {key})
"""


def start_prefill(peers, transport, cluster_id=1):
    p = peers("prefill", env=peer_env(transport))
    p.exec(f"dd = LLMDataDist(LLMRole.PROMPT, {cluster_id}); dd.init(options(listen='127.0.0.1:0')); "
           "cm = dd.cache_manager\n" + SETUP.format(seed=1, key="BlocksCacheKey(1, 0)")
           + BIG.format(seed=7, key="BlocksCacheKey(1, 1)"))
    return p, p.eval("dd.listen_port")


def test_peer_killed_before_link(make_pd):
    pd = make_pd()
    pd.prefill.kill()
    t0 = time.monotonic()
    ret = pd.decode.eval(f"dd.link_clusters([cluster(1, {pd.port})], 3000)")
    assert ret == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert time.monotonic() - t0 < 3.5
    assert pd.decode.eval("dd.links()") == []


@pytest.mark.parametrize("op", ["pull", "push"])
def test_peer_killed_during_a_large_transfer_then_restarted(peers, transport, op):
    """Kill the prefill mid-transfer: the decoder gets an error (or, with direct memory access, may
    finish a copy already under way), never a hang; its resources are released; a restarted
    prefill with the same cluster id links again and serves correct bytes."""
    p, port = start_prefill(peers, transport)
    d = peers("decode", env=peer_env(transport))
    d.exec("dd = LLMDataDist(LLMRole.DECODER, 2); dd.init(options(timeout=10000)); cm = dd.cache_manager\n"
           + SETUP.format(seed=2, key="None") + BIG.format(seed=8, key="None"))
    assert d.eval(f"dd.link_clusters([cluster(1, {port})])")[0] == LLMStatusCode.LLM_SUCCESS
    baseline = d.eval("resources()")
    call = ("cm.pull_blocks(BlocksCacheKey(1, 1), bigc, list(range(64)), list(range(63, -1, -1)))" if op == "pull"
            else "cm.push_blocks(BlocksCacheKey(1, 1), bigc, list(range(64)), list(range(63, -1, -1)))")
    d.exec(f"""
import threading
outcome = []
def run():
    try:
        for _ in range(50):
            {call}
        outcome.append("ok")
    except LLMException as e:
        outcome.append(e.status_code)
worker = threading.Thread(target=run)
worker.start()
""")
    time.sleep(0.05)
    p.kill()
    t0 = time.monotonic()
    d.exec("worker.join(15)")
    assert time.monotonic() - t0 < 12
    outcome = d.eval("outcome")
    assert len(outcome) == 1
    if transport in ("tcp", "ascend"):  # a stream (or HCCL transfer) broken by the peer's death
        assert outcome == [LLMStatusCode.LLM_LINK_FAILED], outcome
    else:  # a direct copy already under way may complete; the next request finds the peer gone
        assert outcome[0] in ("ok", LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_TIMEOUT), outcome
    # unlinking the dead peer succeeds (non-force: there is nobody left to tell), and the serving
    # thread and sockets of that link are gone
    assert d.eval(f"dd.unlink_clusters([cluster(1, {port})])[0]") == LLMStatusCode.LLM_SUCCESS
    assert wait_for(lambda: all(now <= before for now, before in zip(d.eval("resources()"), baseline))), (
        d.eval("resources()"), baseline)
    # a restarted prefill (same cluster id, new process and port) serves correct bytes
    p2, port2 = start_prefill(peers, transport)
    assert d.eval(f"dd.link_clusters([cluster(1, {port2})])")[0] == LLMStatusCode.LLM_SUCCESS
    d.exec("cm.pull_blocks(BlocksCacheKey(1, 1), bigc, [0, 5], [0, 5])")
    assert d.eval("[a[[0, 5]].tobytes() for a in big]") == p2.eval("[a[[0, 5]].tobytes() for a in big]")


@pytest.mark.parametrize("force", [False, True])
def test_unlink_toward_a_dead_peer(make_pd, force):
    pd = linked(make_pd)
    pd.prefill.kill()
    t0 = time.monotonic()
    ret = pd.decode.eval(f"dd.unlink_clusters([cluster(1, {pd.port})], 2000, force={force})")
    assert time.monotonic() - t0 < 3
    # the peer is gone: nothing to notify; the local end is released either way
    assert ret[0] in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED), ret
    assert pd.decode.eval("dd.links()") == []
    with pytest.raises(LLMException) as e:
        pd.decode.exec("cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0])")
    assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK

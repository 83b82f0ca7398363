"""KvCacheManager (v1, legacy) mode across real processes: roles, pulls, switch_role, handles,
single-process multi-device mode (spec 4.2, 6.1, 6.5, 6.6, 7.6, 7.12, 9, 10.4, 10.7, 11.2).

Tests taking the ``backend`` fixture (directly or through ``v1``) run on the CPU backend and on
the Ascend backend over the fake libraries, where caches are device memory read and written
through backend copies (``kv_write``/``kv_read``/``kv_zero``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from backend_env import peer_env
from pdlink import LLMException
from pdlink import LLMStatusCode as S
from peer import wait_for  # the peer releases pulled keys asynchronously
from poll import hang_guard

PROMPT_ID, DECODER_ID = 1, 2

V1_PRELUDE = """
import ctypes, gc, sys

def v1_options(listen=None, devices=0, timeout=None, switch=False, mem_max=None, pool=None):
    cfg = LLMConfig()
    cfg.device_id = devices
    if listen:
        cfg.listen_ip_info = listen
    if timeout:
        cfg.sync_kv_timeout = timeout
    if switch:
        cfg.enable_switch_role = True
    if mem_max:
        cfg.ge_options = {"ge.flowGraphMemMaxSize": str(mem_max)}
    if pool:
        cfg.mem_pool_cfg = '{"memory_size": %d, "page_shift": 12}' % pool
    return cfg.generate_options()

def v1_cluster(remote_id, ports):
    c = LLMClusterInfo()
    c.remote_cluster_id = remote_id
    c.append_local_ip_info("127.0.0.1", 0)
    for port in ports:
        c.append_remote_ip_info("127.0.0.1", port)
    return c

def pattern(size, i, seed):
    return ((np.arange(size, dtype=np.int64) * 7 + i * 13 + seed * 101) % 251).astype(np.uint8)

# Caches are allocated from the device pool. On a device backend (DEVICE_DATA, see peer.py) that is
# device memory of device `dev` (devices 0..n-1 in these tests), reached only by backend copies.
def _to(a, host, size, dev):
    from pdlink.device import open_backend
    open_backend(None, dev).copy(a, int(Placement.DEVICE), host.ctypes.data, int(Placement.HOST), size)

def _from(a, size, dev):
    from pdlink.device import open_backend
    out = np.empty(size, dtype=np.uint8)
    open_backend(None, dev).copy(out.ctypes.data, int(Placement.HOST), a, int(Placement.DEVICE), size)
    return out

def kv_write(kv, seed, dev=0):
    size = kv.cache_desc.size
    for i, a in enumerate(kv.per_device_tensor_addrs[dev]):
        if DEVICE_DATA:
            _to(a, pattern(size, i, seed), size, dev)
        else:
            np.frombuffer((ctypes.c_uint8 * size).from_address(a), dtype=np.uint8)[:] = pattern(size, i, seed)

def kv_read(kv, dev=0):
    size = kv.cache_desc.size
    if DEVICE_DATA:
        return [_from(a, size, dev) for a in kv.per_device_tensor_addrs[dev]]
    return [np.frombuffer((ctypes.c_uint8 * size).from_address(a), dtype=np.uint8).copy()
            for a in kv.per_device_tensor_addrs[dev]]

def kv_zero(kv):
    size = kv.cache_desc.size
    for dev, addrs in enumerate(kv.per_device_tensor_addrs):
        for a in addrs:
            if DEVICE_DATA:
                _to(a, np.zeros(size, dtype=np.uint8), size, dev)
            else:
                ctypes.memset(a, 0, size)
"""


def pattern(size, i, seed):
    return ((np.arange(size, dtype=np.int64) * 7 + i * 13 + seed * 101) % 251).astype(np.uint8)


class llm_error:
    """``with llm_error(code):`` expects an ``LLMException`` (exact class) with that status code."""

    def __init__(self, code, match=None):
        self.code, self.match = code, match

    def __enter__(self):
        return self

    def __exit__(self, tp, value, tb):
        assert tp is not None, f"expected LLMException({self.code}), nothing was raised"
        assert issubclass(tp, LLMException), f"expected LLMException, got {tp.__name__}: {value}"
        assert value.status_code == self.code, f"{value.status_code}: {value}"
        if self.match is not None:
            assert self.match in str(value), str(value)
        return True


class V1:
    """A PROMPT (cluster 1, listening) and a DECODER (cluster 2) in KvCacheManager mode.

    Each side's namespace holds ``dd`` and ``km`` (its KvCacheManager); ``ports`` are the
    prompt's listen ports (one per device).
    """

    def __init__(self, peers, backend="cpu", devices=0, switch=False, timeout=None, prompt_switch=None):
        self.backend = backend
        self.prefill = p = peers("v1-prefill", env=peer_env(backend))
        self.decode = d = peers("v1-decode", env=peer_env(backend))
        n = len(devices) if isinstance(devices, list) else 1
        listen = ";".join(["127.0.0.1:0"] * n)
        p_switch = switch if prompt_switch is None else prompt_switch
        p.exec(V1_PRELUDE)
        d.exec(V1_PRELUDE)
        p.exec(f"dd = LLMDataDist(LLMRole.PROMPT, {PROMPT_ID}); "
               f"dd.init(v1_options({listen!r}, {devices!r}, {timeout!r}, {p_switch!r})); km = dd.kv_cache_manager")
        d.exec(f"dd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); "
               f"dd.init(v1_options(None, {devices!r}, {timeout!r}, {switch!r})); km = dd.kv_cache_manager")
        self.ports = p.eval("dd.listen_ports")
        assert len(self.ports) == n and all(port > 0 for port in self.ports)

    def cluster(self):
        return f"v1_cluster({PROMPT_ID}, {self.ports})"

    def link(self):
        ret = self.decode.eval(f"dd.link_clusters([{self.cluster()}], 5000)")
        assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), ret

    def unlink(self):
        ret = self.decode.eval(f"dd.unlink_clusters([{self.cluster()}], 5000)")
        assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), ret
        assert wait_for(lambda: self.prefill.eval("dd.links()") == []), "the prompt kept its end of the link"


@pytest.fixture
def v1(peers, backend):
    return V1(peers, backend)


# ---------------------------------------------------------------------------- serving flows


def test_vllm_v0_connector_flow(peers, backend):
    """Spec 11.2: P allocates four keyed caches (ids 1..4), D pulls them by id, unlinks at close."""
    pd = V1(peers, backend)
    pd.link()
    num_layers, t, heads, dim = 3, 8, 2, 4
    pd.prefill.exec(f"""
desc = CacheDesc({num_layers}, (1, {t}, {heads}, {dim}), DataType.DT_FLOAT16, seq_len_dim_index=1)
caches = [km.allocate_cache(desc, [CacheKey({PROMPT_ID}, 0, model_id)]) for model_id in (1, 2, 3, 4)]
for c in caches:
    kv_write(c, seed=c.cache_id)
""")
    assert pd.prefill.eval("[c.cache_id for c in caches]") == [1, 2, 3, 4]
    assert pd.prefill.eval("[len(c.per_device_tensor_addrs) for c in caches]") == [1, 1, 1, 1]
    pd.decode.exec(f"""
desc = CacheDesc({num_layers}, (1, {t}, {heads}, {dim}), DataType.DT_FLOAT16, seq_len_dim_index=1)
bufs = [km.allocate_cache(desc) for _ in range(4)]
for b in bufs:
    kv_zero(b)
for i, b in enumerate(bufs):
    km.pull_cache(CacheKeyByIdAndIndex({PROMPT_ID}, cache_id=i + 1, batch_index=0), b, 0)
""")
    size = 1 * t * heads * dim * 2
    got = pd.decode.eval("[kv_read(b) for b in bufs]")
    for cache_id, tensors in enumerate(got, start=1):
        assert len(tensors) == num_layers
        for i, data in enumerate(tensors):
            assert data.tobytes() == pattern(size, i, cache_id).tobytes(), (cache_id, i)
    # the pulls released the keys: once P drops its handles, every cache is freed
    pd.prefill.exec("for c in caches: km.deallocate_cache(c)")
    assert wait_for(lambda: pd.prefill.eval("dd._engine.cache_count") == 0)
    # close: D unlinks; P's end goes too, and pulls now fail with NOT_YET_LINK
    pd.unlink()
    with llm_error(S.LLM_NOT_YET_LINK):
        pd.decode.exec(f"km.pull_cache(CacheKeyByIdAndIndex({PROMPT_ID}, 1, 0), bufs[0])")


def test_pull_by_cache_key_releases_the_key(v1):
    v1.prefill.exec(f"c = km.allocate_cache(CacheDesc(2, [2, 64], DataType.DT_INT8), "
                    f"[CacheKey({PROMPT_ID}, 42), CacheKey({PROMPT_ID}, 43)])\n"
                    "kv_write(c, 5)\n"
                    "km.deallocate_cache(c)")  # only the two keys keep it alive now
    v1.decode.exec("dst = km.allocate_cache(CacheDesc(2, [2, 64], DataType.DT_INT8)); kv_zero(dst)")
    v1.link()
    v1.decode.exec(f"km.pull_cache(CacheKey({PROMPT_ID}, 42), dst, 1)")
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        v1.decode.exec(f"km.pull_cache(CacheKey({PROMPT_ID}, 42), dst, 0)")
    assert v1.prefill.eval("dd._engine.cache_count") == 1  # key 43 still holds it
    v1.decode.exec(f"km.pull_cache(CacheKey(prompt_cluster_id={PROMPT_ID}, req_id=43), dst, 0)")
    assert wait_for(lambda: v1.prefill.eval("dd._engine.cache_count") == 0)
    for i, data in enumerate(v1.decode.eval("kv_read(dst)")):
        full = pattern(128, i, 5)
        assert data[64:].tobytes() == full[:64].tobytes()  # key 42 = slot 0 -> local slot 1
        assert data[:64].tobytes() == full[64:].tobytes()  # key 43 = slot 1 -> local slot 0
    # a removed key cannot be pulled; removing an absent key is a no-op
    v1.prefill.exec(f"c2 = km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8), [CacheKey({PROMPT_ID}, 44)])\n"
                    f"km.remove_cache_key(CacheKey({PROMPT_ID}, 44)); km.remove_cache_key(CacheKey({PROMPT_ID}, 44))")
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        v1.decode.exec(f"km.pull_cache(CacheKey({PROMPT_ID}, 44), dst, 0)")
    # exactly one of req_id / prefix_id must be valid in a pull key
    with llm_error(S.LLM_PARAM_INVALID):
        v1.decode.exec(f"km.pull_cache(CacheKey({PROMPT_ID}, 2**64 - 1), dst, 0)")
    with llm_error(S.LLM_PARAM_INVALID):
        v1.decode.exec(f"km.pull_cache(CacheKey({PROMPT_ID}, 1, 0, 5), dst, 0)")


def test_pull_cache_with_src_and_dst_offsets(v1):
    # P: two caches with the same bytes, batch 2, 64 bytes per slot: id 1 unkeyed, id 2 keyed in slot 1
    # (a pull by id would release a key bound to the slot it reads)
    v1.prefill.exec("c = km.allocate_cache(CacheDesc(2, [2, 64], DataType.DT_INT8)); kv_write(c, 3)\n"
                    f"ck = km.allocate_cache(CacheDesc(2, [2, 64], DataType.DT_INT8), "
                    f"[CacheKey({PROMPT_ID}, 2**64 - 1), CacheKey({PROMPT_ID}, 9)])\nkv_write(ck, 3)")
    v1.decode.exec("dst = km.allocate_cache(CacheDesc(2, [2, 64], DataType.DT_INT8)); kv_zero(dst)")
    v1.link()
    src = [pattern(128, i, 3) for i in range(2)]

    def dst():
        return v1.decode.eval("kv_read(dst)")

    # by id: 24 bytes from offset 16 of remote slot 1 into offset 8 of local slot 1
    v1.decode.exec(f"km.pull_cache(CacheKeyByIdAndIndex({PROMPT_ID}, 1, 1), dst, 1, 24, "
                   "src_cache_offset=16, dst_cache_offset=8)")
    for s, d in zip(src, dst()):
        assert d[64 + 8:64 + 32].tobytes() == s[64 + 16:64 + 40].tobytes()
        assert not d[:72].any() and not d[96:].any()
    # size -1 with only a dst offset: the rest of the local slot, from the start of the remote slot
    v1.decode.exec(f"kv_zero(dst); km.pull_cache(CacheKeyByIdAndIndex({PROMPT_ID}, 1, 0), dst, 0, "
                   "dst_cache_offset=48)")
    for s, d in zip(src, dst()):
        assert d[48:64].tobytes() == s[:16].tobytes() and not d[:48].any() and not d[64:].any()
    # by request key: offsets are relative to the keyed slot (remote slot 1)
    v1.decode.exec(f"kv_zero(dst); km.pull_cache(CacheKey({PROMPT_ID}, 9), dst, 0, 8, src_cache_offset=4, "
                   "dst_cache_offset=-1)")
    for s, d in zip(src, dst()):
        assert d[:8].tobytes() == s[64 + 4:64 + 12].tobytes() and not d[8:].any()
    # ... and the successful pull consumed the key
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        v1.decode.exec(f"km.pull_cache(CacheKey({PROMPT_ID}, 9), dst, 0, 8, src_cache_offset=0)")
    bad = {
        "dst_cache_offset=60, size=8": S.LLM_PARAM_INVALID,  # past the local slot
        "src_cache_offset=60, size=8": S.LLM_PARAM_INVALID,  # past the remote slot (checked by the peer)
        "src_cache_offset=-2": S.LLM_PARAM_INVALID,
        "dst_cache_offset=64": S.LLM_PARAM_INVALID,  # nothing left of the slot
        "src_cache_offset=0, batch_index=2": S.LLM_PARAM_INVALID,
        "src_cache_offset=0, bogus=1": S.LLM_PARAM_INVALID,
    }
    for kwargs, code in bad.items():
        with llm_error(code):
            v1.decode.exec(f"km.pull_cache(CacheKeyByIdAndIndex({PROMPT_ID}, 1, 0), dst, **dict({kwargs}))")
    with pytest.raises(TypeError):
        v1.decode.exec(f"km.pull_cache(CacheKeyByIdAndIndex({PROMPT_ID}, 1, 0), dst, src_cache_offset='1')")
    with pytest.raises(ValueError):
        v1.decode.exec(f"km.pull_cache(CacheKeyByIdAndIndex({PROMPT_ID}, 1, 0), dst, dst_cache_offset=2**63)")


def test_pull_blocks_list_rules_and_bytes(v1):
    v1.prefill.exec(f"blk = km.allocate_blocks_cache(CacheDesc(2, [8, 32], DataType.DT_INT8), "
                    f"BlocksCacheKey({PROMPT_ID}, 0))\nkv_write(blk, 7)")
    v1.decode.exec("blk = km.allocate_blocks_cache(CacheDesc(2, [8, 32], DataType.DT_INT8)); kv_zero(blk)\n"
                   "contig = km.allocate_cache(CacheDesc(2, [8, 32], DataType.DT_INT8))")
    v1.link()
    v1.decode.exec(f"km.pull_blocks(BlocksCacheKey({PROMPT_ID}, 0), blk, [0, 3, 4], [5, 6, 7])")
    for i, d in enumerate(v1.decode.eval("kv_read(blk)")):
        s = pattern(256, i, 7).reshape(8, 32)
        d = d.reshape(8, 32)
        assert [d[k].tobytes() for k in (5, 6, 7)] == [s[k].tobytes() for k in (0, 3, 4)]
        assert not d[:5].any()
    # layer ranges: tensor 1 only (one tensor per layer)
    v1.decode.exec(f"kv_zero(blk); km.pull_blocks(BlocksCacheKey({PROMPT_ID}, 0), blk, [2], [2], "
                   "src_layer_range=range(1, 2), dst_layer_range=range(1, 2), tensor_num_per_layer=1)")
    d = v1.decode.eval("kv_read(blk)")
    assert not d[0].any() and d[1][64:96].tobytes() == pattern(256, 1, 7)[64:96].tobytes()
    key = f"BlocksCacheKey({PROMPT_ID}, 0)"
    type_errors = [
        f"km.pull_blocks({key}, blk, (0,), [1])",  # both lists must be list objects
        f"km.pull_blocks({key}, blk, [0], (1,))",
        f"km.pull_blocks({key}, blk, [0], ['1'])",
        f"km.pull_blocks(CacheKey({PROMPT_ID}, 1), blk, [0], [1])",  # v1: BlocksCacheKey only
        f"km.pull_blocks({key}, None, [0], [1])",
    ]
    for call in type_errors:
        with pytest.raises(TypeError):
            v1.decode.exec(call)
    invalid = [
        f"km.pull_blocks({key}, blk, [], [])",
        f"km.pull_blocks({key}, blk, [0], [])",
        f"km.pull_blocks({key}, blk, [0, 1], [1])",
        f"km.pull_blocks({key}, blk, [0], [8])",  # outside the local cache
        f"km.pull_blocks({key}, contig, [0], [1])",  # not a blocks cache
        f"km.pull_blocks({key}, blk, [0], [1], bogus=1)",
    ]
    for call in invalid:
        with llm_error(S.LLM_PARAM_INVALID):
            v1.decode.exec(call)
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):  # no blocks cache under model 1 on the prompt
        v1.decode.exec(f"km.pull_blocks(BlocksCacheKey({PROMPT_ID}, 1), blk, [0], [1])")


# ---------------------------------------------------------------------------- role rules


def test_role_rules(v1):
    p, d = v1.prefill, v1.decode
    desc = "CacheDesc(1, [2, 16], DataType.DT_INT8)"
    p.exec(f"pc = km.allocate_cache({desc}, [CacheKey({PROMPT_ID}, 1)])\n"
           f"pb = km.allocate_blocks_cache({desc}, BlocksCacheKey({PROMPT_ID}, 0))")
    d.exec(f"dc = km.allocate_cache({desc}); db = km.allocate_blocks_cache({desc})")
    v1.link()
    # PROMPT may not pull, link or check links
    for call, needs in [
        (f"km.pull_cache(CacheKeyByIdAndIndex({DECODER_ID}, 1, 0), pc)", "LLMRole.DECODER"),
        (f"km.pull_blocks(BlocksCacheKey({DECODER_ID}, 0), pb, [0], [0])", "LLMRole.DECODER"),
        (f"dd.check_link_status({DECODER_ID})", "LLMRole.DECODER"),
    ]:
        with llm_error(S.LLM_PARAM_INVALID, match=needs):
            p.exec(call)
    assert p.eval(f"dd.link_clusters([v1_cluster({DECODER_ID}, [1])], 1000)") == (
        S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
    assert p.eval(f"dd.link_clusters([v1_cluster({DECODER_ID}, [1]), v1_cluster(3, [1])], 1000)") == (
        S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID] * 2)
    with pytest.raises(TypeError):  # argument types are still checked first
        p.exec("dd.link_clusters(['x'], 1000)")
    # DECODER may not publish keys
    for call in [f"km.allocate_cache({desc}, [CacheKey({DECODER_ID}, 1)])",
                 f"km.allocate_blocks_cache({desc}, BlocksCacheKey({DECODER_ID}, 0))",
                 f"km.remove_cache_key(CacheKey({DECODER_ID}, 1))"]:
        with llm_error(S.LLM_PARAM_INVALID, match="LLMRole.PROMPT"):
            d.exec(call)
    assert d.eval("dd._engine.cache_count") == 2  # the refused allocations left nothing behind
    # device pool only; num_tensors > 0; the HOST handle of create_cpu_cache cannot be freed here
    for who in (p, d):
        with llm_error(S.LLM_PARAM_INVALID):
            who.exec("km.allocate_cache(CacheDesc(1, [2, 16], DataType.DT_INT8, Placement.HOST))")
        with llm_error(S.LLM_PARAM_INVALID):
            who.exec("km.allocate_blocks_cache(CacheDesc(0, [2, 16], DataType.DT_INT8))")
        with llm_error(S.LLM_PARAM_INVALID):
            who.exec("km.deallocate_cache(KvCache.create_cpu_cache(CacheDesc(1, [2], DataType.DT_INT8, "
                     "Placement.HOST), [1]))")
        with pytest.raises(TypeError):
            who.exec("km.allocate_cache('desc')")
        with pytest.raises(TypeError):
            who.exec("km.deallocate_cache(None)")
    # deallocate: both kinds, either role; a second time is KV_CACHE_NOT_EXIST
    d.exec("km.deallocate_cache(dc); km.deallocate_cache(db)")
    assert d.eval("(dc.per_device_tensor_addrs, dd._engine.cache_count)") == ([], 0)
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        d.exec("km.deallocate_cache(dc)")
    # the prompt may unlink (cleanup after a dead decoder); the decoder sees the link gone
    assert p.eval(f"dd.unlink_clusters([v1_cluster({DECODER_ID}, [])], 2000)") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert wait_for(lambda: d.eval("dd.links()") == [])
    # one LLMException class in both modes, a subclass of RuntimeError
    assert p.eval("LLMException.__module__") == "pdlink.status"


def test_check_link_status(peers, backend):
    v1 = V1(peers, backend, timeout=300)
    d = v1.decode
    with llm_error(S.LLM_NOT_YET_LINK):
        d.exec(f"dd.check_link_status({PROMPT_ID})")
    with pytest.raises(TypeError):
        d.exec(f"dd.check_link_status('{PROMPT_ID}')")
    with pytest.raises(ValueError):
        d.exec("dd.check_link_status(-1)")
    v1.link()
    assert d.eval(f"dd.check_link_status({PROMPT_ID})") is None
    with llm_error(S.LLM_NOT_YET_LINK):
        d.exec("dd.check_link_status(77)")
    # a frozen peer: bounded by llm.SyncKvCacheWaitTime (300 ms)
    v1.prefill.signal(signal.SIGSTOP)
    try:
        with llm_error(S.LLM_TIMEOUT):  # the peer cannot answer: only the timeout ends the call
            d.exec(f"dd.check_link_status({PROMPT_ID})", timeout=hang_guard(300))
    finally:
        v1.prefill.signal(signal.SIGCONT)
    v1.prefill.kill()
    with pytest.raises(LLMException) as e:
        d.exec(f"dd.check_link_status({PROMPT_ID})")
    assert e.value.status_code == S.LLM_LINK_FAILED  # the dead peer's sockets are closed: no waiting
    # the dead peer's link is cleaned up by unlinking, after which it is simply not linked
    assert d.eval(f"dd.unlink_clusters([{v1.cluster()}], 1000)")[0] == S.LLM_SUCCESS
    with llm_error(S.LLM_NOT_YET_LINK):
        d.exec(f"dd.check_link_status({PROMPT_ID})")


# ---------------------------------------------------------------------------- switch_role


def test_switch_role_error_codes(peers, backend):
    pd = V1(peers, backend, switch=True)
    p, d = pd.prefill, pd.decode
    listen = "{'llm.listenIpInfo': '127.0.0.1:0'}"
    for call in ["dd.switch_role(2)", "dd.switch_role('PROMPT')", "dd.switch_role(LLMRole.PROMPT, 'x')",
                 "dd.switch_role(LLMRole.PROMPT, {'llm.listenIpInfo': 1})", "dd.switch_role(None)"]:
        with pytest.raises(TypeError):
            d.exec(call)
    with llm_error(S.LLM_PARAM_INVALID):  # same role
        d.exec("dd.switch_role(LLMRole.DECODER)")
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec(f"dd.switch_role(LLMRole.PROMPT, {listen})")
    for opts in ("None", "{}", "{'llm.SyncKvCacheWaitTime': '1000'}", "{'llm.listenIpInfo': '127.0.0.1'}",
                 "{'llm.listenIpInfo': ''}"):
        with llm_error(S.LLM_PARAM_INVALID):  # to PROMPT without a valid listen address
            d.exec(f"dd.switch_role(LLMRole.PROMPT, {opts})")
    pd.link()
    with llm_error(S.LLM_EXIST_LINK):
        d.exec(f"dd.switch_role(LLMRole.PROMPT, {listen})")
    with llm_error(S.LLM_EXIST_LINK):  # the prompt holds the passive end of the link
        p.exec("dd.switch_role(LLMRole.DECODER)")
    assert d.eval("(dd.role, km._role)") == (2, 2) and p.eval("dd.listen_port") == pd.ports[0]
    # without llm.EnableSwitchRole: FEATURE_NOT_ENABLED (after the Python-side checks)
    d.exec(f"dd.unlink_clusters([{pd.cluster()}], 2000); dd.finalize()\n"
           f"dd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); dd.init(v1_options())")
    with llm_error(S.LLM_PARAM_INVALID):
        d.exec("dd.switch_role(LLMRole.DECODER)")
    with llm_error(S.LLM_PARAM_INVALID):
        d.exec("dd.switch_role(LLMRole.PROMPT)")
    with llm_error(S.LLM_FEATURE_NOT_ENABLED, match="enable_switch_role"):
        d.exec(f"dd.switch_role(LLMRole.PROMPT, {listen})")
    assert d.eval("(dd.role, dd.listen_port)") == (2, 0)


def test_switch_role_swaps_and_pulls_the_other_way(peers, backend):
    pd = V1(peers, backend, switch=True)
    p, d = pd.prefill, pd.decode
    p.exec(f"pblk = km.allocate_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_INT8), "
           f"BlocksCacheKey({PROMPT_ID}, 0))\nkv_write(pblk, 1)")
    d.exec("dblk = km.allocate_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_INT8)); kv_zero(dblk)")
    pd.link()
    d.exec(f"km.pull_blocks(BlocksCacheKey({PROMPT_ID}, 0), dblk, [1], [1])")
    pd.unlink()
    # swap: old prompt stops listening, old decoder listens
    p.exec("dd.switch_role(LLMRole.DECODER)")
    assert p.eval("(dd.role, km._role, dd.listen_port)") == (2, 2, 0)
    d.exec("dd.switch_role(LLMRole.PROMPT, {'llm.listenIpInfo': '127.0.0.1:0'})")
    new_port = d.eval("dd.listen_port")
    assert new_port > 0 and d.eval("(dd.role, km._role)") == (1, 1)
    # role rules follow the new roles
    with llm_error(S.LLM_PARAM_INVALID):
        d.exec(f"km.pull_blocks(BlocksCacheKey({PROMPT_ID}, 0), dblk, [0], [0])")
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec(f"km.allocate_cache(CacheDesc(1, [1, 8], DataType.DT_INT8), [CacheKey({PROMPT_ID}, 1)])")
    # the new prompt publishes; the new decoder links and pulls into its old (still valid) cache
    d.exec(f"nblk = km.allocate_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_INT8), "
           f"BlocksCacheKey({DECODER_ID}, 0))\nkv_write(nblk, 9)")
    assert p.eval(f"dd.link_clusters([v1_cluster({DECODER_ID}, [{new_port}])], 5000)") == (
        S.LLM_SUCCESS, [S.LLM_SUCCESS])
    p.exec(f"km.pull_blocks(BlocksCacheKey({DECODER_ID}, 0), pblk, [2, 3], [0, 1])")
    got = p.eval("kv_read(pblk)")
    for i, data in enumerate(got):
        s = pattern(128, i, 9)
        assert data[:64].tobytes() == s[64:].tobytes()  # remote blocks 2, 3 -> local 0, 1
        assert data[64:].tobytes() == pattern(128, i, 1)[64:].tobytes()  # local blocks 2, 3 unchanged
    # the old decoder's cache also survived the switch: it still holds the block pulled before
    assert [x[32:64].tobytes() for x in d.eval("kv_read(dblk)")] == [pattern(128, i, 1)[32:64].tobytes()
                                                                    for i in range(2)]
    p.exec(f"dd.check_link_status({DECODER_ID})")


# ---------------------------------------------------------------------------- handles and tensors


def test_get_cache_tensors_view_semantics(peers):
    p = peers("v1-tensors")
    p.exec(V1_PRELUDE)
    p.exec(f"dd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); dd.init(v1_options()); km = dd.kv_cache_manager\n"
           "from llm_datadist import Tensor, TensorDesc, KvCacheManager\n"
           "c = km.allocate_cache(CacheDesc(2, [2, 4], DataType.DT_FLOAT16)); kv_zero(c)\n"
           "ts = km.get_cache_tensors(c, 1)\n"
           "view = ts[0].numpy()")
    assert p.eval("(len(ts), type(ts[0]) is Tensor, type(km) is KvCacheManager)") == (1, True, True)
    assert p.eval("(view.shape, str(view.dtype), ts[0].tensor_desc.shape)") == ((2, 4), "float16", [2, 4])
    # writes through the view land in the cache; writes to the cache show through the view
    p.exec("view[1, 2] = 3.5")
    raw = p.eval("kv_read(c)")
    assert not raw[0].any()
    assert raw[1].view(np.float16).reshape(2, 4)[1, 2] == 3.5 and raw[1].view(np.float16).sum() == 3.5
    p.exec("ctypes.memmove(c.per_device_tensor_addrs[0][1], np.array([7.0], dtype=np.float16).ctypes.data, 2)")
    assert p.eval("float(view[0, 0])") == 7.0
    assert p.eval("float(km.get_cache_tensors(c)[0].numpy()[0, 0])") == 0.0  # tensor_index defaults to 0
    p.exec("copy = ts[0].numpy(copy=True); copy[0, 0] = 1.0")
    assert p.eval("float(view[0, 0])") == 7.0
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("km.get_cache_tensors(c, 2)")
    with pytest.raises(TypeError):
        p.exec("km.get_cache_tensors(c, '0')")
    # BF16 comes back as float32 values (numpy has no bfloat16), as in llm_datadist
    p.exec("b = km.allocate_cache(CacheDesc(1, [3], DataType.DT_BF16))\n"
           "ctypes.memmove(b.per_device_tensor_addrs[0][0], np.array([0x3F80, 0x4040, 0xBF00], "
           "dtype=np.uint16).ctypes.data, 6)")
    assert p.eval("km.get_cache_tensors(b)[0].numpy().tolist()") == [1.0, 3.0, -0.5]
    # after deallocation the tensors refuse to expose the memory
    p.exec("km.deallocate_cache(c)")
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("ts[0].numpy()")
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("km.get_cache_tensors(c)")
    # a tensor keeps an otherwise unreferenced handle alive; dropping it frees the cache
    p.exec("t = km.get_cache_tensors(km.allocate_cache(CacheDesc(1, [4], DataType.DT_INT32)))[0]; gc.collect()")
    assert p.eval("dd._engine.cache_count") == 2  # b and the one behind t
    p.exec("t.numpy()[:] = 5; del t; gc.collect()")
    assert p.eval("dd._engine.cache_count") == 1
    # user tensors over numpy arrays
    p.exec("arr = np.arange(6, dtype=np.int32).reshape(2, 3); ut = Tensor(arr); ut.numpy()[0, 0] = 9")
    assert p.eval("(int(arr[0, 0]), ut.tensor_desc.dtype)") == (9, p.eval("DataType.DT_INT32"))
    assert p.eval("Tensor(ut).numpy().tolist()") == [[9, 1, 2], [3, 4, 5]]
    assert p.eval("str(TensorDesc(DataType.DT_FLOAT, (1, 2)))") == "TensorDesc(dtype=DataType.DT_FLOAT, shape=[1, 2])"
    for call, exc in [("Tensor(arr.T)", RuntimeError), ("Tensor(arr, TensorDesc(DataType.DT_INT32, [3, 2]))",
                                                         RuntimeError),
                      ("Tensor(arr, TensorDesc(DataType.DT_FLOAT, [2, 3]))", RuntimeError),
                      ("Tensor([1, 2])", TypeError), ("Tensor(arr, 'desc')", TypeError),
                      ("TensorDesc('float', [1])", TypeError), ("TensorDesc(DataType.DT_FLOAT, ['1'])", TypeError),
                      ("ut.numpy(1)", TypeError)]:
        with pytest.raises(exc):
            p.exec(call)


def test_kv_cache_del_deallocates(v1, backend):
    p, d = v1.prefill, v1.decode
    p.exec("""
caught = []
sys.unraisablehook = lambda info: caught.append(repr(info.exc_value))
c = km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8))
""")
    assert p.eval("dd._engine.cache_count") == 1
    p.exec("del c; gc.collect()")
    assert p.eval("dd._engine.cache_count") == 0
    # a keyed cache: the finalizer drops only the id reference; the key keeps it until pulled
    p.exec(f"c = km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8), [CacheKey({PROMPT_ID}, 5)])\n"
           "kv_write(c, 4); del c; gc.collect()")
    assert p.eval("dd._engine.cache_count") == 1
    d.exec("dst = km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8))")
    v1.link()
    d.exec(f"km.pull_cache(CacheKey({PROMPT_ID}, 5), dst)")
    assert d.eval("kv_read(dst)[0].tobytes()") == pattern(64, 0, 4).tobytes()
    assert wait_for(lambda: p.eval("dd._engine.cache_count") == 0)
    # an explicitly freed handle, a handle in a reference cycle, and handles that outlive finalize
    p.exec("c = km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8)); km.deallocate_cache(c); del c\n"
           "cyc = km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8)); cyc.me = cyc; del cyc; gc.collect()")
    assert p.eval("dd._engine.cache_count") == 0
    p.exec("keep = [km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8)) for _ in range(3)]\n"
           "old_km = km; dd.finalize()\n"
           "assert not old_km.is_initialized()\n"
           "del keep; gc.collect()")
    assert p.eval("caught") == []
    # interpreter exit with live handles and an initialised engine: no error output, exit code 0
    code = ("from llm_datadist import *\n"
            "cfg = LLMConfig(); cfg.device_id = 0; cfg.listen_ip_info = '127.0.0.1:0'\n"
            "dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(cfg.generate_options()); km = dd.kv_cache_manager\n"
            "caches = [km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8), [CacheKey(1, i)])\n"
            "          for i in range(3)]\n"
            "lone = km.allocate_blocks_cache(CacheDesc(1, [2, 64], DataType.DT_INT8))\n"
            "cyc = km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8)); cyc.me = cyc\n")
    import pdlink

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(pdlink.__file__))),
               **peer_env(backend))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    # same with a two-device manager that is still initialised when the interpreter exits
    code = ("from pdlink import _core, LLMRole, CacheDesc, CacheKey, DataType, Placement\n"
            "from pdlink.cache_manager import CacheManager\n"
            "from pdlink.kv_cache_manager import KvCacheManager\n"
            "engines = [_core.Engine('cpu') for _ in range(2)]\n"
            "for e in engines:\n"
            "    e.initialize(9, 1, listen_ip='', listen_port=0, sync_timeout_ms=1000, device_pool_bytes=1 << 20,\n"
            "                 device_page_shift=12, host_pool_bytes=0, host_page_shift=12, handshake_timeout_ms=1000)\n"
            "km = KvCacheManager(None, [CacheManager(None, e, False, {Placement.DEVICE: True}) for e in engines],\n"
            "                    LLMRole.PROMPT)\n"
            "kv = km.allocate_cache(CacheDesc(1, [64], DataType.DT_INT8), [CacheKey(9, 5)])\n"
            "cyc = km.allocate_cache(CacheDesc(1, [64], DataType.DT_INT8)); cyc.me = cyc\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 0 and "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_wrong_manager_access(peers):
    p = peers("v1-managers")
    p.exec(V1_PRELUDE)
    p.exec("dd1 = LLMDataDist(LLMRole.DECODER, 2); dd1.init(v1_options()); km1 = dd1.kv_cache_manager\n"
           "old = km1.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8))")
    with llm_error(S.LLM_PARAM_INVALID, match="kv_cache_manager"):
        p.exec("dd1.cache_manager")
    for call in ("dd1.link('c', {1: 0, 2: 1}, '{}')", "dd1.query_register_mem_status(1)"):
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(call)
    p.exec("dd1.finalize()")
    assert p.eval("km1.is_initialized()") is False
    for call in ("km1.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8))", "km1.deallocate_cache(old)",
                 "dd1.kv_cache_manager", "dd1.check_link_status(1)"):
        with pytest.raises(RuntimeError) as e:
            p.exec(call)
        assert type(e.value) is RuntimeError and str(e.value) == "llm datadist is not initialized"
    # a new instance reuses cache id 1; the old handle (also id 1) must not reach the new cache
    p.exec("dd2 = LLMDataDist(LLMRole.DECODER, 2); dd2.init(v1_options()); km2 = dd2.kv_cache_manager\n"
           "new = km2.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_INT8))")
    assert p.eval("(old.cache_id, new.cache_id, km2.is_initialized())") == (1, 1, True)
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        p.exec("km2.deallocate_cache(old)")
    for call in ("km2.copy_cache(new, old)", "km2.get_cache_tensors(old)",
                 "km2.pull_cache(CacheKeyByIdAndIndex(1, 1, 0), old)"):
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(call)
    # a forged handle with the live id is refused too
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        p.exec("km2.deallocate_cache(KvCache(1, new.cache_desc, new.per_device_tensor_addrs, km2))")
    assert p.eval("(dd2._engine.cache_count, new.per_device_tensor_addrs != [])") == (1, True)
    # v2 handles are not v1 handles and vice versa
    p.exec("v2cache = Cache(1, CacheDesc(1, [1, 64], DataType.DT_INT8), [1])")
    with pytest.raises(TypeError):
        p.exec("km2.deallocate_cache(v2cache)")
    p.exec("dd2.finalize(); dd3 = LLMDataDist(LLMRole.DECODER, 2)\n"
           "dd3.init(options(pool=1 << 20)); cm3 = dd3.cache_manager")
    with pytest.raises(TypeError):
        p.exec("cm3.deallocate_cache(new)")
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("dd3.kv_cache_manager")
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("dd3.check_link_status(1)")


def test_local_copies_and_swaps(peers, backend):
    p = peers("v1-local", env=peer_env(backend))
    p.exec(V1_PRELUDE)
    p.exec(f"dd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); dd.init(v1_options()); km = dd.kv_cache_manager\n"
           "a = km.allocate_cache(CacheDesc(2, [2, 32], DataType.DT_INT8)); kv_write(a, 1)\n"
           "b = km.allocate_cache(CacheDesc(2, [3, 32], DataType.DT_INT8)); kv_zero(b)\n"
           "km.copy_cache(b, a, 2, 1, 8, 16)")
    for i, data in enumerate(p.eval("kv_read(b)")):
        assert data[64 + 8:64 + 24].tobytes() == pattern(64, i, 1)[32 + 8:32 + 24].tobytes()
        assert not data[:72].any() and not data[88:].any()
    with pytest.raises(ValueError):
        p.exec("km.copy_cache(b, a, offset=-1)")
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("km.copy_cache(b, a, size=0)")
    p.exec("blk = km.allocate_blocks_cache(CacheDesc(1, [4, 16], DataType.DT_INT8)); kv_write(blk, 2)\n"
           "km.copy_blocks(blk, {0: [2, 3]})")
    data = p.eval("kv_read(blk)")[0].reshape(4, 16)
    assert data[2].tobytes() == data[3].tobytes() == pattern(64, 0, 2)[:16].tobytes()
    with pytest.raises(TypeError):
        p.exec("km.copy_blocks(blk, {0: (2,)})")
    # swap out to host memory and back in (create_cpu_cache handles)
    p.exec("host = np.zeros((4, 16), dtype=np.int8)\n"
           "hdesc = CacheDesc(1, [4, 16], DataType.DT_INT8, Placement.HOST)\n"
           "hc = KvCache.create_cpu_cache(hdesc, [host.ctypes.data])\n"
           "km.swap_blocks(blk, hc, {1: 3})")
    assert p.eval("host[3].tobytes()") == pattern(64, 0, 2)[16:32].tobytes()
    p.exec("host[0] = 42; km.swap_blocks(hc, blk, {0: 1})")
    assert p.eval("kv_read(blk)[0][16:32].tolist()") == [42] * 16
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("km.swap_blocks(blk, blk, {0: 1})")  # DEVICE -> DEVICE
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("km.swap_blocks(blk, hc, {4: 0})")
    with pytest.raises(AttributeError):
        p.exec("km.swap_blocks(None, hc, {0: 0})")


def test_pool_sizing(peers):
    p = peers("v1-pool")
    p.exec(V1_PRELUDE)
    p.exec("def rss_mib():\n"
           "    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') >> 20\n"
           "import os\nbefore = rss_mib()\n"
           "dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(v1_options('127.0.0.1:0')); km = dd.kv_cache_manager\n"
           "big = km.allocate_cache(CacheDesc(1, [900, 1 << 20], DataType.DT_INT8))\n"
           "grown = rss_mib() - before")
    # the default pool is 1 GiB and mapped lazily: 900 MiB fit, but cost (almost) nothing until touched
    assert p.eval("grown") < 64, p.eval("grown")
    with llm_error(S.LLM_OUT_OF_MEMORY):
        p.exec("km.allocate_cache(CacheDesc(1, [200, 1 << 20], DataType.DT_INT8))")
    for opts, fits, too_big in [("mem_max=1 << 20", 1 << 19, 2 << 20), ("pool=4 << 20", 3 << 20, 2 << 20)]:
        p.exec(f"dd.finalize(); dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(v1_options('127.0.0.1:0', {opts}))\n"
               f"km = dd.kv_cache_manager; ok = km.allocate_cache(CacheDesc(1, [{fits}], DataType.DT_INT8))")
        with llm_error(S.LLM_OUT_OF_MEMORY):
            p.exec(f"km.allocate_cache(CacheDesc(1, [{too_big}], DataType.DT_INT8))")
        # a failed allocation consumes no cache id
        assert p.eval("km.allocate_cache(CacheDesc(1, [16], DataType.DT_INT8)).cache_id") == 2


# ---------------------------------------------------------------------------- multi-device


def test_multi_device_allocation_and_pull(peers, backend):
    pd = V1(peers, backend, devices=[0, 1], switch=True)
    p, d = pd.prefill, pd.decode
    assert len(set(pd.ports)) == 2
    assert p.eval("(dd.listen_port, km.num_devices)") == (pd.ports[0], 2)
    with llm_error(S.LLM_PARAM_INVALID):  # one remote_ip_info per device
        d.exec(f"dd.link_clusters([v1_cluster({PROMPT_ID}, [{pd.ports[0]}])], 2000)")
    # device 1 cannot reach its peer: the cluster is linked on no device (device 0's link is undone)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    assert d.eval(f"dd.link_clusters([v1_cluster({PROMPT_ID}, [{pd.ports[0]}, {closed_port}])], 2000)") == (
        S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
    assert d.eval("dd.links()") == []
    assert wait_for(lambda: p.eval("dd.links()") == [])
    pd.link()
    assert sorted(link["device_index"] for link in d.eval("dd.links()")) == [0, 1]
    assert d.eval(f"dd.check_link_status({PROMPT_ID})") is None
    p.exec(f"""
c = km.allocate_cache(CacheDesc(2, [2, 64], DataType.DT_INT8),
                      [CacheKey({PROMPT_ID}, 2**64 - 1), CacheKey({PROMPT_ID}, 7)])
blk = km.allocate_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_INT8), BlocksCacheKey({PROMPT_ID}, 0))
for dev in (0, 1):
    kv_write(c, 10 + dev, dev)
    kv_write(blk, 20 + dev, dev)
""")
    assert p.eval("(c.cache_id, blk.cache_id, [e.cache_count for e in dd._engines])") == (1, 2, [2, 2])
    addrs = p.eval("c.per_device_tensor_addrs")
    assert len(addrs) == 2 and len(addrs[0]) == len(addrs[1]) == 2 and set(addrs[0]).isdisjoint(addrs[1])
    d.exec("dst = km.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_INT8)); kv_zero(dst)\n"
           "dblk = km.allocate_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_INT8)); kv_zero(dblk)\n"
           f"km.pull_cache(CacheKey({PROMPT_ID}, 7), dst, 0)\n"
           f"km.pull_blocks(BlocksCacheKey({PROMPT_ID}, 0), dblk, [3], [0])")
    for dev in (0, 1):  # device i pulled from the prompt's device i
        for i, data in enumerate(d.eval(f"kv_read(dst, {dev})")):
            assert data.tobytes() == pattern(128, i, 10 + dev)[64:].tobytes(), (dev, i)
        for i, data in enumerate(d.eval(f"kv_read(dblk, {dev})")):
            assert data[:32].tobytes() == pattern(128, i, 20 + dev)[96:].tobytes(), (dev, i)
            assert not data[32:].any()
    # the key was consumed on both devices
    with llm_error(S.LLM_KV_CACHE_NOT_EXIST):
        d.exec(f"km.pull_cache(CacheKey({PROMPT_ID}, 7), dst, 0)")
    # get_cache_tensors gives one tensor per device, each over its own device's memory
    # (on Ascend numpy() reads the device memory through the backend, as a copy)
    got = d.eval("[t.numpy().tobytes() for t in km.get_cache_tensors(dst, 1)]")
    assert got == [pattern(128, 1, 10 + dev)[64:].tobytes() for dev in (0, 1)]
    # switch_role is not available in multi-device mode, even with enable_switch_role
    pd.unlink()
    with llm_error(S.LLM_FEATURE_NOT_ENABLED, match="multi-device"):
        d.exec("dd.switch_role(LLMRole.PROMPT, {'llm.listenIpInfo': '127.0.0.1:0'})")
    with llm_error(S.LLM_FEATURE_NOT_ENABLED):
        p.exec("dd.switch_role(LLMRole.DECODER)")
    # deallocation fans out to every device
    p.exec("km.deallocate_cache(c); km.deallocate_cache(blk)")
    assert wait_for(lambda: p.eval("[e.cache_count for e in dd._engines]") == [0, 0])
    # a swap needs host addresses for every device
    d.exec("host = [np.zeros((4, 32), dtype=np.int8) for _ in range(2)]\n"
           "hdesc = CacheDesc(2, [4, 32], DataType.DT_INT8, Placement.HOST)")
    with llm_error(S.LLM_PARAM_INVALID):
        d.exec("km.swap_blocks(dblk, KvCache.create_cpu_cache(hdesc, [host[0].ctypes.data] * 2), {0: 0})")
    d.exec("km.swap_blocks(dblk, KvCache.create_cpu_cache(hdesc, [[h.ctypes.data] * 2 for h in host]), {0: 1})")
    for dev in (0, 1):
        assert d.eval(f"host[{dev}][1].tobytes()") == pattern(128, 1, 20 + dev)[96:].tobytes()


def test_multi_device_partial_allocation_failure_rolls_back(peers):
    """Device 1's pool is smaller: an allocation that fits only device 0 fails with OUT_OF_MEMORY,
    leaves nothing (and no key) behind, and cache ids stay equal across devices."""
    p = peers("v1-rollback")
    p.exec("""
from pdlink import _core
from pdlink.cache_manager import CacheManager
from pdlink.kv_cache_manager import KvCacheManager
engines = []
for pool in (1 << 22, 1 << 20):
    e = _core.Engine("cpu")
    e.initialize(9, int(LLMRole.PROMPT), listen_ip="", listen_port=0, sync_timeout_ms=1000,
                 device_pool_bytes=pool, device_page_shift=12, host_pool_bytes=0, host_page_shift=12,
                 handshake_timeout_ms=1000)
    engines.append(e)
km = KvCacheManager(None, [CacheManager(None, e, False, {Placement.DEVICE: True}) for e in engines], LLMRole.PROMPT)
""")
    with llm_error(S.LLM_OUT_OF_MEMORY):
        p.exec("km.allocate_cache(CacheDesc(1, [2 << 20], DataType.DT_INT8), [CacheKey(9, 5)])")
    assert p.eval("[e.cache_count for e in engines]") == [0, 0]
    p.exec("kv = km.allocate_cache(CacheDesc(1, [64], DataType.DT_INT8), [CacheKey(9, 5)])")  # the key is free again
    assert p.eval("(kv.cache_id, [c.cache_id for c in km._live[kv.cache_id][1]])") == (2, [2, 2])
    p.exec("km.deallocate_cache(kv); km.remove_cache_key(CacheKey(9, 5))")
    assert p.eval("[e.cache_count for e in engines]") == [0, 0]
    p.exec("km._invalidate()\nfor e in engines: e.finalize()")


def test_v1_transfer_cache_async_into_raw_decoder_addresses(v1):
    """v1 transfer_cache_async: PROMPT only, TransferConfig only, WAIT_PROCESS_TIMEOUT on timeout."""
    v1.prefill.exec("src = km.allocate_cache(CacheDesc(4, [1, 256], DataType.DT_INT8))\nkv_write(src, 7)\n"
                    "from llm_datadist import LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig\n"
                    "class Ready(LayerSynchronizer):\n"
                    "    def synchronize_layer(self, layer_index, timeout_in_millis):\n"
                    "        return True\n")
    v1.decode.exec("dst = km.allocate_cache(CacheDesc(4, [1, 256], DataType.DT_INT8))\nkv_zero(dst)")
    v1.link()
    dst_addrs = v1.decode.eval("dst.per_device_tensor_addrs[0]")
    v1.prefill.exec(f"task = km.transfer_cache_async(src, Ready(), [TransferConfig({DECODER_ID}, {dst_addrs})])")
    assert v1.prefill.eval("task.synchronize(5000)") == S.LLM_SUCCESS
    assert v1.prefill.eval("task.get_results()") == [S.LLM_SUCCESS]
    src, dst = v1.prefill.eval("kv_read(src)"), v1.decode.eval("kv_read(dst)")
    assert [t.tobytes() for t in dst] == [t.tobytes() for t in src]
    # a keyed config is a CacheManager-mode feature: TypeError here
    with pytest.raises(TypeError):
        v1.prefill.exec(f"km.transfer_cache_async(src, Ready(), "
                        f"[TransferWithCacheKeyConfig(BlocksCacheKey({DECODER_ID}, 0), range(0, 1), range(0, 1))])")
    # the timeout code of v1 tasks
    v1.prefill.exec("import threading\ngate = threading.Event()\n"
                    "class Slow(LayerSynchronizer):\n"
                    "    def synchronize_layer(self, layer_index, timeout_in_millis):\n"
                    "        return gate.wait(10)\n"
                    f"slow = km.transfer_cache_async(src, Slow(), [TransferConfig({DECODER_ID}, {dst_addrs})])")
    assert v1.prefill.eval("slow.synchronize(100)") == S.LLM_WAIT_PROCESS_TIMEOUT
    v1.prefill.exec("gate.set()")
    assert v1.prefill.eval("slow.synchronize(5000)") == S.LLM_SUCCESS
    # DECODER may not call it
    with llm_error(S.LLM_PARAM_INVALID):
        v1.decode.exec("from llm_datadist import LayerSynchronizer\n"
                       "class R(LayerSynchronizer):\n"
                       "    def synchronize_layer(self, i, t):\n"
                       "        return True\n"
                       "km.transfer_cache_async(dst, R(), [])")

"""Real serving code's call sequences (spec 11), replayed across two processes with byte checks.

Each flow keeps the shape of the connector it comes from: the same options, key conventions,
cluster-id arithmetic and error handling. The v1 (old vllm-ascend) flow lives in test_v1_mode.py,
the vllm-ascend CacheManager-connector flow and the pull_blocks sample in test_comm_link.py, the
switch_role sample in test_transfer.py, the transfer_cache_async sample in test_transfer_async.py.
"""

from __future__ import annotations

import json
import signal

import pytest

from backend_env import peer_env
from pdlink import LLMException, LLMStatusCode

SGLANG_SETUP = """
import json
gpu, world, node = 0, 1, 0
role = LLMRole.{role}
cluster_id = 2 * (gpu + world * node) + (0 if role == LLMRole.PROMPT else 1)
local_comm_res = json.dumps({{"version": "1.2", "server_count": "1", "status": "completed",
    "server_list": [{{"server_id": "127.0.0.1", "device": [{{"device_id": "0", "device_ip": "127.0.0.1",
                                                          "rank_id": "0"}}]}}]}})
cfg = LLMConfig()
cfg.device_id = gpu
cfg.sync_kv_timeout = 20000
cfg.local_comm_res = local_comm_res
if role == LLMRole.PROMPT:
    cfg.listen_ip_info = "127.0.0.1:0"  # sglang uses 26000 + gpu; a free port keeps tests parallel-safe
dd = LLMDataDist(role, cluster_id)
dd.init(cfg.generate_options())
cm = dd.cache_manager
# two KV buffers (K, V of 3 layers each: one tensor per layer) and one aux buffer
bufs = [tensors(3, (8, 128), seed={seed} + i) if role == LLMRole.PROMPT else zeros(3, (8, 128)) for i in range(2)]
aux = tensors(1, (8, 16), seed={seed} + 9) if role == LLMRole.PROMPT else zeros(1, (8, 16))
caches = [cm.register_blocks_cache(CacheDesc(3, [8, 128], DataType.DT_FLOAT16), addrs(b), BlocksCacheKey(cluster_id, i))
          for i, b in enumerate(bufs)]
caches.append(cm.register_blocks_cache(CacheDesc(1, [8, 16], DataType.DT_FLOAT16), addrs(aux),
                                       BlocksCacheKey(cluster_id, len(bufs))))
"""


def test_sglang_prefill_pushes_after_decode_links_without_cluster_id(peers, backend):
    p, d = peers("sglang-prefill", env=peer_env(backend)), peers("sglang-decode", env=peer_env(backend))
    p.exec(SGLANG_SETUP.format(role="PROMPT", seed=1))
    d.exec(SGLANG_SETUP.format(role="DECODER", seed=2))
    port = p.eval("dd.listen_port")
    # the decode side dials with only a remote ip: no remote_cluster_id, no local ip (local_comm_res)
    d.exec(f"info = LLMClusterInfo(); info.append_remote_ip_info('127.0.0.1', {port})\n"
           "ret = dd.link_clusters([info], 20000)")
    assert d.eval("ret") == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
    assert [link["peer_cluster_id"] for link in d.eval("dd.links()")] == [0]
    # the prefill side pushes each buffer into the decode's blocks, tensor_num_per_layer=1
    src_blocks, dst_blocks = [1, 2, 3], [5, 6, 7]
    p.exec(f"""
d_cluster_id = cluster_id + 1
for i, cache in enumerate(caches):
    n = cache.cache_desc.num_tensors
    cm.push_blocks(BlocksCacheKey(d_cluster_id, i), cache, {src_blocks}, {dst_blocks}, range(n), range(n), 1)
""")
    for name in ("bufs[0]", "bufs[1]", "[aux[0]]"):
        src, dst = p.eval(name), d.eval(name)
        for s, t in zip(src, dst):
            assert t[dst_blocks].tobytes() == s[src_blocks].tobytes()
            assert not t[[0, 1, 2, 3, 4]].any()
    # unlinking by address works for a link made without a cluster id
    assert d.eval("dd.unlink_clusters([info])") == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
    assert p.eval("dd.links()") == []


OMNI_MANAGER = """
import time
RETRYABLE = {LLMStatusCode.LLM_REPEAT_REQUEST, LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
             LLMStatusCode.LLM_PROCESSING_LINK, LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
             LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, LLMStatusCode.LLM_LINK_BUSY}
attempts = []

def pull_with_retry(cache_key, cache, src, dst, retries=3, pause=0.2):
    # omni-infer's llmdatadist_manager: retry on the listed codes, re-raise TypeError/ValueError
    for attempt in range(retries):
        try:
            cm.pull_blocks(cache_key, cache, src, dst)
            attempts.append("ok")
            return
        except (TypeError, ValueError):
            raise
        except LLMException as e:
            attempts.append(e.status_code)
            if e.status_code not in RETRYABLE or attempt == retries - 1:
                raise
            time.sleep(pause)
"""


def omni_setup(pd):
    # make_pd's engines use omni's options: cache manager, remote cache accessible, sync_kv_timeout
    # one blocks cache per distinct KV shape; P publishes them under model_id k, D registers with key None
    pd.prefill.exec("k0 = tensors(2, (8, 32), seed=4); k1 = tensors(2, (8, 8), seed=5)\n"
                    "c0 = cm.register_blocks_cache(CacheDesc(2, [8, 32], DataType.DT_BF16), addrs(k0), "
                    "BlocksCacheKey(cluster_id=1, model_id=0))\n"
                    "c1 = cm.register_blocks_cache(CacheDesc(2, [8, 8], DataType.DT_BF16), addrs(k1), "
                    "BlocksCacheKey(cluster_id=1, model_id=1))")
    pd.decode.exec("k0 = zeros(2, (8, 32)); k1 = zeros(2, (8, 8))\n"
                   "c0 = cm.register_blocks_cache(CacheDesc(2, [8, 32], DataType.DT_BF16), addrs(k0), None)\n"
                   "c1 = cm.register_blocks_cache(CacheDesc(2, [8, 8], DataType.DT_BF16), addrs(k1), None)\n"
                   + OMNI_MANAGER)
    pd.link()


def test_omni_infer_pull_per_model_id(make_pd):
    pd = make_pd(timeout=20000)
    omni_setup(pd)
    pd.decode.exec("pull_with_retry(BlocksCacheKey(prompt_cluster_id=1, model_id=0), c0, [0, 1, 2], [2, 3, 4])\n"
                   "pull_with_retry(BlocksCacheKey(prompt_cluster_id=1, model_id=1), c1, [7], [0])")
    for name, pairs in (("k0", [(0, 2), (1, 3), (2, 4)]), ("k1", [(7, 0)])):
        src, dst = pd.prefill.eval(name), pd.decode.eval(name)
        for s, t in zip(src, dst):
            assert all(t[b].tobytes() == s[a].tobytes() for a, b in pairs)
    # TypeError and ValueError pass through the retry wrapper unchanged
    with pytest.raises(TypeError):
        pd.decode.exec("pull_with_retry(BlocksCacheKey(1, 0), c0, ['x'], [0])")
    with pytest.raises(ValueError):
        pd.decode.exec("pull_with_retry(CacheKeyByIdAndIndex(1, 1, 2**40), c0, [], [0])")


def test_omni_infer_retry_after_timeout_reports_the_dead_link(make_pd):
    """A pull that times out is retried by omni's wrapper; as llm_datadist documents, the timed-out
    link is unusable, so the retry reports LLM_LINK_FAILED (not retryable) at once instead of
    hanging; relinking restores service."""
    pd = make_pd(timeout=300)
    omni_setup(pd)
    pd.prefill.signal(signal.SIGSTOP)
    try:
        with pytest.raises(LLMException) as e:
            pd.decode.exec("pull_with_retry(BlocksCacheKey(1, 0), c0, [0], [0])")
    finally:
        pd.prefill.signal(signal.SIGCONT)
    assert pd.decode.eval("attempts") == [LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_LINK_FAILED]
    assert e.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    pd.decode.exec(f"dd.unlink_clusters([cluster(1, {pd.port})], force=True)")
    pd.link()
    pd.decode.exec("pull_with_retry(BlocksCacheKey(1, 0), c0, [0], [0])")
    assert pd.decode.eval("k0[0][0].tobytes()") == pd.prefill.eval("k0[0][0].tobytes()")


def test_tuple_returning_calls_do_not_raise_on_peer_failures(peers):
    """Serving code checks link_clusters' tuple rather than catching: keep it a tuple."""
    d = peers("decode")
    d.exec("dd = LLMDataDist(LLMRole.DECODER, 2); dd.init(options())")
    ret = d.eval("dd.link_clusters([cluster(1, 1)], 500)")
    assert ret == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert json.dumps([int(c) for c in ret[1]])  # plain ints underneath (IntEnum)

"""Real serving code's call sequences (llm_datadist_api.md §11), replayed across two processes with byte checks.

Each flow keeps the shape of the connector it comes from (tests/peers/connectors.py): the same
options, key conventions, cluster-id arithmetic and error handling. The v1 (old vllm-ascend) flow
lives in compat/llm_datadist/test_v1_mode.py, the vllm-ascend CacheManager-connector flow in
compat/llm_datadist/test_comm_link.py, the official samples in programs/test_programs.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from backend_env import peer_env
from conftest import PROMPT_ID, Pair
from llm_datadist import BlocksCacheKey, CacheKeyByIdAndIndex, DataType
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import connectors, kv
from verify import Snapshot, assert_same, check_transfer, rows

OK = (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
BUFFERS = [f"buf{i}" for i in range(connectors.SGLANG_BUFFERS)] + ["aux"]


def test_sglang_prefill_pushes_after_decode_links_without_cluster_id(peers: Callable[..., Peer],
                                                                     backend: str) -> None:
    p, d = peers("sglang-prefill", env=peer_env(backend)), peers("sglang-decode", env=peer_env(backend))
    port = p.call(connectors.sglang_start, "prompt", 1)
    d.call(connectors.sglang_start, "decoder", None)
    # the decode side dials with only a remote ip: no remote_cluster_id, no local ip (local_comm_res)
    assert d.call(connectors.sglang_link_by_address, port) == OK
    assert [link["peer_cluster_id"] for link in d.call(kv.links)] == [0]
    # the prefill side pushes each buffer into the decode's blocks, tensor_num_per_layer=1
    src_blocks, dst_blocks = [1, 2, 3], [5, 6, 7]
    sources = {name: p.call(kv.snapshot, name) for name in BUFFERS}
    before = {name: d.call(kv.snapshot, name) for name in BUFFERS}
    p.call(connectors.sglang_push_all, src_blocks, dst_blocks)
    for name in BUFFERS:
        expected = before[name].with_rows(sources[name], list(zip(src_blocks, dst_blocks)))
        assert_same(d.call(kv.snapshot, name), expected, f"the decoder's {name}")
        assert_same(p.call(kv.snapshot, name), sources[name], f"the prefill's {name}")
    # unlinking by address works for a link made without a cluster id
    assert d.call(connectors.sglang_unlink_by_address, port) == OK
    assert p.call(kv.links) == []


SHAPES = {"k0": (8, 32), "k1": (8, 8)}  # one blocks cache per distinct KV shape (model_id 0, 1)


def omni_setup(pair: Pair) -> None:
    """omni's options (cache manager, remote access, sync_kv_timeout) are the pair's; the prefill
    publishes one cache per KV shape under model_id k, the decoder registers them without a key."""
    for model, (name, shape) in enumerate(SHAPES.items()):
        pair.prefill.call(kv.register_blocks, name, 2, shape, DataType.DT_BF16, seed=4 + model,
                          key=BlocksCacheKey(PROMPT_ID, model))
        pair.decode.call(kv.register_blocks, name, 2, shape, DataType.DT_BF16, seed=None)
    pair.link()


def pulled_with_retry(pair: Pair, name: str, model: int, moves: list[tuple[int, int]]) -> None:
    check_transfer(lambda: pair.prefill.call(kv.snapshot, name), lambda: pair.decode.call(kv.snapshot, name),
                   lambda: pair.decode.call(connectors.pull_with_retry, BlocksCacheKey(PROMPT_ID, model), name,
                                            [s for s, _ in moves], [t for _, t in moves]),
                   rows(moves))


def test_omni_infer_pull_per_model_id(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(timeout=20000)
    omni_setup(pair)
    pulled_with_retry(pair, "k0", 0, [(0, 2), (1, 3), (2, 4)])
    pulled_with_retry(pair, "k1", 1, [(7, 0)])
    # TypeError and ValueError pass through the retry wrapper unchanged, on the first attempt
    with pytest.raises(TypeError):
        pair.decode.call(connectors.pull_with_retry, BlocksCacheKey(1, 0), "k0", ["x"], [0])
    with pytest.raises(ValueError):
        pair.decode.call(connectors.pull_with_retry, CacheKeyByIdAndIndex(1, 1, 2**40), "k0", [], [0])
    assert pair.decode.call(connectors.attempts) == ["ok", "ok"]


def test_omni_infer_retry_after_timeout_reports_the_dead_link(make_pair: Callable[..., Pair]) -> None:
    """A pull that times out is retried by omni's wrapper; as llm_datadist documents, the timed-out
    link is unusable, so the retry reports LLM_LINK_FAILED (not retryable) at once, with the peer
    still frozen (a retry that waited would time out again), instead of hanging; relinking
    restores service."""
    pair = make_pair(timeout=300)
    omni_setup(pair)
    before: Snapshot = pair.decode.call(kv.snapshot, "k0")
    pair.prefill.freeze()
    try:
        with pytest.raises(LLMException) as e:
            pair.decode.call(connectors.pull_with_retry, BlocksCacheKey(1, 0), "k0", [0], [0])
    finally:
        pair.prefill.thaw()
    assert pair.decode.call(connectors.attempts) == [LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_LINK_FAILED]
    assert e.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert_same(pair.decode.call(kv.snapshot, "k0"), before, "the destination after the failed pulls")
    assert pair.unlink(force=True) == LLMStatusCode.LLM_SUCCESS
    pair.link()
    pulled_with_retry(pair, "k0", 0, [(0, 0)])


def test_tuple_returning_calls_do_not_raise_on_peer_failures(peers: Callable[..., Peer]) -> None:
    """Serving code checks link_clusters' tuple rather than catching: keep it a tuple."""
    d = peers("decode")
    d.call(kv.start, "decoder", 2)
    ret = d.call(kv.link, 1, 1, 500)
    assert ret == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert json.dumps([int(c) for c in ret[1]])  # plain ints underneath (IntEnum)

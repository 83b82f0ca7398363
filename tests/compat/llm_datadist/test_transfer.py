"""Cross-process KV movement: every transfer kind of llm_datadist's CacheManager, on every backend and
data path, with the whole destination checked (moved bytes equal the source, every other byte and
the guards unchanged) and the source unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

import internals
from conftest import DECODER_ID, PROMPT_ID, Pair, moved, only
from llm_datadist import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, DataType, LLMRole, Placement
from pdlink import LLMException, LLMStatusCode
from peers import kv, workers
from poll import hang_guard, wait_until
from verify import Copy, assert_same, nothing, rows

KEY = Pair.KEY  # BlocksCacheKey(1, 0): the prompt's blocks cache
SHAPE = (8, 64)  # 8 blocks of 64 float16 per tensor


def setup_blocks(pair: Pair, decoder_key: BlocksCacheKey | None = None) -> None:
    pair.prefill.call(kv.register_blocks, "kv", 4, SHAPE, seed=1, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 4, SHAPE, seed=2, key=decoder_key)
    pair.link()


def pulls(pair: Pair, src_blocks: Sequence[int], dst_blocks: Sequence[int], **kw: object) -> Callable[[], None]:
    return lambda: pair.decode.call(kv.pull_blocks, KEY, "kv", src_blocks, dst_blocks, **kw)


def test_pull_blocks_moves_exact_bytes(pair: Pair) -> None:
    setup_blocks(pair)
    moves = [(0, 3), (1, 4), (2, 5), (5, 0)]
    moved((pair.prefill, "kv"), (pair.decode, "kv"), pulls(pair, [s for s, _ in moves], [d for _, d in moves]),
          rows(moves))


def test_push_blocks_moves_exact_bytes(pair: Pair) -> None:
    setup_blocks(pair, decoder_key=BlocksCacheKey(DECODER_ID, 0))
    moved((pair.prefill, "kv"), (pair.decode, "kv"),
                 lambda: pair.prefill.call(kv.push_blocks, BlocksCacheKey(DECODER_ID, 0), "kv", [7, 6], [0, 1]),
                 rows([(7, 0), (6, 1)]))


def test_link_is_symmetric_decoder_pushes_and_prompt_pulls(pair: Pair) -> None:
    setup_blocks(pair, decoder_key=BlocksCacheKey(DECODER_ID, 3))
    # the prompt pulls from the decoder: source and destination swap sides
    moved((pair.decode, "kv"), (pair.prefill, "kv"),
                   lambda: pair.prefill.call(kv.pull_blocks, BlocksCacheKey(DECODER_ID, 3), "kv", [4], [4]),
                   rows([(4, 4)]))


def test_pull_blocks_with_layer_ranges(pair: Pair) -> None:
    setup_blocks(pair)
    # 4 tensors = 2 layers of (K, V); pull layer 1 of the source into layer 0 of the destination
    moved((pair.prefill, "kv"), (pair.decode, "kv"),
                 pulls(pair, [1], [2], src_layer_range=range(1, 2), dst_layer_range=range(0, 1)),
                 rows([(1, 2)], tensors=[(2, 0), (3, 1)]))


def test_tensor_num_per_layer_one(pair: Pair) -> None:
    setup_blocks(pair, decoder_key=BlocksCacheKey(DECODER_ID, 0))
    # SGLang's push: tensor_num_per_layer=1, layer i = tensor i
    moved((pair.prefill, "kv"), (pair.decode, "kv"),
                 lambda: pair.prefill.call(kv.push_blocks, BlocksCacheKey(DECODER_ID, 0), "kv", [3], [3],
                                           src_layer_range=range(2, 4), dst_layer_range=range(2, 4),
                                           tensor_num_per_layer=1),
                 rows([(3, 3)], tensors=[(2, 2), (3, 3)]))


def test_pull_cache_by_request_key_and_by_id(pair: Pair) -> None:
    src_id = pair.prefill.call(kv.register, "src", 2, (4, 32), seed=5, keys=[CacheKey(1, 10), CacheKey(1, 11)])
    pair.decode.call(kv.register, "dst", 2, (3, 32), seed=None)
    pair.link()
    moved((pair.prefill, "src"), (pair.decode, "dst"),
                 lambda: pair.decode.call(kv.pull_cache, CacheKeyByIdAndIndex(PROMPT_ID, src_id, 1), "dst", 2),
                 rows([(1, 2)]))
    # size: only the first 16 bytes of slot 0
    moved((pair.prefill, "src"), (pair.decode, "dst"),
                 lambda: pair.decode.call(kv.pull_cache, CacheKeyByIdAndIndex(PROMPT_ID, src_id, 0), "dst", 0,
                                          size=16),
                 rows([(0, 0)], nbytes=16))


def test_pull_cache_by_request_key_releases_allocated_key(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(remote=False)  # request-key pulls are the non-remote-accessible mode
    pair.prefill.call(kv.allocate, "src", 2, (2, 32), seed=3, keys=[CacheKey(1, 42, 0), CacheKey(1, 43, 0)])
    src = pair.prefill.call(kv.snapshot, "src")
    pair.prefill.call(kv.deallocate, "src")  # only the keys keep it alive now
    pair.decode.call(kv.allocate, "dst", 2, (2, 32))
    pair.link()
    dst0 = pair.decode.call(kv.snapshot, "dst")
    pair.decode.call(kv.pull_cache, CacheKey(1, 42, 0), "dst", 0)
    # the key was consumed by the successful pull: a second pull finds nothing
    with pytest.raises(LLMException) as e:
        pair.decode.call(kv.pull_cache, CacheKey(1, 42, 0), "dst", 1)
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    # the other key still works, and consuming it frees the cache
    pair.decode.call(kv.pull_cache, CacheKey(1, 43, 0), "dst", 1)
    wait_until(lambda: pair.prefill.call(kv.cache_count) == 0, 10, "the prompt freed the consumed cache")
    # key i names slot i: both slots hold the source's, and nothing else in the decoder's pool changed
    assert_same(pair.decode.call(kv.snapshot, "dst"), dst0.with_rows(src, [(0, 0), (1, 1)]), "destination pool")


def test_pull_blocks_from_contiguous_cache(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(remote=False)
    # official sample pull_from_cache_to_blocks: P allocates with a key, D pulls into blocks
    pair.prefill.call(kv.allocate, "src", 2, (1, 4, 16), seed=9, keys=[CacheKey(prompt_cluster_id=1, req_id=0,
                                                                                  model_id=0)])
    pair.decode.call(kv.register_blocks, "blk", 2, (8, 16), seed=None)
    pair.link()
    # the source slot is 4*16 elements = 4 blocks of 16 elements; pull them into blocks 6, 7, 0, 1
    block = 16 * 2
    moved((pair.prefill, "src"), (pair.decode, "blk"),
                 lambda: pair.decode.call(kv.pull_blocks, CacheKey(1, 0, 0), "blk", [], [6, 7, 0, 1]),
                 lambda dst0, src0: dst0.with_bytes(src0, [Copy(t, i * block, t, d * block, block)
                                                           for t in range(2) for i, d in enumerate([6, 7, 0, 1])]))
    pair.prefill.call(kv.remove_cache_key, CacheKey(1, 0, 0))  # a no-op key removal
    pair.prefill.call(kv.deallocate, "src")


def test_push_cache_into_remote_slot(pair: Pair) -> None:
    pair.prefill.call(kv.register, "src", 2, (2, 32), seed=4)
    dst_id = pair.decode.call(kv.register, "dst", 2, (3, 32), seed=None)
    pair.link()
    moved((pair.prefill, "src"), (pair.decode, "dst"),
                 lambda: pair.prefill.call(kv.push_cache, CacheKeyByIdAndIndex(DECODER_ID, dst_id, 2), "src", 1),
                 rows([(1, 2)]))


def test_prefix_key_is_not_consumed(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(remote=False)
    prefix = CacheKey(1, 2**64 - 1, 0, 77)
    pair.prefill.call(kv.allocate, "src", 1, (1, 64), DataType.DT_INT8, seed=1, keys=[prefix])
    pair.decode.call(kv.allocate, "dst", 1, (2, 64), DataType.DT_INT8)
    pair.link()
    for slot in (0, 1):  # pulled twice: prefix keys survive pulls
        def pull(slot: int = slot) -> object:
            return pair.decode.call(kv.pull_cache, CacheKey(cluster_id=1, req_id=2**64 - 1, prefix_id=77), "dst", slot)

        moved((pair.prefill, "src"), (pair.decode, "dst"), pull, rows([(0, slot)]))


def test_many_blocks_are_coalesced_and_exact(make_pair: Callable[..., Pair]) -> None:
    # 10 s, not the default 1 s: on the fake HCCL, each of the ~6,000 runs is a stream task, which
    # on a loaded 2-core machine can take longer than a second in all
    pair = make_pair(timeout=10000)
    pair.prefill.call(kv.register_blocks, "kv", 2, (4096, 8), seed=3, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, (4096, 8), seed=None)
    pair.link()
    rng = np.random.default_rng(0)
    src_blocks = rng.permutation(4096)[:3000].tolist()
    dst_blocks = list(range(100, 3100))  # consecutive on one side only: runs split where src jumps
    moved((pair.prefill, "kv"), (pair.decode, "kv"), pulls(pair, src_blocks, dst_blocks),
          rows(list(zip(src_blocks, dst_blocks))))


def test_switch_roles_then_push_the_other_way(pair: Pair) -> None:
    """Official switch_role sample: after unlinking, P becomes DECODER, D becomes PROMPT and listens,
    they link the other way and the new prompt pushes."""
    setup_blocks(pair, decoder_key=BlocksCacheKey(DECODER_ID, 0))
    assert pair.unlink(force=True) == LLMStatusCode.LLM_SUCCESS
    assert pair.prefill.call(kv.unlink, DECODER_ID, 0, True) == LLMStatusCode.LLM_SUCCESS
    assert pair.prefill.call(kv.switch_role, "decoder") == (LLMRole.DECODER, 0)
    role, new_port = pair.decode.call(kv.switch_role, "prompt", here=True)
    assert role == LLMRole.PROMPT and new_port > 0
    assert pair.prefill.call(kv.link, DECODER_ID, new_port)[0] == LLMStatusCode.LLM_SUCCESS
    # the new prompt (the old decoder) pushes into the new decoder's cache, which now has key (1, 0)
    moved((pair.decode, "kv"), (pair.prefill, "kv"),
                   lambda: pair.decode.call(kv.push_blocks, KEY, "kv", [0, 1], [6, 7]),
                   rows([(0, 6), (1, 7)]))
    moved((pair.decode, "kv"), (pair.prefill, "kv"),
                   lambda: pair.prefill.call(kv.pull_blocks, BlocksCacheKey(DECODER_ID, 0), "kv", [2], [2]),
                   rows([(2, 2)]))


def test_blocks_prepared_before_the_peer_switched_its_role_move_as_before(pair: Pair) -> None:
    """pull_blocks and push_blocks keep a prepared transfer per peer cache; the peer's switch_role
    (unlinked, then switched, then linked again) moves its role epoch, so the kept transfer is stale
    at that peer (docs/architecture.md, "Roles"): the drop-in prepares it again and the call moves
    exact bytes, raising nothing of pdlink's own (LLM_STALE_EPOCH is not llm_datadist's)."""
    setup_blocks(pair, decoder_key=BlocksCacheKey(DECODER_ID, 0))
    moved((pair.prefill, "kv"), (pair.decode, "kv"), pulls(pair, [0], [1]), rows([(0, 1)]))
    moved((pair.decode, "kv"), (pair.prefill, "kv"),
          lambda: pair.decode.call(kv.push_blocks, KEY, "kv", [2], [3]), rows([(2, 3)]))
    assert pair.unlink() == LLMStatusCode.LLM_SUCCESS
    wait_until(lambda: pair.prefill.call(kv.links) == [], 20, "the prompt's end of the link gone")
    role, port = pair.prefill.call(kv.switch_role, "prompt", here=True)  # CacheManager mode: same role allowed
    assert role == LLMRole.PROMPT
    assert pair.decode.call(kv.link, PROMPT_ID, port)[0] == LLMStatusCode.LLM_SUCCESS
    moved((pair.prefill, "kv"), (pair.decode, "kv"), pulls(pair, [4, 5], [6, 7]), rows([(4, 6), (5, 7)]))
    moved((pair.decode, "kv"), (pair.prefill, "kv"),
          lambda: pair.decode.call(kv.push_blocks, KEY, "kv", [0], [5]), rows([(0, 5)]))


def test_concurrent_pulls_from_several_threads(pair: Pair) -> None:
    setup_blocks(pair)

    def pull_in_threads() -> None:
        assert pair.decode.call(workers.concurrent_pulls, KEY, "kv", threads=8, iterations=20) == []

    moved((pair.prefill, "kv"), (pair.decode, "kv"), pull_in_threads, rows([(i, i) for i in range(8)]))


def test_reregistered_cache_is_seen_by_later_pulls(pair: Pair) -> None:
    """A puller may cache the peer's blocks-cache layout (direct memory access); when the peer
    replaces the cache under the same model_id, later pulls must read the new memory."""
    setup_blocks(pair)
    moved((pair.prefill, "kv"), (pair.decode, "kv"), pulls(pair, [0], [0]), rows([(0, 0)]))
    pair.prefill.call(kv.unregister, "kv")
    pair.prefill.call(kv.register_blocks, "kv2", 4, SHAPE, seed=9, key=KEY)
    pair.prefill.call(kv.overwrite, "kv", None)  # the old memory no longer holds the data
    moved((pair.prefill, "kv2"), (pair.decode, "kv"), pulls(pair, [0, 1], [0, 1]), rows([(0, 0), (1, 1)]))
    pair.prefill.call(kv.unregister, "kv2")
    dst = pair.decode.call(kv.snapshot, "kv")
    with pytest.raises(LLMException) as e:
        pulls(pair, [0], [0])()
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert_same(pair.decode.call(kv.snapshot, "kv"), dst, "destination of the refused pull")


def test_push_into_a_cache_that_is_not_remote_accessible_is_refused(pair: Pair) -> None:
    setup_blocks(pair, decoder_key=BlocksCacheKey(DECODER_ID, 0))
    # HOST caches are not remote accessible by default
    pair.decode.call(kv.register_blocks, "host", 1, (4, 16), seed=None, key=BlocksCacheKey(DECODER_ID, 1),
                     placement=Placement.HOST)
    pair.prefill.call(kv.register_blocks, "s1", 1, (4, 16), seed=3)

    def refused() -> None:
        with pytest.raises(LLMException) as e:
            pair.prefill.call(kv.push_blocks, BlocksCacheKey(DECODER_ID, 1), "s1", [0], [0], tensor_num_per_layer=1)
        assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert "not remote accessible" in str(e.value)  # (on ascend: before the DEVICE/HOST placement check)

    moved((pair.prefill, "s1"), (pair.decode, "host"), refused, nothing)


# About 300,000 segments: the fake HCCL moves ~12,000 a second (more slowly under a sanitizer), so the
# transfers get a generous sync_kv_timeout, and the Ascend cells (25 s each) run with the heavy tests.
SPLIT_TIMEOUT_MS = 180_000

@only("cpu-cma", "cpu-tcp", "ascend-fake", heavy=("ascend-fake",))
def test_a_transfer_larger_than_one_request_is_split_and_exact(make_pair: Callable[..., Pair]) -> None:
    """More (tensor, block run) pieces than one request may name (pdlink._core.LIMITS): the
    requester splits the pull into several requests, transparently; every byte lands."""
    pair = make_pair(timeout=SPLIT_TIMEOUT_MS)
    pieces = internals.core.LIMITS["max_request_pieces"]
    blocks = pieces // 4 + 5000  # 4 tensors: more pieces than one request, in runs that never coalesce
    pair.prefill.call(kv.register_blocks, "kv", 4, (2 * blocks, 4), DataType.DT_INT8, seed=3, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 4, (2 * blocks, 4), DataType.DT_INT8, seed=None)
    pair.link()
    src_blocks = list(range(0, 2 * blocks, 2))  # every other block: no two runs are consecutive
    dst_blocks = list(range(2 * blocks - 1, 0, -2))
    moved((pair.prefill, "kv"), (pair.decode, "kv"),
          lambda: pair.decode.call_within(hang_guard(SPLIT_TIMEOUT_MS), kv.pull_blocks, KEY, "kv", src_blocks,
                                          dst_blocks),
          rows(list(zip(src_blocks, dst_blocks))))


@only("cpu-cma", "cpu-tcp", "ascend-fake", heavy=("ascend-fake",))
def test_a_split_pull_by_request_key_releases_the_key_after_the_last_request(make_pair: Callable[..., Pair]) -> None:
    """A keyed pull into blocks, split into several requests: the source key survives the first
    requests and is released only once the last one has landed."""
    pair = make_pair(remote=False, pool=8 << 20, timeout=SPLIT_TIMEOUT_MS)
    pieces = internals.core.LIMITS["max_request_pieces"]
    blocks = pieces // 2 + 1000  # 2 tensors, every block its own run
    pair.prefill.call(kv.allocate, "src", 2, (1, blocks, 4), DataType.DT_INT8, seed=5, keys=[CacheKey(1, 77, 0)])
    src = pair.prefill.call(kv.snapshot, "src")
    pair.prefill.call(kv.deallocate, "src")  # only the key holds it now
    pair.decode.call(kv.register_blocks, "blk", 2, (2 * blocks, 4), DataType.DT_INT8, seed=None)
    pair.link()
    dst0 = pair.decode.call(kv.snapshot, "blk")
    dst_blocks = list(range(2 * blocks - 1, 0, -2))
    pair.decode.call_within(hang_guard(SPLIT_TIMEOUT_MS), kv.pull_blocks, CacheKey(1, 77, 0), "blk", [], dst_blocks)
    block = 4
    expected = dst0.with_bytes(src, [Copy(t, i * block, t, d * block, block) for t in range(2)
                                     for i, d in enumerate(dst_blocks)])
    assert_same(pair.decode.call(kv.snapshot, "blk"), expected, "destination")
    wait_until(lambda: pair.prefill.call(kv.cache_count) == 0, 10, "the key released after the last request")


@pytest.mark.parametrize("integrity", [False, True], ids=["sealed-frames", "payload-integrity"])
def test_authenticated_links_move_exact_bytes(make_pair: Callable[..., Pair], integrity: bool) -> None:
    """With a link secret (every frame sealed) and with payload integrity (payloads sealed too, in
    chunks): pulls and pushes on every path are byte-exact. Blocks of 160 KiB, so a sealed payload
    spans several chunks, and chunk boundaries fall inside runs and between them."""
    env = {"PDLINK_LINK_SECRET": "transfer-secret", **({"PDLINK_PAYLOAD_INTEGRITY": "1"} if integrity else {})}
    # a generous timeout: under ThreadSanitizer (.ci/sanitizers.sh) the push lands in the serving
    # thread, and each received piece of these large blocks is a suppressed race report there
    # (ordered through the peer process, which TSan cannot see), seconds in all
    pair = make_pair(prefill_env=env, decode_env=env, pool=None, timeout=30000)
    shape = (6, 80 * 1024)  # 6 blocks of 160 KiB per tensor
    pair.prefill.call(kv.register_blocks, "kv", 2, shape, seed=1, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, shape, seed=2)
    pair.link()
    for side in (pair.prefill, pair.decode):
        assert [(link["authenticated"], link["payload_integrity"]) for link in side.call(kv.links)] == [
            (True, integrity)]
    moves = [(0, 1), (1, 2), (2, 3), (5, 0)]  # one run of three blocks (480 KiB) and one of one
    moved((pair.prefill, "kv"), (pair.decode, "kv"), pulls(pair, [s for s, _ in moves], [d for _, d in moves]),
          rows(moves))
    moved((pair.decode, "kv"), (pair.prefill, "kv"),
          lambda: pair.decode.call(kv.push_blocks, KEY, "kv", [4, 1], [5, 4]), rows([(4, 5), (1, 4)]))

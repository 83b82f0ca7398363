"""Layer-wise ``transfer_cache_async`` (llm_datadist_api.md §7.8-7.11, 8.5, 10.5) across two real processes.

Every transfer kind (keyed or raw addresses; cache->cache, blocks->blocks, cache->blocks), the
layer loop's stop rules, ``CacheTask`` timeouts, tasks stopped by ``finalize`` and
``unlink_clusters`` (between layers, and with a push held in flight at a relay) and every
validation rule. The prefill pushes into
the decoder (the decoder dials, links are symmetric); every push checks the whole destination
(moved bytes equal the source, every other byte and the guards unchanged) and the source unchanged
(tests/verify.py). Peer-side code: tests/peers/transfer_async.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

from conftest import DECODER_ID, PROMPT_ID, Pair, only
from internals import transfer_cache_async
from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import kv
from peers import transfer_async as ta
from poll import wait_until
from relay import DOWN, Relay
from verify import Copy, Snapshot, assert_same, check_transfer, nothing, rows

S = LLMStatusCode
R = TypeVar("R")

DST_KEY = BlocksCacheKey(DECODER_ID, 0)  # the decoder's blocks cache, the push target
SHAPE = (8, 64)  # 8 blocks of 64 float16 (128 bytes) per tensor
TASK_GUARD_S = 60  # bounds waiting for a task: reaching it means a hang, not a slow machine
Outcome = tuple[LLMStatusCode, list[LLMStatusCode | None], list[tuple[int, int | None]]]


def keyed(src_layers: range, dst_layers: range, key: BlocksCacheKey | CacheKeyByIdAndIndex = DST_KEY,
          src_batch_index: int = 0) -> TransferWithCacheKeyConfig:
    return TransferWithCacheKeyConfig(key, src_layers, dst_layers, src_batch_index)


def setup_blocks(pair: Pair, num: int, seed: int) -> None:
    """`num` tensors of SHAPE: the prefill's "kv" patterned with `seed` (key BlocksCacheKey(1, 0)),
    the decoder's "kv" zeros (key DST_KEY); linked."""
    pair.prefill.call(kv.register_blocks, "kv", num, SHAPE, seed=seed, key=Pair.KEY)
    pair.decode.call(kv.register_blocks, "kv", num, SHAPE, seed=None, key=DST_KEY)
    pair.link()


def snapshot(peer: Peer, name: str) -> Snapshot:
    return peer.call(kv.snapshot, name)


def pushed(pair: Pair, src: str, dst: str, action: Callable[[], R],
           expect: Callable[[Snapshot, Snapshot], Snapshot]) -> R:
    """``action`` pushes the prefill's cache `src` into the decoder's cache `dst`: the whole
    destination is what `expect` says, the source unchanged (verify.check_transfer). Returns
    what `action` returned."""
    out: list[R] = []
    check_transfer(lambda: snapshot(pair.prefill, src), lambda: snapshot(pair.decode, dst),
                   lambda: out.append(action()), expect)
    return out[0]


def run(pair: Pair, src: str, configs: list[Any], *rest: Any, fail_at: int | None = None) -> Callable[[], Outcome]:
    """Starts ``transfer_cache_async(src, <a recording synchronizer>, configs, *rest)`` on the
    prefill (the synchronizer answers False at layer `fail_at`) and waits for it: (synchronize(),
    get_results(), the synchronizer's calls)."""
    return lambda: pair.prefill.call_within(TASK_GUARD_S, ta.run, src, configs, *rest, fail_at=fail_at)


def blocks_of(slot_blocks: list[int], block: int, tensors: int = 2) -> Callable[[Snapshot, Snapshot], Snapshot]:
    """``expect`` of a contiguous source slot 0 cut into `block`-byte chunks, chunk j into block
    ``slot_blocks[j]`` of each tensor (the last chunk may be short)."""
    def expect(dst0: Snapshot, src0: Snapshot) -> Snapshot:
        copies = [Copy(t, j * block, t, d * block, min(block, src0.row_bytes - j * block))
                  for t in range(tensors) for j, d in enumerate(slot_blocks)]
        return dst0.with_bytes(src0, copies)
    return expect


# ---------------------------------------------------------------------------- keyed (remote accessible)


def test_official_sample_blocks_cache_key(pair: Pair) -> None:
    """transfer_cache_async_sample.py: a blocks cache pushed with
    TransferWithCacheKeyConfig(BlocksCacheKey(D_ID, 0), range(0, 1), range(0, 1)), then get_results()."""
    setup_blocks(pair, 4, seed=1)

    def push() -> tuple[list[LLMStatusCode | None], LLMStatusCode]:
        pair.prefill.call(ta.new_sync)
        pair.prefill.call(ta.transfer, "kv", ta.SYNC, [keyed(range(0, 1), range(0, 1))])
        return pair.prefill.call_within(TASK_GUARD_S, ta.get_results), pair.prefill.call(ta.synchronize)

    # Without block indices a source pushes one slot; a blocks source's slot is block 0. Layer 1
    # (tensors 2, 3) was not asked for.
    assert pushed(pair, "kv", "kv", push, rows([(0, 0)], tensors=[(0, 0), (1, 1)])) == (
        [S.LLM_SUCCESS], S.LLM_SUCCESS)


def test_two_configs_to_two_layers_of_one_destination_and_layer_order(pair: Pair) -> None:
    setup_blocks(pair, 6, seed=2)
    # source layer 0 -> destination layer 2, source layer 2 -> destination layer 0; nobody wants layer 1
    configs = [keyed(range(0, 1), range(2, 3)), keyed(range(2, 3), range(0, 1))]
    outcome = pushed(pair, "kv", "kv", run(pair, "kv", configs, [0, 1, 5], [3, 4, 0], 128),  # 128 = the block size
                     rows([(0, 3), (1, 4), (5, 0)], tensors=[(0, 4), (1, 5), (4, 0), (5, 1)]))
    assert outcome == (S.LLM_SUCCESS, [S.LLM_SUCCESS, S.LLM_SUCCESS], [(0, None), (2, None)])


def test_cache_to_cache_by_id_and_index_and_cache_to_blocks(pair: Pair) -> None:
    pair.prefill.call(kv.register, "ct", 4, (2, 64), seed=3)
    pair.prefill.call(kv.register, "one", 2, (1, 256), seed=4)
    ct_id = pair.decode.call(kv.register, "ct", 4, (3, 64), seed=None)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=None, key=DST_KEY)
    pair.link()
    # whole slot 1 of both layers -> slot 2 of the decoder's cache
    config = keyed(range(0, 2), range(0, 2), CacheKeyByIdAndIndex(DECODER_ID, ct_id, 2), src_batch_index=1)
    outcome = pushed(pair, "ct", "ct", run(pair, "ct", [config]), rows([(1, 2)]))
    assert outcome[:2] == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    # a 512-byte slot cut into 128-byte blocks, into blocks 6, 7, 0, 1 of the decoder's blocks cache
    outcome = pushed(pair, "one", "kv", run(pair, "one", [keyed(range(0, 1), range(0, 1))], None, [6, 7, 0, 1], 128),
                     blocks_of([6, 7, 0, 1], 128))
    assert outcome[:2] == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


def test_synchronizer_false_stops_the_transfer(pair: Pair) -> None:
    setup_blocks(pair, 6, seed=5)
    configs = [keyed(range(0, 3), range(0, 3)), keyed(range(2, 3), range(2, 3), BlocksCacheKey(9, 0))]
    # only layer 0 of block 1 moves: layer 1 is refused by the synchronizer
    outcome = pushed(pair, "kv", "kv", run(pair, "kv", configs, [1], [1], fail_at=1),
                     rows([(1, 1)], tensors=[(0, 0), (1, 1)]))
    # the config holding layer 1 is marked PARAM_INVALID; cluster 9's config never transferred
    assert outcome == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID, None], [(0, None), (1, None)])


def test_blocking_synchronizer_times_out_then_completes(pair: Pair) -> None:
    setup_blocks(pair, 4, seed=6)
    src0, dst0 = snapshot(pair.prefill, "kv"), snapshot(pair.decode, "kv")
    pair.prefill.call(ta.new_sync, gated=True)
    pair.prefill.call(ta.transfer, "kv", ta.SYNC, [keyed(range(0, 2), range(0, 2))], [2, 3], [2, 3])
    assert pair.prefill.call(ta.synchronize, 300) == S.LLM_TIMEOUT  # the gate is shut: only the timeout can end it
    assert pair.prefill.call(ta.get_results, 0) == [S.LLM_TIMEOUT]
    assert pair.prefill.call(ta.synchronize, 0) == S.LLM_TIMEOUT
    assert_same(snapshot(pair.decode, "kv"), dst0, "destination while layer 0 is pending")  # nothing moved
    pair.prefill.call(ta.open_gate)
    assert pair.prefill.call_within(TASK_GUARD_S, ta.outcome) == (
        S.LLM_SUCCESS, [S.LLM_SUCCESS], [(0, None), (1, None)])
    assert_same(snapshot(pair.decode, "kv"), dst0.with_rows(src0, [(2, 2), (3, 3)]), "destination")
    assert_same(snapshot(pair.prefill, "kv"), src0, "source")
    bad_timeouts: list[tuple[object, type[Exception]]] = [
        ("1", TypeError), (-1, ValueError), (2**32, ValueError), (1.5, TypeError)]
    for bad, exc in bad_timeouts:
        for method in (ta.synchronize, ta.get_results):
            with pytest.raises(exc) as info:
                pair.prefill.call(method, bad)
            assert type(info.value) is exc, (method.__name__, bad, info.value)


def test_failure_mid_way_records_the_code_and_stops(pair: Pair) -> None:
    setup_blocks(pair, 6, seed=7)
    configs = [keyed(range(0, 3), range(0, 3)), keyed(range(1, 2), range(1, 2), BlocksCacheKey(DECODER_ID, 7))]
    # layers 0 and 1 (tensors 0-3) went before the failure; layer 2 was never transferred
    outcome = pushed(pair, "kv", "kv", run(pair, "kv", configs, [2], [2]),
                     rows([(2, 2)], tensors=[(0, 0), (1, 1), (2, 2), (3, 3)]))
    # model 7 does not exist on cluster 2: its code lands in cluster 2's (shared) slot
    assert outcome == (S.LLM_KV_CACHE_NOT_EXIST, [S.LLM_KV_CACHE_NOT_EXIST] * 2, [(0, None), (1, None)])
    # the link is still fine
    outcome = pushed(pair, "kv", "kv", run(pair, "kv", [keyed(range(2, 3), range(2, 3))], [2], [2]),
                     rows([(2, 2)], tensors=[(4, 4), (5, 5)]))
    assert outcome[:2] == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


# ---------------------------------------------------------------------------- finalize and unlink stop a task
# llm_datadist's task thread pushes layer by layer through the native wrapper: after finalize the
# wrapper is gone and the next layer's push is LLM_PARAM_INVALID; after unlink_clusters the next
# push to that cluster is LLM_NOT_YET_LINK; the loop ends at that first failure (docs/compatibility.md).


def _held_at_layer_1(pair: Pair) -> tuple[Snapshot, Snapshot]:
    """A two-layer push of blocks 2 and 3 whose layer 0 moved and whose layer 1 waits at the
    synchronizer; the source and destination before it."""
    setup_blocks(pair, 4, seed=8)
    src0, dst0 = snapshot(pair.prefill, "kv"), snapshot(pair.decode, "kv")
    pair.prefill.call(ta.new_sync, gated=True, gate_from=1)
    pair.prefill.call(ta.transfer, "kv", ta.SYNC, [keyed(range(0, 2), range(0, 2))], [2, 3], [2, 3])
    wait_until(lambda: pair.prefill.call(ta.sync_waiting, 1), TASK_GUARD_S, "layer 1 at the synchronizer")
    assert pair.prefill.call(ta.running_tasks) == 1
    return src0, dst0


def test_finalize_stops_a_task_at_its_next_layer(pair: Pair) -> None:
    """Finalized while layer 1 waits: the task ends there with LLM_PARAM_INVALID (what the
    original's next push gets from its finalized wrapper), only layer 0 moved, the manager keeps no
    task."""
    src0, dst0 = _held_at_layer_1(pair)
    pair.prefill.call(kv.finalize)
    pair.prefill.call(ta.open_gate)
    assert pair.prefill.call_within(TASK_GUARD_S, ta.outcome) == (
        S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID], [(0, None), (1, None)])
    assert pair.prefill.call(ta.running_tasks) == 0
    assert_same(snapshot(pair.decode, "kv"), dst0.with_rows(src0, [(2, 2), (3, 3)], [(0, 0), (1, 1)]), "destination")
    assert_same(snapshot(pair.prefill, "kv"), src0, "source")


def test_unlink_stops_a_task_at_its_next_layer(pair: Pair) -> None:
    """The prefill unlinks the decoder while layer 1 waits: the task ends there with
    LLM_NOT_YET_LINK, only layer 0 moved, the manager keeps no task."""
    src0, dst0 = _held_at_layer_1(pair)
    assert pair.prefill.call(kv.unlink, DECODER_ID, pair.port, True) == S.LLM_SUCCESS
    pair.prefill.call(ta.open_gate)
    assert pair.prefill.call_within(TASK_GUARD_S, ta.outcome) == (
        S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK], [(0, None), (1, None)])
    assert pair.prefill.call(ta.running_tasks) == 0
    assert_same(snapshot(pair.decode, "kv"), dst0.with_rows(src0, [(2, 2), (3, 3)], [(0, 0), (1, 1)]), "destination")


BIG = (8, 1 << 18)  # 8 blocks of 512 KiB: 4 MiB per tensor, a layer of 8 MiB


def _landed(before: Snapshot, after: Snapshot, src: Snapshot, tensors: Sequence[int]) -> int:
    """How many bytes of ``after`` changed from ``before``; asserts that they lie in ``tensors``
    and hold ``src``'s bytes at their places, and that everything else (guards included) holds
    ``before``'s."""
    copies = []
    for t in range(len(before.tensors)):
        changed = np.flatnonzero(before.tensor(t) != after.tensor(t))
        assert t in tensors or not changed.size, f"tensor {t} changed"
        for run in (np.split(changed, np.flatnonzero(np.diff(changed) != 1) + 1) if changed.size else []):
            copies.append(Copy(t, int(run[0]), t, int(run[0]), int(run[-1]) - int(run[0]) + 1))
    assert_same(after, before.with_bytes(src, copies), "destination of the stopped task")
    return sum(c.nbytes for c in copies)


@only("cpu-tcp")
@pytest.mark.one_host("the test process relays the link")
@pytest.mark.parametrize("stop", ["finalize", "unlink"])
def test_a_push_held_in_flight_stops_with_the_originals_code(make_pair: Callable[..., Pair], stop: str) -> None:
    """Layer 0 of a two-layer push of 8 MiB layers held at a relay after 1 MiB, then the prefill is
    finalized or unlinks the decoder (force): the task ends with the code the original's next push
    gets (LLM_PARAM_INVALID, LLM_NOT_YET_LINK), layer 1 is never asked for, the decoder's cache
    changed only in layer 0 (by at most what the relay let through while it held; its tensors
    hold the source's bytes or their old ones), and layer 1 stays untouched once the relay lets
    the bytes sent before the stop go."""
    pair = make_pair(pool=None)
    with Relay(pair.port) as relay:
        pair.prefill.call(kv.register_blocks, "big", 4, BIG, seed=9, key=Pair.KEY)
        pair.decode.call(kv.register_blocks, "big", 4, BIG, seed=None, key=DST_KEY)
        assert pair.decode.call(kv.link, PROMPT_ID, relay.port, ip="127.0.0.1") == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        src0, dst0 = snapshot(pair.prefill, "big"), snapshot(pair.decode, "big")
        relay.hold_after(DOWN, 1 << 20)  # the prefill accepted the link: its pushes flow down
        blocks = list(range(BIG[0]))
        pair.prefill.call(ta.new_sync)
        pair.prefill.call(ta.transfer, "big", ta.SYNC, [keyed(range(0, 2), range(0, 2))], blocks, blocks)
        relay.wait_held(DOWN)
        if stop == "finalize":
            pair.prefill.call_within(TASK_GUARD_S, kv.finalize)
            code = S.LLM_PARAM_INVALID
        else:
            assert pair.prefill.call_within(TASK_GUARD_S, kv.unlink, DECODER_ID, pair.port, True) == S.LLM_SUCCESS
            code = S.LLM_NOT_YET_LINK
        assert pair.prefill.call_within(TASK_GUARD_S, ta.outcome) == (code, [code], [(0, None)])
        assert pair.prefill.call(ta.running_tasks) == 0
        after = snapshot(pair.decode, "big")
        assert _landed(dst0, after, src0, [0, 1]) <= 1 << 20
        # what the prefill had sent before the stop (in the sockets' buffers and held at the relay)
        # still reaches the decoder, which writes it where it belongs: layer 1 is never touched
        relay.release()
        wait_until(relay.ended, TASK_GUARD_S, "the relayed connection ended")
        _landed(dst0, snapshot(pair.decode, "big"), src0, [0, 1])
        assert_same(snapshot(pair.prefill, "big"), src0, "source")


# ---------------------------------------------------------------------------- raw addresses (TransferConfig)


def test_transfer_config_into_raw_addresses(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(remote=False)
    pair.prefill.call(kv.register, "ct", 4, (2, 64), seed=8)
    pair.decode.call(kv.register, "ct", 4, (3, 64), seed=None)
    pair.link()
    slot = 64 * 2  # bytes per slot of the decoder's cache
    # every layer of slot 1 -> slot 2 (addresses pre-offset, as llm_datadist requires); layer 1 of
    # slot 0 -> slot 0: two configs to one cluster share its result slot
    addrs = pair.decode.call(kv.tensor_addresses, "ct")
    all_layers = [a + 2 * slot for a in addrs]
    configs = [TransferConfig(DECODER_ID, all_layers, None, 1), TransferConfig(DECODER_ID, addrs[2:], range(1, 2))]
    outcome = pushed(pair, "ct", "ct", run(pair, "ct", configs),
                     lambda dst0, src0: dst0.with_rows(src0, [(1, 2)]).with_rows(src0, [(0, 0)],
                                                                                 tensors=[(2, 2), (3, 3)]))
    assert outcome == (S.LLM_SUCCESS, [S.LLM_SUCCESS, S.LLM_SUCCESS], [(0, None), (1, None)])


def test_transfer_config_with_block_indices(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(remote=False)
    pair.prefill.call(kv.register_blocks, "kv", 4, SHAPE, seed=9)
    pair.prefill.call(kv.register, "one", 2, (1, 256), seed=10)
    pair.decode.call(kv.register_blocks, "kv", 4, SHAPE, seed=None)
    pair.decode.call(kv.register_blocks, "pg", 2, (8, 80), seed=None)
    pair.link()
    kv_addrs = pair.decode.call(kv.tensor_addresses, "kv")
    pg_addrs = pair.decode.call(kv.tensor_addresses, "pg")
    # blocks -> blocks, both layers; dst_block_memory_size omitted (= the source block size)
    outcome = pushed(pair, "kv", "kv", run(pair, "kv", [TransferConfig(DECODER_ID, kv_addrs)], [0, 1, 5], [3, 4, 0]),
                     rows([(0, 3), (1, 4), (5, 0)]))
    assert outcome[:2] == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    # layer 1 only, with dst_block_memory_size = the block size (128 bytes)
    outcome = pushed(pair, "kv", "kv",
                     run(pair, "kv", [TransferConfig(DECODER_ID, kv_addrs[2:], range(1, 2))], [7], [7], 128),
                     rows([(7, 7)], tensors=[(2, 2), (3, 3)]))
    assert outcome[:2] == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    # cache -> blocks: a 512-byte slot in 160-byte blocks 5, 6, 0, 2 (the last chunk is 32 bytes)
    outcome = pushed(pair, "one", "pg",
                     run(pair, "one", [TransferConfig(DECODER_ID, pg_addrs)], None, [5, 6, 0, 2], 160),
                     blocks_of([5, 6, 0, 2], 160))
    assert outcome[:2] == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


def test_raw_addresses_outside_registered_memory(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(remote=False)
    pair.prefill.call(kv.register, "ct", 2, (1, 64), seed=11)
    pair.decode.call(kv.register, "ct", 2, (1, 64), seed=None)
    size = 128  # bytes per tensor
    other = pair.decode.call(ta.unregistered, "other", 2, size, 1, 12)  # guarded, never registered
    pair.link()
    reg = pair.decode.call(kv.tensor_addresses, "ct")
    other0 = pair.decode.call(ta.unregistered_snapshot, "other")
    cases = [(other, nothing),                             # memory the decoder never registered
             ([reg[0] + size - 64, reg[1]], nothing),      # a run crossing the end of a registered tensor
             ([reg[0], other[1]], rows([(0, 0)], tensors=[(0, 0)]))]  # K fits (and lands), V does not
    for dst, expect in cases:
        outcome = pushed(pair, "ct", "ct", run(pair, "ct", [TransferConfig(DECODER_ID, dst)]), expect)
        assert outcome[:2] == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID]), dst
        assert_same(pair.decode.call(ta.unregistered_snapshot, "other"), other0, "memory the decoder never registered")
    # an unlinked cluster, then a correct push over the same link
    outcome = pushed(pair, "ct", "ct", run(pair, "ct", [TransferConfig(9, reg)]), nothing)
    assert outcome[:2] == (S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
    outcome = pushed(pair, "ct", "ct", run(pair, "ct", [TransferConfig(DECODER_ID, reg)]), rows([(0, 0)]))
    assert outcome[:2] == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


# ---------------------------------------------------------------------------- validation


K = keyed(range(0, 1), range(0, 1))
RAW = TransferConfig(DECODER_ID, [4096, 8192])
SYNC = ta.SYNC
VALIDATION_CACHES = ("kv", "ct", "odd", "host")


def setup_validation(p: Peer, remote: bool) -> None:
    """An unlinked PROMPT engine with a blocks cache "kv", plain caches "ct" and "odd" (3 tensors)
    and a HOST cache "host", all patterned; a fresh recording synchronizer."""
    p.call(kv.start, "prompt", PROMPT_ID, remote=remote)
    p.call(kv.register_blocks, "kv", 4, SHAPE, seed=1)
    p.call(kv.register, "ct", 4, (2, 64), seed=2)
    p.call(kv.register, "odd", 3, (2, 64), seed=3)
    p.call(kv.register, "host", 2, (2, 64), seed=4, placement=Placement.HOST)
    p.call(ta.new_sync)


def caches(p: Peer) -> list[Snapshot]:
    return [snapshot(p, name) for name in VALIDATION_CACHES]


def assert_unchanged(p: Peer, before: list[Snapshot]) -> None:
    for now, then in zip(caches(p), before):
        assert_same(now, then, "a cache of the refusing peer")


def _expect(p: Peer, args: tuple[Any, ...], exc: type[Exception],
            code: LLMStatusCode = S.LLM_PARAM_INVALID) -> Exception:
    """``transfer_cache_async(*args)`` raises exactly `exc` (an LLMException: with `code`)."""
    with pytest.raises(exc) as info:
        p.call(ta.transfer, *args)
    err = info.value
    assert type(err) is exc, (args, err)  # LLMException itself, never a subclass
    if isinstance(err, LLMException):
        assert err.status_code == code, (args, err)
    return err


def test_validation_remote_accessible_mode(peers: Callable[..., Peer]) -> None:
    p = peers("v")
    setup_validation(p, remote=True)
    before = caches(p)
    threads = p.call(ta.active_threads)
    tensors = [np.zeros(SHAPE, np.float16) for _ in range(4)]  # the arrays themselves, not a Cache
    cases: list[tuple[tuple[Any, ...], type[Exception]]] = [
        # llm_datadist_api.md §8.5: the source
        ((None, SYNC, [K]), TypeError), ((tensors, SYNC, [K]), TypeError), (("host", SYNC, [K]), LLMException),
        # block index lists and dst_block_memory_size: types, then ranges
        (("kv", SYNC, [K], None, "0"), TypeError), (("kv", SYNC, [K], None, [0, "1"]), TypeError),
        (("kv", SYNC, [K], [0.5], [0]), TypeError), (("kv", SYNC, [K], [True], [0]), TypeError),
        (("kv", SYNC, [K], None, [-1], 128), ValueError), (("kv", SYNC, [K], [2**64], [0]), ValueError),
        (("kv", SYNC, [K], [0], [0], "128"), TypeError), (("kv", SYNC, [K], [0], [0], -1), ValueError),
        # rule 4: src_block_indices need dst_block_indices of the same length
        (("kv", SYNC, [K], [0]), LLMException), (("kv", SYNC, [K], [0, 1], [0]), LLMException),
        # rule 5: a contiguous source into blocks needs dst_block_memory_size
        (("ct", SYNC, [K], None, [0]), LLMException),
        # the synchronizer and the configs
        (("kv", None, [K]), TypeError), (("kv", object(), [K]), TypeError),
        (("kv", SYNC, None), TypeError), (("kv", SYNC, K), TypeError), (("kv", SYNC, [K, None]), TypeError),
        (("kv", SYNC, [RAW]), TypeError), (("kv", SYNC, [K, RAW]), TypeError),
        # rule 6: dst_block_memory_size without dst blocks
        (("kv", SYNC, [K], None, None, 128), LLMException), (("kv", SYNC, [K], [], [], 1), LLMException),
        # rule 1: two tensors per layer
        (("odd", SYNC, [K]), LLMException),
        # rule 2: the layer range within the source's layers
        (("kv", SYNC, [keyed(range(1, 3), range(0, 2))]), LLMException),
        # rule 4: src_batch_index 0 with src blocks
        (("kv", SYNC, [keyed(range(0, 1), range(0, 1), CacheKeyByIdAndIndex(DECODER_ID, 1), 1)], [0], [0]),
         LLMException),
    ]
    for args, exc in cases:
        _expect(p, args, exc)
    msg = str(_expect(p, ("kv", SYNC, [RAW]), TypeError))
    assert msg.startswith("While enable_remote_cache_accessible is True, transfer_configs"), msg
    # 7.9: ranges of unequal length set one at a time are caught here
    k2 = keyed(range(0, 1), range(0, 1))
    k2.src_layer_range = range(0, 2)
    _expect(p, ("kv", SYNC, [k2]), LLMException)
    # nothing started, the synchronizer was never asked
    assert (p.call(ta.active_threads), p.call(ta.sync_calls)) == (threads, [])
    # valid calls: bms 0 means "not given"; an empty config list succeeds at once; an unlinked peer
    # is a result, not an exception
    p.call(ta.transfer, "kv", SYNC, [], None, None, 0)
    assert p.call(ta.get_results) == []
    p.call(ta.transfer, "kv", SYNC, ())
    assert p.call(ta.synchronize) == S.LLM_SUCCESS
    p.call(ta.transfer, "kv", SYNC, [K], None, None, 0)
    assert p.call(ta.get_results) == [S.LLM_NOT_YET_LINK]
    p.call(ta.transfer, "ct", SYNC, [K], None, [0], 64)
    assert p.call(ta.get_results) == [S.LLM_NOT_YET_LINK]
    assert_unchanged(p, before)  # no call touched a source
    p.call(kv.finalize)
    _expect(p, ("kv", SYNC, [K]), LLMException, S.LLM_ENGINE_FINALIZED)  # a finalized engine's manager


def test_validation_raw_address_mode(peers: Callable[..., Peer]) -> None:
    p = peers("w")
    setup_validation(p, remote=False)
    before = caches(p)
    cases: list[tuple[tuple[Any, ...], type[Exception]]] = [
        (("kv", SYNC, [K]), TypeError), (("kv", SYNC, [RAW, K]), TypeError),
        # 7.8 / rule 3: two dst_addrs per transferred layer (default range: every layer)
        (("kv", SYNC, [RAW]), LLMException),
        (("kv", SYNC, [TransferConfig(DECODER_ID, [1, 2, 3], range(0, 2))]), LLMException),
        (("kv", SYNC, [TransferConfig(DECODER_ID, [1, 2, 3, 4], range(0, 1))]), LLMException),
        # rule 2
        (("kv", SYNC, [TransferConfig(DECODER_ID, [1, 2, 3, 4], range(1, 3))]), LLMException),
        # rule 4: src_batch_index 0 with src blocks
        (("kv", SYNC, [TransferConfig(DECODER_ID, [1, 2], range(0, 1), 1)], [0], [0]), LLMException),
    ]
    for args, exc in cases:
        _expect(p, args, exc)
    assert p.call(ta.sync_calls) == []
    p.call(ta.transfer, "kv", SYNC, [TransferConfig(DECODER_ID, [1, 2, 3, 4])])
    assert p.call(ta.get_results) == [S.LLM_NOT_YET_LINK]
    assert_unchanged(p, before)  # no call touched a source


# ---------------------------------------------------------------------------- the algorithm alone


class _Sync(LayerSynchronizer):
    def __init__(self, action: Callable[[int], bool] | None = None) -> None:
        self.calls: list[int] = []
        self.action = action

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append(layer_index)
        if self.action is not None:
            return self.action(layer_index)
        return True


def _cache(num_tensors: int = 4, shape: tuple[int, ...] = (2, 64), blocks: bool = False) -> Cache:
    addrs = [4096 * (i + 1) for i in range(num_tensors)]
    return Cache(1, CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16), addrs, is_blocks_cache=blocks)


def test_timeout_code_is_a_parameter_and_exceptions_read_as_timeouts() -> None:
    """The v1 KvCacheManager passes LLM_WAIT_PROCESS_TIMEOUT; a synchronizer that raises ends the
    thread and every answer is the timeout code (as upstream)."""
    calls: list[dict[str, Any]] = []
    gate = threading.Event()

    def blocked(layer: int) -> bool:
        gate.wait(10)
        return True

    task = transfer_cache_async(lambda *a, **k: calls.append(k), _cache(), False, _Sync(blocked),
                                [TransferConfig(2, [1, 2, 3, 4])], remote_cache_accessible=False,
                                timeout_code=S.LLM_WAIT_PROCESS_TIMEOUT)
    assert task.synchronize(10) == S.LLM_WAIT_PROCESS_TIMEOUT
    assert task.get_results(0) == [S.LLM_WAIT_PROCESS_TIMEOUT]
    gate.set()
    assert task.get_results() == [S.LLM_SUCCESS] and len(calls) == 4

    def boom(layer: int) -> bool:
        raise ZeroDivisionError("layer not ready")

    task = transfer_cache_async(lambda *a, **k: None, _cache(), False, _Sync(boom),
                                [TransferConfig(2, [1, 2, 3, 4]), TransferConfig(3, [1, 2, 3, 4])],
                                remote_cache_accessible=False)
    assert task.synchronize() == S.LLM_TIMEOUT
    assert task.get_results() == [S.LLM_TIMEOUT, S.LLM_TIMEOUT]


def test_runs_sent_to_the_engine() -> None:
    """Raw cache -> blocks: one native call per tensor, consecutive chunks coalesced, absolute remote
    addresses; a config the engine would refuse fails at its first layer with PARAM_INVALID."""
    sent: list[tuple[Any, ...]] = []

    def fn(op: str, is_push: bool, key: Any, cache: Cache, mode: str, **kw: Any) -> None:
        sent.append((op, is_push, key, mode, kw))

    cache = _cache(shape=(1, 32))  # 64-byte slots
    task = transfer_cache_async(fn, cache, False, _Sync(), [TransferConfig(7, [1000, 2000], range(1, 2))],
                                None, [3, 4, 9], 24, remote_cache_accessible=False)
    assert task.get_results() == [S.LLM_SUCCESS]
    assert sent == [
        ("transfer_cache_async", True, None, "EXPLICIT",
         {"peer": 7, "local_tensors": [2 + k], "remote_tensors": [0], "local_runs": [(0, 48), (48, 16)],
          "remote_runs": [(base + 72, 48), (base + 216, 16)]})
        for k, base in enumerate((1000, 2000))]
    # more dst blocks than the slot has chunks: PARAM_INVALID at layer 0, nothing sent
    sent.clear()
    sync = _Sync()
    task = transfer_cache_async(fn, cache, False, sync, [TransferConfig(7, [1, 2, 3, 4])], None, [0, 1, 2, 3], 24,
                                remote_cache_accessible=False)
    assert task.get_results() == [S.LLM_PARAM_INVALID] and sent == [] and sync.calls == [0]
    # src_block_indices with a contiguous source
    task = transfer_cache_async(fn, cache, False, _Sync(), [TransferConfig(7, [1, 2, 3, 4])], [0], [0],
                                remote_cache_accessible=False)
    assert task.get_results() == [S.LLM_PARAM_INVALID] and sent == []


def test_configs_are_not_mutated() -> None:
    cfg = TransferConfig(2, [1, 2, 3, 4])
    task = transfer_cache_async(lambda *a, **k: None, _cache(), False, _Sync(), [cfg], remote_cache_accessible=False)
    assert task.get_results() == [S.LLM_SUCCESS]
    assert cfg.src_layer_range is None


def test_cache_task_is_exported() -> None:
    import llm_datadist
    from llm_datadist import CacheTask

    assert llm_datadist.CacheTask is CacheTask
    assert "CacheTask" in llm_datadist.__all__

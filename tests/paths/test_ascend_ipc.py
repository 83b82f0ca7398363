"""Same-host IPC for DEVICE memory on the Ascend backend (fake vendor libraries).

Two processes of one host with the IPC symbols (aclrtIpcMem*) move DEVICE caches without HCCL:
the serving side checks the access as always, exports the addressed regions, and the requester
maps them and copies device to device. `PDLINK_TRANSPORT=tcp` turns this off (the shared suite's
`[ascend]` cases run that way, over HCCL); a peer whose runtime lacks IPC makes the link fall
back to HCCL. The fakes' call counters show which path moved the bytes (peers/fake_ascend.py).

Every transfer is checked on the whole destination (moved blocks equal the source, every other
byte and the guards unchanged) with the source unchanged; a refused or failed one changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import DECODER_ID, PROMPT_ID, Pair, only, reader
from fake_ascend.build import build
from llm_datadist import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, DataType
from pdlink import LLMException
from pdlink import LLMStatusCode as S
from peers import fake_ascend, kv
from poll import wait_until
from verify import Snapshot, assert_same, check_transfer, nothing, rows

KEY = Pair.KEY  # BlocksCacheKey(1, 0): the prompt's blocks cache
SHAPE = (8, 512)  # 8 blocks of 512 float16 per tensor
ACL_ERROR_INVALID_PARAM = 100000

ascend = only("ascend-fake")  # the IPC path exists on the Ascend backend only


def make(make_pair: Callable[..., Pair], transport: str = "auto", prefill_extra: dict[str, str] | None = None,
         remote: bool = True) -> Pair:
    """A linked pair of Ascend peers on data path ``transport`` ("auto": IPC between the two)."""
    pair = make_pair(remote=remote, prefill_env={"PDLINK_TRANSPORT": transport, **(prefill_extra or {})},
                     decode_env={"PDLINK_TRANSPORT": transport})
    if transport == "tcp":
        pair.link()  # also checks that both report the tcp transport
    else:
        ret = pair.decode.call(kv.link, PROMPT_ID, pair.port)
        assert ret == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), ret
    return pair


def blocks(pair: Pair, decoder_key: BlocksCacheKey | None = None) -> None:
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2, key=decoder_key)


def refused(read_src: Callable[[], Snapshot], read_dst: Callable[[], Snapshot],
            action: Callable[[], object]) -> LLMException:
    """``action`` must raise LLMException and change neither side: its exception."""
    def attempt() -> LLMException:
        with pytest.raises(LLMException) as e:
            action()
        return e.value

    err = check_transfer(read_src, read_dst, attempt, nothing)
    assert isinstance(err, LLMException)
    return err


def refused_pull(pair: Pair, src_blocks: list[int], dst_blocks: list[int]) -> LLMException:
    return refused(reader(pair.prefill, "kv"), reader(pair.decode, "kv"),
                   lambda: pair.decode.call(kv.pull_blocks, KEY, "kv", src_blocks, dst_blocks))


@ascend
def test_pull_and_push_blocks_over_ipc_without_hccl(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair)
    blocks(pair, decoder_key=BlocksCacheKey(DECODER_ID, 0))
    pair.pulled([0, 1, 2, 6], [3, 4, 5, 0])
    check_transfer(reader(pair.prefill, "kv"), reader(pair.decode, "kv"),
                   lambda: pair.prefill.call(kv.push_blocks, BlocksCacheKey(DECODER_ID, 0), "kv", [7, 5], [1, 2]),
                   rows([(7, 1), (5, 2)]))
    # IPC moved the bytes (decode imported the prompt's regions and vice versa); HCCL never ran and
    # no communicator was set up; the prompt exported its regions for the pull.
    assert pair.decode.call(fake_ascend.calls, "aclrtIpcMemImportByKey") >= 2
    assert pair.prefill.call(fake_ascend.calls, "aclrtIpcMemImportByKey") >= 2
    for side in (pair.prefill, pair.decode):
        assert side.call(fake_ascend.call_counts, "HcclBatchSendRecv", "HcclCommInitRootInfo") == \
            {"HcclBatchSendRecv": 0, "HcclCommInitRootInfo": 0}
    assert pair.prefill.call(fake_ascend.calls, "aclrtIpcMemGetExportKey") >= 2


@ascend
def test_pull_cache_slot_over_ipc(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair)
    src_id = pair.prefill.call(kv.register, "src", 2, (4, 64), seed=5)
    pair.decode.call(kv.register, "dst", 2, (2, 64), seed=None)  # zeros
    # source batch slot 1 into local slot 1; slot 0 stays zero
    check_transfer(reader(pair.prefill, "src"), reader(pair.decode, "dst"),
                   lambda: pair.decode.call(kv.pull_cache, CacheKeyByIdAndIndex(PROMPT_ID, src_id, 1), "dst", 1),
                   rows([(1, 1)]))
    assert pair.decode.call(fake_ascend.calls, "HcclBatchSendRecv") == 0


@ascend
def test_a_refused_access_over_ipc_changes_nothing_and_keeps_the_link(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair)
    blocks(pair)
    err = refused_pull(pair, [8], [0])  # the prompt has 8 blocks
    assert err.status_code == S.LLM_PARAM_INVALID
    assert pair.prefill.call(fake_ascend.calls, "aclrtIpcMemGetExportKey") == 0  # refused before anything was exported
    pair.pulled([7], [0])


@ascend
def test_a_failed_import_is_an_error_and_the_next_pull_works(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair)
    blocks(pair)
    pair.decode.call(fake_ascend.inject, "aclrtIpcMemImportByKey", ACL_ERROR_INVALID_PARAM)  # once
    err = refused_pull(pair, [3], [3])
    assert err.status_code == S.LLM_PARAM_INVALID
    assert "over IPC: aclrtIpcMemImportByKey failed: ACL_ERROR_INVALID_PARAM (100000)" in str(err)
    pair.pulled([3], [3])
    assert not pair.decode.call(kv.links)[0]["broken"]


@ascend
def test_a_peer_without_ipc_makes_the_link_fall_back_to_hccl(make_pair: Callable[..., Pair]) -> None:
    # The prompt's runtime lacks aclrtIpcMemGetExportKey (variant no_optional): it refuses IPC, and
    # the decode moves the bytes over an HCCL channel instead, from then on.
    pair = make(make_pair, prefill_extra={"PDLINK_ASCEND_LIB_DIR": str(build("no_optional"))})
    blocks(pair)
    for _ in range(2):
        pair.pulled([1, 2], [5, 6])
    assert pair.decode.call(fake_ascend.call_counts, "aclrtIpcMemImportByKey", "HcclCommInitRootInfo",
                            "HcclBatchSendRecv") == \
        {"aclrtIpcMemImportByKey": 0,
         "HcclCommInitRootInfo": 1,  # one channel, set up on first use
         "HcclBatchSendRecv": 2}


@ascend
def test_forcing_tcp_uses_hccl_even_on_one_host(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair, transport="tcp")
    blocks(pair)
    pair.pulled([4], [4])
    assert pair.decode.call(fake_ascend.call_counts, "aclrtIpcMemImportByKey", "HcclBatchSendRecv") == \
        {"aclrtIpcMemImportByKey": 0, "HcclBatchSendRecv": 1}


@ascend
def test_pull_by_request_key_over_ipc_releases_the_key_only_after_the_copy(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair, remote=False)  # request keys: caches not remote accessible (llm_datadist's rule)
    pair.prefill.call(kv.allocate, "src", 2, (2, 4096), DataType.DT_INT8, seed=6, keys=[CacheKey(PROMPT_ID, 5)])
    pair.prefill.call(kv.deallocate, "src")  # only the request key holds it now
    pair.decode.call(kv.allocate, "dst", 2, (2, 4096), DataType.DT_INT8)
    src, dst = reader(pair.prefill, "src"), reader(pair.decode, "dst")

    def pull(batch_index: int) -> Callable[[], None]:
        return lambda: pair.decode.call(kv.pull_cache, CacheKey(PROMPT_ID, 5), "dst", batch_index)

    pair.decode.call(fake_ascend.inject, "aclrtIpcMemImportByKey", ACL_ERROR_INVALID_PARAM)  # the first copy fails
    assert refused(src, dst, pull(1)).status_code == S.LLM_PARAM_INVALID
    assert pair.prefill.call(kv.cache_count) == 1  # the key still holds the cache
    # key slot 0 -> local slot 1 (the whole pools: everything else in them unchanged)
    check_transfer(src, dst, pull(1), rows([(0, 1)]))
    wait_until(lambda: pair.prefill.call(kv.cache_count) == 0, 10, "the consumed cache freed")
    # the key is gone: a pull is refused and changes nothing here (the source was consumed: its
    # pool is free memory now, so only the destination is checked)
    before = dst()
    with pytest.raises(LLMException) as err:
        pull(0)()
    assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    assert_same(dst(), before, "destination of a pull by a consumed key")
    assert pair.decode.call(fake_ascend.calls, "HcclBatchSendRecv") == 0

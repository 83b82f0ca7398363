"""HCCL one-sided access on the Ascend backend (fake vendor libraries): `pdlink.HcclOneSided=1`.

With both ends enabling it (option `pdlink.HcclOneSided` or PDLINK_HCCL_ONE_SIDED=1) and both
runtimes having the one-sided symbols, a device channel is prepared at its setup (each side
registers and binds its device pool and registered DEVICE caches, then HcclCommPrepare), and a
pull or push becomes: a checked request on the control connection answered with addresses, then
HcclBatchGet/HcclBatchPut by the requester alone. Memory registered after the link, or an end
that does not enable it, falls back to the two-sided HcclBatchSendRecv. The links here are
forced to TCP (the ascend-fake variant), so IPC (same host) stays out of the way; the fakes' call
counters show the path (peers/fake_ascend.py).

Every transfer is checked on the whole destination (moved blocks equal the source, every other
byte and the guards unchanged) with the source unchanged; a refused or failed one changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import DECODER_ID, PROMPT_ID, Pair, only, reader
from internals import parse_engine_options
from llm_datadist import BlocksCacheKey, CacheKey, DataType
from pdlink import LLMException
from pdlink import LLMStatusCode as S
from peers import fake_ascend, kv
from poll import wait_until
from verify import check_transfer, nothing, rows

KEY = Pair.KEY  # BlocksCacheKey(1, 0): the prompt's blocks cache
SHAPE = (8, 512)  # 8 blocks of 512 float16 per tensor
HCCL_E_REMOTE = 21

ascend = only("ascend-fake")  # HCCL one-sided access exists on the Ascend backend only


def make(make_pair: Callable[..., Pair], prompt_one_sided: str = "1", decode_one_sided: str = "1",
         remote: bool = True) -> Pair:
    """Two Ascend peers (not linked yet), each enabling one-sided access or not."""
    return make_pair(remote=remote, prefill_env={"PDLINK_HCCL_ONE_SIDED": prompt_one_sided},
                     decode_env={"PDLINK_HCCL_ONE_SIDED": decode_one_sided})


def prompt_cache(pair: Pair) -> None:
    pair.prefill.call(kv.register_blocks, "kv", 2, SHAPE, seed=1, key=KEY)


def decode_cache(pair: Pair, decoder_key: BlocksCacheKey | None = None) -> None:
    pair.decode.call(kv.register_blocks, "kv", 2, SHAPE, seed=2, key=decoder_key)


def refused_pull(pair: Pair, src_blocks: list[int], dst_blocks: list[int]) -> LLMException:
    """A pull that must raise LLMException and change neither side: its exception."""
    def attempt() -> LLMException:
        with pytest.raises(LLMException) as e:
            pair.decode.call(kv.pull_blocks, KEY, "kv", src_blocks, dst_blocks)
        return e.value

    err = check_transfer(reader(pair.prefill, "kv"), reader(pair.decode, "kv"), attempt, nothing)
    assert isinstance(err, LLMException)
    return err


@ascend
def test_pull_and_push_blocks_one_sided(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair)
    prompt_cache(pair)
    decode_cache(pair, decoder_key=BlocksCacheKey(DECODER_ID, 0))
    pair.link()
    pair.pulled([0, 1, 2, 6], [3, 4, 5, 0])
    check_transfer(reader(pair.prefill, "kv"), reader(pair.decode, "kv"),
                   lambda: pair.prefill.call(kv.push_blocks, BlocksCacheKey(DECODER_ID, 0), "kv", [7], [1]),
                   rows([(7, 1)]))
    assert pair.decode.call(fake_ascend.calls, "HcclBatchGet") == 1
    assert pair.prefill.call(fake_ascend.calls, "HcclBatchPut") == 1
    for side in (pair.prefill, pair.decode):
        assert side.call(fake_ascend.call_counts, "HcclBatchSendRecv", "HcclCommPrepare") == \
            {"HcclBatchSendRecv": 0,
             "HcclCommPrepare": 2}  # one channel per direction, both prepared


@ascend
def test_memory_registered_after_the_link_goes_two_sided(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair)
    prompt_cache(pair)
    pair.link()
    decode_cache(pair)  # not in the memory the channel prepared
    pair.pulled([5], [2])
    assert pair.decode.call(fake_ascend.call_counts, "HcclBatchGet", "HcclBatchSendRecv") == \
        {"HcclBatchGet": 0, "HcclBatchSendRecv": 1}


@ascend
@pytest.mark.parametrize("who", ["prompt", "decode"])
def test_one_end_without_it_means_two_sided(make_pair: Callable[..., Pair], who: str) -> None:
    pair = make(make_pair, prompt_one_sided="0" if who == "prompt" else "1",
                decode_one_sided="0" if who == "decode" else "1")
    prompt_cache(pair)
    decode_cache(pair)
    pair.link()
    pair.pulled([3], [3])
    for side in (pair.prefill, pair.decode):
        assert side.call(fake_ascend.calls, "HcclCommPrepare") == 0
    assert pair.decode.call(fake_ascend.calls, "HcclBatchSendRecv") == 1


@ascend
def test_a_refused_access_changes_nothing_and_keeps_the_link(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair)
    prompt_cache(pair)
    decode_cache(pair)
    pair.link()
    assert refused_pull(pair, [8], [0]).status_code == S.LLM_PARAM_INVALID  # the prompt has 8 blocks
    pair.pulled([7], [0])
    assert pair.decode.call(fake_ascend.calls, "HcclBatchGet") == 1


@ascend
def test_a_failed_get_breaks_the_link_and_a_relinked_pull_succeeds(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair)
    prompt_cache(pair)
    decode_cache(pair)
    pair.link()
    pair.decode.call(fake_ascend.inject, "HcclBatchGet", HCCL_E_REMOTE)  # once
    err = refused_pull(pair, [1], [1])
    assert err.status_code == S.LLM_LINK_FAILED
    assert "HcclBatchGet failed: HCCL_E_REMOTE" in str(err)
    assert pair.decode.call(kv.links)[0]["broken"]
    assert pair.unlink(force=True) == S.LLM_SUCCESS
    pair.link()
    pair.pulled([1], [1])


@ascend
def test_pull_by_request_key_one_sided_releases_the_key_after_the_copy(make_pair: Callable[..., Pair]) -> None:
    pair = make(make_pair, remote=False)  # request keys: caches not remote accessible (llm_datadist's rule)
    pair.prefill.call(kv.allocate, "src", 2, (2, 4096), DataType.DT_INT8, seed=6, keys=[CacheKey(PROMPT_ID, 5)])
    pair.prefill.call(kv.deallocate, "src")  # only the request key holds it now
    pair.decode.call(kv.allocate, "dst", 2, (2, 4096), DataType.DT_INT8)
    pair.link()
    # key slot 0 -> local slot 1 (the whole pools: everything else in them unchanged)
    check_transfer(reader(pair.prefill, "src"), reader(pair.decode, "dst"),
                   lambda: pair.decode.call(kv.pull_cache, CacheKey(PROMPT_ID, 5), "dst", 1), rows([(0, 1)]))
    wait_until(lambda: pair.prefill.call(kv.cache_count) == 0, 10, "the consumed cache freed")
    assert pair.decode.call(fake_ascend.call_counts, "HcclBatchGet", "HcclBatchSendRecv") == \
        {"HcclBatchGet": 1, "HcclBatchSendRecv": 0}


def test_option_is_validated() -> None:
    assert parse_engine_options({"pdlink.HcclOneSided": "1"})["hccl_one_sided"] is True
    assert parse_engine_options({})["hccl_one_sided"] is False
    with pytest.raises(LLMException) as e:
        parse_engine_options({"pdlink.HcclOneSided": "yes"})
    assert e.value.status_code == S.LLM_PARAM_INVALID

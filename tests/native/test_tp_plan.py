"""pdlink.kv's TP plan (pdlink/tp.py): a decode rank's plan, applied piece by piece to prefill ranks'
blocks cut from one model-wide KV tensor, must fill every byte of every local block exactly once and
equal that rank's blocks cut from the same tensor (a numpy reference of the whole destination); the
worked cases of docs/native_api.md ("Different TP and block sizes"); every field a mismatch names.
Pure Python: no engine."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdlink import InvalidArgument, LLMStatusCode, kv
from pdlink.kv import GeometryMismatch, KvGeometry, Row, TpPlan
from tp_reference import blocks_of, model_kv

BLOCKS = 3  # local blocks per test


def apply(plan: TpPlan, remote: dict[int, np.ndarray], local_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The local blocks the plan's reads fill (0xEE where none does) and how often each byte is written."""
    out = np.full((local_blocks, plan.local.block_bytes), 0xEE, np.uint8)
    writes = np.zeros(out.shape, np.int64)
    for b in range(local_blocks):
        for r in plan.reads:
            src = remote[r.remote_rank][plan.block_ratio * b + r.sub_block]
            assert (r.remote.length, r.remote.count) == (r.local.length, r.local.count), r
            for k in range(r.local.count):
                lo, ro = r.local.offset + k * r.local.stride, r.remote.offset + k * r.remote.stride
                assert ro + r.remote.length <= src.size, f"{r} reads past the remote block"
                assert lo + r.local.length <= out.shape[1], f"{r} writes past the local block"
                out[b, lo:lo + r.local.length] = src[ro:ro + r.remote.length]
                writes[b, lo:lo + r.local.length] += 1
    return out, writes


def geometry(layout: str, heads: int, tp: int, rank: int, block_tokens: int = 4, head_size: int = 8,
             dtype: str = "float16") -> KvGeometry:
    kv_n = 1 if layout == "MLA" else 2
    return KvGeometry(layout, kv_heads=heads, head_size=head_size, dtype=dtype, block_tokens=block_tokens,
                      tp_size=tp, tp_rank=rank, layers=2, kv=kv_n)


def check_plan(layout: str, heads: int, prefill_tp: int, decode_tp: int, decode_rank: int, prefill_block: int = 4,
               decode_block: int = 4, per_token: bool = False) -> TpPlan:
    """The plan of decode rank ``decode_rank`` over every prefill rank, checked against the reference."""
    prefill = [geometry(layout, heads, prefill_tp, r, prefill_block) for r in range(prefill_tp)]
    decode = geometry(layout, heads, decode_tp, decode_rank, decode_block)
    plan = kv.tp_plan(decode, prefill, per_token=per_token)
    x = model_kv(heads, decode.head_size * decode.itemsize, BLOCKS * decode_block, seed=decode_rank)
    got, writes = apply(plan, {g.tp_rank: blocks_of(g, x) for g in prefill}, BLOCKS)
    assert (writes == 1).all(), f"bytes written {np.unique(writes)} times, not once each"
    np.testing.assert_array_equal(got, blocks_of(decode, x))
    holding = {g.tp_rank for g in prefill if set(range(g.first_head, g.first_head + g.heads))
               & set(range(decode.first_head, decode.first_head + decode.heads))}
    assert set(plan.ranks) | set(plan.skipped) == holding and not set(plan.ranks) & set(plan.skipped)
    return plan


# ---------------------------------------------------------------------------------- worked cases
def test_tp_2_to_1_reads_both_ranks_whole() -> None:
    plan = check_plan("HND", 4, 2, 1, 0)
    span = 4 * 8 * 2  # tokens * head_size * itemsize: one head of one block
    assert plan.reads == (kv.TpRead(0, 0, 2, 0, Row(0, 2 * span, 2 * span, 1), Row(0, 2 * span, 2 * span, 1)),
                          kv.TpRead(1, 2, 2, 0, Row(0, 2 * span, 2 * span, 1), Row(2 * span, 2 * span, 2 * span, 1)))
    assert (plan.block_ratio, plan.skipped, plan.pieces_per_block) == (1, (), 2)


def test_tp_1_to_2_each_decode_rank_reads_a_head_slice_of_the_one_prefill_rank() -> None:
    span = 4 * 8 * 2
    for rank in (0, 1):
        plan = check_plan("HND", 4, 1, 2, rank)
        assert plan.reads == (kv.TpRead(0, 2 * rank, 2, 0, Row(2 * rank * span, 2 * span, 2 * span, 1),
                                        Row(0, 2 * span, 2 * span, 1)),)


def test_tp_4_to_2_with_2_kv_heads_reads_each_head_once_and_skips_the_duplicates() -> None:
    # prefill ranks 0..3 hold heads 0, 0, 1, 1 (replicated); decode rank r holds head r
    assert [geometry("HND", 2, 4, r).first_head for r in range(4)] == [0, 0, 1, 1]
    assert [(r, check_plan("HND", 2, 4, 2, r).ranks, check_plan("HND", 2, 4, 2, r).skipped) for r in (0, 1)] == \
        [(0, (0,), (1,)), (1, (2,), (3,))]


def test_tp_4_to_2_with_8_kv_heads_reads_two_ranks() -> None:
    plan = check_plan("HND", 8, 4, 2, 1)
    assert (plan.ranks, plan.skipped) == ((2, 3), ())


def test_decode_wider_than_heads_replicates_one_head() -> None:
    # TP 1 -> 4 with 2 KV heads: decode ranks 0, 1 hold head 0 and 2, 3 head 1
    assert [check_plan("HND", 2, 1, 4, r).reads[0].first_head for r in range(4)] == [0, 0, 1, 1]


def test_mla_4_to_2_reads_one_rank() -> None:
    for rank in (0, 1):
        plan = check_plan("MLA", 1, 4, 2, rank)
        # vLLM's choice: tp_rank * remote_tp // tp; every other rank holds the same cache
        others = tuple(r for r in range(4) if r != 2 * rank)
        assert (plan.ranks, len(plan.reads), plan.skipped) == ((2 * rank,), 1, others)


def test_mla_2_to_4_reads_the_rank_of_its_group() -> None:
    assert [check_plan("MLA", 1, 2, 4, r).ranks for r in range(4)] == [(0,), (0,), (1,), (1,)]


def test_block_sizes_16_to_32_tokens_map_one_decode_block_to_two_prefill_blocks() -> None:
    plan = check_plan("HND", 4, 1, 1, 0, prefill_block=16, decode_block=32)
    assert (plan.block_ratio, sorted({r.sub_block for r in plan.reads})) == (2, [0, 1])
    # each sub-block's heads land 32 tokens apart: 4 pieces of 16 tokens per sub-block
    assert [(r.local.count, r.local.stride, r.remote.stride) for r in plan.reads] == [(4, 32 * 16, 16 * 16)] * 2


@pytest.mark.parametrize("layout", ["HND", "NHD", "MLA"])
def test_block_ratio_with_a_tp_change(layout: str) -> None:
    heads = 1 if layout == "MLA" else 4
    check_plan(layout, heads, 2, 1, 0, prefill_block=2, decode_block=8, per_token=True)
    check_plan(layout, heads, 1, 2, 1, prefill_block=4, decode_block=8, per_token=True)


def test_an_hnd_head_slice_is_one_piece_per_block() -> None:
    plan = check_plan("HND", 8, 1, 4, 3)
    assert (plan.pieces_per_block, plan.reads[0].remote.offset) == (1, 6 * 4 * 8 * 2)


def test_an_nhd_head_slice_is_refused_unless_per_token_pieces_are_asked_for() -> None:
    with pytest.raises(GeometryMismatch) as e:
        check_plan("NHD", 4, 1, 2, 0)
    assert (e.value.field, e.value.status_code) == ("layout", LLMStatusCode.LLM_PARAM_INVALID)
    assert "per_token=True" in str(e.value)
    plan = check_plan("NHD", 4, 1, 2, 0, per_token=True)
    assert plan.pieces_per_block == 4  # one per token


def test_nhd_without_a_head_slice_needs_no_per_token_pieces() -> None:
    assert check_plan("NHD", 4, 2, 2, 1).pieces_per_block == 1
    assert check_plan("NHD", 4, 1, 1, 0, prefill_block=2, decode_block=8).pieces_per_block == 4  # one per sub-block


# ---------------------------------------------------------------------------------- mismatches
@pytest.mark.parametrize(("field", "change"), [
    ("layout", {"layout": "NHD"}),
    ("dtype", {"dtype": "bfloat16"}),
    ("head_size", {"head_size": 16}),
    ("kv_heads", {"kv_heads": 8}),
    ("layers", {"layers": 3}),
    ("block_tokens", {"block_tokens": 3}),
    ("block_tokens", {"block_tokens": 8}),  # a decode block smaller than the prefill's
])
def test_a_pair_that_cannot_be_mapped_names_the_field(field: str, change: dict) -> None:
    decode = geometry("HND", 4, 1, 0)
    prefill = replace(geometry("HND", 4, 2, 0), **change)
    with pytest.raises(GeometryMismatch) as e:
        kv.tp_plan(decode, [prefill])
    assert e.value.field == field, str(e.value)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert isinstance(e.value, InvalidArgument) and isinstance(e.value, ValueError)


def test_tp_sizes_neither_of_which_divides_the_other_are_refused() -> None:
    with pytest.raises(GeometryMismatch) as e:
        kv.check_pair(geometry("HND", 12, 3, 0), geometry("HND", 12, 2, 0))
    assert e.value.field == "tp_size"


def test_a_head_on_no_given_rank_is_refused() -> None:
    with pytest.raises(GeometryMismatch) as e:
        kv.tp_plan(geometry("HND", 4, 1, 0), [geometry("HND", 4, 2, 0)])  # rank 1 (heads 2, 3) missing
    assert e.value.field == "tp_rank" and "head 2" in str(e.value)


def test_prefill_ranks_must_agree() -> None:
    decode = geometry("HND", 4, 1, 0)
    for bad, field in (([geometry("HND", 4, 2, 0), geometry("HND", 4, 2, 0)], "tp_rank"),
                       ([geometry("HND", 4, 2, 0), geometry("HND", 4, 4, 1)], "tp_size"),
                       ([geometry("HND", 4, 2, 0), geometry("HND", 4, 2, 1, block_tokens=2)], "block_tokens"),
                       ([], "tp_rank")):
        with pytest.raises(GeometryMismatch) as e:
            kv.tp_plan(decode, bad)
        assert e.value.field == field, (bad, str(e.value))


def test_a_mapping_of_ranks_is_accepted() -> None:
    prefill = {f"prefill-{r}": geometry("HND", 4, 2, r) for r in range(2)}
    assert kv.tp_plan(geometry("HND", 4, 1, 0), prefill).ranks == (0, 1)


@pytest.mark.parametrize(("field", "kwargs"), [
    ("layout", {"layout": "HDN"}), ("dtype", {"dtype": "float12"}), ("kv_heads", {"kv_heads": 0}),
    ("head_size", {"head_size": -1}), ("block_tokens", {"block_tokens": 1.5}), ("tp_rank", {"tp_rank": 2}),
    ("tp_size", {"kv_heads": 3}), ("kv_heads", {"layout": "MLA"}), ("layers", {"layers": True}),
])
def test_an_invalid_geometry_is_refused_naming_the_field(field: str, kwargs: dict) -> None:
    args = {"layout": "HND", "kv_heads": 4, "head_size": 8, "dtype": "float16", "block_tokens": 4, "tp_size": 2,
            "tp_rank": 0} | kwargs
    with pytest.raises(InvalidArgument) as e:
        KvGeometry(**args)
    assert f"KvGeometry.{field}:" in str(e.value)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_mismatch_pickles_with_its_field() -> None:
    e = GeometryMismatch("dtype", "the decode side has 'float16', the prefill side 'bfloat16'")
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.field, str(back), back.status_code) == (GeometryMismatch, "dtype", str(e),
                                                                    LLMStatusCode.LLM_PARAM_INVALID)


# ---------------------------------------------------------------------------------- every shape
@settings(max_examples=300, deadline=None)
@given(layout=st.sampled_from(["HND", "NHD", "MLA"]), heads_log=st.integers(0, 3), prefill_log=st.integers(0, 3),
       decode_log=st.integers(0, 3), ratio_log=st.integers(0, 2), prefill_block=st.sampled_from([1, 2, 4]),
       data=st.data())
def test_every_plan_fills_each_byte_once_with_the_reference_bytes(layout: str, heads_log: int, prefill_log: int,
                                                                   decode_log: int, ratio_log: int, prefill_block: int,
                                                                   data: st.DataObject) -> None:
    heads = 1 if layout == "MLA" else 1 << heads_log
    decode_tp = 1 << decode_log
    rank = data.draw(st.integers(0, decode_tp - 1))
    plan = check_plan(layout, heads, 1 << prefill_log, decode_tp, rank, prefill_block, prefill_block << ratio_log,
                      per_token=True)
    # the pieces a block costs: one per read of HND blocks per sub-block and head run, one per token at most
    assert plan.pieces_per_block <= (prefill_block << ratio_log) * max(1, plan.local.heads)


# ---------------------------------------------------------------------------------- plan_rows
def expand(rows_: np.ndarray) -> list[tuple[int, int]]:
    return [(int(a) + k * int(s), int(n)) for a, n, s, c in rows_ for k in range(int(c))]


@pytest.mark.parametrize(("layout", "heads", "prefill_tp", "decode_tp", "ratio"), [
    ("HND", 4, 2, 1, 1), ("HND", 4, 1, 2, 2), ("HND", 2, 4, 2, 1), ("NHD", 4, 2, 1, 2), ("MLA", 1, 4, 2, 2),
])
def test_plan_rows_move_the_planned_blocks_between_any_block_indices(layout: str, heads: int, prefill_tp: int,
                                                                    decode_tp: int, ratio: int) -> None:
    """Rows for local blocks [4, 0, 2] of a 2-layer cache from scattered remote blocks, applied to
    memory laid out as the addresses say (tensors 4096 bytes apart from 1 << 20, each rank's
    region its own range): the local blocks equal the reference, every other byte is untouched."""
    prefill = [geometry(layout, heads, prefill_tp, r, 2) for r in range(prefill_tp)]
    decode = geometry(layout, heads, decode_tp, decode_tp - 1, 2 * ratio)
    plan = kv.tp_plan(decode, prefill, per_token=True)
    tensors, local_blocks, remote_blocks = decode.layers * decode.kv, [4, 0, 2], []
    for b in local_blocks:  # remote blocks for local block b: scattered, 16 - (ratio * b + j)
        remote_blocks += [16 - (ratio * b + j) for j in range(ratio)]
    xs = [model_kv(heads, decode.head_size * decode.itemsize, 17 * 2, seed=t) for t in range(tensors)]
    tensor_bytes = 17 * max(g.block_bytes for g in prefill + [decode])
    base = {r: (r + 2) << 20 for r in range(prefill_tp)}
    memory = {r: np.zeros(tensors * tensor_bytes, np.uint8) for r in range(prefill_tp)}
    for g in prefill:
        for t in range(tensors):
            blocks = blocks_of(g, xs[t]).reshape(-1)
            memory[g.tp_rank][t * tensor_bytes:t * tensor_bytes + blocks.size] = blocks
    local = np.full(tensors * tensor_bytes, 0xEE, np.uint8)
    expected = local.copy()
    local_base = 1 << 20
    for t in range(tensors):
        for i, b in enumerate(local_blocks):  # the tokens of its remote blocks, in order
            tokens = np.concatenate([xs[t][rb * 2:rb * 2 + 2] for rb in remote_blocks[ratio * i:ratio * (i + 1)]])
            off = t * tensor_bytes + b * decode.block_bytes
            expected[off:off + decode.block_bytes] = blocks_of(decode, tokens)[0]
    rows_ = kv.plan_rows(plan, [local_base + t * tensor_bytes for t in range(tensors)],
                         {r: [base[r] + t * tensor_bytes for t in range(tensors)] for r in plan.ranks},
                         local_blocks, remote_blocks)
    assert sorted(rows_) == list(plan.ranks)
    for rank, (lrows, rrows) in rows_.items():
        for (la, n), (ra, m) in zip(expand(lrows), expand(rrows), strict=True):
            assert n == m
            local[la - local_base:la - local_base + n] = memory[rank][ra - base[rank]:ra - base[rank] + n]
    np.testing.assert_array_equal(local, expected)


def test_plan_rows_check_their_lists() -> None:
    plan = kv.tp_plan(geometry("HND", 4, 1, 0, 4), [geometry("HND", 4, 1, 0, 2)])
    for args, text in ((([0, 1], {0: [0, 1]}, [0], [0]), "need 2 remote blocks"),
                       (([0], {0: [0, 1]}, [0], [0, 1]), "1 local tensors given"),
                       (([0, 1, 2, 3], {0: [0]}, [0], [0, 1]), "rank 0 needs 4 remote tensor addresses")):
        with pytest.raises(InvalidArgument, match=text):
            kv.plan_rows(plan, *args)
